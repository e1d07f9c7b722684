"""One set of checks run against the simulator and against real vLLM (CPU build, tiny dummy-weight model).

What the router relies on must be the same on both: response shapes, streaming with usage, cached-token
accounting, /tokenize counts, metric names, KV events (shapes, order and block hashes), and tool calling: the
refusal without a tool-call parser, and with one (the shared engines have Hermes') the tool calls themselves, as
the official OpenAI and Anthropic SDKs read them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from .engines import (
    BOTH_ENGINES,
    ENGINE_PYTHON,
    MODEL_DIR,
    MODEL_NAME,
    ROOT,
    EventSubscriber,
    events_of,
    start_engine,
)

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


def test_n_choices_share_the_prompt_and_add_up_their_output(engine):
    """`n` choices: the prompt counts once, the output of every choice adds up, and each choice ends on its own.
    On a fresh prompt the second choice finds the first's whole blocks cached, and that is what is reported."""
    prompt = [t + 7 for t in PROMPT_IDS]  # unlike any other test's prompt
    with engine.client() as client:
        body = client.post(
            "/v1/completions",
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "ignore_eos": True, "n": 2},
        ).json()
    assert [(c["index"], c["finish_reason"]) for c in body["choices"]] == [(0, "length"), (1, "length")]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), 6)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 3 * 128


def test_n_choices_stream_each_with_its_own_running_usage(engine):
    request = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Write a sorting function, twice."}],
        "max_tokens": 3,
        "ignore_eos": True,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with engine.client() as client, client.stream("POST", "/v1/chat/completions", json=request) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [c for c in events[:-1] if c["choices"]]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    for index in (0, 1):
        own = [c for c in chunks if c["choices"][0]["index"] == index]
        counts = [c["usage"]["completion_tokens"] for c in own]
        # Its own count, not the sum (vLLM may fold two of a choice's tokens into one chunk).
        assert counts[0] == 0 and counts[-1] == 3 and counts == sorted(set(counts))
        assert own[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6
    with engine.client() as client:
        refused = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "n": 0})
    assert refused.status_code == 400


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


@pytest.mark.vllm
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


@pytest.mark.vllm
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


@pytest.mark.vllm
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "x = 1", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ],
)
def test_the_two_engines_answer_with_the_same_fields(sim_engine, vllm_engine, path, body):
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


# --- tool calling -----------------------------------------------------------------------------------------
# Real vLLM with random weights calls a tool only when tool_choice forces one: its grammar then writes the call,
# with as much whitespace as the sampled tokens like between the JSON's tokens. One enum property and a single
# call (parallel tool calls off) keep the call short (40 to 220 tokens seen); max_tokens leaves room to spare,
# and a seed makes OpenAI requests repeatable (Anthropic's API has none).
UNITS = ["celsius", "fahrenheit"]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"unit": {"type": "string", "enum": UNITS}},
    "required": ["unit"],
    "additionalProperties": False,
}
OPENAI_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather where the user is.",
        "parameters": WEATHER_SCHEMA,
        "strict": True,
    },
}
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "The weather where the user is.",
    "input_schema": WEATHER_SCHEMA,
    "strict": True,
}
QUESTION = [{"role": "user", "content": "What is the weather like?"}]
FORCED = {"max_tokens": 2000, "seed": 1, "parallel_tool_calls": False}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
OPENAI_CHOICES = {"required": "required", "named": NAMED}
ANTHROPIC_CHOICES = {
    "any": {"type": "any", "disable_parallel_tool_use": True},
    "tool": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
}
AUTO_REFUSAL = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
REQUIRED_REFUSAL = 'tool_choice="required" requires --tool-call-parser to be set'
NAMED_REFUSAL = 'tool_choice=function "get_weather" requires --tool-call-parser to be set'
# A finished tool conversation: the call, its result, and the question it answers.
OPENAI_HISTORY = [
    *QUESTION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
]
ANTHROPIC_HISTORY = [
    *QUESTION,
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"unit": "celsius"}},
        ],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 degrees and sunny"}],
    },
]


def openai_sdk(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0, timeout=120)


def anthropic_sdk(engine) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=engine.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(params=BOTH_ENGINES)
def engine_without_parser(request):
    """An engine of each kind started without a tool-call parser; vLLM's, a minute of start-up, only for the one
    test that needs it."""
    engine = start_engine(request.param, events=False, tool_parser=False)
    yield engine
    engine.stop()


