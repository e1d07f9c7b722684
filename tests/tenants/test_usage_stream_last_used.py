"""ApiKey.last_used_at is written by the usage ingestion, in batches, off the request path: the newest event of
each key, never moving back."""

from __future__ import annotations

from datetime import timedelta
from uuid import uuid4

import pytest
from django.utils import timezone

from tenants.models import ApiKey
from tenants.usage_stream import usage_event_emit_sync, usage_ingest_until_empty, usage_redis

from .test_usage_ingest import make_event


@pytest.fixture
def stream(settings):
    settings.USAGE_STREAM = f"usage:test:{uuid4().hex}"
    settings.USAGE_DEAD_LETTER_STREAM = f"usage:test-dead:{uuid4().hex}"
    client = usage_redis()
    yield client
    client.delete(settings.USAGE_STREAM, settings.USAGE_DEAD_LETTER_STREAM)


def last_used(key) -> object:
    return ApiKey.objects.get(id=key.api_key.id).last_used_at


def test_each_keys_last_use_is_its_newest_event(world, stream):
    now = timezone.now()
    usage_event_emit_sync(stream, make_event(world.key_a1, "req-1", created_at=now - timedelta(minutes=5)))
    usage_event_emit_sync(stream, make_event(world.key_a1, "req-2", created_at=now - timedelta(minutes=1)))
    usage_event_emit_sync(stream, make_event(world.key_a1, "req-3", created_at=now - timedelta(minutes=3)))
    usage_event_emit_sync(stream, make_event(world.key_b1, "req-4", created_at=now - timedelta(minutes=2)))
    assert last_used(world.key_a1) is None

    assert usage_ingest_until_empty(consumer="test") == 4

    assert last_used(world.key_a1) == now - timedelta(minutes=1)
    assert last_used(world.key_b1) == now - timedelta(minutes=2)
    assert last_used(world.key_a2) is None  # no event of its own


def test_a_late_older_event_does_not_move_it_back(world, stream):
    now = timezone.now()
    usage_event_emit_sync(stream, make_event(world.key_a2, "req-new", created_at=now))
    usage_ingest_until_empty(consumer="test")
    # Replayed from a router's journal after an outage, say: older than what is recorded.
    usage_event_emit_sync(stream, make_event(world.key_a2, "req-late", created_at=now - timedelta(hours=1)))
    usage_ingest_until_empty(consumer="test")
    assert last_used(world.key_a2) == now

    usage_event_emit_sync(
        stream, make_event(world.key_a2, "req-newer", created_at=now + timedelta(seconds=1))
    )
    usage_ingest_until_empty(consumer="test")
    assert last_used(world.key_a2) == now + timedelta(seconds=1)


def test_a_redelivered_batch_still_sets_it(world, stream):
    """Rows already in the ledger (a worker died before acknowledging) still count as the key's use."""
    at = timezone.now()
    event = make_event(world.key_b1, "req-again", created_at=at)
    usage_event_emit_sync(stream, event)
    usage_ingest_until_empty(consumer="test")
    ApiKey.objects.filter(id=world.key_b1.api_key.id).update(last_used_at=None)
    usage_event_emit_sync(stream, event)

    assert usage_ingest_until_empty(consumer="test") == 0  # already recorded
    assert last_used(world.key_b1) == at
