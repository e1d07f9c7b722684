"""The kubernetes orchestrator's reconcile, against a test double of the Kubernetes API.

No API server can run on these machines, so `KubernetesApiDouble` below stands in for one: a real HTTP server
on localhost that the official client reaches through a real kubeconfig. It records every server-side-apply
patch (with its field manager), keeps the applied objects, lists them by label selector, deletes them, serves
pods and workload status that a test sets, and can answer with injected errors (409, 500). It is the only
mock in these tests; everything on our side (client, orchestrator, services, database) is real.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from django.test import override_settings

from serving import services
from serving.engine_keys import engine_api_key
from serving.models import (
    DesiredStatus,
    Endpoint,
    Health,
    KvConnector,
    ModelDeployment,
    ObservedStatus,
    OrchestratorKind,
    Pool,
    PoolRole,
)
from serving.orchestrators import kube_render as render
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

    # what a test sets or reads
    def set_status(self, plural: str, namespace: str, name: str, status: dict) -> None:
        self.objects[(plural, namespace, name)]["status"] = status

    def add_pod(self, namespace: str, name: str, labels: dict, ip: str | None, ready: bool) -> None:
        condition = {"type": "Ready", "status": "True" if ready else "False"}
        self.objects[("pods", namespace, name)] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels, "uid": str(uuid.uuid4())},
            "status": {"podIP": ip, "phase": "Running", "conditions": [condition]},
        }

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
                if plural == "pods" and old:
                    # Our apply to a pod sets its annotations only; the rest stays the kubelet's.
                    old["metadata"]["annotations"] = applied["metadata"].get("annotations") or {}
                    return 200, old
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


def pod_labels(deployment: ModelDeployment, pool: str = "main", **extra) -> dict:
    return {
        render.LABEL_MANAGED_BY: render.MANAGER,
        render.LABEL_DEPLOYMENT: deployment.name,
        render.LABEL_DEPLOYMENT_ID: str(deployment.pk),
        render.LABEL_POOL: pool,
        **extra,
    }


def test_it_creates_the_objects_with_server_side_apply_under_one_field_manager(cluster):
    deployment = make_deployment()
    result = reconcile(deployment)
    assert [(p["plural"], p["name"]) for p in cluster.patches] == [
        ("configmaps", "qwen"),
        ("secrets", "qwen-engine-key"),  # the key and the policy before the pods that need them
        ("networkpolicies", "qwen-engines"),
        ("networkpolicies", "qwen-engines-egress"),
        ("services", "qwen-main"),
        ("deployments", "qwen-main"),
    ]
    assert {(p["fieldManager"], p["force"]) for p in cluster.patches} == {("inference-platform", "true")}
    root_uid = cluster.get("configmaps", "inference", "qwen")["metadata"]["uid"]
    for plural, name in (
        ("services", "qwen-main"),
        ("deployments", "qwen-main"),
        ("secrets", "qwen-engine-key"),
        ("networkpolicies", "qwen-engines"),
        ("networkpolicies", "qwen-engines-egress"),
    ):
        owner = cluster.get(plural, "inference", name)["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("ConfigMap", "qwen", root_uid)
    assert cluster.get("deployments", "inference", "qwen-main")["spec"]["replicas"] == 2
    assert result.status == ObservedStatus.PROGRESSING and result.settling
    assert deployment.observed_status == ObservedStatus.PROGRESSING
    assert "main: 0 of 2 replicas ready" in deployment.status_message


def test_a_second_reconcile_sends_no_change(cluster):
    deployment = make_deployment()
    reconcile(deployment)
    sent = len(cluster.patches)
    reconcile(deployment)
    assert len(cluster.patches) == sent and not cluster.deletes


def test_status_and_pods_are_read_back_into_endpoints(cluster):
    deployment = make_deployment(kv_connector=KvConnector.NIXL, role=PoolRole.DECODE)
    reconcile(deployment)
    cluster.add_pod("inference", "qwen-main-a", pod_labels(deployment), "10.1.0.5", ready=True)
    cluster.add_pod("inference", "qwen-main-b", pod_labels(deployment), "10.1.0.6", ready=False)
    cluster.add_pod("inference", "qwen-main-c", pod_labels(deployment), None, ready=False)  # no IP yet
    cluster.add_pod("inference", "other", pod_labels(deployment, pool="gone"), "10.1.0.9", ready=True)
    cluster.set_status("deployments", "inference", "qwen-main", {"replicas": 2, "readyReplicas": 1})
    result = reconcile(deployment)
    rows = {e.name: e for e in Endpoint.objects.filter(pool__deployment=deployment)}
    assert set(rows) == {"qwen-main-a", "qwen-main-b"}
    a = rows["qwen-main-a"]
    assert (a.url, a.kv_events_endpoint, a.kv_side_channel) == (
        "http://10.1.0.5:8000",
        "tcp://10.1.0.5:5557",
        "10.1.0.5:5600",
    )
    assert a.role == PoolRole.DECODE and a.health == Health.HEALTHY and a.last_seen_at
    assert rows["qwen-main-b"].health == Health.STARTING
    assert result.status == ObservedStatus.DEGRADED

    cluster.objects[("pods", "inference", "qwen-main-b")]["status"]["conditions"][0]["status"] = "True"
    cluster.objects.pop(("pods", "inference", "qwen-main-a"))
    cluster.set_status("deployments", "inference", "qwen-main", {"replicas": 2, "readyReplicas": 2})
    reconcile(deployment)
    rows = {e.name: e.health for e in Endpoint.objects.filter(pool__deployment=deployment)}
    assert rows == {"qwen-main-b": Health.HEALTHY}
    assert deployment.observed_status == ObservedStatus.READY


def test_only_leaders_of_a_leader_worker_set_become_endpoints(cluster):
    deployment = make_deployment(
        replicas=1, nodes_per_replica=2, data_parallel_size=4, enable_expert_parallel=True, gpus_per_replica=4
    )
    reconcile(deployment)
    assert cluster.names("leaderworkersets") == {"qwen-main"} and not cluster.names("deployments")
    cluster.add_pod(
        "inference",
        "qwen-main-0",
        pod_labels(deployment, **{render.LWS_WORKER_INDEX_LABEL: "0"}),
        "10.2.0.1",
        True,
    )
    cluster.add_pod(
        "inference",
        "qwen-main-0-1",
        pod_labels(deployment, **{render.LWS_WORKER_INDEX_LABEL: "1"}),
        "10.2.0.2",
        True,
    )
    cluster.set_status("leaderworkersets", "inference", "qwen-main", {"replicas": 1, "readyReplicas": 1})
    reconcile(deployment)
    assert list(Endpoint.objects.filter(pool__deployment=deployment).values_list("name", flat=True)) == [
        "qwen-main-0"
    ]
    assert deployment.observed_status == ObservedStatus.READY


def test_scaling_and_a_change_of_options_patch_only_the_workload(cluster):
    deployment = make_deployment()
    reconcile(deployment)
    cluster.patches.clear()
    Pool.objects.filter(deployment=deployment).update(replicas=5)
    reconcile(deployment)
    assert [(p["plural"], p["body"]["spec"]["replicas"]) for p in cluster.patches] == [("deployments", 5)]

    cluster.patches.clear()
    Pool.objects.filter(deployment=deployment).update(
        kv_connector=KvConnector.OFFLOADING, cpu_offload_bytes=8 * 1024**3
    )
    reconcile(deployment)
    assert [p["plural"] for p in cluster.patches] == ["deployments"]
    args = cluster.get("deployments", "inference", "qwen-main")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert "OffloadingConnector" in args[args.index("--kv-transfer-config") + 1]


def test_it_restores_what_someone_else_changed(cluster):
    deployment = make_deployment()
    reconcile(deployment)
    cluster.get("deployments", "inference", "qwen-main")["spec"]["replicas"] = 7  # kubectl scale, say
    reconcile(deployment)
    assert cluster.get("deployments", "inference", "qwen-main")["spec"]["replicas"] == 2


def test_it_prunes_objects_no_longer_wanted(cluster):
    deployment = make_deployment()
    Pool.objects.create(deployment=deployment, name="extra")
    reconcile(deployment)
    assert cluster.names("deployments") == {"qwen-main", "qwen-extra"}
    cluster.add_pod("inference", "qwen-extra-a", pod_labels(deployment, pool="extra"), "10.3.0.1", True)
    reconcile(deployment)
    assert Endpoint.objects.filter(pool__name="extra").exists()

    Pool.objects.filter(deployment=deployment, name="extra").delete()
    reconcile(deployment)
    assert cluster.names("deployments") == {"qwen-main"} and cluster.names("services") == {"qwen-main"}

    ModelDeployment.objects.filter(pk=deployment.pk).update(desired_status=DesiredStatus.STOPPED)
    deployment.refresh_from_db()
    result = reconcile(deployment)
    assert not cluster.names("deployments") and not cluster.names("services")
    assert cluster.names("configmaps") == {"qwen"}  # the root stays while the deployment exists
    # So do the key and the policies: pods still shutting down stay guarded.
    assert cluster.names("secrets") == {"qwen-engine-key"}
    assert cluster.names("networkpolicies") == {"qwen-engines", "qwen-engines-egress"}
    assert result.status == ObservedStatus.STOPPED


def test_a_deleted_deployment_is_swept_away_but_nothing_else(cluster):
    keep = make_deployment("keep")
    gone = make_deployment("gone")
    reconcile(keep)
    reconcile(gone)
    foreign = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "theirs", "labels": {"app": "x"}},
    }
    cluster.objects[("configmaps", "inference", "theirs")] = foreign
    gone.delete()
    swept = services.engines_sweep().gone
    assert "inference/Deployment/gone-main" in swept and "inference/ConfigMap/gone" in swept
    assert {
        "inference/Secret/gone-engine-key",
        "inference/NetworkPolicy/gone-engines",
        "inference/NetworkPolicy/gone-engines-egress",
    } <= set(swept)
    assert cluster.names("configmaps") == {"keep", "theirs"}
    assert cluster.names("deployments") == {"keep-main"}
    assert cluster.names("secrets") == {"keep-engine-key"}
    assert cluster.names("networkpolicies") == {"keep-engines", "keep-engines-egress"}


def test_a_conflict_is_retried_with_backoff(cluster):
    deployment = make_deployment()
    cluster.faults.append(("PATCH", "/deployments/qwen-main", 409))
    reconcile(deployment)
    deployment_patches = [p for p in cluster.patches if p["plural"] == "deployments"]
    assert len(deployment_patches) == 1  # the 409 answer was not recorded; the retry was
    assert deployment.observed_status == ObservedStatus.PROGRESSING


def test_an_api_error_fails_one_deployment_but_not_the_others(cluster):
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


def test_namespaces_come_from_the_deployment_or_settings_and_must_be_allowed(cluster):
    deployment = make_deployment()
    ModelDeployment.objects.filter(pk=deployment.pk).update(namespace="team-b")
    deployment.refresh_from_db()
    reconcile(deployment)
    assert {p["namespace"] for p in cluster.patches} == {"team-b"}
    ModelDeployment.objects.filter(pk=deployment.pk).update(namespace="kube-system")
    deployment.refresh_from_db()
    result = reconcile(deployment)
    assert result.status == ObservedStatus.FAILED and "kube-system" in result.message


def test_without_a_cluster_it_says_so(settings):
    settings.KUBERNETES_KUBECONFIG = ""
    settings.KUBERNETES_IN_CLUSTER = False
    deployment = make_deployment()
    with pytest.raises(KubernetesError):
        services.deployment_reconcile(deployment_id=deployment.pk)
    deployment.refresh_from_db()
    assert "no cluster configured" in deployment.status_message
    assert services.engines_sweep().gone == []


def test_the_engines_key_and_network_policy_are_applied_and_kept_in_step(cluster, settings):
    settings.ENGINE_KEY_SECRET = "first"
    deployment = make_deployment(kv_connector=KvConnector.NIXL)
    reconcile(deployment)
    secret = cluster.get("secrets", "inference", "qwen-engine-key")
    assert base64.b64decode(secret["data"]["VLLM_API_KEY"]).decode() == engine_api_key(deployment.pk)
    assert secret["metadata"]["labels"][render.LABEL_DEPLOYMENT_ID] == str(deployment.pk)
    template = cluster.get("deployments", "inference", "qwen-main")["spec"]["template"]
    assert template["spec"]["automountServiceAccountToken"] is False
    env = {item["name"]: item for item in template["spec"]["containers"][0]["env"]}
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "qwen-engine-key"
    policy = cluster.get("networkpolicies", "inference", "qwen-engines")["spec"]
    assert len(policy["ingress"]) == 3  # router and worker; KV-event ingester; the deployment's own pods

    # A pool without NIXL no longer needs traffic between the deployment's pods: only the policy changes.
    cluster.patches.clear()
    Pool.objects.filter(deployment=deployment).update(kv_connector=KvConnector.NONE)
    reconcile(deployment)
    assert ("networkpolicies", "qwen-engines") in [(p["plural"], p["name"]) for p in cluster.patches]
    assert len(cluster.get("networkpolicies", "inference", "qwen-engines")["spec"]["ingress"]) == 2

    # A new secret: a new key in the Secret, and the pods roll to read it.
    cluster.patches.clear()
    settings.ENGINE_KEY_SECRET = "second"
    reconcile(deployment)
    assert [(p["plural"], p["name"]) for p in cluster.patches] == [
        ("secrets", "qwen-engine-key"),
        ("deployments", "qwen-main"),
    ]
    secret = cluster.get("secrets", "inference", "qwen-engine-key")
    assert base64.b64decode(secret["data"]["VLLM_API_KEY"]).decode() == engine_api_key(deployment.pk)


def test_a_scale_down_drains_the_pod_it_removes_first(cluster, settings):
    """Two ready pods, replicas 2 -> 1: the pod with nothing in flight is drained (no new requests, the
    lowest deletion cost) while the Deployment keeps both; once nothing is in flight there the Deployment goes to
    one replica, and the pod's lifetime ends with its drain recorded."""
    import time

    import redis

    from routing.contracts import REPLICA_LOAD_KEY
    from serving.models import EndpointLifetime
    from serving.orchestrators.kubernetes import POD_DELETION_COST

    settings.ROUTER_CONFIG_POLL_SECONDS = 0.2
    settings.ROUTER_LOAD_SHARE_SECONDS = 0.05
    client = redis.Redis.from_url(settings.REDIS_URL)
    deployment = make_deployment()
    reconcile(deployment)
    cluster.add_pod("inference", "qwen-main-a", pod_labels(deployment), "10.1.0.5", ready=True)
    cluster.add_pod("inference", "qwen-main-b", pod_labels(deployment), "10.1.0.6", ready=True)
    cluster.set_status("deployments", "inference", "qwen-main", {"replicas": 2, "readyReplicas": 2})
    reconcile(deployment)
    rows = {e.name: e for e in Endpoint.objects.filter(pool__deployment=deployment)}

    def in_flight(name: str, count: int) -> None:
        key = REPLICA_LOAD_KEY.format(rows[name].pk)
        if count:
            client.hset(key, "replica-1", f"{count}.0 {count} {time.time():.3f} 0")
        else:
            client.delete(key)

    in_flight("qwen-main-b", 3)  # a router replica has three requests there
    Pool.objects.filter(deployment=deployment).update(replicas=1)
    result = reconcile(deployment)
    drained = Endpoint.objects.get(name="qwen-main-a")
    assert drained.draining_since is not None and "Draining 1 replica" in result.message
    assert Endpoint.objects.get(name="qwen-main-b").draining_since is None
    pod = cluster.get("pods", "inference", "qwen-main-a")
    assert pod["metadata"]["annotations"] == {POD_DELETION_COST: "-1000000"}
    assert cluster.get("deployments", "inference", "qwen-main")["spec"]["replicas"] == 2

    in_flight("qwen-main-a", 1)  # a request that reached it before the routers reloaded
    time.sleep(1.0)  # past the time routers take to reload (0.8 s here)
    reconcile(deployment)
    assert cluster.get("deployments", "inference", "qwen-main")["spec"]["replicas"] == 2

    in_flight("qwen-main-a", 0)
    reconcile(deployment)
    assert cluster.get("deployments", "inference", "qwen-main")["spec"]["replicas"] == 1
    cluster.objects.pop(("pods", "inference", "qwen-main-a"))  # the ReplicaSet deletes the cheapest pod
    reconcile(deployment)
    assert list(Endpoint.objects.filter(pool__deployment=deployment).values_list("name", flat=True)) == [
        "qwen-main-b"
    ]
    life = EndpointLifetime.objects.get(endpoint_name="qwen-main-a")
    assert life.ready_at and life.draining_at and life.stopped_at and life.draining_at <= life.stopped_at
    in_flight("qwen-main-b", 0)


def test_engine_pods_wait_for_routers_before_stopping_and_have_time_to_finish(cluster, settings):
    deployment = make_deployment()
    reconcile(deployment)
    spec = cluster.get("deployments", "inference", "qwen-main")["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": settings.KUBERNETES_PRESTOP_SLEEP_S}}}
    assert spec["terminationGracePeriodSeconds"] == (
        settings.ENGINE_DRAIN_TIMEOUT_S + settings.KUBERNETES_PRESTOP_SLEEP_S
    )
