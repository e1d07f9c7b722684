"""deploy/monitoring/grafana: one dashboard per area, every query names series the platform exports, every
variable a query uses is defined."""

from __future__ import annotations

import re

import pytest

from .monitoring import (
    PROMETHEUS_OWN,
    dashboard_queries,
    dashboards,
    exported_series,
    metric_names,
    panels,
    variable_query,
)

AREAS = {"fleet", "deployment", "tenant", "router"}
GRAFANA_VARIABLES = {"__rate_interval", "__range", "__interval"}


def test_the_name_finder_finds_what_a_query_selects_and_nothing_else():
    expr = (
        'sum by (model, le) (rate(router_time_to_first_token_seconds_bucket{model=~"$model", x="a b"}[$__rate_interval]))'
        " / on (deployment) group_left (pool) max(vllm:kv_cache_usage_perc offset 5m) > 0.8e1 and up == bool 1"
        " or vector(0)"
    )
    assert metric_names(expr) == {
        "router_time_to_first_token_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "up",
    }
    assert variable_query('label_values(platform_endpoints{deployment="$deployment"}, pool)') == (
        'platform_endpoints{deployment="$deployment"}'
    )


def test_the_exported_names_come_from_the_router_control_plane_and_engines():
    names = exported_series()
    # One of each kind, so a registry that stopped being read fails here rather than passing every query.
    assert {"router_requests_total", "usage_stream_lag_entries", "process_cpu_seconds_total"} <= names
    assert {"platform_deployment_status", "platform_usage_tokens_total"} <= names
    assert {"vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket"} <= names


def test_there_is_a_dashboard_per_area_with_its_own_uid():
    found = dashboards()
    assert set(found) == AREAS
    uids = [dashboard["uid"] for dashboard in found.values()]
    assert len(set(uids)) == len(uids)


@pytest.mark.parametrize("area", sorted(AREAS))
def test_every_query_names_only_series_the_platform_exports(area):
    exported = exported_series() | PROMETHEUS_OWN
    dashboard = dashboards()[area]
    unknown = []
    queries = list(dashboard_queries(dashboard))
    assert queries
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{area}: {where} selects no metric: {expr}"
        unknown += [f"{where}: {name}" for name in sorted(names - exported)]
    assert not unknown, f"{area} queries series nothing exports: {unknown}"


@pytest.mark.parametrize("area", sorted(AREAS))
def test_every_variable_a_query_uses_is_defined(area):
    dashboard = dashboards()[area]
    defined = {variable["name"] for variable in dashboard["templating"]["list"]} | GRAFANA_VARIABLES
    for where, expr in dashboard_queries(dashboard):
        used = set(re.findall(r"\$\{?(\w+)", expr))
        assert used <= defined, f"{area}: {where} uses {sorted(used - defined)}"
    for panel in panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"], panel["title"]