def test_without_a_tool_parser_tools_are_refused_as_vllm_refuses_them(engine_without_parser):
    engine = engine_without_parser
    tools = {"tools": [OPENAI_TOOL]}
    cases = [
        ({}, AUTO_REFUSAL),  # tools without a tool_choice mean "auto"
        ({"tool_choice": "auto", "stream": True}, AUTO_REFUSAL),
        ({"tool_choice": "required"}, REQUIRED_REFUSAL),
        ({"tool_choice": NAMED}, NAMED_REFUSAL),
    ]
    with engine.client() as client:
        for extra, message in cases:
            body = {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 2, **tools, **extra}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 400, extra
            assert response.json() == {
                "error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            }, extra
        none = {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 2, **tools, "tool_choice": "none"}
        assert client.post("/v1/chat/completions", json=none).status_code == 200

        anthropic_cases = [
            ({}, AUTO_REFUSAL),
            ({"stream": True}, AUTO_REFUSAL),
            ({"tool_choice": {"type": "any"}}, REQUIRED_REFUSAL),
            ({"tool_choice": {"type": "tool", "name": "get_weather"}}, NAMED_REFUSAL),
        ]
        for extra, message in anthropic_cases:
            body = {
                "model": MODEL_NAME,
                "messages": QUESTION,
                "max_tokens": 2,
                "tools": [ANTHROPIC_TOOL],
                **extra,
            }
            response = client.post("/v1/messages", json=body)
            assert response.status_code == 400, extra
            assert response.json() == {
                "type": "error",
                "error": {"type": "BadRequestError", "message": message},
            }
        counted = client.post(
            "/v1/messages/count_tokens",
            json={"model": MODEL_NAME, "messages": QUESTION, "tools": [ANTHROPIC_TOOL]},
        )
        assert counted.status_code == 400 and counted.json()["error"]["message"] == AUTO_REFUSAL

    with pytest.raises(openai.BadRequestError) as caught:
        openai_sdk(engine).chat.completions.create(
            model=MODEL_NAME, messages=QUESTION, tools=[OPENAI_TOOL], max_tokens=2
        )
    assert caught.value.status_code == 400 and AUTO_REFUSAL in caught.value.message
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_sdk(engine).messages.create(
            model=MODEL_NAME, messages=QUESTION, tools=[ANTHROPIC_TOOL], max_tokens=2
        )
    assert caught.value.body["error"] == {"type": "BadRequestError", "message": AUTO_REFUSAL}


@pytest.mark.parametrize("kind", BOTH_ENGINES)
def test_auto_tool_choice_without_a_parser_fails_at_start_up(kind):
    argv = (
        [sys.executable, "-m", "simulator"]
        if kind == "sim"
        else [str(ENGINE_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
    )
    ran = subprocess.run(
        [*argv, "--model", str(MODEL_DIR), "--load-format", "dummy", "--enable-auto-tool-choice"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    assert ran.returncode == 1
    last = ran.stderr.strip().splitlines()[-1]
    assert last == "TypeError: Error: --enable-auto-tool-choice requires --tool-call-parser"


# vLLM's refusal of a context longer than the model's, in its model config's validation error. The derived length
# is a float where a RoPE factor applies (1.0 for default RoPE, which a config with rope_theta has).
LONGER_THAN_THE_MODEL = re.compile(
    r"Value error, User-specified max_model_len \(1048576\) is greater than the derived max_model_len "
    r"\(max_position_embeddings=262144(\.0)? or model_max_length=None in model's config\.json\)\. "
    r"To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1\. "
)


@pytest.mark.parametrize("kind", BOTH_ENGINES)
def test_a_max_model_len_beyond_the_model_fails_at_start_up(kind):
    argv = (
        [sys.executable, "-m", "simulator"]
        if kind == "sim"
        else [str(ENGINE_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
    )
    env = {key: value for key, value in os.environ.items() if key != "VLLM_ALLOW_LONG_MAX_MODEL_LEN"}
    ran = subprocess.run(
        [*argv, "--model", str(MODEL_DIR), "--load-format", "dummy", "--max-model-len", "1048576"],
        capture_output=True,
        text=True,
        timeout=60 if kind == "sim" else 300,
        cwd=ROOT,
        env={**env, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert ran.returncode == 1
    assert "1 validation error for ModelConfig" in ran.stderr
    assert LONGER_THAN_THE_MODEL.search(ran.stderr), ran.stderr[-3000:]


@pytest.mark.parametrize("choice", OPENAI_CHOICES)
def test_a_forced_tool_call_reaches_the_openai_sdk(engine, choice):
    reply = openai_sdk(engine).chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=[OPENAI_TOOL], tool_choice=OPENAI_CHOICES[choice], **FORCED
    )
    (answer,) = reply.choices
    # As OpenAI's API: "tool_calls" when the model chose to call ("required"), "stop" for a named function.
    assert answer.finish_reason == ("tool_calls" if choice == "required" else "stop")
    assert answer.message.role == "assistant" and answer.message.content == ""
    (call,) = answer.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict) and set(arguments) == {"unit"} and arguments["unit"] in UNITS
    assert reply.id.startswith("chatcmpl-")
    usage = reply.usage
    assert (
        usage.completion_tokens > 10 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    )


@pytest.mark.parametrize("choice", OPENAI_CHOICES)
def test_a_forced_tool_call_streams_to_the_openai_sdk(engine, choice):
    stream = openai_sdk(engine).chat.completions.create(
        model=MODEL_NAME,
        messages=QUESTION,
        tools=[OPENAI_TOOL],
        tool_choice=OPENAI_CHOICES[choice],
        stream=True,
        stream_options={"include_usage": True},
        **FORCED,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    first = deltas[0]
    assert first.index == 0 and first.type == "function" and first.id.startswith("chatcmpl-tool-")
    assert first.function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    arguments = json.loads("".join(d.function.arguments or "" for d in deltas))
    assert isinstance(arguments, dict) and set(arguments) == {"unit"} and arguments["unit"] in UNITS
    finishing = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finishing[-1] == ("tool_calls" if choice == "required" else "stop")
    assert all(reason is None for reason in finishing[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 10


@pytest.mark.parametrize("choice", ANTHROPIC_CHOICES)
def test_a_forced_tool_call_reaches_the_anthropic_sdk(engine, choice):
    client = anthropic_sdk(engine)
    request = {"model": MODEL_NAME, "messages": QUESTION, "tools": [ANTHROPIC_TOOL]}
    message = client.messages.create(max_tokens=2000, tool_choice=ANTHROPIC_CHOICES[choice], **request)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("chatcmpl-")
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("chatcmpl-tool-")
    assert isinstance(block.input, dict) and set(block.input) == {"unit"} and block.input["unit"] in UNITS
    # The prompt is split into uncached input, cache writes and cache reads; together they are all of it.
    usage = message.usage
    prompt = client.messages.count_tokens(tool_choice=ANTHROPIC_CHOICES[choice], **request).input_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == prompt
    assert usage.output_tokens > 10


@pytest.mark.parametrize("choice", ANTHROPIC_CHOICES)
def test_a_forced_tool_call_streams_to_the_anthropic_sdk(engine, choice):
    with anthropic_sdk(engine).messages.stream(
        model=MODEL_NAME,
        max_tokens=2000,
        messages=QUESTION,
        tools=[ANTHROPIC_TOOL],
        tool_choice=ANTHROPIC_CHOICES[choice],
    ) as stream:
        events = list(stream)
        message = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    start = next(event for event in events if event.type == "content_block_start")
    assert start.index == 0 and start.content_block.type == "tool_use"
    assert start.content_block.name == "get_weather" and start.content_block.input == {}
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert partial and all(
        e.delta.type == "input_json_delta" for e in events if e.type == "content_block_delta"
    )
    assert json.loads("".join(partial)) == message.content[0].input
    assert "content_block_stop" in kinds
    delta = next(event for event in events if event.type == "message_delta")
    assert delta.delta.stop_reason == "tool_use" and delta.usage.output_tokens > 10
    (block,) = message.content
    assert block.type == "tool_use" and block.id == start.content_block.id
    assert (
        isinstance(block.input, dict) and block.input["unit"] in UNITS and message.stop_reason == "tool_use"
    )


def test_a_tool_conversation_goes_on_through_both_sdks(engine):
    reply = openai_sdk(engine).chat.completions.create(
        model=MODEL_NAME, messages=OPENAI_HISTORY, tools=[OPENAI_TOOL], max_tokens=3
    )
    assert reply.choices[0].finish_reason == "length" and isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].message.tool_calls is None and reply.usage.completion_tokens == 3
    message = anthropic_sdk(engine).messages.create(
        model=MODEL_NAME, messages=ANTHROPIC_HISTORY, tools=[ANTHROPIC_TOOL], max_tokens=3
    )
    assert message.stop_reason == "max_tokens" and [block.type for block in message.content] == ["text"]
    assert message.usage.output_tokens == 3


def shape(value):
    """A response with its values replaced by their types (lists by their first item's shape)."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value[:1]]
    return type(value).__name__ if value is not None else None


@pytest.mark.vllm
def test_the_two_engines_answer_a_tool_call_with_the_same_fields(sim_engine, vllm_engine):
    chat = {
        "model": MODEL_NAME,
        "messages": QUESTION,
        "tools": [OPENAI_TOOL],
        "tool_choice": "required",
        **FORCED,
    }
    messages = {
        "model": MODEL_NAME,
        "messages": QUESTION,
        "tools": [ANTHROPIC_TOOL],
        "tool_choice": ANTHROPIC_CHOICES["any"],
        "max_tokens": 2000,
    }
    replies = []
    for engine in (sim_engine, vllm_engine):
        with engine.client() as client:
            streamed = client.post("/v1/chat/completions", json={**chat, "stream": True})
            chunks = [
                json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
            ]
            replies.append(
                {
                    "chat": client.post("/v1/chat/completions", json=chat).json(),
                    "messages": client.post("/v1/messages", json=messages).json(),
                    # The role chunk, the call's first delta, one with arguments, and the finishing one.
                    "chunks": [chunks[0], chunks[1], chunks[2], chunks[-1]],
                }
            )
    sim, real = (shape(reply) for reply in replies)
    assert sim == real
    for reply in replies:
        assert reply["chat"]["choices"][0]["message"]["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
        assert reply["messages"]["content"][0]["id"].startswith("chatcmpl-tool-")


@pytest.mark.vllm
def test_the_two_engines_tokenize_a_tool_conversation_alike(sim_engine, vllm_engine):
    body = {"model": MODEL_NAME, "messages": OPENAI_HISTORY, "tools": [OPENAI_TOOL]}
    results = [
        httpx.post(f"{e.url}/tokenize", json=body, timeout=60).json() for e in (sim_engine, vllm_engine)
    ]
    assert results[0]["tokens"] == results[1]["tokens"] and results[0]["count"] > 100
    anthropic_body = {"model": MODEL_NAME, "messages": ANTHROPIC_HISTORY, "tools": [ANTHROPIC_TOOL]}
    counts = [
        httpx.post(f"{e.url}/v1/messages/count_tokens", json=anthropic_body, timeout=60).json()
        for e in (sim_engine, vllm_engine)
    ]
    assert counts[0] == counts[1] and counts[0]["input_tokens"] > 100


# --- cache salts: one tenant's prompts never hit another tenant's cached blocks --------------------------------
def salted_body(path: str, context: str, salt: str | None) -> dict:
    """A request on `path` whose prompt starts with `context` (several 128-token blocks)."""
    messages = [{"role": "system", "content": context}, {"role": "user", "content": "Go on."}]
    body = {
        "/v1/completions": {"prompt": context, "max_tokens": 1},
        "/v1/chat/completions": {"messages": messages, "max_tokens": 1},
        "/v1/messages": {"system": context, "messages": messages[1:], "max_tokens": 1},
        "/v1/responses": {"input": messages, "max_output_tokens": 1},
    }[path]
    return {"model": MODEL_NAME, **body, **({"cache_salt": salt} if salt else {})}


def cached_tokens(path: str, usage: dict) -> int:
    if path == "/v1/messages":
        return usage["cache_read_input_tokens"]
    if path == "/v1/responses":
        return usage["input_tokens_details"]["cached_tokens"]
    return usage["prompt_tokens_details"]["cached_tokens"]


SALTED_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"]


@pytest.mark.parametrize("path", SALTED_ROUTES)
def test_a_cache_salt_keeps_its_prefix_cache_apart(engine, path):
    context = f"Salted {path}. " + "The repository has many modules and a long history. " * 40
    seen = []
    with engine.client() as client:
        for salt in ("tenant-a", "tenant-b", "tenant-a", None, "tenant-b"):
            response = client.post(path, json=salted_body(path, context, salt))
            assert response.status_code == 200, response.text
            seen.append(cached_tokens(path, response.json()["usage"]))
    # Another salt, and no salt, find nothing of the first one's blocks; the same salt finds them all.
    assert seen[0] == seen[1] == seen[3] == 0
    assert seen[2] == seen[4] > 0 and seen[2] % 128 == 0


def test_salted_blocks_are_announced_with_their_salt(engine):
    """vLLM puts the salt in the extra keys of the first block only: later blocks chain from its hash."""
    subscriber = EventSubscriber(engine.events_endpoint)
    prompt = [t + 4 for t in PROMPT_IDS]
    try:
        with engine.client() as client:
            for body in (
                {"prompt": prompt, "cache_salt": "tenant-a"},
                {"prompt": prompt + PROMPT_IDS[:256], "cache_salt": "tenant-a"},
                {"prompt": prompt},
            ):
                client.post("/v1/completions", json={"model": MODEL_NAME, "max_tokens": 1, **body})
        messages = subscriber.messages(
            until=lambda got: sum(e["type"] == "BlockStored" for e in events_of(got)) >= 3
        )
    finally:
        subscriber.close()
    salted, grown, plain = (e for e in events_of(messages) if e["type"] == "BlockStored")
    assert salted["parent_block_hash"] is None and salted["extra_keys"] == [["tenant-a"], None, None]
    assert grown["parent_block_hash"] == salted["block_hashes"][-1] and grown["extra_keys"] == [None] * 2
    assert plain["extra_keys"] == [None] * 3
    assert set(plain["block_hashes"]).isdisjoint(salted["block_hashes"])


@pytest.mark.vllm
def test_the_two_engines_hash_salted_blocks_alike(sim_engine, vllm_engine):
    prompt = [t + 5 for t in PROMPT_IDS]
    hashes = []
    for engine in (sim_engine, vllm_engine):
        subscriber = EventSubscriber(engine.events_endpoint)
        try:
            httpx.post(
                f"{engine.url}/v1/completions",
                json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"},
                timeout=60,
            )
            messages = subscriber.messages(
                until=lambda got: any(e["type"] == "BlockStored" for e in events_of(got))
            )
        finally:
            subscriber.close()
        hashes.append(next(e for e in events_of(messages) if e["type"] == "BlockStored")["block_hashes"])
    assert hashes[0] == hashes[1]


SALT_RULE = (
    "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."
)


@pytest.mark.parametrize(
    "salt, message",
    [
        ("", "Parameter 'cache_salt' must be a non-empty string if provided."),
        (7, "Parameter 'cache_salt' must be a non-empty string if provided."),
        ("tenant/a", SALT_RULE),
        ("x" * 129, SALT_RULE),
    ],
    ids=["empty", "not-a-string", "a-slash", "too-long"],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_it_refuses_a_malformed_cache_salt(engine, path, salt, message):
    with engine.client() as client:
        response = client.post(path, json=salted_body(path, "x", None) | {"cache_salt": salt})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": f"{message} (parameter=cache_salt)",
        "type": "BadRequestError",
        "param": "cache_salt",
        "code": 400,
    }


@pytest.mark.parametrize(
    "salt, kind",
    [("", "string_too_short"), (7, "string_type"), ("x" * 1025, "string_too_long"), ("tenant/a", None)],
    ids=["empty", "not-a-string", "too-long", "a-slash"],
)
def test_the_messages_api_refuses_a_malformed_cache_salt_as_vllm_does(engine, salt, kind):
    """/v1/messages types the salt in its own request model first (plain error shape), then checks it as the
    chat-completions request it becomes (Anthropic's error shape)."""
    with engine.client() as client:
        response = client.post(
            "/v1/messages", json=salted_body("/v1/messages", "x", None) | {"cache_salt": salt}
        )
    assert response.status_code == 400
    body = response.json()
    if kind is None:
        assert body == {
            "type": "error",
            "error": {"type": "BadRequestError", "message": f"{SALT_RULE} (parameter=cache_salt)"},
        }
    else:
        error = body["error"]
        assert error["type"] == "Bad Request" and error["param"] == "body.cache_salt"
        assert error["message"].startswith(
            f"1 validation error:\n  {{'type': '{kind}', 'loc': 'body.cache_salt'"
        )


# --- the Responses API, as the Codex CLI calls it ---------------------------------------------------------------
# Codex streams POST /v1/responses with developer and user messages, function tools beside a namespace of tools and
# a hosted web search, reasoning summaries, store off, encrypted reasoning asked for, a prompt cache key (its
# session) and client metadata. vLLM 0.32 takes all of it (the namespace's functions shown to the model as
# `<namespace>__<name>`, the hosted tool not shown, the rest ignored).
SHELL_SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "array", "items": {"type": "string"}}, "workdir": {"type": "string"}},
    "required": ["command"],
    "additionalProperties": False,
}
CODEX_TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Runs a command.",
        "strict": False,
        "parameters": SHELL_SCHEMA,
    },
    {
        "type": "namespace",
        "name": "mcp__docs",
        "description": "A documentation server.",
        "tools": [
            {
                "type": "function",
                "name": "search",
                "description": "Searches the docs.",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
            }
        ],
    },
    {"type": "web_search"},
]
CODEX_INPUT = [
    {
        "type": "message",
        "role": "developer",
        "content": [
            {"type": "input_text", "text": "<permissions instructions>sandboxed</permissions instructions>"}
        ],
    },
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files here."}]},
]
CODEX_REQUEST = {
    "model": MODEL_NAME,
    "instructions": "You are Codex, a coding agent.",
    "input": CODEX_INPUT,
    "tools": CODEX_TOOLS,
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "019a-codex-session",
    "client_metadata": {"originator": "codex_exec"},
    "max_output_tokens": 8,
    "ignore_eos": True,
}
# A later turn of the same session: reasoning, calls (one to a namespaced tool) and their outputs, an answer.
CODEX_HISTORY = [
    *CODEX_INPUT,
    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "List them."}]},
    {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command": ["ls"]}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
    {
        "type": "function_call",
        "call_id": "call_2",
        "namespace": "mcp__docs",
        "name": "search",
        "arguments": '{"q": "ls"}',
    },
    {"type": "function_call_output", "call_id": "call_2", "output": "no results"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Two files."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks."}]},
]
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather where the user is.",
    "parameters": WEATHER_SCHEMA,
    "strict": True,
}
RESPONSES_CHOICES = {
    "required": ([RESPONSES_TOOL], "required", None),
    "named": ([RESPONSES_TOOL], {"type": "function", "name": "get_weather"}, None),
    # A function inside a namespace, chosen by its own name: vLLM finds it and answers with its namespace.
    "namespaced": (
        [
            {
                "type": "namespace",
                "name": "weather",
                "description": "Weather tools.",
                "tools": [RESPONSES_TOOL],
            }
        ],
        {"type": "function", "name": "get_weather"},
        "weather",
    ),
}
FORCED_RESPONSE = {"max_output_tokens": 2000, "seed": 1, "parallel_tool_calls": False}


