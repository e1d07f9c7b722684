"""The portal's charts: time series for a period, read from the history (tenants/usage_series.py for the ledger's
side, portal/history.py for the engines'), as the browser draws them (static/portal/charts.js, with uPlot).

A period is the last hour or day in minutes, or the last week or month (30 days) in hours, ending with the step
now under way; a step with no traffic is 0 (no requests) or empty (no latency). Counts are per minute whatever
the step (an hour's row is divided by 60), so that they read against a per-minute quota; spend is cumulative over
the period, so that it reads against a budget.

A team's page charts its requests' TTFT and inter-token latency, p50 and p90; a deployment's, its own and each
pool's (the requests its engines streamed, against the pool's autoscaling objectives), with each pool's requests,
errors and tokens per minute and its spend beside the deployment's. Percentiles come from the series' histograms
added up per step (tenants/usage_series.py).

The answer: `t`, the steps' starts (seconds since the epoch), and `charts`, each with its `series`, each with a
value per step (`values`) and a unit the browser formats (per_min, tokens_per_min, ms, ratio, replicas,
requests, tokens, money:<currency>).

Over 400 lines: each chart's series read the same period and steps, and change together with the page's
script.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db.models import Sum

from serving.models import AutoscalingPolicy, ModelDeployment, Pool, PoolRole
from tenants.models import (
    PRIORITY_RANK,
    DeploymentUsageSeries,
    PoolUsageSeries,
    PriorityClass,
    Quota,
    TeamUsageSeries,
)
from tenants.usage_series import HistogramSum, histogram_quantile

from .models import PoolSeries, PrefixSeries

# period -> (span, step in seconds)
PERIODS = {"hour": (3600, 60), "day": (86_400, 60), "week": (7 * 86_400, 3600), "month": (30 * 86_400, 3600)}
COUNTS = (
    "requests",
    "failed",
    "cancelled",
    "rejected",
    "prompt_tokens",
    "cached_prompt_tokens",
    "output_tokens",
)


@dataclass(frozen=True)
class Window:
    period: str
    step_s: int
    starts: list[datetime]

    @property
    def first(self) -> datetime:
        return self.starts[0]

    @property
    def end(self) -> datetime:
        return self.starts[-1] + timedelta(seconds=self.step_s)

    @property
    def per_minute(self) -> float:
        return 60 / self.step_s


def window_for(period: str, now: datetime) -> Window:
    span, step = PERIODS[period]
    last = int(now.timestamp()) // step * step
    n = span // step
    return Window(period, step, [datetime.fromtimestamp(last - (n - 1 - i) * step, UTC) for i in range(n)])


def _series(key: str, label: str, unit: str, values: list, **extra) -> dict:
    return {"key": key, "label": label, "unit": unit, "values": values, **extra}


def _chart(key: str, title: str, series: list[dict], **extra) -> dict:
    return {"id": key, "title": title, "series": series, **extra}


def _answer(window: Window, scope: str, ident: int | None, charts: list[dict]) -> dict:
    return {
        "scope": scope,
        "id": ident,
        "period": window.period,
        "step_s": window.step_s,
        "t": [int(at.timestamp()) for at in window.starts],
        "charts": charts,
    }


# --- reading the ledger's series -------------------------------------------------------------------------


def _by_start(rows, window: Window, name: str, default=0) -> list:
    values = {row["start"]: row[name] for row in rows}
    return [values.get(at, default) for at in window.starts]


def _rate(rows, window: Window, name: str) -> list[float]:
    return [round(float(v) * window.per_minute, 3) for v in _by_start(rows, window, name)]


def _ratio(numerators: list, denominators: list) -> list[float | None]:
    return [round(n / d, 4) if d else None for n, d in zip(numerators, denominators, strict=True)]


def _quantiles(rows, window: Window, name: str, q: float) -> list[float | None]:
    out = []
    for counts in _by_start(rows, window, name, None):
        value = histogram_quantile(counts, q)
        out.append(None if value is None else round(value, 1))
    return out


def _cumulative_cost(rows, window: Window, key: str = "spend", label: str = "Spend") -> list[dict]:
    """Spend from the period's start, one series per currency."""
    per_currency: dict[str, dict] = defaultdict(dict)
    for row in rows:
        per_currency[row["currency"]][row["start"]] = row["cost"]
    series = []
    for currency, costs in sorted(per_currency.items()):
        total, values = Decimal(0), []
        for at in window.starts:
            total += costs.get(at, 0)
            values.append(round(float(total), 6))
        series.append(_series(f"{key}_{currency}", f"{label} ({currency})", f"money:{currency}", values))
    return series


