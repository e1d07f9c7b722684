"""Live traffic: recent requests from the usage stream and the ledger, counted once, over a WebSocket."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime

import pytest
from asgiref.testing import ApplicationCommunicator
from channels.db import database_sync_to_async
from django.db import connections

from portal.live import QUEUE_KEY, live_traffic
from portal.websockets import websocket_urlpatterns
from serving.models import ModelDeployment
from tenants.usage_stream import UsageEvent, stream_key, usage_event_emit_sync, usage_redis

from ..conftest import make_usage, make_user


@pytest.fixture
def stream(settings):
    settings.USAGE_STREAM = "usage:test-live"
    usage_redis().delete(stream_key())
    yield
    usage_redis().delete(stream_key())


def emit(world, request_id: str, *, status: str = "completed", key=None, **fields) -> UsageEvent:
    key = (key or world.key_a1).api_key
    values = dict(
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
    event = UsageEvent(**{**values, **fields})
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


# --- flow control: queues from the routers' reports in Redis, dispatches and waits from usage ---------------


@pytest.fixture
def queues(world):
    """Publish a router replica's queue for a deployment, as routing/scheduling/flow.py does."""
    keys = set()

    def publish(deployment, replica: str, queued: list, *, age_s: float = 0.0, saturated: bool = True):
        key = QUEUE_KEY.format(deployment.pk)
        keys.add(key)
        state = {"at": time.time() - age_s, "saturated": saturated, "queued": queued}
        usage_redis().hset(key, replica, json.dumps(state))

    yield publish
    if keys:
        usage_redis().delete(*keys)


def _deployment(snapshot: dict, name: str) -> dict:
    (row,) = [d for d in snapshot["deployments"] if d["name"] == name]
    return row


def test_live_traffic_shows_queues_dispatches_and_waits_per_class_and_tenant(world, stream, queues):
    a, b = world.tenant_a.pk, world.tenant_b.pk
    queues(world.deployment, "router-1", [["interactive", a, 2], ["batch", b, 5]])
    queues(world.deployment, "router-2", [["interactive", a, 1]], age_s=1.0, saturated=False)
    queues(world.deployment, "router-3", [["batch", b, 100]], age_s=10.0)  # gone stale: left out
    usage_redis().hset(QUEUE_KEY.format(world.deployment.pk), "router-4", "not json")
    emit(world, "i-1", priority_class="interactive", queued_ms=100)
    emit(world, "i-2", priority_class="interactive", queued_ms=300)
    emit(world, "i-late", status="rejected", priority_class="interactive", queued_ms=30_000, output_tokens=0)
    emit(world, "b-1", key=world.key_b1, priority_class="batch", queued_ms=0)
    # Ingested already: the ledger's row carries the class and wait too.
    make_usage(
        world.key_b1,
        "b-2",
        deployment=world.deployment,
        priority_class="batch",
        queued_ms=800,
        status="completed",
    )
    tiny = _deployment(live_traffic(window_s=10), "tiny")
    assert tiny["saturated"] is True and tiny["queued"] == 8
    assert tiny["flow"] == [
        {
            "priority_class": "interactive",
            "tenant": "acme",
            "queued": 3,
            "dispatches": 2,
            "rejected": 1,
            "wait_ms_mean": round((100 + 300 + 30_000) / 3),
            "wait_ms_p90": 30_000,
            "wait_ms_max": 30_000,
        },
        {
            "priority_class": "batch",
            "tenant": "bolt",
            "queued": 5,
            "dispatches": 2,
            "rejected": 0,
            "wait_ms_mean": 400,
            "wait_ms_p90": 800,
            "wait_ms_max": 800,
        },
    ]
    # The rejected request is an error of the deployment's too; the world's records, with no class, are not
    # flow rows.
    assert tiny["errors"] == 1 and tiny["requests"] == 5


