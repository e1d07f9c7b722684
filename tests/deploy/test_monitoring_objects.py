"""deploy/monitoring's Kubernetes objects select what deploy/base and the orchestrator really label, on ports
that exist, and its kustomization ships every dashboard."""

from __future__ import annotations

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


def test_the_kustomization_ships_every_dashboard_and_object():
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    shipped = {file for generator in kustomization["configMapGenerator"] for file in generator["files"]}
    assert shipped == {f"grafana/{path.name}" for path in DASHBOARDS.glob("*.json")}
    assert set(kustomization["resources"]) == {path.name for path in MONITORING.glob("*.yaml")} - {
        "kustomization.yaml"
    }
