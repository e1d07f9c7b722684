"""The ledger over time: per-minute and per-hour sums per team, per deployment and per pool, for the portal's
charts.

The billing roll-up (tenants/billing.py) adds each batch of records to these series in the same transaction as
to the daily rows, under the same watermark: every record is counted once, whatever worker dies when, and the
request path does nothing for them. Minutes are kept HISTORY_MINUTES_KEEP_DAYS, hours HISTORY_HOURS_KEEP_DAYS;
the daily rows, forever.

Latencies are histograms (lists of counts per bucket of milliseconds), summed by the SQL functions of migration
0011 (`history_histogram`, `history_histogram_add`, `history_histogram_sum`), so that p50 and p90 hold for any
sum of rows: a deployment's classes, the fleet's deployments, a step of an hour. Bucket 0 holds 0 ms up to
1 ms; bucket i >= 1 holds [2^((i-1)/3), 2^(i/3)) ms (26 % wide), and a percentile is interpolated inside its
bucket. Teams, deployments and pools each keep the same counts (requests, errors by kind, input, cached and
output tokens, cost per currency) and TTFT and inter-token latency (ITL: a request's time after its first token
over its other tokens); deployments also keep the wait in a router's queue. A pool's rows count the records of
its engines (PoolUsageSeries says how a record finds its pool).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import Aggregate

from serving.models import Endpoint

from .models import DeploymentUsageSeries, PoolUsageSeries, TeamUsageSeries, UsageRecord, UsageStatus

STEPS = {60: "minute", 3600: "hour"}
BUCKETS_PER_DOUBLING = 3
LAST_BUCKET = 63  # 2^(62/3) ms is about 28 minutes: anything longer is counted there


def bucket_bounds(index: int) -> tuple[float, float]:
    """The milliseconds bucket `index` holds, [low, high)."""
    if index == 0:
        return 0.0, 1.0
    return 2 ** ((index - 1) / BUCKETS_PER_DOUBLING), 2 ** (index / BUCKETS_PER_DOUBLING)


def histogram_quantile(counts: list[int] | None, q: float) -> float | None:
    """The q-quantile (0 < q <= 1) of the values a histogram counts, interpolated inside its bucket; None when
    it counts nothing."""
    total = sum(counts or ())
    if not total:
        return None
    rank, seen = q * total, 0
    for index, n in enumerate(counts):
        if n and seen + n >= rank:
            low, high = bucket_bounds(index)
            return low + (high - low) * (rank - seen) / n
        seen += n
    return bucket_bounds(len(counts) - 1)[1]  # not reached: the last non-empty bucket holds the rank


class HistogramSum(Aggregate):
    """The bucket-wise sum of histograms (SQL: history_histogram_sum)."""

    function = "history_histogram_sum"
    output_field = ArrayField(models.IntegerField())


# --- writing: called by the billing roll-up, inside its transaction and table lock ------------------------

_COUNTS = """
       count(*), count(*) FILTER (WHERE status = 'failed'), count(*) FILTER (WHERE status = 'cancelled'),
       count(*) FILTER (WHERE status = 'rejected'), sum(prompt_tokens), sum(cached_prompt_tokens),
       sum(output_tokens), sum(cost)"""
_ADD_COUNTS = ", ".join(
    f"{c} = t.{c} + EXCLUDED.{c}"
    for c in (
        "requests",
        "failed",
        "cancelled",
        "rejected",
        "prompt_tokens",
        "cached_prompt_tokens",
        "output_tokens",
        "cost",
    )
)
_COLUMNS = "requests, failed, cancelled, rejected, prompt_tokens, cached_prompt_tokens, output_tokens, cost"

# The latency histograms of a group of records, and how a row adds another's: the same for every series.
_COMPLETED = f"status = '{UsageStatus.COMPLETED}' AND ttft_ms IS NOT NULL"
_LATENCIES = f"""
       history_histogram(array_agg(history_bucket(ttft_ms)) FILTER (WHERE {_COMPLETED})),
       history_histogram(array_agg(history_bucket((latency_ms - ttft_ms)::float8 / (output_tokens - 1)))
                         FILTER (WHERE {_COMPLETED} AND latency_ms IS NOT NULL AND output_tokens > 1))"""
_ADD_LATENCIES = """
    ttft_ms = history_histogram_add(t.ttft_ms, EXCLUDED.ttft_ms),
    itl_ms = history_histogram_add(t.itl_ms, EXCLUDED.itl_ms)"""


def _minute_or_hour(step_s: int) -> str:
    return f"date_trunc('{STEPS[step_s]}', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"


def _team_sql(step_s: int) -> str:
    table = TeamUsageSeries._meta.db_table
    return f"""
