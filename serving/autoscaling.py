"""Demand-driven replicas for each pool: signals in, one recommendation per pool, stabilised, applied.

The rule (`recommend`), per pool and per target the pool's policy sets:
- Capacity targets (uncached prompt tokens queued for prefill, and sequences running, per replica; mean KV-cache
  use) ask for `ceil(projected total / target per replica)` replicas (KV use: `ceil(replicas x use / target)`).
  The projection looks one start-up time ahead, `now + growth x startup`, so that replicas asked for now are
  ready when the load arrives. `growth` is the growth that lasted, not noise: the signal's least-squares slope
  over the passes of the last TREND_WINDOW_S (30 s; at least TREND_MIN_SAMPLES, 4, with this one), less its
  one-sided 95 % confidence margin (Student's t times the slope's standard error), and 0 when that lower bound
  is not above 0. A closed loop of a few sessions at night goes up and down by a request or two from one pass to
  the next: its slope is within its noise and nothing is projected; a ramp rises pass after pass, clear of its
  noise, and is projected.
- Latency objectives (TTFT p90 for prefill and aggregated pools, inter-token latency p90 for decode and aggregated
  pools) only ever hold or raise: over the objective they ask for `ceil(replicas x p90 / objective)` (at least one
  more); within 80 % of it they hold today's replicas, so a capacity target cannot shrink a pool that is close to
  missing its objective; below that they ask for nothing.
- The pool gets the largest ask, within [min_replicas, max_replicas], and moves at most `max_scale_up_step` up or
  `max_scale_down_step` down at once. No traffic at all asks for `min_replicas`.

Stabilisation (`stabilise`), as Kubernetes' HPA does it: a pool grows only to the smallest recommendation of its
scale-up window (demand that lasted) and shrinks only to the largest of its scale-down window (quiet that lasted).
Recommendations are kept in Redis per pool.

Prefill and decode pools of one deployment are separate pools, each with its own policy and signals: they scale
independently. An operator's edit of a pool's replicas turns its autoscaling off (serving/services.py), so the
autoscaler never fights a person; it is turned back on in the admin, the API or the portal.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from routing.contracts import AUTOSCALE_HISTORY_KEY, AUTOSCALE_RECOMMENDATIONS_KEY

from .models import (
    AutoscalingPolicy,
    Endpoint,
    EndpointLifetime,
    Health,
    Pool,
    PoolRole,
    ScalingEvent,
)

log = logging.getLogger(__name__)

# Within this share of a latency objective, a pool is held at its replicas (no scale-down).
LATENCY_HOLD = 0.8
# The growth of demand is fitted over the passes of this last stretch, and needs this many (this pass's included).
TREND_WINDOW_S = 30.0
TREND_MIN_SAMPLES = 4
# Student's t, one-sided 95 %, by degrees of freedom (samples - 2); beyond the table, 1.70 to 30, then 1.645.
_T95 = (
    6.314,
    2.920,
    2.353,
    2.132,
    2.015,
    1.943,
    1.895,
    1.860,
    1.833,
    1.812,
    1.796,
    1.782,
    1.771,
    1.761,
    1.753,
)
# Each pass's replicas and signals per pool, newest first, for the portal's charts (an hour at 5 s a pass).
HISTORY_LENGTH = 720


@dataclass(frozen=True)
class Signals:
    """What one pool sees now. Totals are over the pool's ready replicas; None: no measurement."""

    ready: int = 0
    queued_prompt_tokens: float = 0.0  # uncached prompt tokens the routers have sent and not seen prefilled
    running_requests: float = 0.0  # sequences running or waiting on the engines
    kv_cache_utilization: float | None = None  # mean over the ready replicas, 0..1
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None
    requests: int = 0  # requests finished over the latency window


@dataclass(frozen=True)
class Trend:
    """Growth per second of the capacity signals beyond their noise (`growth`; 0 when none or unknown)."""

    queued_prompt_tokens: float = 0.0
    running_requests: float = 0.0
    kv_cache_utilization: float = 0.0


@dataclass(frozen=True)
class Recommendation:
    replicas: int
    reason: str
    asks: dict[str, int]


