"""deploy/monitoring's Kubernetes objects select what deploy/base and the orchestrator really label, on ports
that exist, and its kustomization ships every dashboard."""

from __future__ import annotations

import pytest
import yaml

from serving.orchestrators import kube_render

from .monitoring import DASHBOARDS, MONITORING

BASE = MONITORING.parent / "base"


def objects(path) -> list[dict]:
    return [obj for obj in yaml.safe_load_all(path.read_text()) if obj]


def service(name: str) -> dict:
    return next(obj for obj in objects(BASE / f"{name}.yaml") if obj["kind"] == "Service")


def prometheus_label(kubernetes_label: str) -> str:
    """How Prometheus's Kubernetes discovery names a pod label: every character not [a-zA-Z0-9_] becomes _."""
    return "__meta_kubernetes_pod_label_" + "".join(
        c if c.isalnum() or c == "_" else "_" for c in kubernetes_label
    )


def test_the_service_monitors_select_the_router_and_web_services_on_their_ports():
    monitors = {obj["metadata"]["name"]: obj for obj in objects(MONITORING / "service-monitors.yaml")}
    for monitor_name, service_name, path in (
        ("router", "router", "/metrics"),
        ("control-plane", "web", "/metrics/platform"),
    ):
        monitor, target = monitors[monitor_name], service(service_name)
        assert monitor["metadata"]["namespace"] == target["metadata"]["namespace"]
        labels = target["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {port["name"] for port in target["spec"]["ports"]}
        assert endpoint["path"] == path
        assert endpoint["authorization"]["credentials"]["name"] == "platform-secrets"


def test_the_pod_monitor_selects_engine_pods_and_keeps_their_deployment_pool_and_role():
    (monitor,) = objects(MONITORING / "pod-monitor.yaml")
    assert monitor["spec"]["selector"]["matchLabels"] == {kube_render.LABEL_MANAGED_BY: kube_render.MANAGER}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http"  # the engine container's port name (kube_render)
    relabel = {rule["targetLabel"]: rule["sourceLabels"] for rule in endpoint["relabelings"]}
    assert relabel == {
        "deployment": [prometheus_label(kube_render.LABEL_DEPLOYMENT)],
        "pool": [prometheus_label(kube_render.LABEL_POOL)],
        "role": [prometheus_label(kube_render.LABEL_ROLE)],
        "endpoint": ["__meta_kubernetes_pod_name"],
    }


def test_prometheus_may_reach_engine_http():
    (policy,) = objects(MONITORING / "network-policy.yaml")
    assert policy["spec"]["podSelector"]["matchLabels"] == {kube_render.LABEL_MANAGED_BY: kube_render.MANAGER}
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": kube_render.HTTP_PORT}]


# The labels the Prometheus Operator (kube-prometheus-stack) gives the pods it runs in the monitoring namespace.
MONITORING_PODS = {
    "prometheus": {
        "app.kubernetes.io/name": "prometheus",
        "app.kubernetes.io/managed-by": "prometheus-operator",
        "app.kubernetes.io/instance": "k8s",
        "prometheus": "k8s",
    },
    "alertmanager": {
        "app.kubernetes.io/name": "alertmanager",
        "app.kubernetes.io/managed-by": "prometheus-operator",
        "alertmanager": "main",
    },
    "grafana": {"app.kubernetes.io/name": "grafana", "app.kubernetes.io/instance": "kube-prometheus-stack"},
    "exporter": {"app.kubernetes.io/name": "kube-state-metrics"},
}


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """A label selector as the API server reads it; these manifests use matchLabels only (an expression would be
    read wrongly here, so it fails the test instead)."""
    assert set(selector) <= {"matchLabels"}, selector
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_admits(peer: dict, own_namespace: str, namespace: str, pod_labels: dict[str, str]) -> bool:
    """A `from` peer: a pod selector alone means pods of the policy's own namespace."""
    assert set(peer) <= {"namespaceSelector", "podSelector"}, peer  # no ipBlock in these policies
    if "namespaceSelector" in peer:
        namespace_ok = _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
    else:
        namespace_ok = namespace == own_namespace
    return namespace_ok and _selects(peer.get("podSelector", {}), pod_labels)


def admitted(
    policies: list[dict], engine: dict[str, str], namespace: str, pod: dict[str, str], port: int
) -> bool:
    """Whether NetworkPolicy semantics let a pod (its namespace and labels) open `port` on an engine pod: isolated
    for ingress by any policy selecting it, then allowed if any rule of those policies admits the peer and port."""
    selecting = [
        policy
        for policy in policies
        if "Ingress" in policy["spec"]["policyTypes"] and _selects(policy["spec"]["podSelector"], engine)
    ]
    assert selecting, "the engine pod must be isolated for ingress"
    return any(
        any(
            _peer_admits(peer, policy["metadata"]["namespace"], namespace, pod)
            for peer in rule.get("from", [])
        )
        and any(entry["port"] == port for entry in rule.get("ports", []))
        for policy in selecting
        for rule in policy["spec"].get("ingress", [])
    )


@pytest.mark.django_db
def test_only_prometheus_of_the_monitoring_namespace_reaches_an_engine():
    """vLLM's API key guards only /v1 and a few prefixes (`POST /invocations` runs inference without one), so no
    pod of the monitoring namespace but Prometheus's may open engine HTTP: not Grafana, Alertmanager or an
    exporter. Read from the rendered objects: the engines' default deny, a deployment's own policy as the
    orchestrator renders it, and the monitoring policy."""
    from serving.models import ModelDeployment, OrchestratorKind, Pool

    deployment = ModelDeployment.objects.create(
        name="qwen",
        served_model_name="qwen",
        model_source="Qwen/Qwen3-8B",
        orchestrator=OrchestratorKind.KUBERNETES,
    )
    pool = Pool.objects.create(deployment=deployment, name="main")
    policies = [
        *(obj for obj in objects(BASE / "network-policies.yaml") if obj["kind"] == "NetworkPolicy"),
        kube_render.render_network_policy(deployment, None),
        *objects(MONITORING / "network-policy.yaml"),
    ]
    assert {policy["metadata"]["namespace"] for policy in policies} == {kube_render.namespace_of(deployment)}
    engine = kube_render.pool_labels(deployment, pool)
    http = kube_render.HTTP_PORT
    reach = {
        name: admitted(policies, engine, "monitoring", labels, http)
        for name, labels in MONITORING_PODS.items()
    }
    assert reach == {"prometheus": True, "alertmanager": False, "grafana": False, "exporter": False}
    # Prometheus itself only on engine HTTP, and only from the monitoring namespace.
    assert not admitted(
        policies, engine, "monitoring", MONITORING_PODS["prometheus"], kube_render.KV_EVENTS_PORT
    )
    assert not admitted(policies, engine, "default", MONITORING_PODS["prometheus"], http)
    # The platform's own way in still works.
    router = {kube_render.PLATFORM_NAME_LABEL: kube_render.ROUTER_PODS}
    assert admitted(policies, engine, kube_render.platform_namespace(), router, http)


def test_the_kustomization_ships_every_dashboard_and_object():
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    shipped = {file for generator in kustomization["configMapGenerator"] for file in generator["files"]}
    assert shipped == {f"grafana/{path.name}" for path in DASHBOARDS.glob("*.json")}
    assert set(kustomization["resources"]) == {path.name for path in MONITORING.glob("*.yaml")} - {
        "kustomization.yaml"
    }