def response_events(response: httpx.Response) -> list[dict]:
    """A Responses stream's events, each checked to name itself on its `event:` line as its data does."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            event = json.loads(line[len("data: ") :])
            assert event["type"] == name, line
            events.append(event)
    return events


def check_event_order(events: list[dict]) -> list[dict]:
    """vLLM's order: created, in_progress, then each output item whole (added, its parts and deltas, done) with
    output indexes from 0, then completed; sequence numbers 0, 1, 2, ... The items done, in order."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for event in events[:2]:
        assert event["response"]["status"] == "in_progress" and event["response"]["output"] == []
        assert event["response"]["usage"] is None
    done, at = [], 2
    while at < len(events) - 1:
        added = events[at]
        assert added["type"] == "response.output_item.added" and added["output_index"] == len(done)
        item = added["item"]
        assert item["status"] == "in_progress"
        at += 1
        if item["type"] == "message":
            assert events[at]["type"] == "response.content_part.added" and events[at]["part"]["text"] == ""
            at += 1
            text = ""
            while events[at]["type"] == "response.output_text.delta":
                assert events[at]["item_id"] == item["id"] and events[at]["content_index"] == 0
                text += events[at]["delta"]
                at += 1
            assert [e["type"] for e in events[at : at + 2]] == [
                "response.output_text.done",
                "response.content_part.done",
            ]
            assert events[at]["text"] == events[at + 1]["part"]["text"] == text
            at += 2
        else:
            assert item["type"] == "function_call" and item["arguments"] == ""
            arguments = ""
            while events[at]["type"] == "response.function_call_arguments.delta":
                assert events[at]["item_id"] == item["id"]
                arguments += events[at]["delta"]
                at += 1
            assert events[at]["type"] == "response.function_call_arguments.done"
            assert events[at]["arguments"] == arguments and events[at]["name"] == item["name"]
            at += 1
        finished = events[at]
        assert finished["type"] == "response.output_item.done" and finished["output_index"] == len(done)
        assert finished["item"]["id"] == item["id"] and finished["item"]["status"] == "completed"
        done.append(finished["item"])
        at += 1
    completed = events[-1]["response"]
    assert completed["output"] == done
    return done