def recommend(
    policy: AutoscalingPolicy, current: int, signals: Signals, trend: Trend, startup_s: float
) -> Recommendation:
    """The replicas the pool should have now, by the rule in this module's docstring (before stabilisation)."""
    targets = policy.targets()
    base = max(current, 1)
    asks: dict[str, int] = {}
    ahead = max(startup_s, 0.0)

    def projected(now: float, slope: float) -> float:
        return now + max(slope, 0.0) * ahead

    if "queued_prompt_tokens_per_replica" in targets:
        total = projected(signals.queued_prompt_tokens, trend.queued_prompt_tokens)
        asks["queued_prompt_tokens_per_replica"] = math.ceil(
            total / targets["queued_prompt_tokens_per_replica"]
        )
    if "running_requests_per_replica" in targets:
        total = projected(signals.running_requests, trend.running_requests)
        asks["running_requests_per_replica"] = math.ceil(total / targets["running_requests_per_replica"])
    if "kv_cache_utilization" in targets and signals.kv_cache_utilization is not None:
        use = min(projected(signals.kv_cache_utilization, trend.kv_cache_utilization), 1.0)
        asks["kv_cache_utilization"] = math.ceil(round(base * use / targets["kv_cache_utilization"], 6))
    for name, value in (("ttft_p90_s", signals.ttft_p90_s), ("itl_p90_s", signals.itl_p90_s)):
        if name not in targets or value is None:
            continue
        objective = targets[name]
        if value > objective:
            asks[name] = max(base + 1, math.ceil(round(base * value / objective, 6)))
        elif value > LATENCY_HOLD * objective:
            asks[name] = current

    if not asks or max(asks.values()) <= 0:
        wanted, why = policy.min_replicas, "no demand"
    else:
        name = max(asks, key=asks.get)
        wanted, why = asks[name], f"{name} asks for {asks[name]}"
    bounded = min(max(wanted, policy.min_replicas), policy.max_replicas)
    if bounded != wanted:
        why += f", bounded to [{policy.min_replicas}, {policy.max_replicas}]"
    if bounded > current + policy.max_scale_up_step:
        bounded = current + policy.max_scale_up_step
        why += f", at most {policy.max_scale_up_step} up at once"
    elif bounded < current - policy.max_scale_down_step:
        bounded = max(current - policy.max_scale_down_step, policy.min_replicas)
        why += f", at most {policy.max_scale_down_step} down at once"
    return Recommendation(bounded, why, asks)


def stabilise(
    history: list[tuple[float, int]], now: float, current: int, up_window_s: float, down_window_s: float
) -> int:
    """The replicas to move to, from the recommendations of the last windows (`history`: (time, replicas),
    including the one just made): up only to what the whole scale-up window asked at least, down only to what
    the whole scale-down window allowed at most."""
    # Times are kept to the millisecond: the recommendation just made is always inside both windows.
    up = [r for t, r in history if now - t <= up_window_s + 0.001] or [current]
    down = [r for t, r in history if now - t <= down_window_s + 0.001] or [current]
    if min(up) > current:
        return min(up)
    if max(down) < current:
        return max(down)
    return current


# --- signals ----------------------------------------------------------------------------------------------


