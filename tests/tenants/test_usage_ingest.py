"""Usage events go from the Redis stream into the ledger exactly once, whatever dies on the way."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from urllib.parse import quote
from uuid import uuid4

import pytest
import redis.asyncio
from django.conf import settings as django_settings
from django.db import connection
from django.utils import timezone

from tenants import usage_stream
from tenants.models import PriceSheet, UsageRecord
from tenants.tasks import ingest_usage
from tenants.usage_stream import (
    GROUP,
    UsageEvent,
    usage_event_emit,
    usage_event_emit_sync,
    usage_ingest_batch,
    usage_ingest_until_empty,
    usage_redis,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def streams(settings):
    """A stream and a dead-letter stream of this test's own, so tests never see each other's entries."""
    suffix = uuid4().hex
    settings.USAGE_STREAM = f"usage:test:{suffix}"
    settings.USAGE_DEAD_LETTER_STREAM = f"usage:test-dead:{suffix}"
    client = usage_redis()
    yield client
    client.delete(settings.USAGE_STREAM, settings.USAGE_DEAD_LETTER_STREAM)


def make_event(key, request_id: str, **fields) -> UsageEvent:
    api_key = key.api_key
    values = dict(
        request_id=request_id,
        tenant_id=api_key.team.tenant_id,
        team_id=api_key.team_id,
        api_key_id=api_key.id,
        deployment_id=None,
        model="tiny-qwen",
        endpoint="127.0.0.1:9001",
        prompt_tokens=1000,
        cached_prompt_tokens=600,
        output_tokens=50,
        ttft_ms=120,
        latency_ms=900,
        status="completed",
        created_at=timezone.now(),
    )
    return UsageEvent(**{**values, **fields})


def pending(client) -> int:
    return client.xpending(django_settings.USAGE_STREAM, GROUP)["pending"]


def test_it_encodes_an_event_as_one_field_of_compact_json(world):
    event = make_event(world.key_a1, "req-json", deployment_id=world.deployment.id)
    encoded = event.encode()
    assert " " not in encoded
    assert json.loads(encoded)["created_at"].endswith("+00:00")
    assert UsageEvent.decode(encoded) == event


def test_it_writes_events_as_records_at_each_tenants_price(world, streams):
    at = timezone.now()
    usage_event_emit_sync(
        streams, make_event(world.key_a1, "req-1", deployment_id=world.deployment.id, created_at=at)
    )
    usage_event_emit_sync(streams, make_event(world.key_b1, "req-2", status="cancelled"))

    assert usage_ingest_batch(consumer="test") == 2

    a = UsageRecord.objects.get(request_id="req-1")
    # List price: 400 fresh * 0.5 + 600 cached * 0.05 + 50 out * 1.5 = 305 per million tokens.
    assert (a.cost, a.currency) == (Decimal("0.00030500"), "USD")
    assert (a.tenant, a.team, a.api_key_id) == (world.tenant_a, world.team_a1, world.key_a1.api_key.id)
    assert (a.deployment, a.model, a.endpoint) == (world.deployment, "tiny-qwen", "127.0.0.1:9001")
    assert (a.prompt_tokens, a.cached_prompt_tokens, a.output_tokens) == (1000, 600, 50)
    assert (a.ttft_ms, a.latency_ms, a.status, a.created_at) == (120, 900, "completed", at)
    b = UsageRecord.objects.get(request_id="req-2")
    # Tenant B's own sheet: 400 * 0.4 + 600 * 0.04 + 50 * 1.2 = 244 per million tokens.
    assert (b.cost, b.tenant, b.status) == (Decimal("0.00024400"), world.tenant_b, "cancelled")
    assert streams.xlen(django_settings.USAGE_STREAM) == 0
    assert pending(streams) == 0


def test_it_records_the_class_and_the_queue_wait_and_reads_events_written_before_they_existed(world, streams):
    usage_event_emit_sync(
        streams, make_event(world.key_a1, "req-queued", priority_class="batch", queued_ms=1250)
    )
    usage_event_emit_sync(
        streams,
        make_event(world.key_a1, "req-refused", priority_class="interactive", queued_ms=30000, status="rejected",
                   prompt_tokens=0, cached_prompt_tokens=0, output_tokens=0),
    )  # fmt: skip
    # An event from a router's journal written before the fields existed.
    old = json.loads(make_event(world.key_a1, "req-old").encode())
    del old["priority_class"], old["queued_ms"]
    streams.xadd(django_settings.USAGE_STREAM, {usage_stream.FIELD: json.dumps(old)})
    bad = json.loads(make_event(world.key_a1, "req-bad").encode()) | {"priority_class": "urgent"}
    streams.xadd(django_settings.USAGE_STREAM, {usage_stream.FIELD: json.dumps(bad)})

    assert usage_ingest_batch(consumer="test") == 3
    rows = {r.request_id: r for r in UsageRecord.objects.all()}
    assert (rows["req-queued"].priority_class, rows["req-queued"].queued_ms) == ("batch", 1250)
    refused = rows["req-refused"]
    assert (refused.status, refused.priority_class, refused.cost) == ("rejected", "interactive", Decimal("0"))
    assert (rows["req-old"].priority_class, rows["req-old"].queued_ms) == ("", None)
    assert "req-bad" not in rows  # dead-lettered: not a class
    assert streams.xlen(django_settings.USAGE_DEAD_LETTER_STREAM) == 1


def test_it_charges_nothing_in_the_default_currency_when_no_sheet_is_in_force(world, streams, settings):
    settings.USAGE_DEFAULT_CURRENCY = "EUR"
    before_prices = world.price_list.effective_from - timedelta(hours=1)
    usage_event_emit_sync(streams, make_event(world.key_a1, "req-early", created_at=before_prices))
    usage_event_emit_sync(streams, make_event(world.key_a1, "req-unpriced", model="unpriced"))

    assert usage_ingest_until_empty(consumer="test") == 2

    for record in UsageRecord.objects.filter(request_id__in=["req-early", "req-unpriced"]):
        assert (record.cost, record.currency) == (Decimal("0"), "EUR")


def test_it_prices_at_the_sheet_in_force_when_the_request_was_made(world, streams):
    PriceSheet.objects.create(
        served_model_name="tiny-qwen",
        effective_from=timezone.now() - timedelta(hours=1),
        currency="USD",
        input_per_mtok=Decimal("1"),
        cached_input_per_mtok=Decimal("0.1"),
        output_per_mtok=Decimal("3"),
    )
    two_hours_ago = timezone.now() - timedelta(hours=2)
    usage_event_emit_sync(streams, make_event(world.key_a1, "req-old", created_at=two_hours_ago))
    usage_event_emit_sync(streams, make_event(world.key_a1, "req-new"))

    usage_ingest_until_empty(consumer="test")

    assert UsageRecord.objects.get(request_id="req-old").cost == Decimal("0.000305")
    assert UsageRecord.objects.get(request_id="req-new").cost == Decimal("0.00061")


def test_it_takes_events_from_the_async_emitter(world, streams):
    async def emit() -> None:
        client = redis.asyncio.Redis.from_url(django_settings.REDIS_URL)
        try:
            await usage_event_emit(client, make_event(world.key_a2, "req-async"))
        finally:
            await client.aclose()

    asyncio.run(emit())

    assert usage_ingest_batch(consumer="test") == 1
    assert UsageRecord.objects.get(request_id="req-async").team == world.team_a2


def test_it_writes_one_record_for_an_event_emitted_twice(world, streams):
    event = make_event(world.key_a1, "req-twice")
    usage_event_emit_sync(streams, event)
    usage_event_emit_sync(streams, event)

    assert usage_ingest_batch(consumer="test") == 1
    usage_event_emit_sync(streams, event)
    assert usage_ingest_batch(consumer="test") == 0

    assert UsageRecord.objects.filter(request_id="req-twice").count() == 1
    assert streams.xlen(django_settings.USAGE_STREAM) == 0


def test_it_writes_no_duplicate_when_a_batch_dies_between_commit_and_ack(
    world, streams, settings, monkeypatch
):
    settings.USAGE_VISIBILITY_TIMEOUT_MS = 100
    for i in range(3):
        usage_event_emit_sync(streams, make_event(world.key_a1, f"req-c{i}"))

    def die(*args, **kwargs):
        raise RuntimeError("worker died before acknowledging")

    with monkeypatch.context() as patch:
        patch.setattr(usage_stream, "_ack", die)
        with pytest.raises(RuntimeError):
            usage_ingest_batch(consumer="dies")
    assert UsageRecord.objects.filter(request_id__startswith="req-c").count() == 3
    assert pending(streams) == 3

    time.sleep(0.2)
    assert usage_ingest_batch(consumer="survivor") == 0

    assert UsageRecord.objects.filter(request_id__startswith="req-c").count() == 3
    assert pending(streams) == 0
    assert streams.xlen(django_settings.USAGE_STREAM) == 0


def test_it_loses_nothing_when_a_batch_dies_before_commit(world, streams, settings, monkeypatch):
    settings.USAGE_VISIBILITY_TIMEOUT_MS = 300
    for i in range(3):
        usage_event_emit_sync(streams, make_event(world.key_a1, f"req-r{i}"))
    insert = usage_stream._insert

    def insert_then_die(records):
        insert(records)
        raise RuntimeError("worker died inside the transaction")

    with monkeypatch.context() as patch:
        patch.setattr(usage_stream, "_insert", insert_then_die)
        with pytest.raises(RuntimeError):
            usage_ingest_batch(consumer="dies")
    assert not UsageRecord.objects.filter(request_id__startswith="req-r").exists()
    assert pending(streams) == 3

    # Not yet: another consumer leaves them alone until the visibility timeout has passed.
    assert usage_ingest_batch(consumer="survivor") == 0
    time.sleep(0.4)
    assert usage_ingest_batch(consumer="survivor") == 3
    assert usage_ingest_batch(consumer="survivor") == 0

    assert UsageRecord.objects.filter(request_id__startswith="req-r").count() == 3
    assert pending(streams) == 0


def test_it_dead_letters_malformed_entries_and_writes_the_rest(world, streams):
    stream = django_settings.USAGE_STREAM
    good = make_event(world.key_a1, "req-good")
    streams.xadd(stream, {"e": "{not json"})
    streams.xadd(stream, {"other": "field"})
    streams.xadd(stream, {"e": make_event(world.key_a1, "req-cached", cached_prompt_tokens=1001).encode()})
    streams.xadd(stream, {"e": make_event(world.key_a1, "req-unknown-key", api_key_id=999_999).encode()})
    streams.xadd(stream, {"e": make_event(world.key_a1, "req-wrong-team", team_id=world.team_a2.id).encode()})
    streams.xadd(stream, {"e": json.dumps({**json.loads(good.encode()), "created_at": "2025-01-01T00:00"})})
    usage_event_emit_sync(streams, good)

    assert usage_ingest_batch(consumer="test") == 1

    dead = streams.xrange(django_settings.USAGE_DEAD_LETTER_STREAM)
    reasons = [fields["reason"] for _, fields in dead]
    assert len(reasons) == 6
    assert reasons[0].startswith("not JSON")
    assert "cached_prompt_tokens exceeds prompt_tokens" in reasons
    assert "unknown api_key_id 999999" in reasons
    assert any("belongs to team" in reason for reason in reasons)
    assert any(reason.startswith("created_at") for reason in reasons)
    assert all(fields["stream"] == stream for _, fields in dead)
    assert "no 'e' field" in reasons
    written = UsageRecord.objects.exclude(id__in=[world.usage_a1.id, world.usage_b1.id])
    assert list(written.values_list("request_id", flat=True)) == ["req-good"]
    assert pending(streams) == 0
    assert usage_ingest_batch(consumer="test") == 0


def test_it_dead_letters_a_row_the_database_refuses_and_writes_the_rest(world, streams):
    PriceSheet.objects.create(
        served_model_name="huge",
        effective_from=timezone.now() - timedelta(days=1),
        input_per_mtok=Decimal("999999"),
        cached_input_per_mtok=Decimal("0"),
        output_per_mtok=Decimal("0"),
    )
    # Two billion tokens at that price cost more than the ledger's cost column can hold.
    usage_event_emit_sync(
        streams, make_event(world.key_a1, "req-huge", model="huge", prompt_tokens=2_000_000_000)
    )
    usage_event_emit_sync(streams, make_event(world.key_a1, "req-fine"))

    assert usage_ingest_batch(consumer="test") == 1

    assert UsageRecord.objects.filter(request_id="req-fine").exists()
    [(_, fields)] = streams.xrange(django_settings.USAGE_DEAD_LETTER_STREAM)
    assert "req-huge" in fields["fields"]
    assert fields["reason"].startswith("refused by the database")
    assert pending(streams) == 0


def test_it_drains_the_stream_from_the_celery_task(world, streams, settings):
    settings.USAGE_INGEST_BATCH_SIZE = 7
    for i in range(20):
        usage_event_emit_sync(streams, make_event(world.key_b1, f"req-t{i}"))

    assert ingest_usage.apply().get() == 20

    assert UsageRecord.objects.filter(request_id__startswith="req-t").count() == 20


# A real worker, killed while it ingests -----------------------------------------------------------------


def database_url() -> str:
    db = connection.settings_dict
    auth = quote(db["USER"], safe="") + (":" + quote(db["PASSWORD"], safe="") if db["PASSWORD"] else "")
    return f"postgresql://{auth}@{quote(db['HOST'], safe='')}:{db['PORT']}/{quote(db['NAME'], safe='')}"


@pytest.fixture
def start_worker(tmp_path, streams):
    """Start a real Celery worker on a queue of its own, reading this test's stream from the test database."""
    (tmp_path / "usage_worker_settings.py").write_text(
        "from inference_platform.settings import *  # noqa: F403\n"
        f"USAGE_STREAM = {django_settings.USAGE_STREAM!r}\n"
        f"USAGE_DEAD_LETTER_STREAM = {django_settings.USAGE_DEAD_LETTER_STREAM!r}\n"
        "USAGE_INGEST_BATCH_SIZE = 10\n"
        "USAGE_VISIBILITY_TIMEOUT_MS = 1000\n"
        "USAGE_INGEST_MAX_SECONDS = 60\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "usage_worker_settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
        "DATABASE_URL": database_url(),
    }
    queue = f"usage-test-{uuid4().hex[:8]}"
    workers: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        n = len(workers)
        # The worker writes its own copy of the file descriptor; the log stays in tmp_path for a post-mortem.
        with open(tmp_path / f"worker{n}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "inference_platform", "worker", "--pool", "solo"]
                + ["-Q", queue, "-n", f"usage{n}-{queue}@%h", "-l", "info"]
                + ["--without-gossip", "--without-mingle", "--without-heartbeat"],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        workers.append(proc)
        return proc

    start.queue = queue
    yield start
    for proc in workers:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for(condition, *, timeout: float, every: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return False


def test_it_records_every_event_once_when_a_worker_is_killed_mid_ingest(
    transactional_db, world, streams, start_worker
):
    total = 3000
    ids = [f"req-kill-{i}" for i in range(total)]
    at = datetime.now(UTC)
    pipe = streams.pipeline(transaction=False)
    for request_id in ids:
        usage_event_emit_sync(pipe, make_event(world.key_a1, request_id, created_at=at))
    pipe.execute()
    recorded = UsageRecord.objects.filter(request_id__startswith="req-kill-")

    first = start_worker()
    ingest_usage.apply_async(queue=start_worker.queue)
    assert wait_for(lambda: recorded.count() >= 100, timeout=60), "the first worker is not ingesting"
    first.send_signal(signal.SIGKILL)
    first.wait()
    at_kill = recorded.count()
    assert 0 < at_kill < total, "the worker must die part-way through the stream"

    start_worker()

    def all_recorded() -> bool:
        ingest_usage.apply_async(queue=start_worker.queue)
        return recorded.count() == total

    assert wait_for(all_recorded, timeout=120, every=1.0), f"{recorded.count()} of {total} recorded"
    assert sorted(recorded.values_list("request_id", flat=True)) == sorted(ids)
    assert sum(recorded.values_list("cost", flat=True)) == Decimal("0.000305") * total
    assert wait_for(lambda: pending(streams) == 0, timeout=10)
    assert streams.xlen(django_settings.USAGE_DEAD_LETTER_STREAM) == 0