def check_usage(usage: dict, max_output: int) -> None:
    assert set(usage) == {
        "input_tokens",
        "input_tokens_details",
        "output_tokens",
        "output_tokens_details",
        "total_tokens",
    }
    assert usage["input_tokens"] > 100 and 0 < usage["output_tokens"] <= max_output
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    cached = usage["input_tokens_details"]["cached_tokens"]
    assert 0 <= cached <= usage["input_tokens"] and cached % 128 == 0
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0


def check_codex_echo(response: dict) -> None:
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["model"] == MODEL_NAME and response["instructions"] == CODEX_REQUEST["instructions"]
    assert response["tool_choice"] == "auto" and response["parallel_tool_calls"] is True
    assert response["reasoning"]["summary"] == "auto" and response["previous_response_id"] is None
    assert [tool["type"] for tool in response["tools"]] == ["function", "namespace", "web_search"]
    assert response["tools"][1]["tools"][0]["name"] == "search"
    # Neither engine finishes within 8 tokens (the simulator's call to `shell` is longer).
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_codex_request_streams_as_vllm_streams_it(engine):
    with (
        engine.client() as client,
        client.stream("POST", "/v1/responses", json={**CODEX_REQUEST, "stream": True}) as response,
    ):
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        events = response_events(response)
    done = check_event_order(events)
    assert all(item["type"] in ("message", "function_call") for item in done)
    completed = events[-1]["response"]
    check_codex_echo(completed)
    assert completed["id"] == events[0]["response"]["id"]
    check_usage(completed["usage"], 8)


def test_a_codex_request_is_answered_whole_without_stream(engine):
    with engine.client() as client:
        response = client.post("/v1/responses", json=CODEX_REQUEST)
    assert response.status_code == 200, response.text
    body = response.json()
    check_codex_echo(body)
    check_usage(body["usage"], 8)
    for item in body["output"]:
        assert item["status"] == "completed" and item["type"] in ("message", "function_call")
        if item["type"] == "message":
            assert item["id"].startswith("msg_") and item["role"] == "assistant"
            assert [part["type"] for part in item["content"]] == ["output_text"]
    # The OpenAI SDK reads it.
    extra = {"client_metadata": CODEX_REQUEST["client_metadata"], "ignore_eos": True}
    known = {k: v for k, v in CODEX_REQUEST.items() if k not in extra}
    parsed = openai_sdk(engine).responses.create(**known, extra_body=extra)
    assert parsed.status == "incomplete" and parsed.usage.input_tokens == body["usage"]["input_tokens"]


@pytest.mark.parametrize("choice", RESPONSES_CHOICES)
def test_a_forced_call_streams_as_function_call_events(engine, choice):
    tools, tool_choice, namespace = RESPONSES_CHOICES[choice]
    request = {
        "model": MODEL_NAME,
        "input": "What is the weather like?",
        "tools": tools,
        "tool_choice": tool_choice,
        "stream": True,
        **FORCED_RESPONSE,
    }
    with (
        engine.client(timeout=300) as client,
        client.stream("POST", "/v1/responses", json=request) as response,
    ):
        assert response.status_code == 200
        events = response_events(response)
    (call,) = check_event_order(events)
    assert call["type"] == "function_call" and call["id"].startswith("fc_")
    assert call["call_id"].startswith("chatcmpl-tool-")
    assert (call["name"], call["namespace"]) == ("get_weather", namespace)
    arguments = json.loads(call["arguments"])
    assert set(arguments) == {"unit"} and arguments["unit"] in UNITS
    completed = events[-1]["response"]
    assert completed["status"] == "completed" and completed["incomplete_details"] is None
    assert completed["usage"]["output_tokens"] > 5


