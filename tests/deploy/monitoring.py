"""What deploy/monitoring's dashboards and rules query, and what the platform exports, for the tests beside.

The exported names come from the code's own registries: the router's (routing/server/metrics.py, with the usage
finisher's gauges), the control plane's collector (control_metrics/collector.py, by its describe(), so no
database is read) and the engines' (the simulator exports vLLM's names: simulator/metrics.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import yaml

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
DASHBOARDS = MONITORING / "grafana"
RULES = MONITORING / "rules" / "platform-alerts.yml"
RULE_TESTS = MONITORING / "rules" / "platform-alerts.test.yml"

# The series a family of each type is exposed as (Prometheus text format, as prometheus_client writes it).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}
# Series Prometheus itself writes for every scrape target.
PROMETHEUS_OWN = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}

KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
}
KEYWORDS |= {"inf", "nan"}


def _series(families) -> set[str]:
    return {family.name + suffix for family in families for suffix in SUFFIXES[family.type]}


def router_series() -> set[str]:
    import routing.metering.finisher  # noqa: F401  (registers the usage stream's and journal's gauges)
    from routing.server import metrics

    return _series(metrics.registry.collect())


def control_plane_series() -> set[str]:
    from control_metrics.collector import ControlPlaneCollector

    return _series(ControlPlaneCollector().describe())


def engine_series() -> set[str]:
    from simulator.metrics import EngineMetrics

    return _series(EngineMetrics("any-model").registry.collect())


def exported_series() -> set[str]:
    return router_series() | control_plane_series() | engine_series()


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (those before a `{`, or bare), by shape, not by parsing:
    strings, label matchers, ranges and grouping clauses are removed, then every identifier that is not a
    function call or a keyword is a metric name."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^{}]*\}", " ", expr)
    expr = re.sub(r"\[[^\[\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.:$])[A-Za-z_:][\w:]*", expr):
        follows = expr[match.end() :].lstrip()
        if follows.startswith("(") or match.group().lower() in KEYWORDS:
            continue
        names.add(match.group())
    return names


def variable_query(query: str) -> str:
    """The PromQL inside a Grafana Prometheus variable's query (`label_values(expr, label)`, `query_result(expr)`)."""
    if match := re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query):
        return match.group(1)
    if match := re.fullmatch(r"\s*query_result\((.*)\)\s*", query):
        return match.group(1)
    return query


def dashboards() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            yield f"variable {variable['name']!r}", variable_query(query)


def alerting_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