def _sums(qs, window: Window, *extra: str):
    return (
        qs.filter(step_s=window.step_s, start__gte=window.first, start__lt=window.end)
        .order_by()
        .values("start", *extra)
        .annotate(**{name: Sum(name) for name in COUNTS})
    )


REQUESTS = (
    ("requests", "Requests"),
    ("failed", "Failed"),
    ("cancelled", "Cancelled"),
    ("rejected", "Rejected (queue)"),
)


def _request_series(rows, window: Window, kinds=REQUESTS) -> list[dict]:
    return [_series(kind, label, "per_min", _rate(rows, window, kind)) for kind, label in kinds]


def _token_series(rows, window: Window) -> list[dict]:
    prompt = _rate(rows, window, "prompt_tokens")
    cached = _rate(rows, window, "cached_prompt_tokens")
    fresh = [round(p - c, 3) for p, c in zip(prompt, cached, strict=True)]
    return [
        _series("input", "Input (fresh)", "tokens_per_min", fresh),
        _series("cached", "Input (cached)", "tokens_per_min", cached),
        _series("output", "Output", "tokens_per_min", _rate(rows, window, "output_tokens")),
    ]


def _traffic_charts(rows, cost_rows, window: Window, *, limits: Quota | None = None) -> list[dict]:
    """Requests and errors, tokens and spend: what every scope charts."""
    requests = _request_series(rows, window)
    tokens = _token_series(rows, window)
    spend = _cumulative_cost(cost_rows, window)
    if limits is not None:
        n = len(window.starts)
        for field, label, unit, target in (
            ("requests_per_minute", "Quota: requests/min", "per_min", requests),
            ("input_tokens_per_minute", "Quota: input tokens/min", "tokens_per_min", tokens),
            ("output_tokens_per_minute", "Quota: output tokens/min", "tokens_per_min", tokens),
        ):
            if getattr(limits, field) is not None:
                target.append(_series(field, label, unit, [getattr(limits, field)] * n, dash=True))
        if limits.spend_budget is not None and spend:
            budget = float(limits.spend_budget)
            spend.append(
                _series(
                    "spend_budget",
                    f"Budget per {limits.budget_period}",
                    f"money:{limits.currency}",
                    [budget] * n,
                    dash=True,
                )
            )
    return [
        _chart("traffic", "Requests and errors per minute", requests),
        _chart("tokens", "Tokens per minute", tokens),
        _chart("spend", "Spend over the period", spend),
    ]


def _cache_series(rows, window: Window, deployment_ids: list[int] | None) -> list[dict]:
    prompt = _by_start(rows, window, "prompt_tokens")
    cached = _by_start(rows, window, "cached_prompt_tokens")
    prefix = PrefixSeries.objects.filter(step_s=window.step_s, start__gte=window.first, start__lt=window.end)
    if deployment_ids is not None:
        prefix = prefix.filter(deployment_id__in=deployment_ids)
    prefix = list(prefix.order_by().values("start").annotate(p=Sum("predicted"), r=Sum("reported")))
    return [
        _series("prefix_hit_rate", "Prefix-hit rate (cached / input)", "ratio", _ratio(cached, prompt)),
        _series(
            "predicted_reported",
            "Cached tokens predicted / reported",
            "ratio",
            _ratio(_by_start(prefix, window, "p"), _by_start(prefix, window, "r")),
        ),
    ]


# --- reading the engines' series -------------------------------------------------------------------------


def _pool_rows(window: Window, deployment_ids: list[int] | None) -> list[dict]:
    qs = PoolSeries.objects.filter(step_s=window.step_s, start__gte=window.first, start__lt=window.end)
    if deployment_ids is not None:
        qs = qs.filter(deployment_id__in=deployment_ids)
    return list(qs.order_by().values())


