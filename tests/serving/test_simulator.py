"""The simulator's own behaviour: bounded KV with eviction, a waiting queue, a latency model where a cache hit
shows in time to first token, deterministic output, client aborts, and NIXL-style prefill/decode hand-off."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from .engines import MODEL_NAME, EventSubscriber, events_of, start_engine


def blocks_prompt(n_blocks: int, salt: int) -> list[int]:
    return [(i * 13 + salt * 101) % 3000 + 100 for i in range(n_blocks * 128)]


def complete(engine, prompt, max_tokens=1, **extra) -> dict:
    response = httpx.post(
        f"{engine.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, **extra},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture
def small_cache_engine():
    engine = start_engine("sim", "--num-gpu-blocks-override", "6")
    yield engine
    engine.stop()


def test_it_evicts_least_recently_used_blocks_when_full(small_cache_engine):
    engine = small_cache_engine
    subscriber = EventSubscriber(engine.events_endpoint)
    try:
        a, b = (blocks_prompt(2, salt) + [7] for salt in (1, 2))  # 2 full blocks + 1 partial each
        c = blocks_prompt(3, 3) + [7]
        complete(engine, a)
        complete(engine, b)
        assert (
            complete(engine, a)["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
        )  # a is now most recent
        complete(engine, c)  # needs 4 of the 6 blocks: b's two, the least recently used, must go
        messages = subscriber.messages(timeout=2)
    finally:
        subscriber.close()
    removed = [h for e in events_of(messages) if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    stored = {
        tuple(e["token_ids"][:4]): e["block_hashes"]
        for e in events_of(messages)
        if e["type"] == "BlockStored"
    }
    assert set(removed) == set(stored[tuple(b[:4])])
    assert complete(engine, a)["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    assert complete(engine, b)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.fixture
def slow_engine():
    engine = start_engine(
        "sim",
        "--max-num-seqs",
        "1",
        "--decode-time",
        "0.05",
        "--prefill-time-per-token",
        "0.0005",
        events=False,
    )
    yield engine
    engine.stop()


def test_it_queues_requests_beyond_max_num_seqs(slow_engine):
    async def run():
        async with httpx.AsyncClient(base_url=slow_engine.url, timeout=60) as client:

            async def one(salt):
                start = time.monotonic()
                await client.post(
                    "/v1/completions",
                    json={"model": MODEL_NAME, "prompt": [salt + 100] * 10, "max_tokens": 6},
                )
                return time.monotonic() - start

            tasks = [asyncio.create_task(one(i)) for i in range(3)]
            await asyncio.sleep(0.1)
            waiting = slow_engine.metrics()["vllm:num_requests_waiting"]
            running = slow_engine.metrics()["vllm:num_requests_running"]
            return waiting, running, sorted(await asyncio.gather(*tasks))

    waiting, running, durations = asyncio.run(run())
    assert (running, waiting) == (1, 2)
    # One at a time: each takes ~5 x 50 ms of decode, so the third finishes after about three of them.
    assert durations[2] > 2.5 * durations[0]


def test_a_cache_hit_shows_in_time_to_first_token(slow_engine):
    prompt = blocks_prompt(8, salt=9) + [1, 2, 3]  # 1027 tokens, 0.5 ms each when not cached

    def ttft() -> float:
        with httpx.stream(
            "POST",
            f"{slow_engine.url}/v1/completions",
            timeout=60,
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "stream": True},
        ) as response:
            start = time.monotonic()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    return time.monotonic() - start
        raise AssertionError("no token")

    cold, warm = ttft(), ttft()
    assert cold > 0.4
    assert warm < cold / 4


def test_a_request_queued_behind_a_prefill_of_its_prefix_reuses_it():
    # As vLLM does, the prefix is looked up when the request's prefill is scheduled, not when it arrives: the
    # second of two identical prompts sent together waits for the first's prefill and then finds it cached.
    engine = start_engine("sim", "--prefill-time-per-token", "0.0005", "--decode-time", "0.01")
    prompt = blocks_prompt(8, salt=21) + [7, 8, 9]  # 1027 tokens: 0.51 s of prefill when nothing is cached

    async def run():
        async with httpx.AsyncClient(base_url=engine.url, timeout=60) as client:

            async def one(delay: float):
                await asyncio.sleep(delay)
                response = await client.post(
                    "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}
                )
                return time.monotonic(), response.json()["usage"]

            start = time.monotonic()
            (first_at, first), (second_at, second) = await asyncio.gather(one(0.0), one(0.05))
            return first_at - start, first, second_at - start, second

    try:
        first_s, first, second_s, second = asyncio.run(run())
        hits = engine.metrics()["vllm:prefix_cache_hits_total"]
    finally:
        engine.stop()
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == 8 * 128
    assert hits == 8 * 128
    assert first_s > 0.45 and second_s < first_s + 0.25  # it did not compute the 1,027 tokens again


def test_its_output_is_deterministic_for_a_seed(sim_engine):
    texts = {complete(sim_engine, "same prompt", 8, seed=42)["choices"][0]["text"] for _ in range(3)}
    assert len(texts) == 1
    assert complete(sim_engine, "same prompt", 8, seed=43)["choices"][0]["text"] not in texts


def test_it_aborts_a_request_when_the_client_goes_away(slow_engine):
    with httpx.stream(
        "POST",
        f"{slow_engine.url}/v1/completions",
        timeout=60,
        json={"model": MODEL_NAME, "prompt": "abort me", "max_tokens": 200, "stream": True},
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        metrics = slow_engine.metrics()
        if metrics["vllm:num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics["vllm:request_success_total"] >= 1
    assert metrics["vllm:generation_tokens_total"] < 200


@pytest.fixture
def pd_pair():
    timing = ["--prefill-time-per-token", "0.0005", "--kv-transfer-time-per-token", "0.00001"]
    prefill = start_engine("sim", *timing, nixl_role="kv_producer")
    decode = start_engine("sim", *timing, nixl_role="kv_consumer")
    yield prefill, decode
    prefill.stop()
    decode.stop()


def test_it_hands_a_prefill_over_to_a_decode_engine(pd_pair):
    prefill, decode = pd_pair
    prompt = blocks_prompt(8, salt=21) + [9, 9]
    first = complete(
        prefill,
        prompt,
        1,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == len(prompt)
    assert params["remote_port"] == prefill.side_channel_port and params["transfer_mode"] == "pull"

    start = time.monotonic()
    second = complete(decode, prompt, 4, kv_transfer_params=params)
    elapsed = time.monotonic() - start
    assert second["usage"]["completion_tokens"] == 4
    assert elapsed < 0.3  # the 1026 prompt tokens were pulled (about 10 ms), not recomputed (about 0.5 s)
    decode_metrics = decode.metrics()
    assert decode_metrics["vllm:nixl_xfer_time_seconds_count"] == 1
    assert decode_metrics.get("vllm:nixl_num_failed_transfers_total", 0) == 0
    # The prefill engine released the blocks it held for the transfer.
    assert prefill.metrics()["vllm:kv_cache_usage_perc"] == 0

    # The same parameters again: the KV is gone, so the decode engine recomputes and counts a failure.
    start = time.monotonic()
    complete(decode, [t + 1 for t in prompt], 1, kv_transfer_params=params)
    assert time.monotonic() - start > 0.4
    assert decode.metrics()["vllm:nixl_num_failed_transfers_total"] == 1
