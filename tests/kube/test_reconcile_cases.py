"""The kubernetes orchestrator's reconcile, case by case, against the real control plane (tests/kube/harness.py):
what it applies is merged and validated by the real API server under the worker's own ServiceAccount, the
ReplicaSet controller makes the pods, the scheduler binds them by their GPU requests and the garbage collector
removes what a deleted owner held. Most cases need no engine process, so their kubelet stand-in reports pods
Running and Ready without starting one (`run_engines=False`); the key rotation case runs the simulator.

What we send is read two ways: on the server (objects, managedFields, generations) and from our own client's
calls (`sent`: every apply and delete the orchestrator makes, passed through to the server unchanged), since a
server-side apply that changes nothing leaves no trace on the server.

The LeaderWorkerSet controller cannot run here: `LeaderWorkerSetControllerStandIn` below creates the leader and
worker pods it would, from the applied set's own templates, and reports the set's status. Faults a real server
cannot be made to produce (injected conflicts and 500s) stay in tests/serving/test_kubernetes_reconcile.py.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import time
from dataclasses import dataclass, field

import httpx
import pytest
import redis
from kubernetes import client
from kubernetes.client.rest import ApiException

from routing.contracts import REPLICA_LOAD_KEY
from serving import services
from serving.engine_keys import engine_api_key
from serving.models import (
    DesiredStatus,
    Endpoint,
    EndpointLifetime,
    Health,
    KvConnector,
    ModelDeployment,
    ObservedStatus,
    OrchestratorKind,
    Pool,
    PoolRole,
)
from serving.orchestrators import kube_render as render
from serving.orchestrators.kube_api import KubeApi
from serving.orchestrators.kubernetes import POD_DELETION_COST

from .harness import FakeKubelet
from .test_reconcile import (
    NAMESPACE,
    pods,
    reconcile,
    reconcile_until,
    remove,
    sim_deployment,
)

pytestmark = [pytest.mark.kube, pytest.mark.kubectl, pytest.mark.django_db(transaction=True)]

MANAGER = "inference-platform"
ENGINE_IMAGE = "vllm/vllm-openai:v0.11.0"
KINDS = {kind: (api_version, kind) for api_version, kind in [*render.MANAGED_KINDS, ("v1", "Pod")]}
OTHER_MANAGER = "kubectl-edit"
LWS_PREFIX = "leaderworkerset.sigs.k8s.io/"


# --- fixtures and helpers -------------------------------------------------------------------------------------


@pytest.fixture
def quiet_kubelet(kube_admin, nodes, tmp_path):
    """The kubelet stand-in without engine processes: bound pods turn Running and Ready at once."""
    fake = FakeKubelet(kube_admin, tmp_path / "pods", run_engines=False, nodes=nodes)
    yield fake
    fake.stop()


@dataclass
class Sent:
    """What the orchestrator sent: every apply (the object) and delete (kind, namespace, name), in order."""

    applies: list[dict] = field(default_factory=list)
    deletes: list[tuple[str, str, str]] = field(default_factory=list)

    def writes(self) -> list[tuple[str, str]]:
        return [(obj["kind"], obj["metadata"]["name"]) for obj in self.applies]

    def clear(self) -> None:
        self.applies.clear()
        self.deletes.clear()


@pytest.fixture
def sent(monkeypatch) -> Sent:
    """Records the orchestrator's writes on their way to the API server (they are still made, unchanged)."""
    record = Sent()
    apply, delete = KubeApi.apply, KubeApi.delete

    def recording_apply(self, obj: dict) -> dict:
        record.applies.append(obj)
        return apply(self, obj)

    def recording_delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        record.deletes.append((kind, namespace, name))
        delete(self, api_version, kind, namespace, name)

    monkeypatch.setattr(KubeApi, "apply", recording_apply)
    monkeypatch.setattr(KubeApi, "delete", recording_delete)
    return record


def vllm_deployment(name: str, pools: dict[str, dict] | None = None, **pool_fields) -> ModelDeployment:
    """A vLLM deployment (no engine runs: its pods are the quiet kubelet's); one pool `main` of 2 replicas by
    default, or the pools given by name."""
    deployment = ModelDeployment.objects.create(
        name=name,
        served_model_name=name,
        model_source="Qwen/Qwen3-8B",
        orchestrator=OrchestratorKind.KUBERNETES,
        engine_image=ENGINE_IMAGE,
    )
    for pool, fields in (pools or {"main": {"replicas": 2} | pool_fields}).items():
        Pool.objects.create(deployment=deployment, name=pool, **fields)
    return deployment


def objects(
    kube_admin, kind: str, deployment: ModelDeployment | int, namespace: str = NAMESPACE
) -> dict[str, dict]:
    """The live objects of a kind that carry the deployment's labels (or its id's), by name (read as admin)."""
    api_version, _ = KINDS[kind]
    pk = deployment if isinstance(deployment, int) else deployment.pk
    selector = f"{render.LABEL_MANAGED_BY}={render.MANAGER},{render.LABEL_DEPLOYMENT_ID}={pk}"
    return {
        obj["metadata"]["name"]: obj
        for obj in KubeApi(kube_admin).list(api_version, kind, namespace, selector)
    }


