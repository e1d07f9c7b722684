"""The engines' egress NetworkPolicy through the reconcile, against the real control plane
(tests/kube/harness.py): the API server validates every policy applied, and what is checked is the policy read
back from it, matched by the same reachability rules as the rendered ones (tests/serving/test_engine_egress.py).
"""

from __future__ import annotations

import pytest
from kubernetes import client

from serving import services
from serving.models import DesiredStatus, KvConnector, ModelDeployment, ObservedStatus, Pool
from serving.orchestrators import kube_render as render
from tests.serving.test_engine_egress import DNS, METADATA, reaches

from . import test_reconcile_cases as cases
from .test_reconcile import NAMESPACE, reconcile, remove
from .test_reconcile_cases import KINDS, MANAGER, OTHER_MANAGER, objects, owns, vllm_deployment, wait_for

pytestmark = [pytest.mark.kube, pytest.mark.kubectl, pytest.mark.django_db(transaction=True)]

sent = cases.sent  # the orchestrator's writes on their way to the API server, as a fixture here too


def egress(kube_admin, deployment: ModelDeployment) -> dict:
    """The deployment's egress policy as the API server holds it."""
    return objects(kube_admin, "NetworkPolicy", deployment)[render.egress_policy_name(deployment)]


def test_the_egress_policy_is_reconciled_kept_in_step_and_pruned_with_the_deployment(
    worker_cluster, kube_admin, sent
):
    deployment = vllm_deployment("case-egress")
    pk, name = deployment.pk, render.egress_policy_name(deployment)
    try:
        reconcile(deployment)
        # Before the pods it guards, owned by the root like the rest.
        assert sent.writes().index(("NetworkPolicy", name)) < sent.writes().index(
            ("Deployment", "case-egress-main")
        )
        live = egress(kube_admin, deployment)
        root_uid = objects(kube_admin, "ConfigMap", deployment)["case-egress"]["metadata"]["uid"]
        assert live["metadata"]["ownerReferences"][0]["uid"] == root_uid
        template = objects(kube_admin, "Deployment", deployment)["case-egress-main"]["spec"]["template"]
        peer = {"namespace": NAMESPACE, "pod": template["metadata"]["labels"]}  # the labels its pods get
        assert reaches(live, DNS, 53, "UDP") and not reaches(live, peer, 5600)

        sent.clear()
        reconcile(deployment)
        assert sent.applies == [] and sent.deletes == []  # nothing changed, nothing sent

        # Someone opens the engines to everything: the next reconcile takes it back.
        wanted = live["spec"]["egress"]
        client.NetworkingV1Api(kube_admin).patch_namespaced_network_policy(
            name,
            NAMESPACE,
            {"spec": {"egress": [*wanted, {}]}},
            field_manager=OTHER_MANAGER,
            _content_type="application/strategic-merge-patch+json",
        )
        assert reaches(egress(kube_admin, deployment), {"ip": METADATA}, 80)  # the edit took
        reconcile(deployment)
        live = egress(kube_admin, deployment)
        assert live["spec"]["egress"] == wanted and not reaches(live, {"ip": METADATA}, 80)
        assert not owns(live, OTHER_MANAGER, "f:egress") and owns(live, MANAGER, "f:egress")

        # NIXL makes the deployment's pods talk to each other: the policy follows.
        Pool.objects.filter(deployment=deployment).update(kv_connector=KvConnector.NIXL)
        reconcile(deployment)
        assert reaches(egress(kube_admin, deployment), peer, 5600)

        # Stopped: the workloads go, the policy stays for pods still shutting down.
        ModelDeployment.objects.filter(pk=pk).update(desired_status=DesiredStatus.STOPPED)
        deployment.refresh_from_db()
        reconcile(deployment)
        assert not objects(kube_admin, "Deployment", deployment)
        assert name in objects(kube_admin, "NetworkPolicy", deployment)

        # Deleted: swept with everything else of the deployment. Its owner reference is taken off first, so that
        # the sweep itself, not the garbage collector following the root, has to find it.
        client.NetworkingV1Api(kube_admin).patch_namespaced_network_policy(
            name,
            NAMESPACE,
            [{"op": "remove", "path": "/metadata/ownerReferences"}],
            field_manager=OTHER_MANAGER,
            _content_type="application/json-patch+json",
        )
        deployment.delete()
        swept = services.engines_sweep().gone
        assert f"{NAMESPACE}/NetworkPolicy/{name}" in swept
        assert not objects(kube_admin, "NetworkPolicy", pk)
        wait_for(
            lambda: not any(objects(kube_admin, kind, pk) for kind in KINDS), "the deployment's objects gone"
        )
    finally:
        if ModelDeployment.objects.filter(pk=pk).exists():
            remove(deployment, kube_admin)
        else:
            services.engines_sweep()


@pytest.mark.parametrize("cidr", [METADATA + "/32", "169.254.0.0/16", "fd00:ec2::254/128", "not-a-cidr"])
def test_a_range_engines_must_never_reach_fails_the_deployment_and_changes_nothing(
    worker_cluster, kube_admin, settings, sent, cidr
):
    settings.KUBERNETES_ENGINE_EGRESS_CIDRS = [cidr]
    deployment = vllm_deployment("case-egress-range")
    try:
        result = reconcile(deployment)
        assert result.status == ObservedStatus.FAILED and "KUBERNETES_ENGINE_EGRESS_CIDRS" in result.message
        assert sent.applies == [] and sent.deletes == []
        assert not any(objects(kube_admin, kind, deployment) for kind in KINDS)
    finally:
        remove(deployment, kube_admin)