def _mean(rows: list[dict], window: Window, name: str, per: str = "samples") -> list[float | None]:
    sums: dict = defaultdict(float)
    counts: dict = defaultdict(int)
    for row in rows:
        sums[row["start"]] += row[name] / row[per] if row[per] else 0.0
        counts[row["start"]] += 1 if row[per] else 0
    return [round(sums[at], 3) if counts[at] else None for at in window.starts]


def _kv_mean(rows: list[dict], window: Window) -> list[float | None]:
    sums: dict = defaultdict(float)
    counts: dict = defaultdict(int)
    for row in rows:
        sums[row["start"]] += row["kv_sum"]
        counts[row["start"]] += row["kv_samples"]
    return [round(sums[at] / counts[at], 4) if counts[at] else None for at in window.starts]


# --- the scopes ------------------------------------------------------------------------------------------


def fleet_history(*, period: str, now: datetime) -> dict:
    """Every deployment together: traffic, tokens, spend, TTFT p90 per deployment, cache hits, engines."""
    window = window_for(period, now)
    ledger = DeploymentUsageSeries.objects.all()
    rows = list(_sums(ledger, window))
    cost_rows = list(_sums(ledger, window, "currency").annotate(cost=Sum("cost")))
    names = dict(ModelDeployment.objects.values_list("id", "name"))
    per_deployment = (
        ledger.filter(step_s=window.step_s, start__gte=window.first, start__lt=window.end)
        .order_by()
        .values("start", "deployment_id")
        .annotate(ttft=HistogramSum("ttft_ms"))
    )
    ttft: dict[int, list] = defaultdict(list)
    for row in per_deployment:
        ttft[row["deployment_id"]].append(row)
    ttft_series = [
        _series(
            f"ttft_p90_{d}",
            f"{names.get(d, '(deleted)')} TTFT p90",
            "ms",
            _quantiles(rs, window, "ttft", 0.9),
        )
        for d, rs in sorted(ttft.items(), key=lambda kv: names.get(kv[0], "~"))
        if d is not None
    ]
    pools = _pool_rows(window, None)
    charts = _traffic_charts(rows, cost_rows, window)
    charts[2:2] = [
        _chart("ttft", "Time to first token, p90 per deployment", ttft_series),
        _chart("cache", "Prefix cache", _cache_series(rows, window, None)),
        _chart(
            "engines",
            "Engines",
            [
                _series("replicas", "Replicas wanted", "replicas", _mean(pools, window, "replicas")),
                _series("ready", "Engines ready", "replicas", _mean(pools, window, "ready")),
                _series("kv", "KV-cache use (mean)", "ratio", _kv_mean(pools, window)),
            ],
        ),
    ]
    return _answer(window, "fleet", None, charts)


def _objective(policies: list[AutoscalingPolicy], field: str) -> float | None:
    targets = [getattr(p, field) for p in policies if getattr(p, field, None) is not None]
    return min(targets) * 1000 if targets else None


def _latency_chart(key: str, title: str, rows, window: Window, name: str, objective: float | None) -> dict:
    series = [
        _series(f"{key}_p50", f"{title} p50", "ms", _quantiles(rows, window, name, 0.5)),
        _series(f"{key}_p90", f"{title} p90", "ms", _quantiles(rows, window, name, 0.9)),
    ]
    if objective is not None:
        series.append(
            _series(f"{key}_objective", "Objective (p90)", "ms", [objective] * len(window.starts), dash=True)
        )
    return _chart(key, title, series)


def _pool_latency_chart(name: str, rows, window: Window, policy: AutoscalingPolicy | None) -> dict:
    """The TTFT and ITL of the requests a pool's engines served, against its autoscaling policy's objectives."""
    series = [
        _series("ttft_p50", "TTFT p50", "ms", _quantiles(rows, window, "ttft", 0.5)),
        _series("ttft_p90", "TTFT p90", "ms", _quantiles(rows, window, "ttft", 0.9)),
        _series("itl_p50", "ITL p50", "ms", _quantiles(rows, window, "itl", 0.5)),
        _series("itl_p90", "ITL p90", "ms", _quantiles(rows, window, "itl", 0.9)),
    ]
    for key, label, field in (
        ("ttft_objective", "TTFT objective (p90)", "ttft_p90_s"),
        ("itl_objective", "ITL objective (p90)", "itl_p90_s"),
    ):
        objective = _objective([policy] if policy else [], field)
        if objective is not None:
            series.append(_series(key, label, "ms", [objective] * len(window.starts), dash=True))
    return _chart(f"pool_{name}_latency", f"Pool {name}: latency of the requests its engines served", series)


