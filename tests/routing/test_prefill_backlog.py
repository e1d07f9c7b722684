"""The router's prefill backlog per engine, end to end: a real router process in front of simulator engines with a
slow prefill. A request counts its uncached prompt tokens against its engine until its first token comes back,
then only its decode slot; the router replica publishes the backlog with its load in Redis, which is where this
test reads it (as the other replicas do)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis
from django.conf import settings

from routing.contracts import REPLICA_LOAD_KEY
from routing.models import RoutingPolicy
from serving.models import Endpoint

from ..serving.engines import MODEL_NAME, start_engine
from .conftest import make_fleet


@pytest.fixture
def slow_prefill_fleet(router_process):
    # 2 ms per uncached prompt token: a prompt of a few hundred tokens prefills for about a second.
    engines = [
        start_engine("sim", "--prefill-time-per-token", "0.002", "--decode-time", "0.05", events=False)
        for _ in range(2)
    ]
    fleet = make_fleet(router_process, engines)
    RoutingPolicy.objects.create(deployment=fleet.deployment, mode="approximate")
    fleet.sync()
    yield fleet
    for engine in engines:
        engine.stop()


def published(client: redis.Redis, endpoint_ids: list[int]) -> dict[int, tuple[float, int, float]]:
    """Per endpoint this router loads: (its weighted load, its requests in flight, its prefill backlog)."""
    out = {}
    for endpoint_id in endpoint_ids:
        for value in client.hgetall(REPLICA_LOAD_KEY.format(endpoint_id)).values():
            weighted, active, _at, backlog = value.split()
            out[endpoint_id] = (float(weighted), int(active), float(backlog))
    return out


def test_a_request_counts_its_prefill_against_its_engine_until_its_first_token(slow_prefill_fleet):
    fleet = slow_prefill_fleet
    ids = list(Endpoint.objects.filter(pool__deployment=fleet.deployment).values_list("id", flat=True))
    client = redis.Redis.from_url(settings.REDIS_URL)
    seen: dict[str, object] = {}

    async def watch_prefill():
        deadline = time.monotonic() + 5
        while True:
            loads = await asyncio.to_thread(published, client, ids)
            if any(backlog > 0 for _, _, backlog in loads.values()):
                seen["prefilling"] = loads
                return
            assert time.monotonic() < deadline, f"no prefill backlog was published: {loads}"
            await asyncio.sleep(0.02)

    async def run():
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Summarise the module layout. " * 60}],
            "max_tokens": 40,
            "stream": True,
        }
        headers = {"authorization": f"Bearer {fleet.key.secret}"}
        # The engine answers with its first token, so the backlog is watched while the request waits for it.
        watcher = asyncio.create_task(watch_prefill())
        async with httpx.AsyncClient(timeout=60) as http:
            url = f"{fleet.router.url}/v1/chat/completions"
            async with http.stream("POST", url, json=body, headers=headers) as resp:
                assert resp.status_code == 200
                chunks = resp.aiter_bytes()
                await anext(chunks)  # the first token
                await watcher
                # After it, while the request still decodes: in flight there, with no prefill left.
                deadline = time.monotonic() + 2
                while "decoding" not in seen:
                    loads = await asyncio.to_thread(published, client, ids)
                    if loads and all(backlog == 0 for _, _, backlog in loads.values()):
                        seen["decoding"] = loads
                    assert time.monotonic() < deadline, f"the backlog stayed after the first token: {loads}"
                    await asyncio.sleep(0.02)
                async for _ in chunks:
                    pass

    asyncio.run(run())
    prefilling = seen["prefilling"]
    (engine, (_, active, backlog)) = next((e, v) for e, v in prefilling.items() if v[2] > 0)
    assert active == 1 and backlog >= 200  # the prompt's tokens, none of them cached
    assert seen["decoding"][engine][1] == 1  # the same request, still streaming