@pytest.mark.parametrize("choice", RESPONSES_CHOICES)
def test_a_forced_call_is_a_function_call_item(engine, choice):
    tools, tool_choice, namespace = RESPONSES_CHOICES[choice]
    request = {
        "model": MODEL_NAME,
        "input": QUESTION,
        "tools": tools,
        "tool_choice": tool_choice,
        **FORCED_RESPONSE,
    }
    with engine.client(timeout=300) as client:
        body = client.post("/v1/responses", json=request).json()
    (call,) = body["output"]
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert (call["name"], call["namespace"]) == ("get_weather", namespace)
    assert json.loads(call["arguments"])["unit"] in UNITS
    # A namespaced function chosen by its own name is echoed by its flat name.
    echoed = tool_choice if namespace is None else {**tool_choice, "name": f"{namespace}__get_weather"}
    assert body["status"] == "completed" and body["tool_choice"] == echoed
    assert body["usage"]["total_tokens"] == body["usage"]["input_tokens"] + body["usage"]["output_tokens"]


@pytest.mark.vllm
def test_the_two_engines_answer_responses_with_the_same_fields(sim_engine, vllm_engine):
    """The Response object and each kind of event have the same fields on both engines (a text answer, and a
    forced call), and the same events come in the same order."""
    text = {**CODEX_REQUEST, "tool_choice": "none", "max_output_tokens": 4}
    call = {"model": MODEL_NAME, "input": QUESTION, "tools": [RESPONSES_TOOL], "tool_choice": "required"}
    call.update(FORCED_RESPONSE)
    replies = []
    for engine in (sim_engine, vllm_engine):
        reply = {}
        with engine.client(timeout=300) as client:
            for name, body in (("text", text), ("call", call)):
                reply[name] = shape(client.post("/v1/responses", json=body).json())
                streamed = client.post("/v1/responses", json={**body, "stream": True})
                events = [
                    json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")
                ]
                kinds = [e["type"] for e in events]
                reply[f"{name} events"] = [k for i, k in enumerate(kinds) if not i or k != kinds[i - 1]]
                reply[f"{name} shapes"] = {e["type"]: shape(e) for e in events}
        replies.append(reply)
    assert replies[0] == replies[1]


@pytest.mark.vllm
@pytest.mark.parametrize("input_items", [CODEX_INPUT, CODEX_HISTORY], ids=["first-turn", "later-turn"])
def test_the_two_engines_render_a_codex_request_alike(sim_engine, vllm_engine, input_items):
    body = {**CODEX_REQUEST, "input": input_items, "tool_choice": "none", "max_output_tokens": 1}
    counts = [
        httpx.post(f"{e.url}/v1/responses", json=body, timeout=120).json()["usage"]["input_tokens"]
        for e in (sim_engine, vllm_engine)
    ]
    assert counts[0] == counts[1] > 100


def validation(problems: list[str], param: str) -> dict:
    count = len(problems)
    message = f"{count} validation error{'s' if count > 1 else ''}:\n" + "\n".join(f"  {p}" for p in problems)
    return {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}}


def refusal(message: str, param: str | None, kind: str = "BadRequestError", code: int = 400) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


INCLUDE_CHOICES = (
    "'code_interpreter_call.outputs', 'computer_call_output.output.image_url', 'file_search_call.results', "
    "'message.input_image.image_url', 'message.output_text.logprobs' or 'reasoning.encrypted_content'"
)
NO_STORE = (
    "This vLLM engine does not support `store=True` and therefore does not support the background mode. To "
    "enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the "
    "vLLM server."
)
NOT_FOUND = refusal("Response with id 'resp_earlier' not found.", "response_id", "invalid_request_error", 404)
RESPONSES_REFUSALS = {
    "no-input": (
        {},
        validation(
            [
                "{'type': 'missing', 'loc': 'body.input', 'msg': 'Field required', 'input': '<dict of 2 items>'}"
            ],
            "body.input",
        ),
    ),
    "input-a-number": (
        {"input": 5},
        validation(
            [
                "{'type': 'string_type', 'loc': 'body.input', 'msg': 'Input should be a valid string', 'input': '5'}",
                "{'type': 'list_type', 'loc': 'body.input', 'msg': 'Input should be a valid list', 'input': '5'}",
            ],
            "body.input",
        ),
    ),
    "no-messages": (
        {"input": []},
        refusal("Cannot apply chat template to an empty conversation. Provide at least one message.", None),
    ),
    "an-unknown-include": (
        {"input": "hi", "include": ["nope"]},
        validation(
            [
                f"{{'type': 'literal_error', 'loc': 'body.include.0', 'msg': \"Input should be {INCLUDE_CHOICES}\", "
                f"'input': 'nope', 'ctx': {{'expected': \"{INCLUDE_CHOICES}\"}}}}"
            ],
            "body.include.0",
        ),
    ),
    # Nothing is stored (vLLM's default), so no earlier response is ever found, with store on or off.
    "previous-response-store-off": (
        {"input": "hi", "previous_response_id": "resp_earlier", "store": False},
        NOT_FOUND,
    ),
    "previous-response-streamed": (
        {"input": "hi", "previous_response_id": "resp_earlier", "stream": True},
        NOT_FOUND,
    ),
    "background-store-off": (
        {"input": "hi", "background": True, "store": False},
        refusal("background can only be used when `store` is true (parameter=background)", "background"),
    ),
    "background": (
        {"input": "hi", "background": True},
        refusal(NO_STORE, "background", "invalid_request_error"),
    ),
    "required-without-tools": (
        {"input": "hi", "tool_choice": "required"},
        refusal(
            "Tool choice 'required' must be specified with 'tools' parameter. (parameter=tool_choice)",
            "tool_choice",
        ),
    ),
    "named-tool-missing": (
        {"input": "hi", "tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
        refusal(
            "Tool choice 'function' not found in 'tools' parameter. (parameter=tool_choice)", "tool_choice"
        ),
    ),
    "custom-tool-grammar": (
        {
            "input": "hi",
            "tools": [
                {
                    "type": "custom",
                    "name": "apply_patch",
                    "format": {"type": "grammar", "syntax": "lark", "definition": "s"},
                }
            ],
        },
        refusal(
            "Custom tools with a grammar format are not supported; only free-form text custom tools are accepted. "
            "(parameter=tools)",
            "tools",
        ),
    ),
    "prompt-template": (
        {"input": "hi", "prompt": {"id": "pmpt_1"}},
        refusal("prompt template is not supported (parameter=prompt)", "prompt"),
    ),
    "encrypted-reasoning": (
        {
            "input": [
                {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
                {"role": "user", "content": "hi"},
            ]
        },
        refusal("Encrypted content is not supported. (parameter=input)", "input"),
    ),
    "max-output-beyond-context": (
        {"input": "hi", "max_output_tokens": 5000},
        refusal(
            "max_output_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output tokens. "
            "(parameter=max_output_tokens, value=5000)",
            "max_output_tokens",
        ),
    ),
    "max-output-zero": (
        {"input": "hi", "max_output_tokens": 0},
        refusal("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens"),
    ),
    "a-malformed-salt": (
        {"input": "hi", "cache_salt": "tenant/a"},
        refusal(f"{SALT_RULE} (parameter=cache_salt)", "cache_salt"),
    ),
}


@pytest.mark.parametrize("case", RESPONSES_REFUSALS)
def test_the_responses_api_refuses_as_vllm_does(engine, case):
    extra, expected = RESPONSES_REFUSALS[case]
    with engine.client() as client:
        response = client.post("/v1/responses", json={"model": MODEL_NAME, **extra})
    assert (response.status_code, response.json()) == (expected["error"]["code"], expected)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"input": [{"type": "nope"}]}, "body.input"),
        ({"input": "hi", "tools": [{"type": "nope"}]}, "body.tools.0"),
        ({"input": "hi", "tools": [RESPONSES_TOOL], "tool_choice": "sometimes"}, "body.tool_choice"),
        ({"input": "hi", "temperature": "hot"}, "body.temperature"),
    ],
    ids=["an-unknown-item", "an-unknown-tool", "an-unknown-tool-choice", "a-temperature-not-a-number"],
)
def test_the_responses_api_refuses_malformed_fields_in_pydantics_shape(engine, extra, param):
    with engine.client() as client:
        response = client.post("/v1/responses", json={"model": MODEL_NAME, **extra})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "Bad Request" and error["param"].startswith(param) and error["code"] == 400
    assert "validation error" in error["message"]


