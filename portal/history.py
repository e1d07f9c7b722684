"""The engines' side of the portal's history: what the worker already scrapes, kept per minute and per hour.

Every few seconds (HISTORY_SAMPLE_EVERY_S, a beat task) the worker reads what it scraped into Redis and adds
one sample per pool to the pool's row of this minute (portal.models.PoolSeries): replicas wanted, engines
ready, requests running and waiting (vLLM's own gauges), KV-cache use, and the routers' prefill backlog. It
copies the routers' per-minute prefix-routing counters (predicted and reported cached tokens) before they
expire (PrefixSeries). Each hour's row is the sum of its minutes', recomputed from them, so a sample retried or
lost changes one mean a little and nothing else. The ledger's side is tenants/usage_series.py.
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import UTC, datetime

import redis
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from routing.contracts import LOAD_KEY, PREFIX_HEALTH_KEY, REPLICA_LOAD_KEY, others_load
from routing.kvindex.prefix_health import WINDOW_MINUTES
from serving.models import Endpoint, Health, Pool
from tenants.usage_series import keep_after, usage_series_prune

from .models import PoolSeries, PrefixSeries

_POOL = PoolSeries._meta.db_table
_PREFIX = PrefixSeries._meta.db_table
_POOL_SUMS = (
    "samples",
    "replicas",
    "ready",
    "running",
    "waiting",
    "queued_prompt_tokens",
    "kv_samples",
    "kv_sum",
)

_POOL_MINUTE_SQL = f"""
INSERT INTO {_POOL} AS t (step_s, start, pool_id, deployment_id, {", ".join(_POOL_SUMS)}, kv_max)
VALUES (60, %s, %s, %s, 1, %s, %s, %s, %s, %s, %s, %s, %s)
ON CONFLICT ON CONSTRAINT pool_series_one_row_per_step DO UPDATE SET
    {", ".join(f"{c} = t.{c} + EXCLUDED.{c}" for c in _POOL_SUMS)},
    kv_max = GREATEST(t.kv_max, EXCLUDED.kv_max)
"""
_POOL_HOUR_SQL = f"""
INSERT INTO {_POOL} AS t (step_s, start, pool_id, deployment_id, {", ".join(_POOL_SUMS)}, kv_max)
SELECT 3600, %s, pool_id, max(deployment_id), {", ".join(f"sum({c})" for c in _POOL_SUMS)}, max(kv_max)
FROM {_POOL} WHERE step_s = 60 AND start >= %s AND start < %s + interval '1 hour'
GROUP BY pool_id
ON CONFLICT ON CONSTRAINT pool_series_one_row_per_step DO UPDATE SET
    {", ".join(f"{c} = EXCLUDED.{c}" for c in _POOL_SUMS)}, kv_max = EXCLUDED.kv_max
"""
_PREFIX_MINUTE_SQL = f"""
INSERT INTO {_PREFIX} AS t (step_s, start, deployment_id, predicted, reported) VALUES (60, %s, %s, %s, %s)
ON CONFLICT ON CONSTRAINT prefix_series_one_row_per_step DO UPDATE SET
    predicted = EXCLUDED.predicted, reported = EXCLUDED.reported
"""
_PREFIX_HOUR_SQL = f"""
INSERT INTO {_PREFIX} AS t (step_s, start, deployment_id, predicted, reported)
SELECT 3600, %s, deployment_id, sum(predicted), sum(reported)
FROM {_PREFIX} WHERE step_s = 60 AND start >= %s AND start < %s + interval '1 hour'
GROUP BY deployment_id
ON CONFLICT ON CONSTRAINT prefix_series_one_row_per_step DO UPDATE SET
    predicted = EXCLUDED.predicted, reported = EXCLUDED.reported