def test_a_deployment_with_requests_waiting_shows_before_any_finishes(world, stream, queues):
    other = ModelDeployment.objects.create(
        name="coder", served_model_name="coder-v2", model_source="models/coder", engine_kind="sim"
    )
    queues(other, "router-1", [["standard", world.tenant_a.pk, 4], ["batch", world.tenant_a.pk, 0]])
    coder = _deployment(live_traffic(window_s=10), "coder")
    assert (coder["requests"], coder["saturated"], coder["queued"]) == (0, True, 4)
    assert coder["flow"] == [
        {
            "priority_class": "standard",
            "tenant": "acme",
            "queued": 4,
            "dispatches": 0,
            "rejected": 0,
            "wait_ms_mean": None,
            "wait_ms_p90": None,
            "wait_ms_max": None,
        }
    ]


def test_a_deployment_whose_queue_reports_are_all_stale_shows_none(world, stream, queues):
    queues(world.deployment, "router-1", [["batch", world.tenant_a.pk, 9]], age_s=5.0)
    emit(world, "unclassed")  # a request of before flow control: no class, no wait
    tiny = _deployment(live_traffic(window_s=10), "tiny")
    assert (tiny["saturated"], tiny["queued"], tiny["flow"]) == (None, 0, [])


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
        assert all({"flow", "queued", "saturated"} <= set(d) for d in snapshot["deployments"])
        await communicator.send_input({"type": "websocket.disconnect", "code": 1000})
        await communicator.wait(2)
        communicator = _communicator(outsider)
        await communicator.send_input({"type": "websocket.connect"})
        closed = await communicator.receive_output(5)
        assert (closed["type"], closed["code"]) == ("websocket.close", 4403)
        await database_sync_to_async(connections.close_all)()  # the consumer's thread's connection

    asyncio.run(talk())


def _socket_scope(headers: list[tuple[bytes, bytes]]) -> dict:
    return {
        "type": "websocket",
        "path": "/ws/portal/live/",
        "headers": headers,
        "query_string": b"",
        "client": ("127.0.0.1", 50000),
        "server": ("localhost", 8000),
        "subprotocols": [],
    }


@pytest.mark.django_db(transaction=True)
def test_the_web_side_serves_it_on_the_session_cookie_and_the_router_does_not(stream, settings):
    from django.test import Client

    from inference_platform.asgi import application as router
    from inference_platform.web_asgi import web_application

    settings.ALLOWED_HOSTS = ["localhost"]
    web = web_application()  # the origin check reads ALLOWED_HOSTS when it is built
    client = Client()
    client.force_login(make_user("live-op", "operator"))
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
    signed_in = [(b"cookie", cookie.encode()), (b"origin", b"http://localhost:8000")]

    async def talk():
        communicator = ApplicationCommunicator(web, _socket_scope(signed_in))
        await communicator.send_input({"type": "websocket.connect"})
        assert (await communicator.receive_output(5))["type"] == "websocket.accept"
        assert "deployments" in json.loads((await communicator.receive_output(5))["text"])
        await communicator.send_input({"type": "websocket.disconnect", "code": 1000})
        await communicator.wait(2)
        # No cookie: the consumer refuses; a foreign origin: the origin check does.
        foreign = [(b"cookie", cookie.encode()), (b"origin", b"http://elsewhere.example")]
        for headers in ([(b"origin", b"http://localhost:8000")], foreign):
            communicator = ApplicationCommunicator(web, _socket_scope(headers))
            await communicator.send_input({"type": "websocket.connect"})
            assert (await communicator.receive_output(5))["type"] == "websocket.close"
            await communicator.wait(2)
        # The router's application takes HTTP and lifespan only: it refuses the socket before it opens.
        communicator = ApplicationCommunicator(router, _socket_scope(signed_in))
        await communicator.send_input({"type": "websocket.connect"})
        assert (await communicator.receive_output(5)) == {"type": "websocket.close", "code": 1008}
        await communicator.wait(2)
        await database_sync_to_async(connections.close_all)()  # the consumer's thread's connection

    asyncio.run(talk())
