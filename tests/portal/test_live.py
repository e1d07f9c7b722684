"""Live traffic: recent requests from the usage stream and the ledger, counted once, over a WebSocket."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest
from asgiref.testing import ApplicationCommunicator
from channels.db import database_sync_to_async
from django.db import connections

from portal.live import live_traffic
from portal.routing import websocket_urlpatterns
from tenants.usage_stream import UsageEvent, stream_key, usage_event_emit_sync, usage_redis

from ..conftest import make_usage, make_user


@pytest.fixture
def stream(settings):
    settings.USAGE_STREAM = "usage:test-live"
    usage_redis().delete(stream_key())
    yield
    usage_redis().delete(stream_key())


def emit(world, request_id: str, *, status: str = "completed", key=None) -> UsageEvent:
    key = (key or world.key_a1).api_key
    event = UsageEvent(
        request_id=request_id,
        tenant_id=key.team.tenant_id,
        team_id=key.team_id,
        api_key_id=key.id,
        deployment_id=world.deployment.id,
        model="tiny-qwen",
        endpoint="127.0.0.1:1",
        prompt_tokens=1000,
        cached_prompt_tokens=750,
        output_tokens=20,
        ttft_ms=100,
        latency_ms=400,
        status=status,
        created_at=datetime.now(UTC),
    )
    usage_event_emit_sync(usage_redis(), event)
    return event


def test_live_traffic_counts_each_request_once_from_stream_or_ledger(world, stream):
    emit(world, "live-1")
    emit(world, "live-2", status="failed", key=world.key_b1)
    make_usage(
        world.key_a1, "live-1", deployment=world.deployment, ttft_ms=300
    )  # live-1 ingested, not yet deleted
    snapshot = live_traffic(window_s=10)
    # The world fixture's two records were made just now as well.
    assert snapshot["total"]["requests"] == 4
    (tiny,) = [d for d in snapshot["deployments"] if d["name"] == "tiny"]
    assert tiny["requests"] == 2 and tiny["errors"] == 1
    assert tiny["prefix_hit_rate"] == round(1350 / 2000, 3)
    assert {t["name"]: t["requests"] for t in snapshot["tenants"]} == {"acme": 2, "bolt": 2}


def _communicator(user) -> ApplicationCommunicator:
    from channels.routing import URLRouter

    scope = {
        "type": "websocket",
        "path": "/ws/portal/live/",
        "headers": [],
        "query_string": b"",
        "user": user,
    }
    return ApplicationCommunicator(URLRouter(websocket_urlpatterns), scope)


@pytest.mark.django_db(transaction=True)
def test_the_websocket_streams_snapshots_to_operators_only(stream):
    operator, outsider = make_user("live-op", "operator"), make_user("live-nobody")

    async def talk():
        communicator = _communicator(operator)
        await communicator.send_input({"type": "websocket.connect"})
        assert (await communicator.receive_output(5))["type"] == "websocket.accept"
        snapshot = json.loads((await communicator.receive_output(5))["text"])
        assert snapshot["window_s"] == 10 and "deployments" in snapshot
        await communicator.send_input({"type": "websocket.disconnect", "code": 1000})
        await communicator.wait(2)
        communicator = _communicator(outsider)
        await communicator.send_input({"type": "websocket.connect"})
        closed = await communicator.receive_output(5)
        assert (closed["type"], closed["code"]) == ("websocket.close", 4403)
        await database_sync_to_async(connections.close_all)()  # the consumer's thread's connection

    asyncio.run(talk())