def _pool_traffic_chart(name: str, rows, window: Window) -> dict:
    """The requests a pool's engines served and their tokens, per minute (requests on the left axis, tokens on
    the right). None is rejected: a rejected request reached no engine."""
    series = [*_request_series(rows, window, REQUESTS[:3]), *_token_series(rows, window)]
    return _chart(f"pool_{name}_traffic", f"Pool {name}: requests and tokens per minute", series)


def deployment_history(*, deployment: ModelDeployment, period: str, now: datetime) -> dict:
    """One deployment: traffic, tokens, latency against its objectives, cache hits, queueing; per pool, replicas
    against the autoscaler's signals and the traffic and latency of the requests its engines served; spend, the
    deployment's and each pool's."""
    window = window_for(period, now)
    ledger = DeploymentUsageSeries.objects.filter(deployment_id=deployment.pk)
    rows = list(_sums(ledger, window).annotate(ttft=HistogramSum("ttft_ms"), itl=HistogramSum("itl_ms")))
    cost_rows = list(_sums(ledger, window, "currency").annotate(cost=Sum("cost")))
    by_class: dict[str, list] = defaultdict(list)
    for row in (
        ledger.filter(
            step_s=window.step_s, start__gte=window.first, start__lt=window.end, queued_ms__isnull=False
        )
        .order_by()
        .values("start", "priority_class")
        .annotate(queued=HistogramSum("queued_ms"))
    ):
        by_class[row["priority_class"]].append(row)
    labels = dict(PriorityClass.choices)
    queue_series = [
        _series(f"queued_p90_{c}", f"Queue wait p90: {labels.get(c, 'not recorded')}", "ms",
                _quantiles(rs, window, "queued", 0.9))
        for c, rs in sorted(by_class.items(), key=lambda kv: PRIORITY_RANK.get(kv[0], 9))
    ]  # fmt: skip
    pools = {p.pk: p for p in Pool.objects.filter(deployment=deployment).order_by("name")}
    policies = list(AutoscalingPolicy.objects.filter(pool__deployment=deployment))
    pool_rows = _pool_rows(window, [deployment.pk])
    queue_series.append(
        _series(
            "queued_prompt_tokens",
            "Routers' prefill backlog",
            "tokens",
            _mean(pool_rows, window, "queued_prompt_tokens"),
        )
    )
    charts = _traffic_charts(rows, cost_rows, window)
    charts[2:2] = [
        _latency_chart(
            "ttft", "Time to first token", rows, window, "ttft", _objective(policies, "ttft_p90_s")
        ),
        _latency_chart("itl", "Inter-token latency", rows, window, "itl", _objective(policies, "itl_p90_s")),
        _chart("cache", "Prefix cache", _cache_series(rows, window, [deployment.pk])),
        _chart("queueing", "Queueing", queue_series),
    ]
    spend = next(c for c in charts if c["id"] == "spend")
    targets = {p.pool_id: p for p in policies}
    served_qs = PoolUsageSeries.objects.filter(pool_id__in=list(pools))
    served_rows = list(
        _sums(served_qs, window, "pool_id").annotate(ttft=HistogramSum("ttft_ms"), itl=HistogramSum("itl_ms"))
    )
    served_cost = list(_sums(served_qs, window, "pool_id", "currency").annotate(cost=Sum("cost")))
    for pool_id, pool in pools.items():
        mine = [r for r in pool_rows if r["pool_id"] == pool_id]
        series = [
            _series("replicas", "Replicas wanted", "replicas", _mean(mine, window, "replicas")),
            _series("ready", "Engines ready", "replicas", _mean(mine, window, "ready")),
            _series("running", "Requests running", "requests", _mean(mine, window, "running")),
            _series("waiting", "Requests waiting", "requests", _mean(mine, window, "waiting")),
            _series("kv", "KV-cache use (mean)", "ratio", _kv_mean(mine, window)),
        ]
        kv_target = getattr(targets.get(pool_id), "kv_cache_utilization", None)
        if kv_target is not None:
            series.append(
                _series(
                    "kv_target", "KV-cache use target", "ratio", [kv_target] * len(window.starts), dash=True
                )
            )
        title = f"Pool {pool.name}: replicas and the autoscaler's signals"
        charts.insert(-1, _chart(f"pool_{pool.name}", title, series))
        # The ledger names the engine that streamed a request: a P/D deployment's decode engine, never its prefill.
        if pool.role != PoolRole.PREFILL:
            served = [r for r in served_rows if r["pool_id"] == pool_id]
            charts.insert(-1, _pool_traffic_chart(pool.name, served, window))
            charts.insert(-1, _pool_latency_chart(pool.name, served, window, targets.get(pool_id)))
            cost = [r for r in served_cost if r["pool_id"] == pool_id]
            spend["series"] += _cumulative_cost(cost, window, f"spend_pool_{pool.name}", f"Pool {pool.name}")
    return _answer(window, "deployment", deployment.pk, charts)


