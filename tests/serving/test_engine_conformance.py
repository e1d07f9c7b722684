"""One set of checks run against the simulator and against real vLLM (CPU build, tiny dummy-weight model).

What the router relies on must be the same on both: response shapes, streaming with usage, cached-token
accounting, /tokenize counts, metric names, and KV events (shapes, order and block hashes).
"""

from __future__ import annotations

import json

import httpx
import pytest

from .engines import MODEL_NAME, EventSubscriber, events_of

# A prompt of token ids: three full 128-token blocks and a partial one.
PROMPT_IDS = [(i * 7 + 11) % 3000 + 100 for i in range(3 * 128 + 40)]


def sse_events(response: httpx.Response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_it_is_healthy_and_lists_its_model(engine):
    with engine.client() as client:
        assert client.get("/health").status_code == 200
        models = client.get("/v1/models").json()
    assert models["object"] == "list"
    (model,) = models["data"]
    assert model["id"] == MODEL_NAME and model["max_model_len"] == 4096 and model["owned_by"] == "vllm"
    assert {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"} <= set(
        model
    )


def test_it_answers_a_completion_with_usage(engine):
    with engine.client() as client:
        body = client.post(
            "/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": "def hello(name):",
                "max_tokens": 5,
                "ignore_eos": True,
            },
        ).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert (
        usage["prompt_tokens_details"] == {"cached_tokens": 0}
        or usage["prompt_tokens_details"]["cached_tokens"] == 0
    )


def test_it_streams_a_chat_completion_ending_with_usage(engine):
    request = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Write a sorting function."}],
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with engine.client() as client, client.stream("POST", "/v1/chat/completions", json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert "cached_tokens" in usage_chunk["usage"]["prompt_tokens_details"]
    content_chunks = [c for c in chunks[1:-1] if c["choices"]]
    assert content_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks[:-1])


def test_it_streams_without_usage_unless_asked(engine):
    request = {"model": MODEL_NAME, "prompt": "x = ", "max_tokens": 3, "ignore_eos": True, "stream": True}
    with engine.client() as client, client.stream("POST", "/v1/completions", json=request) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert all(chunk["choices"] and "usage" not in chunk for chunk in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_it_reports_prefix_cache_hits_on_a_repeated_prefix(engine):
    before = engine.metrics()
    prompt = [t + 1 for t in PROMPT_IDS]  # unlike any other test's prompt
    with engine.client() as client:
        first = client.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}
        ).json()
        second = client.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt + [5, 6, 7], "max_tokens": 1}
        ).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * 128  # whole blocks only
    after = engine.metrics()
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == 3 * 128
    assert (
        after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
        == 2 * len(prompt) + 3
    )
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 2 * len(prompt) + 3


def test_it_exposes_vllms_metric_names(engine):
    names = set(engine.metrics())
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ):
        assert name in names, name
    text = httpx.get(f"{engine.url}/metrics").text
    assert f'vllm:num_requests_running{{engine="0",model_name="{MODEL_NAME}"}}' in text
    assert 'finished_reason="length"' in text


def test_it_publishes_kv_events_for_stored_blocks(engine):
    subscriber = EventSubscriber(engine.events_endpoint)
    prompt = [t + 2 for t in PROMPT_IDS]
    try:
        with engine.client() as client:
            client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
        messages = subscriber.messages(
            until=lambda got: any(e["type"] == "BlockStored" for e in events_of(got))
        )
    finally:
        subscriber.close()
    assert messages, "no KV events arrived"
    topic, seq, payload = messages[0]
    assert topic == f"kv@127.0.0.1:{engine.url.rsplit(':', 1)[1]}@{MODEL_NAME}".encode()
    assert isinstance(seq, int)
    assert len(payload) == 3 and isinstance(payload[0], float) and payload[2] == 0
    stored = [e for e in events_of(messages) if e["type"] == "BlockStored"]
    first = stored[0]
    assert first["parent_block_hash"] is None
    assert first["block_size"] == 128 and first["medium"] == "GPU"
    assert len(first["block_hashes"]) == 3 and first["token_ids"] == prompt[: 3 * 128]
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first["block_hashes"])
    assert {"lora_id", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"} <= set(first)
    engine.extra.setdefault("hashes", {})[tuple(prompt[:384])] = first["block_hashes"]


def test_it_refuses_an_unknown_model_with_vllms_error_shape(engine):
    with engine.client() as client:
        response = client.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "NotFoundError" and error["param"] == "model" and error["code"] == 404
    assert "The model `nope` does not exist" in error["message"]


def test_it_refuses_max_tokens_beyond_the_context(engine):
    with engine.client() as client:
        response = client.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 5000}
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and "cannot be greater than max_model_len=4096" in error["message"]


def test_it_refuses_a_prompt_longer_than_the_context(engine):
    with engine.client() as client:
        response = client.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": [100] * 5000, "max_tokens": 1}
        )
    assert response.status_code == 400
    assert "maximum context length is 4096 tokens" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"},
        {
            "messages": [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Fix the bug in utils.py, please."},
            ]
        },
    ],
)
def test_the_two_engines_tokenize_alike(sim_engine, vllm_engine, body):
    results = [
        httpx.post(f"{e.url}/tokenize", json={"model": MODEL_NAME, **body}).json()
        for e in (sim_engine, vllm_engine)
    ]
    assert results[0]["tokens"] == results[1]["tokens"]
    assert results[0]["count"] == results[1]["count"] > 10
    assert results[0]["max_model_len"] == results[1]["max_model_len"] == 4096


def test_the_two_engines_hash_blocks_alike(sim_engine, vllm_engine):
    prompt = [t + 3 for t in PROMPT_IDS]
    hashes = []
    for engine in (sim_engine, vllm_engine):
        subscriber = EventSubscriber(engine.events_endpoint)
        try:
            httpx.post(
                f"{engine.url}/v1/completions",
                json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1},
                timeout=60,
            )
            messages = subscriber.messages(
                until=lambda got: any(e["type"] == "BlockStored" for e in events_of(got))
            )
        finally:
            subscriber.close()
        hashes.append(next(e for e in events_of(messages) if e["type"] == "BlockStored")["block_hashes"])
    assert hashes[0] == hashes[1]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "x = 1", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ],
)
def test_the_two_engines_answer_with_the_same_fields(sim_engine, vllm_engine, path, body):
    def shape(value):
        if isinstance(value, dict):
            return {key: shape(item) for key, item in value.items()}
        if isinstance(value, list):
            return [shape(item) for item in value[:1]]
        return type(value).__name__ if value is not None else None

    replies = [
        httpx.post(
            f"{e.url}{path}", json={"model": MODEL_NAME, "ignore_eos": True, **body}, timeout=60
        ).json()
        for e in (sim_engine, vllm_engine)
    ]
    sim, real = (shape(reply) for reply in replies)
    assert set(sim) == set(real)
    assert set(sim["choices"][0]) == set(real["choices"][0])
    assert set(sim["usage"]) == set(real["usage"])
