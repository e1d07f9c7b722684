"""Failures the router must survive: a dead or failing engine, an engine dying mid-stream, a client leaving,
and a key revoked while two replicas serve it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from aiohttp import web

from inference_platform.ports import free_port
from serving.models import Endpoint, Health
from tenants.keys import api_key_revoke

from ..serving.engines import MODEL_NAME, start_engine
from .conftest import make_fleet, start_router
from .router_metrics import router_metrics
from .usage import usage_events


def chat(fleet, **body) -> httpx.Response:
    payload = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    return httpx.post(
        f"{fleet.router.url}/v1/chat/completions",
        json=payload,
        timeout=60,
        headers={"authorization": f"Bearer {fleet.key.secret}"},
    )


class FailingEngine:
    """An HTTP server that answers every request with a 500, in a thread."""

    def __init__(self):
        self.port = free_port()
        self.hits = 0
        self._ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        self._ready.wait(5)

    def _serve(self):
        import asyncio

        async def fail(request):
            self.hits += 1
            return web.json_response({"error": {"message": "boom"}}, status=500)

        async def main():
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", fail)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._ready.set()
            await asyncio.Event().wait()

        asyncio.run(main())


def test_it_fails_over_from_dead_and_failing_engines(fleet):
    pool = fleet.deployment.pools.get()
    failing = FailingEngine()
    Endpoint.objects.create(
        pool=pool,
        name="tiny-main-dead",
        url=f"http://127.0.0.1:{free_port()}",
        role="both",
        health=Health.HEALTHY,
    )
    Endpoint.objects.create(
        pool=pool,
        name="tiny-main-500",
        url=f"http://127.0.0.1:{failing.port}",
        role="both",
        health=Health.HEALTHY,
    )
    fleet.sync()
    responses = [chat(fleet) for _ in range(8)]
    assert [r.status_code for r in responses] == [200] * 8
    assert failing.hits >= 1  # it was tried, and its 500 never reached a client


def test_it_answers_503_when_no_engine_can_serve(fleet):
    Endpoint.objects.filter(pool__deployment=fleet.deployment).update(health=Health.UNHEALTHY)
    fleet.sync()
    response = chat(fleet)
    assert response.status_code == 503 and "unavailable" in response.json()["error"]["message"]


@pytest.fixture
def slow_fleet(router_process):
    engine = start_engine("sim", "--decode-time", "0.05")
    fleet = make_fleet(router_process, [engine])
    yield fleet
    engine.stop()


def test_an_engine_dying_mid_stream_ends_the_stream_with_an_error_and_bills_what_was_sent(slow_fleet):
    fleet = slow_fleet
    engine = fleet.engines[0]
    received, error = 0, None
    with httpx.stream(
        "POST",
        f"{fleet.router.url}/v1/chat/completions",
        timeout=60,
        headers={"authorization": f"Bearer {fleet.key.secret}"},
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 200,
            "stream": True,
        },
    ) as response:
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                error = data["error"]
                continue
            if data["choices"] and data["choices"][0]["delta"].get("content"):
                received += 1
                if received == 5:
                    os.killpg(engine.process.pid, signal.SIGKILL)
    assert error is not None and error["type"] == "upstream_error" and "billed" in error["message"]
    (event,) = usage_events([request_id], wait_for=1)
    assert event.status == "failed"
    assert 5 <= event.output_tokens <= 8  # what had been streamed when the engine died


def test_a_client_leaving_mid_stream_aborts_the_engine_request_and_bills_it(slow_fleet):
    fleet = slow_fleet
    engine = fleet.engines[0]
    with httpx.stream(
        "POST",
        f"{fleet.router.url}/v1/completions",
        timeout=60,
        headers={"authorization": f"Bearer {fleet.key.secret}"},
        json={"model": MODEL_NAME, "prompt": "count to a thousand", "max_tokens": 500, "stream": True},
    ) as response:
        request_id = response.headers["x-request-id"]
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 4:
                    break
    left_at = time.monotonic()
    while time.monotonic() - left_at < 1.0 and engine.metrics()["vllm:num_requests_running"] > 0:
        time.sleep(0.05)
    assert engine.metrics()["vllm:num_requests_running"] == 0, "the engine still runs the request after 1 s"
    assert (
        f'finished_reason="abort",model_name="{MODEL_NAME}"}} 1.0' in httpx.get(f"{engine.url}/metrics").text
    )
    (event,) = usage_events([request_id], wait_for=1)
    assert event.status == "cancelled" and event.output_tokens >= 4


def test_a_revocation_reaches_every_replica_within_five_seconds(fleet):
    second = start_router()
    try:
        for url in (fleet.router.url, second.url):
            ok = httpx.post(
                f"{url}/v1/completions",
                json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1},
                headers={"x-api-key": fleet.key.secret},
            )
            assert ok.status_code == 200
        api_key_revoke(api_key=fleet.key.api_key)
        revoked_at = time.monotonic()
        pending = {fleet.router.url, second.url}
        while pending and time.monotonic() - revoked_at < 5:
            for url in list(pending):
                response = httpx.post(
                    f"{url}/v1/completions",
                    headers={"x-api-key": fleet.key.secret},
                    json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1},
                )
                if response.status_code == 401:
                    pending.discard(url)
            time.sleep(0.1)
        assert not pending, f"still accepted on {pending} five seconds after revocation"
        other = httpx.post(
            f"{second.url}/v1/completions",
            headers={"x-api-key": fleet.other_key.secret},
            json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1},
        )
        assert other.status_code == 200
    finally:
        second.stop()


def gc_counts(router) -> tuple[float, float]:
    """The router's gen-0 garbage collections and the objects they freed, from its /metrics."""
    collections = collected = 0.0
    for line in router_metrics(router.url).splitlines():
        if line.startswith('python_gc_collections_total{generation="0"}'):
            collections = float(line.rsplit(" ", 1)[1])
        elif line.startswith('python_gc_objects_collected_total{generation="0"}'):
            collected = float(line.rsplit(" ", 1)[1])
    return collections, collected


def test_requests_leave_no_garbage_for_the_collector(transactional_db, sim_pair):
    """A request's objects go by reference counting. Objects caught in reference cycles wait for a collection,
    and a collection with tens of thousands of them stalls every stream in flight for tens of ms. This router
    collects often (a low threshold), so a leftover cycle per request shows in what the collections free."""
    router = start_router({"ROUTER_GC_THRESHOLD": "300"})
    try:
        fleet = make_fleet(router, sim_pair)
        with httpx.Client(timeout=60, headers={"authorization": f"Bearer {fleet.key.secret}"}) as client:

            def ask(stream: bool) -> None:
                response = client.post(
                    f"{router.url}/v1/chat/completions",
                    json={
                        "model": MODEL_NAME,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 2,
                        "stream": stream,
                    },
                )
                assert response.status_code == 200

            for _ in range(20):  # warm up: connection pools, metric children
                ask(True)
            collections_before, collected_before = gc_counts(router)
            count = 300
            for index in range(count):
                ask(index % 2 == 0)
            collections, collected = gc_counts(router)
    finally:
        router.stop()
    # No collection at all means fewer than 300 objects outlived 300 requests; otherwise what the collections
    # freed is what cycles left behind.
    assert (collected - collected_before) / count < 2, (collected - collected_before, count, collections)
