"""What a deployment actually did over a period, from the platform's own records, to set beside a what-if's
predictions: the ledger's requests and tokens per tenant (tenants.UsageRecord), TTFT and ITL percentiles from the
deployment's latency histograms (tenants.DeploymentUsageSeries, per minute, else per hour), GPU-hours and the
cost to serve from each engine's recorded lifetime (portal.costs.cost_to_serve), and the latency objectives its
pools' autoscaling policies set."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from django.db.models import Count, Sum

from portal.costs import cost_to_serve
from serving.models import AutoscalingPolicy, ModelDeployment
from tenants.access import Access
from tenants.billing import Period
from tenants.models import DeploymentUsageSeries, Tenant, UsageRecord
from tenants.usage_series import HistogramSum, histogram_quantile

OPERATOR = Access(True, frozenset(), frozenset(), frozenset(), frozenset())


def objectives(deployment: ModelDeployment) -> dict[str, float | None]:
    """The tightest TTFT and ITL p90 objectives its pools' autoscaling policies set (None: none set)."""
    out: dict[str, float | None] = {"ttft_p90_s": None, "itl_p90_s": None}
    for policy in AutoscalingPolicy.objects.filter(pool__deployment=deployment):
        for name in out:
            value = getattr(policy, name)
            if value is not None and (out[name] is None or value < out[name]):
                out[name] = value
    return out


def _latencies(deployment_id: int, since: datetime, until: datetime) -> dict:
    """p50 and p90 of TTFT and ITL in seconds over the period, from the minute rows (else the hour rows, for a
    period older than the minutes are kept)."""
    for step_s in (60, 3600):
        rows = DeploymentUsageSeries.objects.filter(
            deployment_id=deployment_id, step_s=step_s, start__gte=since, start__lt=until
        )
        sums = rows.aggregate(ttft=HistogramSum("ttft_ms"), itl=HistogramSum("itl_ms"), n=Count("id"))
        if sums["n"]:
            break
    out = {"latency_from": {60: "minute", 3600: "hour"}[step_s] if sums["n"] else None}
    for name in ("ttft", "itl"):
        for q in (50, 90):
            ms = histogram_quantile(sums[name], q / 100) if sums["n"] else None
            out[f"{name}_p{q}"] = None if ms is None else ms / 1000
    return out


def period_actuals(*, deployment: ModelDeployment, since: datetime, until: datetime) -> dict:
    ledger = UsageRecord.objects.filter(deployment=deployment, created_at__gte=since, created_at__lt=until)
    per_tenant = list(
        ledger.order_by()
        .values("tenant_id")
        .annotate(
            requests=Count("id"),
            prompt=Sum("prompt_tokens"),
            cached=Sum("cached_prompt_tokens"),
            output=Sum("output_tokens"),
        )
    )
    requests = sum(row["requests"] for row in per_tenant)
    prompt = sum(row["prompt"] or 0 for row in per_tenant)
    cached = sum(row["cached"] or 0 for row in per_tenant)
    output = sum(row["output"] or 0 for row in per_tenant)
    names = dict(Tenant.objects.filter(id__in=[r["tenant_id"] for r in per_tenant]).values_list("id", "name"))
    cost = cost_to_serve(access=OPERATOR, deployment=deployment, period=Period(since, until))
    gpu_hours = sum((p.gpu_hours for p in cost.pools), Decimal(0))
    return {
        "requests": requests,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "hit_share": cached / prompt if prompt else None,
        **_latencies(deployment.pk, since, until),
        "gpu_hours": float(gpu_hours),
        "gpu_cost": float(cost.gpu_cost),
        "currency": cost.currency,
        "cost_per_mtok": float(cost.gpu_cost / (prompt + output) * 1_000_000) if prompt + output else None,
        "per_tenant": {
            str(row["tenant_id"]): {
                "name": names.get(row["tenant_id"], str(row["tenant_id"])),
                "requests": row["requests"],
                "request_share": row["requests"] / requests if requests else 0.0,
                "tokens": (row["prompt"] or 0) + (row["output"] or 0),
                "token_share": ((row["prompt"] or 0) + (row["output"] or 0)) / (prompt + output)
                if prompt + output
                else 0.0,
            }
            for row in per_tenant
        },
    }
