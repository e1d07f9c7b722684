"""/v1/messages/count_tokens under limits: it counts against the key's request rate, its body is bounded, and a
large prompt is tokenized in a worker process, so the replica's streams go on meanwhile."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import orjson
import pytest
from django.conf import settings

from routing.kvindex.prefix import PrefixRouting
from routing.rendering.conversion import RenderError
from routing.rendering.tokenize import RouterTokenizer
from routing.rendering.tokenize_pool import TokenizePool, worker_for
from routing.server.redis_pool import router_redis

from ..serving.engines import MODEL_DIR, MODEL_NAME, start_engine
from .conftest import make_fleet, set_quota, start_router

COUNT = "/v1/messages/count_tokens"


def anthropic_headers(fleet) -> dict:
    return {"x-api-key": fleet.key.secret, "anthropic-version": "2023-06-01"}


def count(fleet, content: str, timeout: float = 60) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}]}
    return httpx.post(
        f"{fleet.router.url}{COUNT}", json=body, headers=anthropic_headers(fleet), timeout=timeout
    )


def words(size: int) -> str:
    """`size` characters of varied words: one long piece for the tokenizer, as a pasted file is."""
    vocabulary = [f"w{index:x}q" for index in range(4000)]
    text = " ".join(vocabulary[(index * 7919) % 4000] for index in range(size // 5 + 1))
    return text[:size]


def test_it_counts_against_the_keys_requests_per_minute(fleet):
    set_quota(fleet, requests_per_minute=2)
    assert count(fleet, "one").status_code == 200
    assert count(fleet, "two").status_code == 200
    refused = count(fleet, "three")
    assert refused.status_code == 429
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "rate_limit_error"
    assert "requests per minute" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1
    # The same counter as generation's: the key's next generation request is refused too.
    generation = httpx.post(
        f"{fleet.router.url}/v1/messages",
        json={"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        headers=anthropic_headers(fleet),
        timeout=60,
    )
    assert generation.status_code == 429


def test_a_key_under_its_rate_is_counted_once_a_call(fleet):
    set_quota(fleet, requests_per_minute=1000)
    answer = count(fleet, "hello")
    assert answer.status_code == 200 and answer.json()["input_tokens"] > 0
    assert int(answer.headers.get("x-ratelimit-remaining-requests", "998")) <= 999


@pytest.fixture
def small_count_fleet(transactional_db, sim_pair):
    router = start_router({"ROUTER_COUNT_TOKENS_MAX_BYTES": "100000"})
    try:
        yield make_fleet(router, sim_pair)
    finally:
        router.stop()


def test_a_body_over_the_count_tokens_limit_is_refused_in_anthropics_shape(small_count_fleet):
    fleet = small_count_fleet
    refused = count(fleet, "x" * 200_000)
    assert refused.status_code == 413
    error = refused.json()
    assert error["type"] == "error" and error["error"]["type"] == "request_too_large"
    assert "100000 bytes" in error["error"]["message"]
    assert count(fleet, "a short prompt").status_code == 200


def test_a_large_prompt_is_tokenized_in_a_worker_with_the_same_ids(transactional_db):
    tokenizer = RouterTokenizer(MODEL_DIR)
    routing = PrefixRouting(router_redis(settings.REDIS_URL, 1))
    routing.pool_min_bytes = 10_000
    small = {"messages": [{"role": "user", "content": "a small prompt"}]}
    large = {"messages": [{"role": "user", "content": words(60_000)}]}
    expected = RouterTokenizer(MODEL_DIR).encode_request(large, "/v1/messages")

    async def both():
        try:
            return (
                await routing.encode(tokenizer, small, "/v1/messages"),
                await routing.encode(tokenizer, large, "/v1/messages"),
            )
        finally:
            routing.pool.close()

    misses = tokenizer.cache.misses
    small_ids, large_ids = asyncio.run(both())
    assert list(large_ids) == list(expected)
    # The small one was tokenized here (pieces went into this process's cache); the large one elsewhere.
    assert tokenizer.cache.misses > misses
    touched = tokenizer.cache.misses
    asyncio.run(routing_encode_again(routing, tokenizer, large))
    assert tokenizer.cache.misses == touched
    assert len(small_ids) > 0


async def routing_encode_again(routing: PrefixRouting, tokenizer: RouterTokenizer, payload: dict) -> None:
    try:
        await routing.encode(tokenizer, payload, "/v1/messages")
    finally:
        routing.pool.close()


def test_every_turn_of_a_conversation_goes_to_the_same_worker():
    first = [{"role": "user", "content": "Fix the failing test in src/app.py."}]
    turns, conversation = [], list(first)
    for n in range(5):
        turns.append(list(conversation))
        conversation += [{"role": "assistant", "content": f"step {n}"}, {"role": "user", "content": "go on"}]
    chosen = {
        worker_for({"system": "You are an agent.", "messages": turn}, "/v1/messages", 4) for turn in turns
    }
    assert len(chosen) == 1
    others = {
        worker_for({"messages": [{"role": "user", "content": f"task {n}"}]}, "/v1/messages", 4)
        for n in range(40)
    }
    assert len(others) > 1  # different conversations spread over the workers


def test_a_render_error_in_a_worker_comes_back_as_one():
    pool = TokenizePool(1)
    payload = {"messages": [{"role": "user", "content": "hello"}]}

    async def render():
        try:
            refusing = "{{ raise_exception('this template refuses every request') }}"
            return await pool.encode(str(MODEL_DIR), refusing, orjson.dumps(payload), payload, "/v1/messages")
        finally:
            pool.close()

    with pytest.raises(RenderError) as refused:
        asyncio.run(render())
    assert refused.value.reason == "template_error" and "refuses every request" in str(refused.value)


@pytest.fixture
def streaming_fleet(transactional_db):
    engine = start_engine("sim", "--decode-time", "0.005")
    router = start_router({"ROUTER_COUNT_TOKENS_MAX_BYTES": str(8 * 1024 * 1024)})
    try:
        fleet = make_fleet(router, [engine])
        fleet.deployment.max_model_len = 1_000_000  # the body limit follows it: room for a 1 MB prompt
        fleet.deployment.save()
        fleet.sync()
        yield fleet
    finally:
        router.stop()
        engine.stop()


def test_a_large_count_does_not_stop_another_stream(streaming_fleet):
    fleet = streaming_fleet
    assert count(fleet, "warm up the tokenizer and its workers").status_code == 200
    time.sleep(2)
    arrivals: list[float] = []
    reading = threading.Event()

    def stream() -> None:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "go"}], "max_tokens": 1200}
        body["stream"] = True
        with httpx.stream(
            "POST",
            f"{fleet.router.url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {fleet.key.secret}"},
            timeout=60,
        ) as reply:
            for _ in reply.iter_raw():
                arrivals.append(time.perf_counter())
                if len(arrivals) == 10:
                    reading.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert reading.wait(30)
    began = time.perf_counter()
    answer = count(fleet, words(1_000_000))
    ended = time.perf_counter()
    reader.join()
    assert answer.status_code == 200 and answer.json()["input_tokens"] > 100_000
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b >= began and a <= ended]
    assert gaps, "the stream ended before the count began"
    # On the router's own thread the count holds its interpreter for about half a second; in a worker the
    # stream keeps its pace.
    assert max(gaps) < 0.25, f"the stream stopped for {max(gaps):.3f} s during a {ended - began:.2f} s count"


def test_a_deployment_routed_by_the_prompt_has_its_tokenizer_and_workers_ready_before_its_first_request(
    transactional_db,
):
    from routing.info import DeploymentInfo, PolicyInfo

    def deployment(id: int, mode: str) -> DeploymentInfo:
        return DeploymentInfo(
            id, f"d{id}", MODEL_NAME, 4096, 16, PolicyInfo(mode=mode), (), 0, tokenizer_path=str(MODEL_DIR)
        )

    routing = PrefixRouting(router_redis(settings.REDIS_URL, 1))

    async def warm(deployments):
        try:
            await routing.warm(deployments)
            return [executor is not None for executor in routing.pool._executors]
        finally:
            routing.pool.close()

    # Routed on load alone: it needs no tokenizer, and nothing is started for it.
    assert asyncio.run(warm([deployment(1, "least_loaded")])) == [False] * routing.pool.processes
    assert routing._tokenizers == {}
    started = asyncio.run(warm([deployment(2, "precise")]))
    assert started == [True] * routing.pool.processes
    assert routing._tokenizers[(str(MODEL_DIR), "")] is not None
