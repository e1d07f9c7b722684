"""The benchmarks' open-loop streamed client against two real simulator engines."""

import asyncio

import pytest

from bench import streamed
from bench.routing_workloads import Req

from ..serving.engines import MODEL_NAME, start_engine


@pytest.fixture(scope="module")
def two_engines():
    engines = [
        start_engine("sim", "--decode-time", "0.01", "--prefill-time-per-token", "0.0001", events=False)
        for _ in range(2)
    ]
    yield engines
    for engine in engines:
        engine.stop()


def test_replay_times_each_request_reads_its_usage_and_keeps_turns_in_order(two_engines):
    ports = [int(engine.url.rsplit(":", 1)[1]) for engine in two_engines]
    reqs = [
        Req(0.0, [1, 2], 1024, 4),  # 0 -> first engine
        Req(0.0, [1, 2, 3], 1536, 4, after=0),  # 1 -> second engine, held back until 0 ended
        Req(0.3, [1, 2, 4], 1536, 4),  # 2 -> first engine, which holds request 0's blocks by then
        Req(0.3, [50], 512, 4, session="s-1"),  # 3 -> second engine
    ]
    bodies = streamed.completion_bodies(MODEL_NAME, reqs, ignore_eos=True)
    results = asyncio.run(streamed.replay(ports, {}, reqs, bodies, chunk_times=True))

    assert all(r["ok"] and r["status"] == 200 for r in results), results
    assert [r["prompt"] for r in results] == [1024, 1536, 1536, 512]
    assert all(r["completion"] == 4 for r in results)
    # Request 1 continues request 0: it waited for its end, so it was sent after it.
    assert results[1]["held_back"] > 0 and results[1]["sent"] >= results[0]["done"]
    # Request 2 went to the engine request 0 went to (i mod 2) and found its 8 blocks there; request 1, on the
    # other engine, found none, nor did the rest.
    assert results[2]["cached"] == 1024
    assert results[0]["cached"] == results[1]["cached"] == results[3]["cached"] == 0
    # Its own prefill at the simulator's per-token time is the first token's floor.
    assert results[2]["ttft"] >= 512 * 0.0001 and results[0]["ttft"] >= 1024 * 0.0001
    for r in results:
        assert r["done"] >= r["sent"] + r["ttft"]
        assert len(r["itl"]) >= 3 and all(gap >= 0 for gap in r["itl"])
        assert sum(r["itl"]) >= 3 * 0.01 * 0.9  # four tokens, 10 ms of decode apart


def test_a_failed_request_is_counted_not_raised(two_engines):
    port = int(two_engines[0].url.rsplit(":", 1)[1])
    reqs = [Req(0.0, [1], 512, 4)]
    bad = [b'{"model": "no-such-model", "prompt": [1, 2], "stream": true}']
    (result,) = asyncio.run(streamed.replay([port], {}, reqs, bad))
    assert result["ok"] is False and result["status"] == 404


def test_replay_sends_agent_sessions_as_text_in_both_dialects(two_engines):
    """Chat workloads: each request to its own path, usage read from each dialect's own stream."""
    import json

    port = int(two_engines[0].url.rsplit(":", 1)[1])
    history = [{"role": "user", "content": "Read the parser and fix it. " * 40}]
    reqs = [
        Req(0.0, [], 0, 4, payload={}, path="/v1/messages"),
        Req(0.0, [], 0, 4, payload={}, path="/v1/chat/completions", after=0),
    ]
    bodies = [
        json.dumps({"model": MODEL_NAME, "max_tokens": 4, "stream": True, "messages": history}).encode(),
        json.dumps(
            {
                "model": MODEL_NAME,
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
                "messages": history,
            }
        ).encode(),
    ]
    anthropic, openai = asyncio.run(streamed.replay([port], {}, reqs, bodies))
    assert anthropic["ok"] and openai["ok"], (anthropic, openai)
    # The same rendered prompt in both: Anthropic's input, cache creation and cache read tokens add up to it,
    # and the second request found the first one's full blocks.
    assert (
        anthropic["prompt"] == openai["prompt"] > 256 and anthropic["completion"] == openai["completion"] == 4
    )
    assert anthropic["cached"] == 0 and openai["cached"] == openai["prompt"] // 128 * 128
