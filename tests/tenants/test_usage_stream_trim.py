"""The usage stream loses nothing when ingestion stalls: emission never trims, the ingestion task trims only what
the consumer group acknowledged, and the lag (entries not acknowledged, age of the oldest) is on /metrics."""

from __future__ import annotations

import asyncio
import time
from uuid import uuid4

import pytest
import redis.asyncio
from django.conf import settings as django_settings

from routing.metering import finisher
from tenants.models import UsageRecord
from tenants.tasks import ingest_usage
from tenants.usage_stream import (
    GROUP,
    _ensure_group,
    usage_event_emit_sync,
    usage_ingest_until_empty,
    usage_redis,
    usage_stream_lag,
    usage_stream_trim,
)

from .test_usage_ingest import make_event


@pytest.fixture
def stream(settings):
    settings.USAGE_STREAM = f"usage:test:{uuid4().hex}"
    settings.USAGE_DEAD_LETTER_STREAM = f"usage:test-dead:{uuid4().hex}"
    client = usage_redis()
    yield client
    client.delete(settings.USAGE_STREAM, settings.USAGE_DEAD_LETTER_STREAM)


def lag() -> tuple[int, float]:
    async def read() -> tuple[int, float]:
        client = redis.asyncio.Redis.from_url(django_settings.REDIS_URL)
        try:
            return await usage_stream_lag(client)
        finally:
            await client.aclose()

    return asyncio.run(read())


def test_a_stalled_consumer_loses_no_event_however_long_the_stream_grows(world, stream, settings):
    settings.USAGE_STREAM_MAXLEN = 10  # the bound emission used to trim at
    stream_name = django_settings.USAGE_STREAM
    _ensure_group(stream, stream_name)
    pipe = stream.pipeline(transaction=False)
    for i in range(300):
        usage_event_emit_sync(pipe, make_event(world.key_a1, f"req-stall-{i}"))
    pipe.execute()
    # A worker read the first 100 and died without acknowledging them.
    stream.xreadgroup(GROUP, "stalled", {stream_name: ">"}, count=100)
    assert stream.xlen(stream_name) == 300

    assert usage_stream_trim() == 0  # nothing was acknowledged: nothing goes
    entries, age = lag()
    assert entries == 300 and age >= 0

    settings.USAGE_VISIBILITY_TIMEOUT_MS = 0  # the dead worker's entries are claimed at once
    assert ingest_usage.apply().get() == 300
    assert UsageRecord.objects.filter(request_id__startswith="req-stall-").count() == 300
    assert stream.xlen(stream_name) == 0
    assert lag() == (0, 0.0)


def test_the_trim_removes_acknowledged_entries_only(world, stream):
    name = django_settings.USAGE_STREAM
    _ensure_group(stream, name)
    ids = [stream.xadd(name, {"e": make_event(world.key_a1, f"req-t{i}").encode()}) for i in range(6)]
    # Entries 0-1 acknowledged but left in the stream, 2-3 delivered and pending, 4-5 not delivered.
    stream.xreadgroup(GROUP, "c", {name: ">"}, count=4)
    stream.xack(name, GROUP, ids[0], ids[1])

    assert usage_stream_trim() == 2
    assert [entry_id for entry_id, _ in stream.xrange(name)] == ids[2:]

    stream.xack(name, GROUP, ids[2], ids[3])  # the pending ones too: now only the undelivered stay
    assert usage_stream_trim() == 2
    assert [entry_id for entry_id, _ in stream.xrange(name)] == ids[4:]
    assert usage_ingest_until_empty(consumer="c") == 2


def test_the_lag_is_the_unacknowledged_entries_and_the_age_of_the_oldest(world, stream):
    name = django_settings.USAGE_STREAM
    assert lag() == (0, 0.0)
    old_ms = int(time.time() * 1000) - 90_000
    stream.xadd(name, {"e": make_event(world.key_a1, "req-old").encode()}, id=f"{old_ms}-0")
    usage_event_emit_sync(stream, make_event(world.key_a1, "req-new"))

    entries, age = lag()
    assert entries == 2 and 89 < age < 120


def test_the_router_exports_the_lag_on_its_metrics(world, stream):
    from prometheus_client import generate_latest

    from routing.server import metrics

    usage_event_emit_sync(stream, make_event(world.key_a1, "req-metric"))

    async def read() -> None:
        client = redis.asyncio.Redis.from_url(django_settings.REDIS_URL)
        try:
            await finisher.Finisher(client, finisher.Admission(client))._read_lag()
        finally:
            await client.aclose()

    asyncio.run(read())
    text = generate_latest(metrics.registry).decode()
    assert "usage_stream_lag_entries 1.0" in text
    assert "usage_stream_oldest_age_seconds" in text