def test_the_responses_api_refuses_what_does_not_fit_or_is_not_stored(engine):
    with engine.client() as client:
        long = client.post(
            "/v1/responses", json={"model": MODEL_NAME, "input": "hello " * 5000, "max_output_tokens": 1}
        )
        unknown = client.post("/v1/responses", json={"model": "nope", "input": "hi"})
        stored = client.get("/v1/responses/resp_earlier")
    assert long.status_code == 400 and long.json()["error"]["param"] == "input_tokens"
    assert "maximum context length is 4096 tokens" in long.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"
    assert (stored.status_code, stored.json()) == (404, NOT_FOUND)


# --- /v1/messages as Claude Code calls it ------------------------------------------------------------------------
# Claude Code streams POST /v1/messages?beta=true with beta headers, adaptive thinking with its display omitted,
# context management, an effort, and a user id that is a JSON string holding its session. vLLM 0.32 takes them
# (context_management it ignores; adaptive thinking pins nothing; the effort becomes the reasoning effort).
CLAUDE_CODE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,context-management-2025-06-27,interleaved-thinking-2025-05-14",
    "x-app": "cli",
    "X-Claude-Code-Session-Id": "5f1c-session",
}
CLAUDE_CODE_REQUEST = {
    "model": MODEL_NAME,
    "max_tokens": 3,
    "system": [
        {
            "type": "text",
            "text": "You are Claude Code, a coding agent.",
            "cache_control": {"type": "ephemeral"},
        }
    ],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Fix the bug in utils.py."}]}],
    "tools": [ANTHROPIC_TOOL],
    "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "metadata": {
        "user_id": json.dumps({"device_id": "d1", "account_uuid": "", "session_id": "5f1c-session"})
    },
}