def startup_seconds(pool: Pool) -> float:
    """The pool's measured engine start-up time: the median of its last lifetimes' ready - started."""
    rows = (
        EndpointLifetime.objects.filter(pool=pool, ready_at__isnull=False)
        .order_by("-started_at")
        .values_list("started_at", "ready_at")[:9]
    )
    samples = sorted((ready - started).total_seconds() for started, ready in rows)
    if not samples:
        return float(settings.AUTOSCALER_DEFAULT_STARTUP_S)
    return samples[len(samples) // 2]


def latency_p90s(deployment_id: int, window_s: float) -> tuple[float | None, float | None, int]:
    """TTFT and inter-token latency p90 of a deployment's requests finished over the window, from the ledger
    (each request's TTFT and latency as its router measured them, whichever replica served it)."""
    from django.db import connection

    since = timezone.now() - timedelta(seconds=window_s)
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT
              percentile_cont(0.9) WITHIN GROUP (ORDER BY ttft_ms)
                FILTER (WHERE ttft_ms IS NOT NULL),
              percentile_cont(0.9) WITHIN GROUP (
                ORDER BY (latency_ms - ttft_ms)::float / (output_tokens - 1))
                FILTER (WHERE ttft_ms IS NOT NULL AND latency_ms IS NOT NULL AND output_tokens > 1),
              count(*)
            FROM tenants_usagerecord
            WHERE deployment_id = %s AND created_at >= %s AND status = 'completed'
            """,
            [deployment_id, since],
        )
        ttft, itl, count = cursor.fetchone()
    return (
        ttft / 1000 if ttft is not None else None,
        itl / 1000 if itl is not None else None,
        count,
    )


def pool_signals(redis, pool: Pool, latency: tuple[float | None, float | None, int]) -> Signals:
    """The pool's signals: the engines' scraped load and the routers' published loads (Redis), and the
    deployment's latency p90s (`latency`, from `latency_p90s`)."""
    from routing.contracts import LOAD_KEY, REPLICA_LOAD_KEY, others_load

    endpoints = list(
        Endpoint.objects.filter(pool=pool, health=Health.HEALTHY, draining_since__isnull=True).values_list(
            "id", flat=True
        )
    )
    queued = running = 0.0
    kv: list[float] = []
    if endpoints:
        with redis.pipeline(transaction=False) as pipe:
            for endpoint_id in endpoints:
                pipe.hgetall(LOAD_KEY.format(endpoint_id))
                pipe.hgetall(REPLICA_LOAD_KEY.format(endpoint_id))
            replies = pipe.execute()
        now = time.time()
        for index in range(len(endpoints)):
            engine, routers = replies[2 * index], replies[2 * index + 1]
            running += float(engine.get(b"running", 0)) + float(engine.get(b"waiting", 0))
            if b"kv_usage" in engine:
                kv.append(float(engine[b"kv_usage"]))
            queued += others_load(routers, "", now).prefill  # every replica's backlog there
    return role_signals(pool.role, len(endpoints), queued, running, kv, latency)


def role_signals(
    role: str,
    ready: int,
    queued: float,
    running: float,
    kv: list[float],
    latency: tuple[float | None, float | None, int],
) -> Signals:
    """A pool's signals from its ready engines' totals (`kv`: each one's KV-cache use) and the deployment's
    latency p90s, as its role reads them: a prefill pool is held to its prompt backlog and TTFT, a decode pool to
    its sequences, KV use and inter-token latency, an aggregated pool to all of them. (The fleet planner's
    autoscaler reads its simulated pools through this too.)"""
    ttft, itl, requests = latency
    return Signals(
        ready=ready,
        queued_prompt_tokens=queued if role != PoolRole.DECODE else 0.0,
        running_requests=running if role != PoolRole.PREFILL else 0.0,
        kv_cache_utilization=(sum(kv) / len(kv)) if kv and role != PoolRole.PREFILL else None,
        ttft_p90_s=ttft if role != PoolRole.DECODE else None,
        itl_p90_s=itl if role != PoolRole.PREFILL else None,
        requests=requests,
    )


def growth(samples: list[tuple[float, float]]) -> float:
    """The growth per second of a signal that its samples ((time, value), any order) show beyond their noise:
    the lower one-sided 95 % confidence bound of the least-squares slope, or 0 when it is not above 0 (or there
    are fewer than TREND_MIN_SAMPLES samples)."""
    n = len(samples)
    if n < TREND_MIN_SAMPLES:
        return 0.0
    mean_t = sum(t for t, _ in samples) / n
    mean_v = sum(v for _, v in samples) / n
    sxx = sum((t - mean_t) ** 2 for t, _ in samples)
    if sxx <= 0:
        return 0.0
    slope = sum((t - mean_t) * (v - mean_v) for t, v in samples) / sxx
    residuals = sum((v - mean_v - slope * (t - mean_t)) ** 2 for t, v in samples)
    error = math.sqrt(residuals / (n - 2) / sxx)
    dof = n - 2
    t95 = _T95[dof - 1] if dof <= len(_T95) else (1.70 if dof <= 30 else 1.645)
    return max(slope - t95 * error, 0.0)


def _trend(redis, pool_id: int, signals: Signals, now: float) -> Trend:
    """Growth per second of the capacity signals (`growth`) over this pass and the recorded passes of the last
    TREND_WINDOW_S."""
    recent = []
    # Newest first: the passes of the window are at the head (passes come every few seconds or faster).
    for item in redis.lrange(AUTOSCALE_HISTORY_KEY.format(pool_id), 0, 127):
        sample = json.loads(item)
        if now - sample["t"] > TREND_WINDOW_S:
            break
        recent.append(sample)

    def slope(name: str) -> float:
        new = getattr(signals, name)
        if new is None:
            return 0.0
        points = [(s["t"], s[name]) for s in recent if s.get(name) is not None]
        return growth([*points, (now, new)])

    return Trend(slope("queued_prompt_tokens"), slope("running_requests"), slope("kv_cache_utilization"))


# --- the task ------------------------------------------------------------------------------------------


# Replicas of a pool the cluster has no room for (pods the scheduler could not place), as the orchestrator last
# saw them; while any wait, the autoscaler asks for no more (they would only wait too).
UNSCHEDULABLE_KEY = "autoscale:unschedulable:{}"
UNSCHEDULABLE_TTL_S = 60


def unschedulable_note(redis, pool_id: int, count: int) -> None:
    """Record (or clear, with 0) how many of the pool's replicas wait for room on the cluster."""
    if count:
        redis.set(UNSCHEDULABLE_KEY.format(pool_id), count, ex=UNSCHEDULABLE_TTL_S)
    else:
        redis.delete(UNSCHEDULABLE_KEY.format(pool_id))


def _held_for_room(redis, pool: Pool, recommendation: Recommendation) -> Recommendation:
    if recommendation.replicas <= pool.replicas:
        return recommendation
    waiting = int(redis.get(UNSCHEDULABLE_KEY.format(pool.pk)) or 0)
    if not waiting:
        return recommendation
    reason = f"{recommendation.reason}; held: {waiting} replica(s) already wait for room on the cluster"
    return Recommendation(pool.replicas, reason, recommendation.asks)


def autoscale_all(redis=None) -> list[ScalingEvent]:
    """One pass over every pool whose autoscaling is on; returns the scaling events it made."""
    import redis as redis_client

    from .services import AUTOSCALER, pool_scale

    redis = redis or redis_client.Redis.from_url(settings.REDIS_URL)
    policies = (
        AutoscalingPolicy.objects.filter(enabled=True, pool__deployment__desired_status="running")
        .select_related("pool", "pool__deployment")
        .order_by("pool_id")
    )
    latency_cache: dict[int, tuple[float | None, float | None, int]] = {}
    events = []
    window = settings.AUTOSCALER_LATENCY_WINDOW_S
    for policy in policies:
        pool = policy.pool
        deployment_id = pool.deployment_id
        if deployment_id not in latency_cache:
            latency_cache[deployment_id] = latency_p90s(deployment_id, window)
        now = time.time()
        signals = pool_signals(redis, pool, latency_cache[deployment_id])
        trend = _trend(redis, pool.pk, signals, now)
        startup = startup_seconds(pool)
        recommendation = _held_for_room(
            redis, pool, recommend(policy, pool.replicas, signals, trend, startup)
        )
        key = AUTOSCALE_RECOMMENDATIONS_KEY.format(pool.pk)
        keep = max(policy.scale_up_window_s, policy.scale_down_window_s)
        with redis.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {f"{now:.3f}:{recommendation.replicas}": now})
            pipe.zremrangebyscore(key, "-inf", now - keep - 1)
            pipe.expire(key, int(keep) + 60)
            pipe.zrange(key, 0, -1)
            *_, members = pipe.execute()
        history = [(float(at), int(replicas)) for at, replicas in (m.decode().split(":") for m in members)]
        target = stabilise(history, now, pool.replicas, policy.scale_up_window_s, policy.scale_down_window_s)
        sample = {"t": round(now, 3), "replicas": target, **asdict(signals)}
        with redis.pipeline(transaction=False) as pipe:
            pipe.lpush(AUTOSCALE_HISTORY_KEY.format(pool.pk), json.dumps(sample))
            pipe.ltrim(AUTOSCALE_HISTORY_KEY.format(pool.pk), 0, HISTORY_LENGTH - 1)
            pipe.expire(AUTOSCALE_HISTORY_KEY.format(pool.pk), 86_400)
            pipe.execute()
        if target == pool.replicas:
            continue
        values = {k: v for k, v in asdict(signals).items() if v is not None}
        values.update(startup_s=round(startup, 1), asks=recommendation.asks)
        reason = recommendation.reason
        if target != recommendation.replicas:
            reason += f"; stabilised to {target}"
        event = ScalingEvent(
            pool=pool,
            from_replicas=pool.replicas,
            to_replicas=target,
            actor=AUTOSCALER,
            signals=values,
            reason=reason,
        )
        if pool_scale(actor=AUTOSCALER, pool=pool, replicas=target, source=AUTOSCALER):
            event.save()
            events.append(event)
            log.info("autoscaler: %s %s -> %s (%s)", pool, event.from_replicas, target, reason)
    return events


def pool_history(redis, pool_id: int) -> list[dict]:
    """The pool's recent passes, oldest first: time, replicas, and the signals read (for the portal)."""
    return [json.loads(item) for item in reversed(redis.lrange(AUTOSCALE_HISTORY_KEY.format(pool_id), 0, -1))]