"""


def _at(epoch_s: float, step_s: int) -> datetime:
    return datetime.fromtimestamp(epoch_s // step_s * step_s, UTC)


def _engine_loads(client, now: float) -> dict[int, dict]:
    """Per pool, what its ready engines report now: the worker's scrape (LOAD_KEY) and the routers' backlog."""
    endpoints = list(
        Endpoint.objects.filter(health=Health.HEALTHY, draining_since__isnull=True).values_list(
            "id", "pool_id"
        )
    )
    pools: dict[int, dict] = defaultdict(
        lambda: {"ready": 0, "running": 0.0, "waiting": 0.0, "queued": 0.0, "kv": []}
    )
    if not endpoints:
        return pools
    with client.pipeline(transaction=False) as pipe:
        for endpoint_id, _ in endpoints:
            pipe.hgetall(LOAD_KEY.format(endpoint_id))
            pipe.hgetall(REPLICA_LOAD_KEY.format(endpoint_id))
        replies = pipe.execute()
    for index, (_, pool_id) in enumerate(endpoints):
        engine, routers = replies[2 * index], replies[2 * index + 1]
        pool = pools[pool_id]
        pool["ready"] += 1
        pool["running"] += float(engine.get(b"running", 0))
        pool["waiting"] += float(engine.get(b"waiting", 0))
        if b"kv_usage" in engine:
            pool["kv"].append(float(engine[b"kv_usage"]))
        pool["queued"] += others_load(routers, "", now).prefill
    return pools


def _prefix_minutes(client, deployment_ids: list[int], now: float) -> list[tuple[datetime, int, int, int]]:
    """The routers' prefix counters of the last minutes still in Redis: (minute, deployment, predicted,
    reported), the minutes with any."""
    minute = int(now // 60)
    wanted = [(d, minute - back) for d in deployment_ids for back in range(WINDOW_MINUTES)]
    with client.pipeline(transaction=False) as pipe:
        for deployment_id, m in wanted:
            pipe.hmget(PREFIX_HEALTH_KEY.format(deployment_id, m), "predicted", "reported")
        replies = pipe.execute()
    return [
        (datetime.fromtimestamp(m * 60, UTC), deployment_id, int(predicted or 0), int(reported or 0))
        for (deployment_id, m), (predicted, reported) in zip(wanted, replies, strict=True)
        if predicted is not None or reported is not None
    ]


def history_sample(*, client=None, now: float | None = None) -> int:
    """Add one sample of every pool to this minute's rows, copy the prefix counters, and recompute the hours they
    fall in; returns how many pools were sampled."""
    now = time.time() if now is None else now
    client = client or redis.Redis.from_url(settings.REDIS_URL)
    loads = _engine_loads(client, now)
    pools = list(Pool.objects.values_list("id", "deployment_id", "replicas"))
    prefix = _prefix_minutes(client, sorted({deployment_id for _, deployment_id, _ in pools}), now)
    minute, hour = _at(now, 60), _at(now, 3600)
    with transaction.atomic(), connection.cursor() as cursor:
        for pool_id, deployment_id, replicas in pools:
            load = loads[pool_id]
            kv = load["kv"]
            cursor.execute(
                _POOL_MINUTE_SQL,
                [minute, pool_id, deployment_id, replicas, load["ready"], load["running"], load["waiting"],
                 load["queued"], len(kv), sum(kv), max(kv) if kv else None],
            )  # fmt: skip
        cursor.execute(_POOL_HOUR_SQL, [hour, hour, hour])
        for at, deployment_id, predicted, reported in prefix:
            cursor.execute(_PREFIX_MINUTE_SQL, [at, deployment_id, predicted, reported])
        for at in sorted({_at(at.timestamp(), 3600) for at, *_ in prefix}):
            cursor.execute(_PREFIX_HOUR_SQL, [at, at, at])
    return len(pools)


def history_prune(*, now: datetime | None = None) -> int:
    """Delete the minutes and hours older than they are kept, the ledger's series and these; returns how many
    rows went."""
    now = now or timezone.now()
    deleted = usage_series_prune(now=now)
    for model in (PoolSeries, PrefixSeries):
        for step_s in (60, 3600):
            deleted += model.objects.filter(step_s=step_s, start__lt=keep_after(step_s, now)).delete()[0]
    return deleted