INSERT INTO {table} AS t (step_s, start, tenant_id, team_id, currency, {_COLUMNS}, ttft_ms, itl_ms)
SELECT {step_s}, {_minute_or_hour(step_s)}, tenant_id, team_id, currency, {_COUNTS}, {_LATENCIES}
FROM {UsageRecord._meta.db_table}
WHERE id > %s AND id <= %s
GROUP BY 2, 3, 4, 5
ON CONFLICT ON CONSTRAINT team_series_one_row_per_group DO UPDATE SET {_ADD_COUNTS}, {_ADD_LATENCIES}
"""


def _deployment_sql(step_s: int) -> str:
    table = DeploymentUsageSeries._meta.db_table
    return f"""
INSERT INTO {table} AS t (step_s, start, deployment_id, priority_class, currency, {_COLUMNS},
                          ttft_ms, itl_ms, queued_ms)
SELECT {step_s}, {_minute_or_hour(step_s)}, deployment_id, priority_class, currency, {_COUNTS}, {_LATENCIES},
       history_histogram(array_agg(history_bucket(queued_ms)) FILTER (WHERE queued_ms IS NOT NULL))
FROM {UsageRecord._meta.db_table}
WHERE id > %s AND id <= %s
GROUP BY 2, 3, 4, 5
ON CONFLICT ON CONSTRAINT deployment_series_one_row_per_group DO UPDATE SET {_ADD_COUNTS}, {_ADD_LATENCIES},
    queued_ms = history_histogram_add(t.queued_ms, EXCLUDED.queued_ms)
"""


def _pool_sql(step_s: int) -> str:
    """A record's pool is that of the endpoint whose URL it names, if that endpoint is still there."""
    table = PoolUsageSeries._meta.db_table
    return f"""
INSERT INTO {table} AS t (step_s, start, pool_id, currency, {_COLUMNS}, ttft_ms, itl_ms)
SELECT {step_s}, {_minute_or_hour(step_s)}, pool_id, currency, {_COUNTS}, {_LATENCIES}
FROM (SELECT r.*, e.pool_id FROM {UsageRecord._meta.db_table} r JOIN {Endpoint._meta.db_table} e ON e.url = r.endpoint
      WHERE r.id > %s AND r.id <= %s AND r.endpoint <> '') AS r
GROUP BY 2, 3, 4
ON CONFLICT ON CONSTRAINT pool_series_one_row_per_group DO UPDATE SET {_ADD_COUNTS}, {_ADD_LATENCIES}
"""


SERIES_SQL = [make(step) for step in STEPS for make in (_team_sql, _deployment_sql, _pool_sql)]
SERIES_MODELS = (TeamUsageSeries, DeploymentUsageSeries, PoolUsageSeries)


def usage_series_add(cursor, *, after_id: int, upto_id: int) -> None:
    """Add the ledger's records with after_id < id <= upto_id to the minute and hour series."""
    for sql in SERIES_SQL:
        cursor.execute(sql, [after_id, upto_id])


def usage_series_clear() -> None:
    """Throw the series away (the roll-up's rebuild adds the whole ledger up again)."""
    for model in SERIES_MODELS:
        model.objects.all().delete()


def keep_after(step_s: int, now: datetime) -> datetime:
    """Rows of this step starting before this are pruned."""
    days = settings.HISTORY_MINUTES_KEEP_DAYS if step_s == 60 else settings.HISTORY_HOURS_KEEP_DAYS
    return now - timedelta(days=days)


def usage_series_prune(*, now: datetime) -> int:
    """Delete the minutes and hours older than they are kept; returns how many rows went."""
    deleted = 0
    for model in SERIES_MODELS:
        for step_s in STEPS:
            deleted += model.objects.filter(step_s=step_s, start__lt=keep_after(step_s, now)).delete()[0]
    return deleted
