"""The simulator's own behaviour: bounded KV with eviction, a waiting queue, a latency model where a cache hit
shows in time to first token, deterministic output, client aborts, and NIXL-style prefill/decode hand-off."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from .engines import MODEL_DIR, MODEL_NAME, ROOT, EventSubscriber, events_of, start_engine


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
                    json={"model": MODEL_NAME, "prompt": [salt + 100] * 10, "max_tokens": 16},
                )
                return time.monotonic() - start

            tasks = [asyncio.create_task(one(i)) for i in range(3)]
            # Until all three have arrived (the engine's own gauges say so), however busy the host; the first
            # takes 0.75 s of decode, so the other two are still waiting then.
            deadline = time.monotonic() + 10
            while True:
                metrics = await asyncio.to_thread(slow_engine.metrics)
                running, waiting = metrics["vllm:num_requests_running"], metrics["vllm:num_requests_waiting"]
                if running + waiting == 3 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            return waiting, running, sorted(await asyncio.gather(*tasks))

    waiting, running, durations = asyncio.run(run())
    assert (running, waiting) == (1, 2)
    # One at a time: each takes ~15 x 50 ms of decode, so the third finishes after about three of them.
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


# --- tool calls: the simulator's own rule (real vLLM with random weights calls tools only when forced) -------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather like?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius"}}\n</tool_call>'


def chat(engine, **body) -> dict:
    response = httpx.post(f"{engine.url}/v1/chat/completions", json={"model": MODEL_NAME, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_auto_tool_choice_calls_the_first_tool_when_the_user_has_the_last_word(sim_engine):
    reply = chat(sim_engine, messages=ASK, tools=[WEATHER, SEARCH], max_tokens=200)
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"unit": "celsius"}'}

    named = chat(
        sim_engine,
        messages=ASK,
        tools=[WEATHER, SEARCH],
        tool_choice={"type": "function", "function": {"name": "search"}},
        max_tokens=200,
    )["choices"][0]
    assert named["finish_reason"] == "stop" and named["message"]["content"] == ""
    assert named["message"]["tool_calls"][0]["function"] == {
        "name": "search",
        "arguments": '{"query": "example"}',
    }

    answered = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{**call, "type": "function"}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "21 degrees"},
    ]
    for body in (
        {"messages": answered, "tools": [WEATHER]},  # the last word is a tool result: the model answers
        {"messages": ASK, "tools": [WEATHER], "tool_choice": "none"},
    ):
        text = chat(sim_engine, max_tokens=4, **body)["choices"][0]
        assert text["finish_reason"] == "length" and isinstance(text["message"]["content"], str)
        assert "tool_calls" not in text["message"]


@pytest.fixture
def agent_model_engine():
    """The simulated model as the platform starts it for agents (serving.engine_command.simulated_model_args)."""
    engine = start_engine("sim", "--answer-length", "6", "--tool-calls-per-conversation", "2")
    yield engine
    engine.stop()


def test_an_agent_model_ends_its_answers_and_its_tool_loops(agent_model_engine):
    engine = agent_model_engine
    # A sampled answer ends by itself after its length, unless max_tokens cuts it first.
    for max_tokens, finish, count in ((50, "stop", 6), (3, "length", 3)):
        reply = chat(engine, messages=ASK, max_tokens=max_tokens)
        assert reply["choices"][0]["finish_reason"] == finish
        assert reply["usage"]["completion_tokens"] == count
    # A user turn gets a call of the first tool until the conversation holds two calls.
    history = list(ASK)
    for _ in range(2):
        choice = chat(engine, messages=history, tools=[WEATHER, SEARCH], max_tokens=200)["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        history += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "21 degrees"},
            {"role": "user", "content": "And tomorrow?"},
        ]
    done = chat(engine, messages=history, tools=[WEATHER, SEARCH], max_tokens=200)["choices"][0]
    assert done["finish_reason"] == "stop" and "tool_calls" not in done["message"]
    # A named or required choice still calls, whatever the conversation holds.
    forced = chat(engine, messages=history, tools=[WEATHER], tool_choice="required", max_tokens=200)
    assert forced["choices"][0]["message"]["tool_calls"]


def test_tool_arguments_follow_the_tools_schema(sim_engine):
    schema = {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "count": {"type": "integer", "minimum": 3},
            "flag": {"type": "boolean"},
            "mode": {"type": "string", "enum": ["fast", "slow"]},
            "ids": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
            "where": {"$ref": "#/$defs/place"},
            "maybe": {"type": ["null", "number"]},
            "optional": {"type": "string"},
        },
        "required": ["text", "count", "flag", "mode", "ids", "where", "maybe"],
        "$defs": {
            "place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        },
    }
    tool = {"type": "function", "function": {"name": "run", "parameters": schema}}
    call = chat(sim_engine, messages=ASK, tools=[tool], tool_choice="required", max_tokens=500)["choices"][0]
    arguments = json.loads(call["message"]["tool_calls"][0]["function"]["arguments"])
    assert arguments == {
        "text": "example",
        "count": 3,
        "flag": False,
        "mode": "fast",
        "ids": [0, 0],
        "where": {"city": "example"},
        "maybe": 0,
    }


def test_a_tool_calls_tokens_are_its_output_tokens(sim_engine):
    call_tokens = httpx.post(
        f"{sim_engine.url}/tokenize", json={"prompt": CALL_TEXT, "add_special_tokens": False}
    ).json()["count"]
    before = sim_engine.metrics()
    body = {"messages": [{"role": "user", "content": "Weather, please: " + "x " * 200}], "tools": [WEATHER]}
    first = chat(sim_engine, tool_choice="required", max_tokens=500, **body)
    assert first["usage"]["completion_tokens"] == call_tokens + 1  # the call, then the end-of-turn token
    # Streamed, from the cache this time: the same tokens, the prompt's full blocks found again.
    response = httpx.post(
        f"{sim_engine.url}/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "tool_choice": "required",
            "max_tokens": 500,
            "stream": True,
            "stream_options": {"include_usage": True},
            **body,
        },
        timeout=60,
    )
    usage = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")][-1][
        "usage"
    ]
    assert usage["completion_tokens"] == call_tokens + 1
    prompt = usage["prompt_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": prompt // 128 * 128, "created_cache_tokens": 0}
    details = first["usage"]["prompt_tokens_details"]  # the tools' system block may be cached already
    assert details["cached_tokens"] + details["created_cache_tokens"] == prompt // 128 * 128
    after = sim_engine.metrics()
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 2 * (
        call_tokens + 1
    )
    assert 'finished_reason="stop"' in httpx.get(f"{sim_engine.url}/metrics").text


def test_max_tokens_cuts_a_tool_call_short_into_text(sim_engine):
    cut = chat(sim_engine, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=5)["choices"][0]
    assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]
    assert CALL_TEXT.startswith(cut["message"]["content"]) and cut["message"]["content"]
    message = httpx.post(
        f"{sim_engine.url}/v1/messages",
        json={
            "model": MODEL_NAME,
            "max_tokens": 5,
            "messages": ASK,
            "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
            "tool_choice": {"type": "any"},
        },
        timeout=60,
    ).json()
    assert message["stop_reason"] == "max_tokens" and message["content"][0]["type"] == "text"


def test_it_takes_vllms_tool_and_template_flags(tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    engines = [
        start_engine("sim", "--chat-template", str(path), events=False, tool_parser=False),
        start_engine(
            "sim",
            "--chat-template",
            template,
            "--tool-call-parser",
            "hermes",  # without --enable-auto-tool-choice vLLM loads no parser: tools are still refused
            "--reasoning-parser",
            "qwen3",
            events=False,
            tool_parser=False,
        ),
        start_engine("sim", "--exclude-tools-when-tool-choice-none", events=False),
    ]
    try:
        expected = httpx.post(
            f"{engines[0].url}/tokenize", json={"prompt": "[user] hi\n", "add_special_tokens": False}
        ).json()["tokens"]
        for engine in engines[:2]:
            rendered = httpx.post(
                f"{engine.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
            )
            assert rendered.json()["tokens"] == expected
        refused = httpx.post(
            f"{engines[1].url}/v1/chat/completions",
            json={"messages": ASK, "tools": [WEATHER], "max_tokens": 1},
        )
        assert (
            refused.status_code == 400 and "--enable-auto-tool-choice" in refused.json()["error"]["message"]
        )
        counts = {
            choice: chat(engines[2], messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=1)[
                "usage"
            ]["prompt_tokens"]
            for choice in ("none", "required")
        }
        plain = chat(engines[2], messages=ASK, max_tokens=1)["usage"]["prompt_tokens"]
        assert counts["none"] == plain < counts["required"]
    finally:
        for engine in engines:
            engine.stop()


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            ["--enable-auto-tool-choice"],
            "TypeError: Error: --enable-auto-tool-choice requires --tool-call-parser",
        ),
        (
            ["--enable-auto-tool-choice", "--tool-call-parser", "hermez"],
            "KeyError: 'invalid tool call parser: hermez (chose from {",
        ),
        (["--reasoning-parser", "qwen4"], "KeyError: 'invalid reasoning parser: qwen4 (chose from {"),
        (["--chat-template", "no/such/template.jinja"], "ValueError: The supplied chat template string"),
    ],
)
def test_it_refuses_to_start_as_vllm_does(flags, error):
    ran = subprocess.run(
        [sys.executable, "-m", "simulator", "--model", str(MODEL_DIR), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert ran.returncode == 1
    assert ran.stderr.strip().splitlines()[-1].startswith(error)


YARN_X4 = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}}


@pytest.mark.parametrize(
    "flags, env",
    [
        (["--hf-overrides", json.dumps(YARN_X4)], {}),  # YaRN makes the model that long
        ([], {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}),  # vLLM's own way round its check, with a warning
    ],
    ids=["yarn", "allowed"],
)
def test_it_starts_beyond_the_models_positions_where_vllm_does(monkeypatch, flags, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    engine = start_engine("sim", "--max-model-len", "1048576", *flags, events=False)
    try:
        (model,) = httpx.get(f"{engine.url}/v1/models", timeout=10).json()["data"]
        assert model["max_model_len"] == 1048576
        warned = "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution" in engine.log()
        assert warned == bool(env)
    finally:
        engine.stop()


def test_a_salted_block_filled_by_output_is_salted_too(sim_engine):
    """A prompt shorter than a block: the first block is completed by generated tokens, and salted as vLLM salts
    every sequence's first block, so another salt's same tokens never hit it."""
    prompt = blocks_prompt(1, 41)[:100]
    subscriber = EventSubscriber(sim_engine.events_endpoint)
    try:
        complete(sim_engine, prompt, max_tokens=40, ignore_eos=True, cache_salt="tenant-a")
        messages = subscriber.messages(
            until=lambda got: any(e["type"] == "BlockStored" for e in events_of(got))
        )
    finally:
        subscriber.close()
    (stored,) = [e for e in events_of(messages) if e["type"] == "BlockStored"]
    assert stored["parent_block_hash"] is None and stored["extra_keys"] == [["tenant-a"]]
    assert stored["token_ids"][:100] == prompt and len(stored["token_ids"]) == 128
    whole = [*stored["token_ids"], 7]  # the prompt and its output, one token further
    for salt, cached in (("tenant-b", 0), ("tenant-a", 128)):
        usage = complete(sim_engine, whole, cache_salt=salt)["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == cached, salt


def test_the_cpu_tier_announces_salted_blocks_without_extra_keys():
    """As vLLM 0.32's offloading connector: its BlockStored events carry no extra keys, so a salted first block
    is known by its engine hash only (the same hash as its GPU copy)."""
    engine = start_engine("sim", "--cpu-offload-blocks", "16")
    subscriber = EventSubscriber(engine.events_endpoint)
    try:
        complete(engine, blocks_prompt(2, 42) + [7], cache_salt="tenant-a")
        messages = subscriber.messages(until=lambda got: len(events_of(got)) >= 2)
    finally:
        subscriber.close()
        engine.stop()
    gpu, cpu = (e for e in events_of(messages) if e["type"] == "BlockStored")
    assert (gpu["medium"], cpu["medium"]) == ("GPU", "CPU")
    assert gpu["extra_keys"] == [["tenant-a"], None] and "extra_keys" not in cpu
    assert cpu["block_hashes"] == gpu["block_hashes"] and cpu["parent_block_hash"] is None


def timed_events(engine, path: str, body: dict) -> tuple[float, list[tuple[float, str]]]:
    """(when the request was sent, each SSE line of the stream with when it arrived), by the client's clock."""
    lines = []
    sent = time.perf_counter()
    with httpx.stream("POST", f"{engine.url}{path}", json={"model": MODEL_NAME, **body}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                lines.append((time.perf_counter(), line))
    return sent, lines


@pytest.fixture
def slow_tool_engine():
    engine = start_engine("sim", "--decode-time", "0.05", "--prefill-overhead", "0.3", events=False)
    yield engine
    engine.stop()


def test_the_first_chunk_comes_with_the_first_token_while_a_tool_call_is_parsed(slow_tool_engine):
    """vLLM's chat stream yields the role chunk on its first output, before the tool-call parser has a name to
    send (chat_completion/serving.py, `first_iteration`), and its Messages stream sends message_start with that
    chunk and a content block only once the call's name is parsed. A client's time to its first chunk, and the
    router's first-token deadline, see the first token, not the parsed call; on /v1/messages the first content
    block comes later."""
    for path, body, first_kind, content_kind in (
        ("/v1/chat/completions", {"messages": ASK, "stream": True}, '"role":"assistant"', '"tool_calls"'),
        (
            "/v1/messages",
            {"messages": ASK, "stream": True, "max_tokens": 200},
            "message_start",
            "content_block_start",
        ),
    ):
        tools = (
            [WEATHER]
            if path.endswith("completions")
            else [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
        )
        sent, lines = timed_events(slow_tool_engine, path, {**body, "tools": tools})
        first = next(t for t, line in lines if first_kind in line.replace(" ", ""))
        content = next(t for t, line in lines if content_kind in line.replace(" ", ""))
        assert first - sent >= 0.3  # not before the prefill: nothing is sent ahead of the first token
        # The call's name takes several tokens (`<tool_call>`, a newline, `{"name": "get_weather"`), each 50 ms.
        assert content - first >= 0.15, (path, content - first)
