"""Least-loaded routing: engines' queues, scraped from their /metrics into Redis, steer new requests away."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from django.db import connection

from routing.models import RoutingPolicy
from routing.scheduling.load_scraper import endpoint_loads_scrape, parse_load

from ..serving.engines import MODEL_NAME, start_engine
from .conftest import make_fleet


def test_it_reads_vllms_load_metrics(sim_engine):
    load = parse_load(httpx.get(f"{sim_engine.url}/metrics").text)
    assert set(load) == {"running", "waiting", "kv_usage", "prefix_hits", "prefix_queries"}


def scrape_in_thread() -> int:
    try:
        return endpoint_loads_scrape()
    finally:
        connection.close()  # this thread's own database connection


@pytest.fixture
def busy_and_idle(router_process):
    busy = start_engine("sim", "--max-num-seqs", "1", "--decode-time", "0.05", events=False)
    idle = start_engine("sim", "--decode-time", "0.001", events=False)
    fleet = make_fleet(router_process, [busy, idle])
    RoutingPolicy.objects.create(deployment=fleet.deployment, mode="least_loaded")
    fleet.sync()
    yield fleet, busy, idle
    busy.stop()
    idle.stop()


def test_it_sends_new_requests_to_the_idle_engine(busy_and_idle):
    fleet, busy, idle = busy_and_idle

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            # Keep the busy engine's only slot taken and a queue behind it, straight at the engine.
            hog = [
                asyncio.create_task(
                    client.post(
                        f"{busy.url}/v1/completions",
                        json={"model": MODEL_NAME, "prompt": "hog", "max_tokens": 80},
                    )
                )
                for _ in range(3)
            ]
            await asyncio.sleep(0.3)
            assert await asyncio.to_thread(scrape_in_thread) == 2
            await asyncio.sleep(0.5)  # the router reads loads every 0.2 s in tests
            replies = [
                await client.post(
                    f"{fleet.router.url}/v1/completions",
                    headers={"authorization": f"Bearer {fleet.key.secret}"},
                    json={"model": MODEL_NAME, "prompt": "route me", "max_tokens": 2},
                )
                for _ in range(6)
            ]
            for task in hog:
                task.cancel()
            return replies

    before = idle.metrics()["vllm:request_success_total"]
    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200] * 6
    assert idle.metrics()["vllm:request_success_total"] - before == 6
