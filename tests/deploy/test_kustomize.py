"""`kubectl kustomize deploy/overlays/<name>` renders every process of the platform, valid against the official
schemas, with least-privilege RBAC for the orchestrator."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest
import yaml

from serving.orchestrators import kube_api, kube_render
from tests.deploy.validation import validate_objects

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = sorted(path.name for path in (DEPLOY / "overlays").iterdir() if path.is_dir())

pytestmark = pytest.mark.kubectl  # `make test` installs kubectl; without it these fail (tests/conftest.py)


@functools.cache
def rendered(overlay: str) -> tuple[dict, ...]:
    run = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    )
    return tuple(obj for obj in yaml.safe_load_all(run.stdout) if obj)


WORKLOADS = ("Deployment", "StatefulSet", "Job")


def find(objects, kind: str, name: str) -> dict:
    return next(obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"] == name)


def workload(objects, name: str) -> dict:
    return next(obj for obj in objects if obj["kind"] in WORKLOADS and obj["metadata"]["name"] == name)


def command(objects, name: str) -> list[str]:
    return workload(objects, name)["spec"]["template"]["spec"]["containers"][0]["command"]


def test_there_are_dev_and_production_overlays():
    assert {"dev", "production"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_overlay_renders_valid_objects(overlay):
    validate_objects(list(rendered(overlay)))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_platform_process_runs_with_its_config_and_secrets(overlay):
    objects = rendered(overlay)
    # The web side is ASGI (uvicorn workers): it serves the portal's WebSocket, which the router must not.
    assert command(objects, "web")[:6] == [
        "python",
        "-m",
        "gunicorn",
        "inference_platform.web_asgi:application",
        "--worker-class",
        "uvicorn_worker.UvicornWorker",
    ]
    assert command(objects, "router")[:4] == [
        "python",
        "-m",
        "uvicorn",
        "inference_platform.asgi:application",
    ]
    assert command(objects, "worker")[5] == "worker" and command(objects, "beat")[5] == "beat"
    assert command(objects, "kv-ingester") == ["python", "manage.py", "run_kv_ingester"]
    job = find(objects, "Job", "migrate")["spec"]["template"]["spec"]["containers"][0]
    assert job["command"] == ["python", "manage.py", "migrate", "--no-input"]
    assert find(objects, "Deployment", "beat")["spec"]["replicas"] == 1
    hpa = find(objects, "HorizontalPodAutoscaler", "router")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "router"}
    router = find(objects, "StatefulSet", "router")["spec"]
    journal = {env["name"]: env["value"] for env in router["template"]["spec"]["containers"][0]["env"]}
    claimed = {
        mount["mountPath"]
        for mount in router["template"]["spec"]["containers"][0]["volumeMounts"]
        if mount["name"] in {claim["metadata"]["name"] for claim in router["volumeClaimTemplates"]}
    }
    assert [path for path in claimed if journal["ROUTER_USAGE_JOURNAL_DIR"].startswith(path + "/")]
    for name in ("web", "router", "worker", "beat", "kv-ingester"):
        container = workload(objects, name)["spec"]["template"]["spec"]["containers"][0]
        sources = {next(iter(ref.values()))["name"] for ref in container["envFrom"]}
        assert sources == {"platform-config", "platform-secrets"}
    if overlay == "dev":
        secret = find(objects, "Secret", "platform-secrets")
        assert set(secret["data"]) == {"SECRET_KEY", "API_KEY_PEPPER", "DATABASE_URL", "REDIS_URL"}
    else:
        assert not [obj for obj in objects if obj["kind"] == "Secret"]  # created outside git


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_worker_may_use_the_api_and_only_for_what_the_orchestrator_manages(overlay):
    objects = rendered(overlay)
    config = find(objects, "ConfigMap", "platform-config")["data"]
    engines_namespace = config["KUBERNETES_NAMESPACE"]
    accounts = {
        obj["metadata"]["name"]: obj["spec"]["template"]["spec"]["serviceAccountName"]
        for obj in objects
        if obj["kind"] in ("Deployment", "StatefulSet")
    }
    assert accounts.pop("worker") == "orchestrator" and set(accounts.values()) == {"platform"}
    assert find(objects, "ServiceAccount", "platform")["automountServiceAccountToken"] is False
    assert not [obj for obj in objects if obj["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    roles = [obj for obj in objects if obj["kind"] == "Role"]
    assert [role["metadata"]["namespace"] for role in roles] == config["KUBERNETES_NAMESPACES"].split(",")
    binding = find(objects, "RoleBinding", roles[0]["metadata"]["name"])
    assert binding["metadata"]["namespace"] == engines_namespace
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "orchestrator", "namespace": "inference-platform"}
    ]
    granted = {}
    for rule in roles[0]["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted[(group, resource)] = set(rule["verbs"])
    managed = {
        ("" if api_version == "v1" else api_version.split("/")[0], kube_api.PLURALS[kind])
        for api_version, kind in kube_render.MANAGED_KINDS
    }
    writable = {key for key, verbs in granted.items() if verbs & {"create", "delete"}}
    assert writable == managed
    # Pods are only read, and patched for the deletion cost of a replica being drained.
    assert granted[("", "pods")] == {"get", "list", "patch"}
    assert set(granted) == managed | {("", "pods")}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_engines_namespaces_refuse_every_ingress_and_egress_no_policy_allows(overlay):
    objects = rendered(overlay)
    config = find(objects, "ConfigMap", "platform-config")["data"]
    for namespace in config["KUBERNETES_NAMESPACES"].split(","):
        policies = [
            obj["spec"]
            for obj in objects
            if obj["kind"] == "NetworkPolicy" and obj["metadata"]["namespace"] == namespace
        ]
        assert sorted(policies, key=lambda spec: spec["policyTypes"]) == [
            {"podSelector": {}, "policyTypes": ["Egress"]},
            {"podSelector": {}, "policyTypes": ["Ingress"]},
        ]


def _selected(objects, peer: dict) -> list[str]:
    """The platform workloads whose pods a NetworkPolicy peer (namespace and pod selector) lets in."""
    namespace = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
    wanted = peer["podSelector"]["matchLabels"].items()
    return [
        obj["metadata"]["name"]
        for obj in objects
        if obj["kind"] in WORKLOADS
        and obj["metadata"]["namespace"] == namespace
        and wanted <= obj["spec"]["template"]["metadata"]["labels"].items()
    ]


@pytest.mark.django_db
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_engines_policy_lets_in_exactly_the_router_worker_and_ingester_pods_of_the_overlay(overlay):
    """The labels and namespace kube_render names are the ones these manifests give those pods."""
    from serving.models import KvConnector, ModelDeployment, OrchestratorKind, Pool

    objects = rendered(overlay)
    deployment = ModelDeployment.objects.create(
        name="qwen",
        served_model_name="qwen",
        model_source="Qwen/Qwen3-8B",
        orchestrator=OrchestratorKind.KUBERNETES,
    )
    Pool.objects.create(deployment=deployment, name="main", kv_connector=KvConnector.NIXL)
    http, events, _own = kube_render.render_network_policy(deployment, None)["spec"]["ingress"]
    assert [_selected(objects, peer) for peer in http["from"]] == [["router"], ["worker"]]
    assert [_selected(objects, peer) for peer in events["from"]] == [["kv-ingester"]]
    namespaces = {obj["metadata"]["name"] for obj in objects if obj["kind"] == "Namespace"}
    assert kube_render.platform_namespace() in namespaces


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_celery_queue_has_workers_of_its_own(overlay):
    """Alert deliveries and what-if runs (settings.CELERY_TASK_ROUTES) are served by workers of their own, with
    no API access; the default worker, whose threads reconcile, autoscale and ingest usage, takes neither."""
    from django.conf import settings

    objects = rendered(overlay)
    queues = {}
    for obj in objects:
        argv = (
            obj["spec"]["template"]["spec"]["containers"][0]["command"] if obj["kind"] == "Deployment" else []
        )
        if argv[3:6] == ["-A", "inference_platform", "worker"]:
            queues[obj["metadata"]["name"]] = argv[argv.index("--queues") + 1].split(",")
    assert queues.pop("worker") == ["celery"]
    routed = {route["queue"] for route in settings.CELERY_TASK_ROUTES.values()}
    assert routed >= {"alerts", "whatif"}
    assert sorted(queue for names in queues.values() for queue in names) == sorted(routed)
    for name in queues:
        spec = workload(objects, name)["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == "platform"
        sources = {next(iter(ref.values()))["name"] for ref in spec["containers"][0]["envFrom"]}
        assert sources == {"platform-config", "platform-secrets"}
