"""The kubernetes orchestrator's reconcile against a real control plane, with the worker's own ServiceAccount
token: what it applies is validated and merged by the real API server, the ReplicaSet controller makes the pods,
the scheduler binds them by their GPU requests, and the kubelet stand-in starts each pod's engine (the simulator,
from the rendered container command) on the pod's own address, so the endpoints the reconcile reads back are
engines that answer."""

from __future__ import annotations

import time

import httpx
import pytest
import redis
from kubernetes import client
from rest_framework.test import APIClient

from serving import services
from serving.autoscaling import UNSCHEDULABLE_KEY
from serving.engine_keys import engine_api_key
from serving.models import Endpoint, Health, ModelDeployment, ObservedStatus, OrchestratorKind, Pool
from serving.orchestrators import kube_render as render
from tenants.models import Role
from tests.conftest import make_user

from .harness import pods_report

pytestmark = [pytest.mark.kube, pytest.mark.kubectl, pytest.mark.django_db(transaction=True)]

NAMESPACE = "inference"


def sim_deployment(name: str, *, replicas: int, gpus: int) -> ModelDeployment:
    deployment = ModelDeployment.objects.create(
        name=name,
        served_model_name=name,
        model_source="models/tiny-qwen",
        engine_kind="sim",
        orchestrator=OrchestratorKind.KUBERNETES,
    )
    Pool.objects.create(
        deployment=deployment,
        name="main",
        replicas=replicas,
        gpus_per_replica=gpus,
        tensor_parallel_size=gpus,
    )
    return deployment


def reconcile(deployment: ModelDeployment):
    result = services.deployment_reconcile(deployment_id=deployment.pk)
    deployment.refresh_from_db()
    return result


def rows_settled(deployment: ModelDeployment) -> bool:
    """Every endpoint row healthy and one per replica of each pool: a pass reads the pods before the workloads'
    status, so a pod that turned ready in between counts as ready there before it has its row."""
    rows = list(Endpoint.objects.filter(pool__deployment=deployment))
    return all(e.health == Health.HEALTHY for e in rows) and all(
        sum(e.pool_id == pool.pk for e in rows) >= pool.replicas for pool in deployment.pools.all()
    )


def reconcile_until(deployment: ModelDeployment, done, timeout: float = 120.0, *, all_healthy: bool = True):
    """Reconcile until `done(result)`; a ready result also waits for every endpoint row to be healthy (rows are
    read at the start of a pass) unless `all_healthy` is off (a lost node's pods stay, unhealthy)."""
    deadline = time.monotonic() + timeout
    while True:
        result = reconcile(deployment)
        if done(result) and (
            result.status != ObservedStatus.READY or not all_healthy or rows_settled(deployment)
        ):
            return result
        assert time.monotonic() < deadline, f"not there within {timeout} s: {result}\n{pods_report()}"
        time.sleep(0.5)


def pods(kube_admin, deployment: ModelDeployment) -> list[client.V1Pod]:
    selector = f"{render.LABEL_DEPLOYMENT_ID}={deployment.pk}"
    return client.CoreV1Api(kube_admin).list_namespaced_pod(NAMESPACE, label_selector=selector).items


def remove(deployment: ModelDeployment, kube_admin, *, wait: bool = True) -> None:
    """Delete the deployment as an operator does, and wait until its pods are gone (their engines stopped); not
    with `wait` off, for pods on a lost node, which nothing confirms gone."""
    pk = deployment.pk
    deployment.delete()
    services.engines_sweep()
    if not wait:
        return
    deadline = time.monotonic() + 60
    selector = f"{render.LABEL_DEPLOYMENT_ID}={pk}"
    core = client.CoreV1Api(kube_admin)
    while core.list_namespaced_pod(NAMESPACE, label_selector=selector).items:
        assert time.monotonic() < deadline, "the deployment's pods were not deleted"
        time.sleep(0.5)


def test_a_deployment_is_scheduled_by_gpu_and_its_engines_answer(worker_cluster, kube_admin, nodes, kubelet):
    first, second = nodes.make(2, gpus=8)
    deployment = sim_deployment("kube-sim", replicas=2, gpus=8)
    try:
        result = reconcile_until(deployment, lambda r: r.status == ObservedStatus.READY)
        assert "2 of 2 replicas ready" in result.message
        placed = pods(kube_admin, deployment)
        # 8 GPUs each on 8-GPU nodes: one pod per node.
        assert sorted(pod.spec.node_name for pod in placed) == [first, second]
        endpoints = list(Endpoint.objects.filter(pool__deployment=deployment))
        assert sorted(e.url for e in endpoints) == sorted(
            f"http://{pod.status.pod_ip}:8000" for pod in placed
        )
        assert {e.health for e in endpoints} == {Health.HEALTHY}
        key = engine_api_key(deployment.pk)
        for endpoint in endpoints:
            models = httpx.get(
                f"{endpoint.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
            )
            assert models.status_code == 200, models.text
            assert [m["id"] for m in models.json()["data"]] == ["kube-sim"]
            assert httpx.get(f"{endpoint.url}/v1/models", timeout=10).status_code == 401
        # Level-triggered and idempotent: with nothing changed, nothing is written.
        again = reconcile(deployment)
        assert "applied" not in again.message and "deleted" not in again.message, again.message
    finally:
        remove(deployment, kube_admin)