def team_history(*, team, period: str, now: datetime) -> dict:
    """One team: requests, tokens and spend against its team-wide quota and budget, and its requests' latency."""
    window = window_for(period, now)
    ledger = TeamUsageSeries.objects.filter(team=team)
    rows = list(_sums(ledger, window).annotate(ttft=HistogramSum("ttft_ms"), itl=HistogramSum("itl_ms")))
    cost_rows = list(_sums(ledger, window, "currency").annotate(cost=Sum("cost")))
    limits = Quota.objects.filter(team=team, api_key__isnull=True).first()
    charts = _traffic_charts(rows, cost_rows, window, limits=limits)
    charts[2:2] = [
        _latency_chart("ttft", "Time to first token", rows, window, "ttft", None),
        _latency_chart("itl", "Inter-token latency", rows, window, "itl", None),
    ]
    return _answer(window, "team", team.pk, charts)


def tenant_history(*, tenant, period: str, now: datetime) -> dict:
    """One tenant: its teams' requests, tokens and spend together."""
    window = window_for(period, now)
    ledger = TeamUsageSeries.objects.filter(tenant=tenant)
    rows = list(_sums(ledger, window))
    cost_rows = list(_sums(ledger, window, "currency").annotate(cost=Sum("cost")))
    return _answer(window, "tenant", tenant.pk, _traffic_charts(rows, cost_rows, window))


# --- a report's days -------------------------------------------------------------------------------------


def report_days(report, period) -> dict:
    """A report grouped by day as bars: cost per day (per currency) and tokens per day, in UTC days."""
    values = {(row.key, row.currency): row for row in report.rows}
    currencies = sorted({row.currency for row in report.rows}) or ["USD"]
    day, days = period.start.date(), []
    last = (period.end - timedelta(microseconds=1)).date()
    while day <= last and len(days) < 400:
        days.append(day)
        day += timedelta(days=1)

    def of(name: str, currency: str | None = None) -> list:
        out = []
        for d in days:
            rows = [r for (k, c), r in values.items() if k == d and (currency is None or c == currency)]
            out.append(sum((getattr(r, name) for r in rows), Decimal(0) if name == "cost" else 0))
        return out

    cost = [
        _series(f"cost_{c}", f"Cost ({c})", f"money:{c}", [round(float(v), 6) for v in of("cost", c)])
        for c in currencies
    ]
    prompt, cached = of("input_tokens"), of("cached_input_tokens")
    tokens = [
        _series("input", "Input (fresh)", "tokens", [p - c for p, c in zip(prompt, cached, strict=True)]),
        _series("cached", "Input (cached)", "tokens", cached),
        _series("output", "Output", "tokens", of("output_tokens")),
    ]
    return {
        "scope": "report",
        "step_s": 86_400,
        "t": [int(datetime(d.year, d.month, d.day, tzinfo=UTC).timestamp()) for d in days],
        "charts": [
            _chart("cost_per_day", "Cost per day", cost, bars=True, utc=True),
            _chart("tokens_per_day", "Tokens per day", tokens, utc=True),
        ],
    }