def appliers(obj: dict) -> set[str]:
    """The field managers that server-side-applied to the object."""
    return {
        entry["manager"]
        for entry in obj["metadata"].get("managedFields") or []
        if entry["operation"] == "Apply"
    }


def owns(obj: dict, manager: str, field_path: str) -> bool:
    """Whether `manager` holds a field (a `f:`-path fragment such as `f:image`) of the object."""
    return any(
        entry["manager"] == manager and field_path in str(entry.get("fieldsV1"))
        for entry in obj["metadata"].get("managedFields") or []
    )


def endpoint_rows(deployment: ModelDeployment) -> dict[str, Endpoint]:
    return {e.name: e for e in Endpoint.objects.filter(pool__deployment=deployment)}


def selected(kube_admin, match_labels: dict[str, str]) -> set[str]:
    """The pods of the engines' namespace that a label selector picks."""
    selector = ",".join(f"{key}={value}" for key, value in match_labels.items())
    items = client.CoreV1Api(kube_admin).list_namespaced_pod(NAMESPACE, label_selector=selector).items
    return {pod.metadata.name for pod in items}


def wait_for(check, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (answer := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)
    return answer


def set_pod_ready(kube_admin, name: str, ready: bool) -> None:
    """What the kubelet reports when a readiness probe fails (or passes again)."""
    status = "True" if ready else "False"
    conditions = [{"type": kind, "status": status} for kind in ("ContainersReady", "Ready")]
    client.CoreV1Api(kube_admin).patch_namespaced_pod_status(
        name, NAMESPACE, {"status": {"conditions": conditions}}
    )


def ready(result) -> bool:
    return result.status == ObservedStatus.READY


# --- the LeaderWorkerSet controller, which cannot run here ----------------------------------------------------


class LeaderWorkerSetControllerStandIn:
    """Does for a live LeaderWorkerSet what its controller would (the controller is not part of this control
    plane): per group, a leader pod `<set>-<group>` from the leader template and `size - 1` worker pods
    `<set>-<group>-<index>` from the worker template, with the controller's labels
    (`leaderworkerset.sigs.k8s.io/name`, `group-index`, `worker-index`, `group-key`), its environment
    (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX) and hostname, owned by the set so that the garbage
    collector removes them with it; and the set's status, from its leaders' readiness."""

    def __init__(self, api: client.ApiClient):
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.group, self.version = render.LWS_API[0].split("/")

    def read(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(
            self.group, self.version, NAMESPACE, "leaderworkersets", name
        )

    def create_pods(self, name: str) -> list[str]:
        lws = self.read(name)
        spec = lws["spec"]["leaderWorkerTemplate"]
        owner = {
            "apiVersion": lws["apiVersion"],
            "kind": "LeaderWorkerSet",
            "name": name,
            "uid": lws["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        made = []
        for group in range(lws["spec"]["replicas"]):
            leader = f"{name}-{group}"
            for index in range(spec["size"]):
                template = spec["leaderTemplate"] if index == 0 else spec["workerTemplate"]
                pod_name = leader if index == 0 else f"{leader}-{index}"
                self.core.create_namespaced_pod(
                    NAMESPACE, self._pod(pod_name, name, leader, group, index, spec["size"], template, owner)
                )
                made.append(pod_name)
        return made

    def _pod(
        self, pod_name: str, lws: str, leader: str, group: int, index: int, size: int, template: dict, owner
    ) -> dict:
        labels = {
            **template["metadata"].get("labels", {}),
            LWS_PREFIX + "name": lws,
            LWS_PREFIX + "group-index": str(group),
            LWS_PREFIX + "worker-index": str(index),
            LWS_PREFIX + "group-key": hashlib.sha1(f"{NAMESPACE}/{leader}".encode()).hexdigest(),
        }
        env = [
            {"name": "LWS_LEADER_ADDRESS", "value": f"{leader}.{lws}.{NAMESPACE}"},
            {"name": "LWS_GROUP_SIZE", "value": str(size)},
            {"name": "LWS_WORKER_INDEX", "value": str(index)},
        ]
        pod_spec = {**template["spec"], "hostname": pod_name, "subdomain": lws}
        pod_spec["containers"] = [
            {**container, "env": [*env, *container.get("env", [])]} for container in pod_spec["containers"]
        ]
        metadata = {
            "name": pod_name,
            "labels": labels,
            "annotations": {**template["metadata"].get("annotations", {}), LWS_PREFIX + "size": str(size)},
            "ownerReferences": [owner],
        }
        return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}

    def report_status(self, name: str) -> None:
        selector = f"{LWS_PREFIX}name={name},{LWS_PREFIX}worker-index=0"
        leaders = self.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
        ready_leaders = sum(
            any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
            for pod in leaders
        )
        status = {"replicas": len(leaders), "readyReplicas": ready_leaders}
        self.custom.patch_namespaced_custom_object_status(
            self.group,
            self.version,
            NAMESPACE,
            "leaderworkersets",
            name,
            {"status": status},
            _content_type="application/merge-patch+json",  # custom resources take no strategic merge
        )


# --- creating, and nothing more --------------------------------------------------------------------------------


def test_it_creates_the_objects_with_server_side_apply_under_one_field_manager(
    worker_cluster, kube_admin, nodes, quiet_kubelet, sent
):
    deployment = vllm_deployment("case-create")
    try:
        result = reconcile(deployment)  # no node yet, so that no pod can be ready at the first pass
        assert sent.writes() == [
            ("ConfigMap", "case-create"),
            ("Secret", "case-create-engine-key"),  # the key and the policies before the pods that need them
            ("NetworkPolicy", "case-create-engines"),
            ("NetworkPolicy", "case-create-engines-egress"),
            ("Service", "case-create-main"),
            ("Deployment", "case-create-main"),
        ]
        assert result.status == ObservedStatus.PROGRESSING and result.settling, result.message
        assert deployment.observed_status == ObservedStatus.PROGRESSING
        assert "main: 0 of 2 replicas ready" in deployment.status_message
        live = {(kind, name): objects(kube_admin, kind, deployment)[name] for kind, name in sent.writes()}
        root_uid = live[("ConfigMap", "case-create")]["metadata"]["uid"]
        for (kind, name), obj in live.items():
            # Applied by our one field manager alone (the controllers only update status and annotations).
            assert appliers(obj) == {MANAGER}, (kind, name, obj["metadata"]["managedFields"])
            if kind != "ConfigMap":
                owner = obj["metadata"]["ownerReferences"][0]
                assert (owner["kind"], owner["name"], owner["uid"]) == ("ConfigMap", "case-create", root_uid)
        assert live[("Deployment", "case-create-main")]["spec"]["replicas"] == 2
        # The cluster acts on it: once a node joins, the ReplicaSet's pods are scheduled and read back as ready.
        nodes.make(1)
        result = reconcile_until(deployment, ready, timeout=60)
        assert "main: 2 of 2 replicas ready" in result.message
        assert set(endpoint_rows(deployment)) == {pod.metadata.name for pod in pods(kube_admin, deployment)}
    finally:
        remove(deployment, kube_admin)


def test_a_second_reconcile_sends_no_change(worker_cluster, kube_admin, nodes, quiet_kubelet, sent):
    nodes.make(1)
    deployment = vllm_deployment("case-again")
    try:
        reconcile_until(deployment, ready, timeout=60)
        generations = {
            (kind, name): obj["metadata"].get("generation")
            for kind in ("NetworkPolicy", "Service", "Deployment")
            for name, obj in objects(kube_admin, kind, deployment).items()
        }
        sent.clear()
        result = reconcile(deployment)
        assert sent.applies == [] and sent.deletes == []
        assert result.status == ObservedStatus.READY and "applied" not in result.message
        assert generations == {
            (kind, name): obj["metadata"].get("generation")
            for kind in ("NetworkPolicy", "Service", "Deployment")
            for name, obj in objects(kube_admin, kind, deployment).items()
        }
    finally:
        remove(deployment, kube_admin)


def test_engine_pods_wait_for_routers_before_stopping_and_have_time_to_finish(
    worker_cluster, kube_admin, settings
):
    settings.KUBERNETES_PRESTOP_SLEEP_S = 7
    deployment = vllm_deployment("case-prestop", replicas=1)
    try:
        reconcile(deployment)
        # Accepted and kept by the API server as written (the preStop sleep action is validated there).
        template = objects(kube_admin, "Deployment", deployment)["case-prestop-main"]["spec"]["template"]
        assert template["spec"]["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 7}}}
        assert template["spec"]["terminationGracePeriodSeconds"] == settings.ENGINE_DRAIN_TIMEOUT_S + 7
    finally:
        remove(deployment, kube_admin)


# --- reading what runs -----------------------------------------------------------------------------------------


def test_status_and_pods_are_read_back_into_endpoints(worker_cluster, kube_admin, nodes, quiet_kubelet):
    """Three 4-GPU replicas on one 8-GPU node: two run, one waits for room (no IP: no endpoint). A pod of a pool
    the deployment does not have is no endpoint; a pod whose readiness fails is `starting`; a pod deleted is
    replaced, and its endpoint goes."""
    (node,) = nodes.make(1, gpus=8)
    deployment = vllm_deployment(
        "case-read",
        replicas=3,
        gpus_per_replica=4,
        tensor_parallel_size=4,
        kv_connector=KvConnector.NIXL,
        role=PoolRole.DECODE,
    )
    core = client.CoreV1Api(kube_admin)
    stray = f"case-read-stray-{deployment.pk}"
    try:
        result = reconcile_until(
            deployment, lambda r: "2 of 3 replicas ready, 1 cannot be scheduled" in r.message, timeout=60
        )
        assert result.status == ObservedStatus.DEGRADED
        placed = sorted(
            (pod for pod in pods(kube_admin, deployment) if pod.status.pod_ip), key=lambda p: p.metadata.name
        )
        assert len(placed) == 2 and len(pods(kube_admin, deployment)) == 3
        rows = endpoint_rows(deployment)
        assert set(rows) == {pod.metadata.name for pod in placed}
        for pod in placed:
            row, ip = rows[pod.metadata.name], pod.status.pod_ip
            assert (row.url, row.kv_events_endpoint, row.kv_side_channel) == (
                f"http://{ip}:8000",
                f"tcp://{ip}:5557",
                f"{ip}:5600",
            )
            assert row.role == PoolRole.DECODE and row.health == Health.HEALTHY and row.last_seen_at

        # Someone's pod with the deployment's labels but a pool it does not have: running, but no endpoint.
        labels = {**render.deployment_labels(deployment), render.LABEL_POOL: "gone"}
        body = {
            "metadata": {"name": stray, "labels": labels},
            "spec": {"nodeName": node, "containers": [{"name": "engine", "image": ENGINE_IMAGE}]},
        }
        core.create_namespaced_pod(NAMESPACE, body)
        wait_for(lambda: core.read_namespaced_pod(stray, NAMESPACE).status.pod_ip, "the stray pod's IP")
        # A readiness probe fails on one pod.
        failing, replaced = (pod.metadata.name for pod in placed)
        set_pod_ready(kube_admin, failing, False)
        reconcile(deployment)
        rows = endpoint_rows(deployment)
        assert set(rows) == {failing, replaced}
        assert rows[failing].health == Health.STARTING and rows[replaced].health == Health.HEALTHY

        # Room for the third (a node joins), the probe passes again, and a pod is deleted (the ReplicaSet
        # replaces it): every endpoint is a live pod of the pool, and all are healthy.
        nodes.make(1, gpus=8)
        set_pod_ready(kube_admin, failing, True)
        core.delete_namespaced_pod(replaced, NAMESPACE)

        def settled(result) -> bool:
            live = {pod.metadata.name for pod in pods(kube_admin, deployment) if pod.status.pod_ip}
            return ready(result) and len(live) == 4 and set(endpoint_rows(deployment)) == live - {stray}

        reconcile_until(deployment, settled, timeout=60)
        assert replaced not in endpoint_rows(deployment) and failing in endpoint_rows(deployment)
        assert deployment.observed_status == ObservedStatus.READY
    finally:
        with contextlib.suppress(ApiException):
            core.delete_namespaced_pod(stray, NAMESPACE, grace_period_seconds=0)
        remove(deployment, kube_admin)


def test_only_leaders_of_a_leader_worker_set_become_endpoints(
    worker_cluster, kube_admin, nodes, quiet_kubelet
):
    nodes.make(1, gpus=8)
    deployment = vllm_deployment(
        "case-lws",
        replicas=1,
        nodes_per_replica=2,
        data_parallel_size=4,
        enable_expert_parallel=True,
        gpus_per_replica=4,
    )
    controller = LeaderWorkerSetControllerStandIn(kube_admin)
    try:
        reconcile(deployment)
        # The set was accepted against its CRD's schema; no Deployment for a multi-node pool.
        assert set(objects(kube_admin, "LeaderWorkerSet", deployment)) == {"case-lws-main"}
        assert not objects(kube_admin, "Deployment", deployment)
        assert controller.create_pods("case-lws-main") == ["case-lws-main-0", "case-lws-main-0-1"]
        # Two GPUs a pod, bound by the scheduler and run by the kubelet stand-in.
        wait_for(
            lambda: (
                all(pod.status.pod_ip for pod in pods(kube_admin, deployment))
                and len(pods(kube_admin, deployment)) == 2
            ),
            "the group's pods running",
        )
        controller.report_status("case-lws-main")
        result = reconcile(deployment)
        assert list(endpoint_rows(deployment)) == ["case-lws-main-0"]
        assert result.status == ObservedStatus.READY and deployment.observed_status == ObservedStatus.READY
        # The headless Service (the leaders' DNS names) selects the leader alone.
        service = client.CoreV1Api(kube_admin).read_namespaced_service("case-lws-main", NAMESPACE)
        assert selected(kube_admin, service.spec.selector) == {"case-lws-main-0"}
        # And the CRD's schema is enforced: a set whose group size is no number is refused.
        broken = controller.read("case-lws-main")
        broken["metadata"] = {"name": "case-lws-broken", "namespace": NAMESPACE}
        broken["spec"]["leaderWorkerTemplate"]["size"] = "two"
        broken.pop("status", None)
        with pytest.raises(client.exceptions.ApiException) as refused:
            controller.custom.create_namespaced_custom_object(
                controller.group, controller.version, NAMESPACE, "leaderworkersets", broken
            )
        assert refused.value.status == 422
    finally:
        remove(deployment, kube_admin)


def test_a_prefill_decode_deployment_is_scheduled_and_its_policy_selects_its_own_pods(
    worker_cluster, kube_admin, nodes, quiet_kubelet
):
    nodes.make(2, gpus=8)
    nixl = {"kv_connector": KvConnector.NIXL}
    deployment = vllm_deployment(
        "case-pd",
        {
            "prefill": {
                "role": PoolRole.PREFILL,
                "replicas": 2,
                "gpus_per_replica": 2,
                "tensor_parallel_size": 2,
            }
            | nixl,
            "decode": {
                "role": PoolRole.DECODE,
                "replicas": 2,
                "gpus_per_replica": 4,
                "tensor_parallel_size": 4,
            }
            | nixl,
        },
    )
    other = vllm_deployment("case-pd-other", replicas=1)
    try:
        result = reconcile_until(deployment, ready, timeout=60)
        reconcile_until(other, ready, timeout=60)
        assert (
            "prefill: 2 of 2 replicas ready" in result.message
            and "decode: 2 of 2 replicas ready" in result.message
        )
        mine = pods(kube_admin, deployment)
        assert len(mine) == 4 and all(pod.spec.node_name and pod.status.phase == "Running" for pod in mine)
        rows = endpoint_rows(deployment)
        assert set(rows) == {pod.metadata.name for pod in mine}
        for pod in mine:
            row = rows[pod.metadata.name]
            assert row.role == pod.metadata.labels[render.LABEL_ROLE]
            assert row.kv_side_channel == f"{pod.status.pod_ip}:5600"
        assert {row.role for row in rows.values()} == {PoolRole.PREFILL, PoolRole.DECODE}

        names = {pod.metadata.name for pod in mine}
        networking = client.NetworkingV1Api(kube_admin)
        ingress = networking.read_namespaced_network_policy(render.network_policy_name(deployment), NAMESPACE)
        egress = networking.read_namespaced_network_policy(render.egress_policy_name(deployment), NAMESPACE)
        # Both policies guard every pod of the deployment, of both pools, and no pod of another deployment.
        assert selected(kube_admin, ingress.spec.pod_selector.match_labels) == names
        assert selected(kube_admin, egress.spec.pod_selector.match_labels) == names
        # The peer rules (NIXL between prefill and decode) let in and out the deployment's own pods, and only them,
        # on every port but HTTP.
        (peer_in,) = [rule for rule in ingress.spec.ingress if rule._from[0].namespace_selector is None]
        (peer_out,) = [
            rule
            for rule in egress.spec.egress
            if rule.to[0].pod_selector and not rule.to[0].namespace_selector
        ]
        for rule, peers in ((peer_in, peer_in._from), (peer_out, peer_out.to)):
            assert selected(kube_admin, peers[0].pod_selector.match_labels) == names
            assert not any(port.port <= 8000 <= (port.end_port or port.port) for port in rule.ports)
        # The platform's rules name a namespace that the API server's own label selects.
        platform = [rule for rule in ingress.spec.ingress if rule._from[0].namespace_selector is not None]
        for rule in platform:
            for peer in rule._from:
                labels = ",".join(f"{k}={v}" for k, v in peer.namespace_selector.match_labels.items())
                spaces = client.CoreV1Api(kube_admin).list_namespace(label_selector=labels).items
                assert [space.metadata.name for space in spaces] == [render.platform_namespace()]
    finally:
        remove(deployment, kube_admin)
        remove(other, kube_admin)


# --- changing it -----------------------------------------------------------------------------------------------


def test_scaling_and_a_change_of_options_patch_only_the_workload(
    worker_cluster, kube_admin, nodes, quiet_kubelet, sent
):
    nodes.make(1, gpus=8)
    deployment = vllm_deployment("case-scale")
    try:
        reconcile_until(deployment, ready, timeout=60)
        sent.clear()
        Pool.objects.filter(deployment=deployment).update(replicas=5)
        reconcile(deployment)
        assert [(obj["kind"], obj["spec"]["replicas"]) for obj in sent.applies] == [("Deployment", 5)]
        reconcile_until(deployment, lambda r: ready(r) and len(endpoint_rows(deployment)) == 5, timeout=60)

        sent.clear()
        workload = objects(kube_admin, "Deployment", deployment)["case-scale-main"]
        Pool.objects.filter(deployment=deployment).update(
            kv_connector=KvConnector.OFFLOADING, cpu_offload_bytes=8 * 1024**3
        )
        reconcile(deployment)
        assert sent.writes() == [("Deployment", "case-scale-main")]
        live = objects(kube_admin, "Deployment", deployment)["case-scale-main"]
        args = live["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "OffloadingConnector" in args[args.index("--kv-transfer-config") + 1]
        # A new pod template: a new generation, which the Deployment controller rolls out.
        assert live["metadata"]["generation"] == workload["metadata"]["generation"] + 1
    finally:
        remove(deployment, kube_admin)


def test_it_restores_what_someone_else_changed(worker_cluster, kube_admin, nodes, quiet_kubelet, sent):
    """Another field manager opens the engines' ingress to everyone and swaps their image: the next reconcile
    takes both fields back (a forced apply: without force, the server answers a conflict)."""
    deployment = vllm_deployment("case-restore", replicas=1)
    apps, networking = client.AppsV1Api(kube_admin), client.NetworkingV1Api(kube_admin)
    policy, workload = render.network_policy_name(deployment), "case-restore-main"
    strategic = {"field_manager": OTHER_MANAGER, "_content_type": "application/strategic-merge-patch+json"}
    try:
        reconcile(deployment)
        wanted_ingress = objects(kube_admin, "NetworkPolicy", deployment)[policy]["spec"]["ingress"]
        networking.patch_namespaced_network_policy(
            policy, NAMESPACE, {"spec": {"ingress": [{}]}}, **strategic
        )
        patch = {
            "spec": {"template": {"spec": {"containers": [{"name": "engine", "image": "someone/else:1"}]}}}
        }
        apps.patch_namespaced_deployment(workload, NAMESPACE, patch, **strategic)
        edited = objects(kube_admin, "Deployment", deployment)[workload]
        assert owns(edited, OTHER_MANAGER, "f:image")

        sent.clear()
        reconcile(deployment)
        assert set(sent.writes()) == {("NetworkPolicy", policy), ("Deployment", workload)}
        live_policy = objects(kube_admin, "NetworkPolicy", deployment)[policy]
        live_workload = objects(kube_admin, "Deployment", deployment)[workload]
        assert live_policy["spec"]["ingress"] == wanted_ingress
        assert live_workload["spec"]["template"]["spec"]["containers"][0]["image"] == ENGINE_IMAGE
        assert owns(live_workload, MANAGER, "f:image") and not owns(live_workload, OTHER_MANAGER, "f:image")
        assert not owns(live_policy, OTHER_MANAGER, "f:ingress")
        sent.clear()
        reconcile(deployment)
        assert sent.applies == []
    finally:
        remove(deployment, kube_admin)


def test_it_prunes_objects_no_longer_wanted(worker_cluster, kube_admin, nodes, quiet_kubelet, sent):
    nodes.make(1, gpus=8)
    deployment = vllm_deployment("case-prune", {"main": {"replicas": 1}, "extra": {"replicas": 1}})
    try:
        reconcile_until(deployment, ready, timeout=60)
        assert set(objects(kube_admin, "Deployment", deployment)) == {"case-prune-main", "case-prune-extra"}
        assert Endpoint.objects.filter(pool__deployment=deployment, pool__name="extra").exists()

        Pool.objects.filter(deployment=deployment, name="extra").delete()
        sent.clear()
        reconcile(deployment)
        assert sorted(sent.deletes) == [
            ("Deployment", NAMESPACE, "case-prune-extra"),
            ("Service", NAMESPACE, "case-prune-extra"),
        ]
        assert set(objects(kube_admin, "Deployment", deployment)) == {"case-prune-main"}
        assert set(objects(kube_admin, "Service", deployment)) == {"case-prune-main"}
        extra = f"{render.LABEL_DEPLOYMENT_ID}={deployment.pk},{render.LABEL_POOL}=extra"
        core = client.CoreV1Api(kube_admin)
        wait_for(  # the garbage collector takes the pool's ReplicaSet and pods with it
            lambda: not core.list_namespaced_pod(NAMESPACE, label_selector=extra).items,
            "the extra pool's pods gone",
        )

        ModelDeployment.objects.filter(pk=deployment.pk).update(desired_status=DesiredStatus.STOPPED)
        deployment.refresh_from_db()
        result = reconcile(deployment)
        assert result.status == ObservedStatus.STOPPED
        assert not objects(kube_admin, "Deployment", deployment) and not objects(
            kube_admin, "Service", deployment
        )
        assert set(objects(kube_admin, "ConfigMap", deployment)) == {"case-prune"}  # the root stays
        # So do the key and the policies: pods still shutting down stay guarded.
        assert set(objects(kube_admin, "Secret", deployment)) == {"case-prune-engine-key"}
        assert set(objects(kube_admin, "NetworkPolicy", deployment)) == {
            "case-prune-engines",
            "case-prune-engines-egress",
        }
        assert not endpoint_rows(deployment)
        wait_for(lambda: not pods(kube_admin, deployment), "the stopped deployment's pods gone")
    finally:
        remove(deployment, kube_admin)


def test_a_deleted_deployment_is_swept_away_but_nothing_else(
    worker_cluster, kube_admin, nodes, quiet_kubelet
):
    nodes.make(1, gpus=8)
    keep = vllm_deployment("case-keep", replicas=1)
    gone = vllm_deployment("case-gone", replicas=1)
    core = client.CoreV1Api(kube_admin)
    foreign = {"metadata": {"name": "case-theirs", "labels": {"app": "x"}}, "data": {"a": "b"}}
    try:
        core.create_namespaced_config_map(NAMESPACE, foreign)
        reconcile_until(keep, ready, timeout=60)
        reconcile_until(gone, ready, timeout=60)
        kept_before = {kind: set(objects(kube_admin, kind, keep)) for kind in KINDS}
        gone_pk = gone.pk
        # One of its objects that the root does not own (the garbage collector would leave it): the sweep finds
        # it by its labels.
        orphan = {"metadata": {"name": "case-gone-orphan", "labels": render.deployment_labels(gone)}}
        core.create_namespaced_secret(NAMESPACE, orphan)
        gone.delete()
        swept = services.engines_sweep().gone
        # The root goes first; what it owns goes with it (the garbage collector, or the sweep where it lists
        # an object before the collector gets to it), pods included.
        assert {f"{NAMESPACE}/ConfigMap/case-gone", f"{NAMESPACE}/Secret/case-gone-orphan"} <= set(swept)
        assert not [name for name in swept if "case-keep" in name or "case-theirs" in name]
        wait_for(
            lambda: not any(objects(kube_admin, kind, gone_pk) for kind in KINDS),
            "the deleted deployment's objects gone",
        )
        assert {kind: set(objects(kube_admin, kind, keep)) for kind in KINDS} == kept_before
        assert len(kept_before["Pod"]) == 1 and kept_before["Deployment"] == {"case-keep-main"}
        assert core.read_namespaced_config_map("case-theirs", NAMESPACE).data == {"a": "b"}
    finally:
        core.delete_namespaced_config_map("case-theirs", NAMESPACE)
        remove(keep, kube_admin)


def test_namespaces_come_from_the_deployment_or_settings_and_must_be_allowed(
    worker_cluster, kube_admin, settings, sent
):
    """A second engines' namespace, granted to the worker as deploy/base grants `inference` (the same Role and
    RoleBinding there), is used when a deployment names it; a namespace not in settings is refused unsent."""
    team = "case-team-b"
    core, rbac = client.CoreV1Api(kube_admin), client.RbacAuthorizationV1Api(kube_admin)
    core.create_namespace({"metadata": {"name": team}})
    for read, create in (
        (rbac.read_namespaced_role, rbac.create_namespaced_role),
        (rbac.read_namespaced_role_binding, rbac.create_namespaced_role_binding),
    ):
        grant = kube_admin.sanitize_for_serialization(read("inference-platform-orchestrator", NAMESPACE))
        grant["metadata"] = {"name": grant["metadata"]["name"], "namespace": team}
        create(team, grant)
    settings.KUBERNETES_NAMESPACES = [NAMESPACE, team]
    deployment = vllm_deployment("case-ns", replicas=1)
    try:
        ModelDeployment.objects.filter(pk=deployment.pk).update(namespace=team)
        deployment.refresh_from_db()
        reconcile(deployment)
        assert sent.applies and {obj["metadata"]["namespace"] for obj in sent.applies} == {team}
        assert set(objects(kube_admin, "Deployment", deployment, team)) == {"case-ns-main"}
        assert not objects(kube_admin, "ConfigMap", deployment)  # nothing in the default namespace

        sent.clear()
        ModelDeployment.objects.filter(pk=deployment.pk).update(namespace="kube-system")
        deployment.refresh_from_db()
        result = reconcile(deployment)
        assert result.status == ObservedStatus.FAILED and "kube-system" in result.message
        assert sent.applies == []
        assert not objects(kube_admin, "ConfigMap", deployment, "kube-system")
    finally:
        deployment.delete()
        services.engines_sweep()
        core.delete_namespace(team)


# --- the engines' key and policies --------------------------------------------------------------------------------


def test_the_engines_key_and_network_policy_are_applied_and_kept_in_step(
    worker_cluster, kube_admin, settings, sent
):
    settings.ENGINE_KEY_SECRET = "first"
    deployment = vllm_deployment("case-key", kv_connector=KvConnector.NIXL)
    try:
        reconcile(deployment)
        secret = objects(kube_admin, "Secret", deployment)["case-key-engine-key"]
        assert base64.b64decode(secret["data"]["VLLM_API_KEY"]).decode() == engine_api_key(deployment.pk)
        assert secret["metadata"]["labels"][render.LABEL_DEPLOYMENT_ID] == str(deployment.pk)
        template = objects(kube_admin, "Deployment", deployment)["case-key-main"]["spec"]["template"]
        assert template["spec"]["automountServiceAccountToken"] is False
        env = {item["name"]: item for item in template["spec"]["containers"][0]["env"]}
        assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "case-key-engine-key"
        policy = objects(kube_admin, "NetworkPolicy", deployment)["case-key-engines"]["spec"]
        assert len(policy["ingress"]) == 3  # router and worker; KV-event ingester; the deployment's own pods

        # A pool without NIXL no longer needs traffic between the deployment's pods: the policy follows.
        sent.clear()
        Pool.objects.filter(deployment=deployment).update(kv_connector=KvConnector.NONE)
        reconcile(deployment)
        assert ("NetworkPolicy", "case-key-engines") in sent.writes()
        assert (
            len(objects(kube_admin, "NetworkPolicy", deployment)["case-key-engines"]["spec"]["ingress"]) == 2
        )

        # A new secret: a new key in the Secret, and a new pod template so that the pods roll to read it.
        sent.clear()
        settings.ENGINE_KEY_SECRET = "second"
        reconcile(deployment)
        assert sent.writes() == [("Secret", "case-key-engine-key"), ("Deployment", "case-key-main")]
        secret = objects(kube_admin, "Secret", deployment)["case-key-engine-key"]
        assert base64.b64decode(secret["data"]["VLLM_API_KEY"]).decode() == engine_api_key(deployment.pk)
        annotations = objects(kube_admin, "Deployment", deployment)["case-key-main"]["spec"]["template"][
            "metadata"
        ]
        digest = hashlib.sha256(engine_api_key(deployment.pk).encode()).hexdigest()[:16]
        assert annotations["annotations"][render.ENGINE_KEY_ANNOTATION] == digest
    finally:
        remove(deployment, kube_admin)


def test_a_new_engine_key_rolls_the_pods_and_only_the_new_key_opens_them(
    worker_cluster, kube_admin, nodes, kubelet, settings
):
    """The simulator runs in each pod, reading its key from the Secret as a kubelet hands it over."""
    settings.ENGINE_KEY_SECRET = "first"
    nodes.make(1, gpus=8)
    deployment = sim_deployment("case-rotate", replicas=1, gpus=1)

    def models(url: str, key: str) -> int:
        return httpx.get(
            f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
        ).status_code

    try:
        reconcile_until(deployment, ready, timeout=90)
        old_key = engine_api_key(deployment.pk)
        (before,) = endpoint_rows(deployment).values()
        assert models(before.url, old_key) == 200

        settings.ENGINE_KEY_SECRET = "second"
        new_key = engine_api_key(deployment.pk)
        assert new_key != old_key

        def rolled(result) -> bool:
            live = {pod.metadata.name for pod in pods(kube_admin, deployment)}
            return ready(result) and before.name not in live and set(endpoint_rows(deployment)) == live

        reconcile_until(deployment, rolled, timeout=90)
        (after,) = endpoint_rows(deployment).values()
        assert models(after.url, new_key) == 200
        assert models(after.url, old_key) == 401
    finally:
        remove(deployment, kube_admin)


# --- scaling down without dropping a request -------------------------------------------------------------------


def test_a_scale_down_drains_the_pod_it_removes_first(
    worker_cluster, kube_admin, nodes, quiet_kubelet, settings
):
    """Two ready pods, replicas 2 -> 1: the pod with nothing in flight is drained (no new requests, the lowest
    deletion cost) while the Deployment keeps both; once nothing is in flight there the Deployment goes to one
    replica, the ReplicaSet controller deletes that pod, and its lifetime ends with its drain recorded."""
    settings.ROUTER_CONFIG_POLL_SECONDS = 0.2
    settings.ROUTER_LOAD_SHARE_SECONDS = 0.05
    store = redis.Redis.from_url(settings.REDIS_URL)
    nodes.make(1, gpus=8)
    deployment = vllm_deployment("case-drain")
    core = client.CoreV1Api(kube_admin)
    workload = "case-drain-main"
    rows: dict[str, Endpoint] = {}

    def in_flight(name: str, count: int) -> None:
        key = REPLICA_LOAD_KEY.format(rows[name].pk)
        if count:
            store.hset(key, "replica-1", f"{count}.0 {count} {time.time():.3f} 0")
        else:
            store.delete(key)

    def replicas() -> int:
        return objects(kube_admin, "Deployment", deployment)[workload]["spec"]["replicas"]

    try:
        reconcile_until(deployment, ready, timeout=60)
        rows = endpoint_rows(deployment)
        idle, busy = sorted(rows)
        in_flight(busy, 3)  # a router replica has three requests there
        Pool.objects.filter(deployment=deployment).update(replicas=1)
        result = reconcile(deployment)
        drained = Endpoint.objects.get(name=idle)
        assert drained.draining_since is not None and "Draining 1 replica" in result.message
        assert Endpoint.objects.get(name=busy).draining_since is None
        assert core.read_namespaced_pod(idle, NAMESPACE).metadata.annotations[POD_DELETION_COST] == "-1000000"
        assert POD_DELETION_COST not in (core.read_namespaced_pod(busy, NAMESPACE).metadata.annotations or {})
        assert replicas() == 2

        in_flight(idle, 1)  # a request that reached it before the routers reloaded
        time.sleep(1.0)  # past the time routers take to reload (0.8 s here)
        reconcile(deployment)
        assert replicas() == 2

        in_flight(idle, 0)
        reconcile(deployment)
        assert replicas() == 1
        # The ReplicaSet controller deletes the pod of lowest cost, the drained one.
        reconcile_until(
            deployment,
            lambda r: (
                ready(r)
                and [p.metadata.name for p in pods(kube_admin, deployment)] == [busy]
                and list(endpoint_rows(deployment)) == [busy]
            ),
            timeout=60,
        )
        life = EndpointLifetime.objects.get(endpoint_name=idle)
        assert life.ready_at and life.draining_at and life.stopped_at and life.draining_at <= life.stopped_at
    finally:
        for name in rows:
            in_flight(name, 0)
        remove(deployment, kube_admin)
