"""The kubernetes orchestrator's reconcile under faults that a real API server cannot be made to produce.

Every other reconcile case runs against a real control plane (tests/kube/test_reconcile_cases.py and
tests/kube/test_reconcile.py). What stays here needs `KubernetesApiDouble`, a test double of the Kubernetes API:
a real HTTP server on localhost that the official client reaches through a real kubeconfig, which keeps and
lists the objects applied to it, records every server-side-apply patch (with its field manager) and answers with
injected errors (a 409 conflict once, a 500 every time) where a test asks for one. The injected faults are the
only reason it exists; everything on our side (client, orchestrator, services, database) is real. (The case
with no cluster configured at all needs no server, and stays beside them.)
"""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from django.test import override_settings

from serving import services
from serving.models import ModelDeployment, ObservedStatus, OrchestratorKind, Pool
from serving.orchestrators.kube_api import KubernetesError

pytestmark = pytest.mark.django_db


class KubernetesApiDouble:
    """A test double of the Kubernetes API server (see the module docstring)."""

    def __init__(self):
        self.objects: dict[tuple[str, str, str], dict] = {}  # (plural, namespace, name) -> object
        self.patches: list[dict] = []  # every apply: plural, namespace, name, field manager, force, body
        self.deletes: list[tuple[str, str, str]] = []
        self.faults: list[tuple[str, str, int]] = []  # (method, path fragment, status), each used once
        self.failing: dict[str, int] = {}  # path fragment -> status, every time
        self.lock = threading.Lock()

    # what a test reads
    def get(self, plural: str, namespace: str, name: str) -> dict | None:
        return self.objects.get((plural, namespace, name))

    def names(self, plural: str) -> set[str]:
        return {name for (kind, _, name) in self.objects if kind == plural}

    # the API
    def handle(self, method: str, path: str, query: dict, headers, body: bytes) -> tuple[int, dict]:
        with self.lock:
            for fault in self.faults:
                if fault[0] == method and fault[1] in path:
                    self.faults.remove(fault)
                    return fault[2], {"kind": "Status", "code": fault[2], "reason": "Injected"}
            for fragment, status in self.failing.items():
                if fragment in path:
                    return status, {"kind": "Status", "code": status, "reason": "Injected"}
            parts = path.strip("/").split("/")
            namespace_at = parts.index("namespaces")
            namespace, plural = parts[namespace_at + 1], parts[namespace_at + 2]
            name = parts[namespace_at + 3] if len(parts) > namespace_at + 3 else None
            key = (plural, namespace, name)
            if method == "GET" and name is None:
                wanted = dict(
                    item.split("=") for item in query.get("labelSelector", [""])[0].split(",") if item
                )
                items = [
                    obj
                    for (kind, ns, _), obj in sorted(self.objects.items())
                    if kind == plural
                    and ns == namespace
                    and wanted.items() <= (obj["metadata"].get("labels") or {}).items()
                ]
                return 200, {"kind": "List", "items": json.loads(json.dumps(items))}
            if method == "PATCH":
                assert headers["Content-Type"] == "application/apply-patch+yaml"
                applied = yaml.safe_load(body)
                self.patches.append(
                    {
                        "plural": plural,
                        "namespace": namespace,
                        "name": name,
                        "fieldManager": query["fieldManager"][0],
                        "force": query.get("force", [""])[0],
                        "body": applied,
                    }
                )
                old = self.objects.get(key)
                uid = old["metadata"]["uid"] if old else str(uuid.uuid4())
                applied["metadata"]["uid"] = uid
                if old and "status" in old:
                    applied["status"] = old["status"]
                self.objects[key] = applied
                return 200, applied
            if method == "DELETE":
                self.deletes.append(key)
                if self.objects.pop(key, None) is None:
                    return 404, {"kind": "Status", "code": 404}
                return 200, {"kind": "Status", "status": "Success"}
            return 405, {"kind": "Status", "code": 405}


@pytest.fixture
def cluster(tmp_path):
    double = KubernetesApiDouble()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self):
            url = urlsplit(self.path)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, payload = double.handle(self.command, url.path, parse_qs(url.query), self.headers, body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_DELETE = _serve

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    server_url = f"http://127.0.0.1:{server.server_address[1]}"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "double", "cluster": {"server": server_url}}],
                "users": [{"name": "platform", "user": {"token": "test-token"}}],
                "contexts": [{"name": "test", "context": {"cluster": "double", "user": "platform"}}],
                "current-context": "other",
            }
        )
    )
    with override_settings(
        KUBERNETES_KUBECONFIG=str(kubeconfig),
        KUBERNETES_CONTEXT="test",
        KUBERNETES_NAMESPACE="inference",
        KUBERNETES_NAMESPACES=["inference", "team-b"],
        KUBERNETES_API_BACKOFF_S=0.01,
        KUBERNETES_API_RETRIES=2,
    ):
        yield double
    server.shutdown()
    server.server_close()


def make_deployment(name: str = "qwen", **pool_fields) -> ModelDeployment:
    deployment = ModelDeployment.objects.create(
        name=name,
        served_model_name=name,
        model_source="Qwen/Qwen3-8B",
        orchestrator=OrchestratorKind.KUBERNETES,
        engine_image="vllm/vllm-openai:v0.11.0",
    )
    Pool.objects.create(deployment=deployment, name="main", **({"replicas": 2} | pool_fields))
    return deployment


def reconcile(deployment: ModelDeployment):
    result = services.deployment_reconcile(deployment_id=deployment.pk)
    deployment.refresh_from_db()
    return result


def test_an_injected_conflict_is_retried_with_backoff(cluster):
    """A 409 on an apply (a real server gives none to a forced apply, so it is injected) is tried again."""
    deployment = make_deployment()
    cluster.faults.append(("PATCH", "/deployments/qwen-main", 409))
    reconcile(deployment)
    deployment_patches = [p for p in cluster.patches if p["plural"] == "deployments"]
    assert len(deployment_patches) == 1  # the 409 answer was not recorded; the retry was
    assert deployment.observed_status == ObservedStatus.PROGRESSING


def test_an_injected_server_error_fails_one_deployment_but_not_the_others(cluster):
    """500s on one deployment's workload (injected: a healthy server does not fail one object's writes)."""
    broken = make_deployment("broken")
    fine = make_deployment("fine")
    cluster.failing["/deployments/broken-main"] = 500
    with pytest.raises(KubernetesError, match="500"):
        services.deployment_reconcile(deployment_id=broken.pk)
    broken.refresh_from_db()
    assert broken.observed_status == ObservedStatus.FAILED and "500" in broken.status_message

    outcome = services.deployments_reconcile_all()
    assert outcome[broken.pk] == "error" and outcome[fine.pk] == ObservedStatus.PROGRESSING
    assert cluster.names("deployments") == {"fine-main"}

    del cluster.failing["/deployments/broken-main"]
    reconcile(broken)
    assert broken.observed_status == ObservedStatus.PROGRESSING


def test_without_a_cluster_it_says_so(settings):
    settings.KUBERNETES_KUBECONFIG = ""
    settings.KUBERNETES_IN_CLUSTER = False
    deployment = make_deployment()
    with pytest.raises(KubernetesError):
        services.deployment_reconcile(deployment_id=deployment.pk)
    deployment.refresh_from_db()
    assert "no cluster configured" in deployment.status_message
    assert services.engines_sweep().gone == []
