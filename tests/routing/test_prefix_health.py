"""Whether prefix routing sees what the engines hold: every replica's predicted and reported cached tokens, and
its render failures, summed over a window in the real Redis; the ratio drifting below 0.8 is flagged."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis
from django.conf import settings

from routing.kvindex.prefix_health import PrefixHealth, prefix_health_for
from routing.server import metrics

DEPLOYMENT = 9_001


def test_replicas_counts_add_up_and_drift_is_flagged():
    sync = redis.Redis.from_url(settings.REDIS_URL)
    for key in sync.scan_iter(match=f"prefix:health:{DEPLOYMENT}:*"):
        sync.delete(key)

    async def two_replicas() -> None:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        first, second = PrefixHealth(), PrefixHealth()
        first.observed(DEPLOYMENT, predicted=3_000, reported=4_000)
        second.observed(DEPLOYMENT, predicted=1_000, reported=6_000)
        second.render_failed(DEPLOYMENT, "image")
        second.render_failed(DEPLOYMENT, "image")
        await first.flush(client, {DEPLOYMENT: "drift-model"})
        await second.flush(client, {DEPLOYMENT: "drift-model"})
        await client.aclose()

    asyncio.run(two_replicas())
    summary = prefix_health_for(sync, DEPLOYMENT)
    assert (summary.predicted, summary.reported) == (4_000, 10_000)
    assert summary.ratio == 0.4 and summary.drifting
    assert summary.render_failures == {"image": 2}
    assert metrics.of(metrics.prediction_ratio, "drift-model")._value.get() == 0.4


def test_too_little_traffic_is_not_called_drift():
    sync = redis.Redis.from_url(settings.REDIS_URL)
    for key in sync.scan_iter(match=f"prefix:health:{DEPLOYMENT + 1}:*"):
        sync.delete(key)
    health = PrefixHealth()
    health.observed(DEPLOYMENT + 1, predicted=0, reported=512)

    async def flush() -> None:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        await health.flush(client, {DEPLOYMENT + 1: "quiet-model"})
        await client.aclose()

    asyncio.run(flush())
    summary = prefix_health_for(sync, DEPLOYMENT + 1)
    assert summary.ratio == 0.0 and not summary.drifting
