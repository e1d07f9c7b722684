"""A Prometheus collector that reads the control plane's state from Postgres at each scrape.

Labels name deployments, pools, endpoints, tenants (by id, as the router's flow metrics do) and teams (by slug);
never a key. `describe()` lists every family without a query, so the names can be checked with no database.
"""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Sum
from django.utils import timezone
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from serving.models import DesiredStatus, Endpoint, Health, ModelDeployment, ObservedStatus, Pool
from tenants.models import Tenant, UsageDaily

DEPLOYMENT = ["deployment", "model"]
POOL = [*DEPLOYMENT, "pool", "role"]
ENDPOINT = [*POOL, "endpoint"]
USAGE = ["tenant", "team", "model"]
TOKEN_KINDS = {"prompt": "prompt_tokens", "cached_prompt": "cached_prompt_tokens", "output": "output_tokens"}


def _families() -> dict[str, Metric]:
    return {
        "status": GaugeMetricFamily(
            "platform_deployment_status",
            "1 for the deployment's observed status as the last reconcile found it, 0 for the others.",
            labels=[*DEPLOYMENT, "status"],
        ),
        "running": GaugeMetricFamily(
            "platform_deployment_desired_running",
            "1 when the operator wants the deployment running, 0 when stopped.",
            labels=DEPLOYMENT,
        ),
        "replicas": GaugeMetricFamily(
            "platform_pool_desired_replicas",
            "Replicas the operator or the autoscaler set for the pool.",
            labels=POOL,
        ),
        "endpoints": GaugeMetricFamily(
            "platform_endpoints",
            "Engine endpoints of the pool by health (draining ones included).",
            labels=[*POOL, "health"],
        ),
        "draining": GaugeMetricFamily(
            "platform_endpoints_draining",
            "Engine endpoints of the pool chosen for removal and finishing their requests.",
            labels=POOL,
        ),
        "restarts": CounterMetricFamily(
            "platform_endpoint_restarts",
            "Times the local orchestrator restarted this engine after it exited or hung.",
            labels=ENDPOINT,
        ),
        "backoff": GaugeMetricFamily(
            "platform_endpoint_restart_backoff",
            "1 while a crashed engine waits out its restart backoff, 0 otherwise.",
            labels=ENDPOINT,
        ),
        "tenant": GaugeMetricFamily(
            "platform_tenant_info",
            "1 per tenant: its id (the `tenant` label everywhere) with its slug and whether it is active.",
            labels=["tenant", "slug", "active"],
        ),
        "requests": CounterMetricFamily(
            "platform_usage_requests",
            "Requests in the usage ledger's daily roll-up, by tenant, team and model.",
            labels=USAGE,
        ),
        "errors": CounterMetricFamily(
            "platform_usage_errors",
            "Requests that failed or were cancelled, from the daily roll-up.",
            labels=USAGE,
        ),
        "tokens": CounterMetricFamily(
            "platform_usage_tokens",
            "Tokens from the daily roll-up by kind: prompt, cached_prompt (part of prompt), output.",
            labels=[*USAGE, "kind"],
        ),
        "cost": CounterMetricFamily(
            "platform_usage_cost",
            "Cost at the prices in force, from the daily roll-up, in the currency named.",
            labels=[*USAGE, "currency"],
        ),
    }


class ControlPlaneCollector:
    def describe(self) -> Iterator[Metric]:
        return iter(_families().values())

    def collect(self) -> Iterator[Metric]:
        families = _families()
        _deployments(families)
        _endpoints(families)
        _usage(families)
        return iter(families.values())


def _deployments(families: dict[str, Metric]) -> None:
    for deployment in ModelDeployment.objects.only(
        "name", "served_model_name", "observed_status", "desired_status"
    ):
        labels = [deployment.name, deployment.served_model_name]
        for status in ObservedStatus.values:
            families["status"].add_metric([*labels, status], float(deployment.observed_status == status))
        families["running"].add_metric(labels, float(deployment.desired_status == DesiredStatus.RUNNING))
    pools = Pool.objects.select_related("deployment").only(
        "name", "role", "replicas", "deployment__name", "deployment__served_model_name"
    )
    for pool in pools:
        families["replicas"].add_metric(_pool_labels(pool), pool.replicas)


def _pool_labels(pool: Pool) -> list[str]:
    return [pool.deployment.name, pool.deployment.served_model_name, pool.name, pool.role]


def _endpoints(families: dict[str, Metric]) -> None:
    now = timezone.now()
    counts: dict[tuple[str, ...], dict[str, int]] = {}
    draining: dict[tuple[str, ...], int] = {}
    # Every pool gets a zero for every health, so "none healthy" is a 0 rather than a missing series.
    for pool in Pool.objects.select_related("deployment"):
        key = tuple(_pool_labels(pool))
        counts[key] = dict.fromkeys(Health.values, 0)
        draining[key] = 0
    for endpoint in Endpoint.objects.select_related("pool__deployment"):
        key = tuple(_pool_labels(endpoint.pool))
        counts[key][endpoint.health] = counts[key].get(endpoint.health, 0) + 1
        draining[key] += endpoint.draining_since is not None
        labels = [*key, endpoint.name]
        families["restarts"].add_metric(labels, endpoint.restart_count)
        waiting = endpoint.next_restart_at is not None and endpoint.next_restart_at > now
        families["backoff"].add_metric(labels, float(waiting))
    for key, by_health in counts.items():
        for health, count in by_health.items():
            families["endpoints"].add_metric([*key, health], count)
        families["draining"].add_metric(list(key), draining[key])


def _usage(families: dict[str, Metric]) -> None:
    for tenant in Tenant.objects.only("slug", "is_active"):
        families["tenant"].add_metric([str(tenant.pk), tenant.slug, str(tenant.is_active).lower()], 1)
    rows = (
        UsageDaily.objects.values("tenant_id", "team__slug", "model", "currency")
        .annotate(
            requests=Sum("requests"),
            errors=Sum("errors"),
            prompt_tokens=Sum("prompt_tokens"),
            cached_prompt_tokens=Sum("cached_prompt_tokens"),
            output_tokens=Sum("output_tokens"),
            cost=Sum("cost"),
        )
        .order_by()
    )
    # A team may have used a model at prices in two currencies: only the cost is kept apart by currency.
    totals: dict[tuple[str, ...], dict[str, int]] = {}
    for row in rows:
        labels = (str(row["tenant_id"]), row["team__slug"], row["model"])
        total = totals.setdefault(labels, dict.fromkeys(["requests", "errors", *TOKEN_KINDS.values()], 0))
        for column in total:
            total[column] += row[column]
        families["cost"].add_metric([*labels, row["currency"]], float(row["cost"]))
    for labels, total in totals.items():
        families["requests"].add_metric(list(labels), total["requests"])
        families["errors"].add_metric(list(labels), total["errors"])
        for kind, column in TOKEN_KINDS.items():
            families["tokens"].add_metric([*labels, kind], total[column])


registry = CollectorRegistry()
registry.register(ControlPlaneCollector())