def test_claude_codes_fields_are_taken_as_vllm_takes_them(engine):
    with engine.client() as client:
        whole = client.post("/v1/messages?beta=true", json=CLAUDE_CODE_REQUEST, headers=CLAUDE_CODE_HEADERS)
        streamed = client.post(
            "/v1/messages?beta=true",
            json={**CLAUDE_CODE_REQUEST, "stream": True},
            headers=CLAUDE_CODE_HEADERS,
        )
        counted = client.post(
            "/v1/messages/count_tokens?beta=true",
            json={k: v for k, v in CLAUDE_CODE_REQUEST.items() if k != "max_tokens"},
            headers=CLAUDE_CODE_HEADERS,
        )
    assert whole.status_code == streamed.status_code == counted.status_code == 200, whole.text
    message = whole.json()
    assert message["type"] == "message" and message["stop_reason"] == "max_tokens"
    usage = message["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    assert prompt == counted.json()["input_tokens"] > 100 and usage["output_tokens"] == 3
    names = [line[len("event: ") :] for line in streamed.text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]


EFFORTS = "'low', 'medium', 'high', 'xhigh' or 'max'"
DISPLAYS = "'summarized', 'omitted' or 'updates'"
THINKING_TAGS = "'enabled', 'disabled', 'adaptive'"
MESSAGES_REFUSALS = {
    "unknown-thinking": (
        {"thinking": {"type": "bogus"}},
        "body.thinking",
        "{'type': 'union_tag_invalid', 'loc': 'body.thinking', 'msg': \"Input tag 'bogus' found using 'type' does "
        f"not match any of the expected tags: {THINKING_TAGS}\", 'input': '<dict of 1 items>', 'ctx': "
        f"{{'discriminator': \"'type'\", 'tag': 'bogus', 'expected_tags': \"{THINKING_TAGS}\"}}}}",
    ),
    "unknown-display": (
        {"thinking": {"type": "adaptive", "display": "nope"}},
        "body.thinking.adaptive.display",
        f"{{'type': 'literal_error', 'loc': 'body.thinking.adaptive.display', 'msg': \"Input should be {DISPLAYS}\", "
        f"'input': 'nope', 'ctx': {{'expected': \"{DISPLAYS}\"}}}}",
    ),
    "unknown-effort": (
        {"output_config": {"effort": "bogus"}},
        "body.output_config.effort",
        f"{{'type': 'literal_error', 'loc': 'body.output_config.effort', 'msg': \"Input should be {EFFORTS}\", "
        f"'input': 'bogus', 'ctx': {{'expected': \"{EFFORTS}\"}}}}",
    ),
    "small-budget": (
        {"thinking": {"type": "enabled", "budget_tokens": 10}},
        "body.thinking.enabled.budget_tokens",
        "{'type': 'greater_than_equal', 'loc': 'body.thinking.enabled.budget_tokens', 'msg': 'Input should be "
        "greater than or equal to 1024', 'input': '10', 'ctx': {'ge': 1024}}",
    ),
    "budget-over-max-tokens": (
        {"thinking": {"type": "enabled", "budget_tokens": 2000}, "max_tokens": 1500},
        "body",
        "{'type': 'value_error', 'loc': 'body', 'msg': 'Value error, thinking.budget_tokens must be less than "
        "max_tokens', 'input': '<dict of 4 items>', 'ctx': {'error': ValueError('thinking.budget_tokens must be "
        "less than max_tokens')}}",
    ),
    "metadata-a-string": (
        {"metadata": "x"},
        "body.metadata",
        "{'type': 'dict_type', 'loc': 'body.metadata', 'msg': 'Input should be a valid dictionary', 'input': 'x'}",
    ),
    "max-tokens-zero": (
        {"max_tokens": 0},
        "body.max_tokens",
        "{'type': 'value_error', 'loc': 'body.max_tokens', 'msg': 'Value error, max_tokens must be positive', "
        "'input': '0', 'ctx': {'error': ValueError('max_tokens must be positive')}}",
    ),
}


@pytest.mark.parametrize("case", MESSAGES_REFUSALS)
def test_the_messages_api_refuses_malformed_claude_code_fields_as_vllm_does(engine, case):
    extra, param, problem = MESSAGES_REFUSALS[case]
    body = {"model": MODEL_NAME, "max_tokens": 3, "messages": QUESTION, **extra}
    with engine.client() as client:
        response = client.post("/v1/messages?beta=true", json=body, headers=CLAUDE_CODE_HEADERS)
    assert (response.status_code, response.json()) == (400, validation([problem], param))


# --- typed fields, read as vLLM's pydantic request models read them ---------------------------------------------
# Lax mode: "false", "0", "no" are false and "yes", "1" true; "2", " 2 ", "2.0" and 2.0 are 2; 2.5 and anything else
# are refused in pydantic's words. Some checks run first on the raw body (stream options with no truthy stream,
# logprob counts that are not numbers). Each case: its route, its fields, and what vLLM 0.32 answers: the kind of
# answer and its output tokens (None: no usage sent), or the status and error body.
TYPED_BASES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"prompt": "hi", "max_tokens": 3},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/responses": {"input": "hi", "max_output_tokens": 3},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
}
TYPED_FIELDS = {
    "chat-stream-string-false": ("/v1/chat/completions", {"stream": "false"}, ("json", 3)),
    "chat-stream-string-no": ("/v1/chat/completions", {"stream": "no"}, ("json", 3)),
    "chat-stream-string-yes": (
        "/v1/chat/completions",
        {"stream": "yes", "stream_options": {"include_usage": True}},
        ("sse", 3),
    ),
    "chat-stream-one": (
        "/v1/chat/completions",
        {"stream": 1, "stream_options": {"include_usage": True}},
        ("sse", 3),
    ),
    "chat-stream-zero": ("/v1/chat/completions", {"stream": 0}, ("json", 3)),
    "chat-stream-string-3": (
        "/v1/chat/completions",
        {"stream": "3"},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'bool_parsing', 'loc': 'body.stream', 'msg': 'Input should be a valid boolean, unable to interpret input', 'input': '3'}",
                    "type": "Bad Request",
                    "param": "body.stream",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-stream-a-fraction": (
        "/v1/chat/completions",
        {"stream": 3.5},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'bool_type', 'loc': 'body.stream', 'msg': 'Input should be a valid boolean', 'input': '3.5'}",
                    "type": "Bad Request",
                    "param": "body.stream",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-stream-a-list": (
        "/v1/chat/completions",
        {"stream": []},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'bool_type', 'loc': 'body.stream', 'msg': 'Input should be a valid boolean', 'input': '<list of 0 items>'}",
                    "type": "Bad Request",
                    "param": "body.stream",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-n-a-string": ("/v1/chat/completions", {"n": "2"}, ("json", 6)),
    "chat-n-a-whole-float": ("/v1/chat/completions", {"n": 2.0}, ("json", 6)),
    "chat-n-a-fraction": (
        "/v1/chat/completions",
        {"n": 2.5},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'int_from_float', 'loc': 'body.n', 'msg': 'Input should be a valid integer, got a number with a fractional part', 'input': '2.5'}",
                    "type": "Bad Request",
                    "param": "body.n",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-n-string-zero": (
        "/v1/chat/completions",
        {"n": "0"},
        (
            400,
            {
                "error": {
                    "message": "n must be at least 1, got 0.",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            },
        ),
    ),
    "chat-n-huge": (
        "/v1/chat/completions",
        {"n": 1180591620717411303424},
        (
            400,
            {
                "error": {
                    "message": "n must be at most 16384, got 1180591620717411303424. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable.",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            },
        ),
    ),
    "chat-max-tokens-a-padded-string": ("/v1/chat/completions", {"max_tokens": " 2 "}, ("json", 2)),
    "chat-max-tokens-a-float-string": ("/v1/chat/completions", {"max_tokens": "2.0"}, ("json", 2)),
    "chat-max-tokens-a-fraction": (
        "/v1/chat/completions",
        {"max_tokens": 2.5},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'int_from_float', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, got a number with a fractional part', 'input': '2.5'}",
                    "type": "Bad Request",
                    "param": "body.max_tokens",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-max-tokens-string-zero": (
        "/v1/chat/completions",
        {"max_tokens": "0"},
        (
            400,
            {
                "error": {
                    "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                    "type": "BadRequestError",
                    "param": "max_tokens",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-max-tokens-too-big-a-float": (
        "/v1/chat/completions",
        {"max_tokens": 1e30},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'int_parsing_size', 'loc': 'body.max_tokens', 'msg': 'Unable to parse input string as an integer, exceeded maximum size', 'input': '1e+30'}",
                    "type": "Bad Request",
                    "param": "body.max_tokens",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-max-completion-tokens-zero": (
        "/v1/chat/completions",
        {"max_completion_tokens": 0},
        (
            400,
            {
                "error": {
                    "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                    "type": "BadRequestError",
                    "param": "max_tokens",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-max-completion-tokens-null": ("/v1/chat/completions", {"max_completion_tokens": None}, ("json", 3)),
    "chat-logprobs-string-yes": ("/v1/chat/completions", {"logprobs": "yes"}, ("json", 3)),
    "chat-logprobs-string-3": (
        "/v1/chat/completions",
        {"logprobs": "3"},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'bool_parsing', 'loc': 'body.logprobs', 'msg': 'Input should be a valid boolean, unable to interpret input', 'input': '3'}",
                    "type": "Bad Request",
                    "param": "body.logprobs",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-top-logprobs-a-string": (
        "/v1/chat/completions",
        {"top_logprobs": "3"},
        (
            400,
            {
                "error": {
                    "message": "`top_logprobs` must be an integer. (parameter=top_logprobs, value=3)",
                    "type": "BadRequestError",
                    "param": "top_logprobs",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-top-logprobs-without-logprobs": (
        "/v1/chat/completions",
        {"top_logprobs": 3.5},
        (
            400,
            {
                "error": {
                    "message": "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)",
                    "type": "BadRequestError",
                    "param": "top_logprobs",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-top-logprobs-over-the-limit": (
        "/v1/chat/completions",
        {"top_logprobs": 21, "logprobs": True},
        (
            400,
            {
                "error": {
                    "message": "Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)",
                    "type": "BadRequestError",
                    "param": "logprobs",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-prompt-logprobs-a-fraction": (
        "/v1/chat/completions",
        {"prompt_logprobs": 3.5},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'int_from_float', 'loc': 'body.prompt_logprobs', 'msg': 'Input should be a valid integer, got a number with a fractional part', 'input': '3.5'}",
                    "type": "Bad Request",
                    "param": "body.prompt_logprobs",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-prompt-logprobs-all": (
        "/v1/chat/completions",
        {"prompt_logprobs": -1},
        (
            400,
            {
                "error": {
                    "message": "Requested prompt logprobs of 32768, which is greater than max allowed: 20 (parameter=prompt_logprobs, value=32768)",
                    "type": "BadRequestError",
                    "param": "prompt_logprobs",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-prompt-logprobs-on-a-stream": (
        "/v1/chat/completions",
        {"prompt_logprobs": 1, "stream": True},
        (
            400,
            {
                "error": {
                    "message": "`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)",
                    "type": "BadRequestError",
                    "param": "prompt_logprobs",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-echo-null": (
        "/v1/chat/completions",
        {"echo": None},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'bool_type', 'loc': 'body.echo', 'msg': 'Input should be a valid boolean', 'input': 'None'}",
                    "type": "Bad Request",
                    "param": "body.echo",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-stream-options-without-stream": (
        "/v1/chat/completions",
        {"stream_options": {"include_usage": True}},
        (
            400,
            {
                "error": {
                    "message": "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
                    "type": "BadRequestError",
                    "param": "stream_options",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-stream-options-a-string": (
        "/v1/chat/completions",
        {"stream_options": "yes", "stream": True},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body.stream_options', 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': 'yes'}",
                    "type": "Bad Request",
                    "param": "body.stream_options",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-stream-options-an-empty-string": (
        "/v1/chat/completions",
        {"stream_options": ""},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body.stream_options', 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': ''}",
                    "type": "Bad Request",
                    "param": "body.stream_options",
                    "code": 400,
                }
            },
        ),
    ),
    "chat-stream-options-string-false-stream": (
        "/v1/chat/completions",
        {"stream_options": {"include_usage": True}, "stream": "false"},
        ("json", 3),
    ),
    "chat-include-usage-string-false": (
        "/v1/chat/completions",
        {"stream_options": {"include_usage": "false"}, "stream": True},
        ("sse", None),
    ),
    "chat-include-usage-a-fraction": (
        "/v1/chat/completions",
        {"stream_options": {"include_usage": 1.5}, "stream": True},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'bool_type', 'loc': 'body.stream_options.include_usage', 'msg': 'Input should be a valid boolean', 'input': '1.5'}",
                    "type": "Bad Request",
                    "param": "body.stream_options.include_usage",
                    "code": 400,
                }
            },
        ),
    ),
    "completion-stream-string-0": ("/v1/completions", {"stream": "0"}, ("json", 3)),
    "completion-n-null": (
        "/v1/completions",
        {"n": None},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'int_type', 'loc': 'body.n', 'msg': 'Input should be a valid integer', 'input': 'None'}",
                    "type": "Bad Request",
                    "param": "body.n",
                    "code": 400,
                }
            },
        ),
    ),
    "completion-n-a-string": ("/v1/completions", {"n": "2"}, ("json", 6)),
    "completion-max-tokens-null": ("/v1/completions", {"max_tokens": None}, ("json", 16)),
    "completion-max-tokens-a-string": ("/v1/completions", {"max_tokens": "2"}, ("json", 2)),
    "completion-logprobs-a-string": (
        "/v1/completions",
        {"logprobs": "3"},
        (
            400,
            {
                "error": {
                    "message": "`logprobs` must be an integer. (parameter=logprobs, value=3)",
                    "type": "BadRequestError",
                    "param": "logprobs",
                    "code": 400,
                }
            },
        ),
    ),
    "completion-logprobs-negative": (
        "/v1/completions",
        {"logprobs": -2},
        (
            400,
            {
                "error": {
                    "message": "`logprobs` must be a positive value or -1. (parameter=logprobs, value=-2)",
                    "type": "BadRequestError",
                    "param": "logprobs",
                    "code": 400,
                }
            },
        ),
    ),
    "completion-logprobs-over-the-limit": (
        "/v1/completions",
        {"logprobs": 21},
        (
            400,
            {
                "error": {
                    "message": "Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)",
                    "type": "BadRequestError",
                    "param": "logprobs",
                    "code": 400,
                }
            },
        ),
    ),
    "completion-echo-a-fraction": (
        "/v1/completions",
        {"echo": 0.5},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'bool_type', 'loc': 'body.echo', 'msg': 'Input should be a valid boolean', 'input': '0.5'}",
                    "type": "Bad Request",
                    "param": "body.echo",
                    "code": 400,
                }
            },
        ),
    ),
    "completion-include-usage-string-yes": (
        "/v1/completions",
        {"stream": "true", "stream_options": {"include_usage": "yes"}},
        ("sse", 3),
    ),
    "messages-stream-string-false": ("/v1/messages", {"stream": "false"}, ("json", 3)),
    "messages-stream-string-yes": ("/v1/messages", {"stream": "yes"}, ("sse", 3)),
    "messages-stream-a-fraction": (
        "/v1/messages",
        {"stream": 0.5},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'bool_type', 'loc': 'body.stream', 'msg': 'Input should be a valid boolean', 'input': '0.5'}",
                    "type": "Bad Request",
                    "param": "body.stream",
                    "code": 400,
                }
            },
        ),
    ),
    "messages-max-tokens-a-string": ("/v1/messages", {"max_tokens": "2"}, ("json", 2)),
    "messages-max-tokens-a-fraction": (
        "/v1/messages",
        {"max_tokens": 2.5},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'int_from_float', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, got a number with a fractional part', 'input': '2.5'}",
                    "type": "Bad Request",
                    "param": "body.max_tokens",
                    "code": 400,
                }
            },
        ),
    ),
    "messages-max-tokens-null": (
        "/v1/messages",
        {"max_tokens": None},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'int_type', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer', 'input': 'None'}",
                    "type": "Bad Request",
                    "param": "body.max_tokens",
                    "code": 400,
                }
            },
        ),
    ),
    "messages-max-tokens-string-zero": (
        "/v1/messages",
        {"max_tokens": "0"},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'value_error', 'loc': 'body.max_tokens', 'msg': 'Value error, max_tokens must be positive', 'input': '0', 'ctx': {'error': ValueError('max_tokens must be positive')}}",
                    "type": "Bad Request",
                    "param": "body.max_tokens",
                    "code": 400,
                }
            },
        ),
    ),
    "responses-stream-string-false": ("/v1/responses", {"stream": "false"}, ("json", 3)),
    "responses-stream-one": ("/v1/responses", {"stream": 1}, ("sse", 3)),
    "responses-stream-an-object": (
        "/v1/responses",
        {"stream": {"on": True}},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'bool_type', 'loc': 'body.stream', 'msg': 'Input should be a valid boolean', 'input': '<dict of 1 items>'}",
                    "type": "Bad Request",
                    "param": "body.stream",
                    "code": 400,
                }
            },
        ),
    ),
    "responses-max-output-tokens-a-string": ("/v1/responses", {"max_output_tokens": "2"}, ("json", 2)),
    "responses-max-output-tokens-a-fraction": (
        "/v1/responses",
        {"max_output_tokens": 2.5},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'int_from_float', 'loc': 'body.max_output_tokens', 'msg': 'Input should be a valid integer, got a number with a fractional part', 'input': '2.5'}",
                    "type": "Bad Request",
                    "param": "body.max_output_tokens",
                    "code": 400,
                }
            },
        ),
    ),
    "responses-top-logprobs-a-word": (
        "/v1/responses",
        {"top_logprobs": "many"},
        (
            400,
            {
                "error": {
                    "message": "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.top_logprobs', 'msg': 'Input should be a valid integer, unable to parse string as an integer', 'input': 'many'}",
                    "type": "Bad Request",
                    "param": "body.top_logprobs",
                    "code": 400,
                }
            },
        ),
    ),
    "count-tokens-ignores-stream-and-max-tokens": (
        "/v1/messages/count_tokens",
        {"stream": "maybe", "max_tokens": 2.5},
        ("json", None),
    ),
}


def answered_output(reply: httpx.Response) -> tuple[str, int | None]:
    """("sse" or "json", the output tokens of the answer's last usage, None when it has none)."""
    if "text/event-stream" not in reply.headers["content-type"]:
        usage = reply.json().get("usage")
        found = "json"
    else:
        usage, found = None, "sse"
        for line in reply.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[len("data: ") :])
                usage = data.get("usage") or (data.get("response") or {}).get("usage") or usage
    if usage is None:
        return found, None
    return found, usage.get("completion_tokens", usage.get("output_tokens"))


@pytest.mark.parametrize("case", TYPED_FIELDS)
def test_typed_fields_are_read_as_vllms_request_models_read_them(engine, case):
    path, extra, expected = TYPED_FIELDS[case]
    body = {"model": MODEL_NAME, **TYPED_BASES[path], **extra}
    with engine.client() as client:
        reply = client.post(path, json=body)
    if isinstance(expected[0], int):
        assert (reply.status_code, reply.json()) == expected
    elif path == "/v1/messages/count_tokens":
        assert reply.status_code == 200 and reply.json()["input_tokens"] > 0
    else:
        assert reply.status_code == 200, reply.text
        assert answered_output(reply) == expected
