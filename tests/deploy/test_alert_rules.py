"""deploy/monitoring's alerting rules: valid for Prometheus (`promtool check rules`), each with a unit test that
passes (`promtool test rules`), on series the platform exports, and the same in the plain file and the
PrometheusRule. promtool is Debian's `prometheus` package (`make promtool` installs it); without it the
promtool checks are skipped and say so."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from routing.kvindex import prefix_health

from .monitoring import MONITORING, RULE_TESTS, RULES, alerting_rules, exported_series, metric_names

HEALTH_ALERTS = {
    "DeploymentDegraded",
    "DeploymentFailed",
    "DeploymentHasNoHealthyEngine",
    "EngineCrashLooping",
    "EnginePodCrashLooping",
    "EngineUnhealthy",
    "PrefixPredictionRatioLow",
    "UsageIngestionLagging",
    "UsageJournalInUse",
    "UsageRecordingRefused",
}
# kube-state-metrics's, for engine pods on Kubernetes (the platform cannot see a pod's restarts itself).
KUBE_STATE_METRICS = {"kube_pod_container_status_restarts_total", "kube_pod_container_status_waiting_reason"}


def promtool(*args: str) -> subprocess.CompletedProcess:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "promtool is not installed (Debian's prometheus package: `make promtool`); rules not checked"
        )
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=120)


def rule(name: str) -> dict:
    return next(rule for rule in alerting_rules() if rule["alert"] == name)


def test_the_health_alerts_are_all_there():
    assert {rule["alert"] for rule in alerting_rules()} == HEALTH_ALERTS


def test_the_rules_are_valid():
    run = promtool("check", "rules", str(RULES))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(HEALTH_ALERTS)} rules found" in run.stdout


def test_every_rule_has_a_unit_test_and_they_pass():
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        # a test that only says "no alert" proves nothing on its own
        if case.get("exp_alerts")
    }
    assert tested == HEALTH_ALERTS
    run = promtool("test", "rules", str(RULE_TESTS))
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_unit_tests_fail_when_a_threshold_moves(tmp_path):
    # The tests must tell a rule that fires too late from one that fires on time.
    (tmp_path / RULES.name).write_text(RULES.read_text().replace("> 300", "> 3000"))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    run = promtool("test", "rules", str(tmp_path / RULE_TESTS.name))
    assert run.returncode != 0
    assert "UsageIngestionLagging" in run.stdout + run.stderr


def test_the_rules_query_series_the_platform_exports():
    exported = exported_series() | KUBE_STATE_METRICS
    for alert in alerting_rules():
        names = metric_names(alert["expr"])
        assert names and names <= exported, f"{alert['alert']}: {sorted(names - exported)}"


def test_the_prediction_ratio_alert_uses_the_portals_threshold_and_window():
    expr = rule("PrefixPredictionRatioLow")["expr"]
    assert f"router_prefix_prediction_ratio) < {prefix_health.DRIFT_BELOW}" in expr
    window = f"[{prefix_health.WINDOW_MINUTES}m]"
    assert (
        f"increase(router_prefix_reported_cached_tokens_total{window})) >= {prefix_health.MIN_REPORTED_TOKENS}"
        in (expr)
    )


def test_the_prometheus_rule_holds_the_same_groups():
    plain = yaml.safe_load(RULES.read_text())["groups"]
    operator = yaml.safe_load((MONITORING / "prometheus-rule.yaml").read_text())
    assert operator["kind"] == "PrometheusRule"
    assert operator["spec"]["groups"] == plain


def test_the_plain_prometheus_configuration_is_valid(tmp_path):
    # promtool checks that the token files exist and the rule files load, relative to the configuration.
    (tmp_path / "prometheus.yml").write_text((MONITORING / "prometheus.yml").read_text())
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / RULES.name).write_text(RULES.read_text())
    for name in ("router_metrics_token", "platform_metrics_token"):
        (tmp_path / name).write_text("token\n")
    run = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(HEALTH_ALERTS)} rules found" in run.stdout
