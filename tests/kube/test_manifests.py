"""deploy/'s manifests applied for real: every overlay server-side-applies to a real API server (with the CRDs it
needs first) and applying it again changes nothing; the worker's ServiceAccount may do what reconciling needs and
nothing more."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from .conftest import DEPLOY, crds_established, kubectl
from .harness import service_account_token

pytestmark = [pytest.mark.kube, pytest.mark.kubectl]

OVERLAYS = sorted(path.name for path in (DEPLOY / "overlays").iterdir() if path.is_dir())
# The Prometheus Operator's CRDs (ServiceMonitor, PodMonitor, PrometheusRule), which deploy/monitoring needs first:
# they come with the operator on a cluster; here, from tests/kube/crds (see its README).
OPERATOR_CRDS = Path(__file__).parent / "crds"


def applied(control_plane, manifest: str) -> dict[str, list]:
    """What our server-side apply owns in each object, and when it last wrote it: the managedFields entries of
    kubectl's Apply. The controllers' own writes (the HPA scaling the router StatefulSet and recording its
    readings, a Deployment's conditions) are entries of their own managers, so they do not show here."""
    listed = json.loads(
        kubectl(control_plane, "get", "-f", "-", "-o", "json", "--show-managed-fields", input=manifest)
    )
    items = listed.get("items", [listed])
    return {
        f"{item['kind']}/{item['metadata'].get('namespace', '')}/{item['metadata']['name']}": [
            (entry.get("time"), json.dumps(entry.get("fieldsV1"), sort_keys=True))
            for entry in item["metadata"].get("managedFields", [])
            if entry.get("manager") == "kubectl" and entry.get("operation") == "Apply"
        ]
        for item in items
    }


def apply_twice(control_plane, manifest: str) -> None:
    kubectl(control_plane, "apply", "--server-side", "-f", "-", input=manifest)
    before = applied(control_plane, manifest)
    assert all(before.values()), (
        f"objects without kubectl's apply entry: {[k for k, v in before.items() if not v]}"
    )
    time.sleep(1.1)  # managedFields times are to the second: a write by the second apply would show
    kubectl(control_plane, "apply", "--server-side", "-f", "-", input=manifest)
    assert applied(control_plane, manifest) == before


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_applies_server_side_and_again_changes_nothing(platform_installed, overlay):
    control_plane = platform_installed
    # The migrate Job's template is immutable: between releases it is deleted (or gone by its TTL) first.
    kubectl(control_plane, "delete", "job", "migrate", "-n", "inference-platform", "--ignore-not-found")
    manifest = kubectl(control_plane, "kustomize", str(DEPLOY / "overlays" / overlay))
    kinds = {obj["kind"] for obj in yaml.safe_load_all(manifest) if obj}
    assert {"Deployment", "StatefulSet", "Role", "RoleBinding", "NetworkPolicy"} <= kinds
    apply_twice(control_plane, manifest)
    # Back to the development overlay the other tests of the tier run on.
    kubectl(control_plane, "delete", "job", "migrate", "-n", "inference-platform", "--ignore-not-found")
    kubectl(control_plane, "apply", "--server-side", "-k", str(DEPLOY / "overlays" / "dev"))


def test_the_monitoring_objects_apply_server_side(platform_installed):
    kubectl(platform_installed, "apply", "--server-side", "-f", str(OPERATOR_CRDS))
    crds_established(platform_installed)
    manifest = kubectl(platform_installed, "kustomize", str(DEPLOY / "monitoring"))
    kinds = {obj["kind"] for obj in yaml.safe_load_all(manifest) if obj}
    assert kinds == {"ServiceMonitor", "PodMonitor", "PrometheusRule", "NetworkPolicy", "ConfigMap"}
    apply_twice(platform_installed, manifest)


# --- the worker's ServiceAccount ------------------------------------------------------------------------------


def can(
    api: client.ApiClient, verb: str, resource: str, namespace: str | None, group: str = "", sub=None
) -> bool:
    review = client.V1SelfSubjectAccessReview(
        spec=client.V1SelfSubjectAccessReviewSpec(
            resource_attributes=client.V1ResourceAttributes(
                verb=verb, resource=resource, namespace=namespace, group=group, subresource=sub
            )
        )
    )
    return client.AuthorizationV1Api(api).create_self_subject_access_review(review).status.allowed


@pytest.fixture(scope="module")
def worker_api(platform_installed, kube_admin, tmp_path_factory):
    """A client with the token the worker's pod gets (its ServiceAccount in deploy/base/worker.yaml)."""
    worker = yaml.safe_load((DEPLOY / "base" / "worker.yaml").read_text())
    account = worker["spec"]["template"]["spec"]["serviceAccountName"]
    token = service_account_token(kube_admin, "inference-platform", account)
    path = platform_installed.kubeconfig_for(tmp_path_factory.mktemp("worker") / "kubeconfig", account, token)
    from kubernetes import config

    return config.new_client_from_config(config_file=str(path))


def test_the_worker_may_manage_what_it_reconciles_in_the_engines_namespace(worker_api):
    for group, resource in (
        ("apps", "deployments"),
        ("leaderworkerset.x-k8s.io", "leaderworkersets"),
        ("inference.networking.k8s.io", "inferencepools"),
        ("networking.k8s.io", "networkpolicies"),
        ("", "services"),
        ("", "secrets"),
        ("", "configmaps"),
    ):
        for verb in ("get", "list", "create", "patch", "delete"):
            assert can(worker_api, verb, resource, "inference", group), (verb, group, resource)
    assert can(worker_api, "patch", "pods", "inference")  # a drained replica's deletion cost


@pytest.mark.parametrize(
    ("verb", "resource", "namespace", "group", "sub"),
    [
        ("get", "secrets", "inference-platform", "", None),  # the platform's own secrets
        ("list", "secrets", "kube-system", "", None),
        ("list", "secrets", None, "", None),  # every namespace's
        ("create", "deployments", "default", "apps", None),  # only the engines' namespace
        ("list", "nodes", None, "", None),
        ("patch", "nodes", None, "", None),
        ("create", "pods", "inference", "", None),  # pods only through their Deployments
        ("delete", "pods", "inference", "", None),
        ("create", "pods", "inference", "", "exec"),
        ("create", "roles", "inference", "rbac.authorization.k8s.io", None),  # no escalation
        ("create", "rolebindings", "inference", "rbac.authorization.k8s.io", None),
        ("escalate", "roles", "inference", "rbac.authorization.k8s.io", None),
        ("bind", "clusterroles", None, "rbac.authorization.k8s.io", None),
        ("create", "clusterrolebindings", None, "rbac.authorization.k8s.io", None),
        ("create", "serviceaccounts", "inference", "", "token"),
        ("impersonate", "serviceaccounts", "inference", "", None),
        ("delete", "namespaces", None, "", None),
        ("create", "customresourcedefinitions", None, "apiextensions.k8s.io", None),
    ],
)
def test_the_worker_may_not(worker_api, verb, resource, namespace, group, sub):
    assert not can(worker_api, verb, resource, namespace, group, sub)


def test_the_other_platform_pods_get_no_api_access(platform_installed):
    account = next(
        obj
        for obj in yaml.safe_load_all((DEPLOY / "base" / "rbac.yaml").read_text())
        if obj["kind"] == "ServiceAccount" and obj["metadata"]["name"] == "platform"
    )
    assert account["automountServiceAccountToken"] is False