def test_pods_past_the_gpus_the_nodes_hold_stay_pending_and_the_status_says_so(
    worker_cluster, kube_admin, nodes, kubelet, settings
):
    nodes.make(1, gpus=8)
    deployment = sim_deployment("kube-full", replicas=2, gpus=8)
    try:
        result = reconcile_until(
            deployment, lambda r: "cannot be scheduled" in r.message and "1 of 2 replicas ready" in r.message
        )
        assert result.status == ObservedStatus.DEGRADED
        assert "GPU" in result.message or "nvidia.com/gpu" in result.message, result.message
        pending = [pod for pod in pods(kube_admin, deployment) if not pod.spec.node_name]
        assert len(pending) == 1
        # Operators read it from the API (and the portal's fleet page), not "progressing" for ever.
        api = APIClient()
        api.force_authenticate(make_user("kube-operator", Role.OPERATOR))
        shown = api.get(f"/api/deployments/{deployment.pk}/").json()
        assert shown["observed_status"] == "degraded" and "cannot be scheduled" in shown["status_message"], (
            shown
        )
        # The autoscaler is told, and asks for no more while it waits (tests/serving/test_autoscaling.py).
        waiting = redis.Redis.from_url(settings.REDIS_URL).get(
            UNSCHEDULABLE_KEY.format(deployment.pools.get().pk)
        )
        assert waiting == b"1"
        (scheduled,) = [c for c in pending[0].status.conditions if c.type == "PodScheduled"]
        assert (scheduled.status, scheduled.reason) == ("False", "Unschedulable")
    finally:
        remove(deployment, kube_admin)


def test_a_new_revision_rolls_out_and_someone_else_s_edit_is_taken_back(
    worker_cluster, kube_admin, nodes, kubelet
):
    nodes.make(1, gpus=8)
    deployment = sim_deployment("kube-roll", replicas=2, gpus=1)
    apps = client.AppsV1Api(kube_admin)
    name = render.pool_object_name(deployment, deployment.pools.get())
    try:
        reconcile_until(deployment, lambda r: r.status == ObservedStatus.READY)
        before = {pod.metadata.name for pod in pods(kube_admin, deployment)}
        # Another field manager scales the engines' Deployment by hand: the next reconcile takes it back.
        apps.patch_namespaced_deployment_scale(name, NAMESPACE, {"spec": {"replicas": 4}})
        # Read as a scale-down: the extra replicas are drained (nothing in flight here), then the workload is
        # applied back to the pool's replicas under our field manager.
        reconcile_until(
            deployment,
            lambda r: (
                apps.read_namespaced_deployment(name, NAMESPACE).spec.replicas == 2
                and r.status == ObservedStatus.READY
            ),
            timeout=60,
        )
        live = apps.read_namespaced_deployment(name, NAMESPACE)
        owners = {
            entry.manager for entry in live.metadata.managed_fields if "f:replicas" in str(entry.fields_v1)
        }
        assert "inference-platform" in owners
        # A new revision: a rolling update replaces every pod, and the endpoints follow.
        ModelDeployment.objects.filter(pk=deployment.pk).update(revision="v2")
        deployment.refresh_from_db()
        reconcile_until(
            deployment,
            lambda r: (
                r.status == ObservedStatus.READY
                and {pod.metadata.name for pod in pods(kube_admin, deployment)}.isdisjoint(before)
                and len(pods(kube_admin, deployment)) == 2
                and Endpoint.objects.filter(pool__deployment=deployment, health=Health.HEALTHY).count() == 2
            ),
            timeout=120,
        )
        rows = set(Endpoint.objects.filter(pool__deployment=deployment).values_list("name", flat=True))
        assert rows == {pod.metadata.name for pod in pods(kube_admin, deployment)}
    finally:
        remove(deployment, kube_admin)


def test_the_inference_pool_and_network_policy_are_accepted_and_select_the_deployment_s_pods(
    worker_cluster, kube_admin, nodes, kubelet, settings
):
    settings.KUBERNETES_INFERENCE_POOL = True
    nodes.make(1, gpus=8)
    deployment = sim_deployment("kube-pool", replicas=2, gpus=1)
    other = sim_deployment("kube-other", replicas=1, gpus=1)
    custom = client.CustomObjectsApi(kube_admin)
    try:
        reconcile_until(deployment, lambda r: r.status == ObservedStatus.READY)
        reconcile_until(other, lambda r: r.status == ObservedStatus.READY)
        group, version = render.INFERENCE_POOL_API[0].split("/")
        (pool,) = [
            item
            for item in custom.list_namespaced_custom_object(group, version, NAMESPACE, "inferencepools")[
                "items"
            ]
            if item["metadata"]["labels"].get(render.LABEL_DEPLOYMENT_ID) == str(deployment.pk)
        ]
        core = client.CoreV1Api(kube_admin)
        mine = {pod.metadata.name for pod in pods(kube_admin, deployment)}

        def selected(match_labels: dict) -> set[str]:
            selector = ",".join(f"{key}={value}" for key, value in match_labels.items())
            return {
                pod.metadata.name
                for pod in core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
            }

        assert selected(pool["spec"]["selector"]["matchLabels"]) == mine
        policy = client.NetworkingV1Api(kube_admin).read_namespaced_network_policy(
            render.network_policy_name(deployment), NAMESPACE
        )
        assert selected(policy.spec.pod_selector.match_labels) == mine
        # The CRD's schema is enforced: a pool without its target ports is refused by the API server.
        broken = {**pool, "metadata": {"name": "broken", "namespace": NAMESPACE}, "spec": {**pool["spec"]}}
        broken["spec"].pop("targetPorts")
        with pytest.raises(client.exceptions.ApiException) as refused:
            custom.create_namespaced_custom_object(group, version, NAMESPACE, "inferencepools", broken)
        assert refused.value.status == 422
    finally:
        remove(deployment, kube_admin)
        remove(other, kube_admin)
