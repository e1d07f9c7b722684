"""Answers the client sizes cannot exhaust the router: prompt logprobs are bounded before the engine is asked, an
engine's whole answer and each event of its stream are bounded as they are read, and usage is read from an answer's
last bytes, not by parsing it whole.

The router runs with small limits (ROUTER_MAX_*), so the answers that cross them stay small enough for a test."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from aiohttp import web

from routing.rendering.dialects import ANTHROPIC, OPENAI, RESPONSES
from routing.server.exchange import UsageFinder

from ..serving.engines import MODEL_NAME
from .conftest import make_fleet, start_router
from .test_engine_errors import HostileEngine
from .test_stream_billing import chunk
from .usage import usage_events

MAX_ANSWER = 256 * 1024
MAX_EVENT = 64 * 1024
MAX_ENTRIES = 4096


@pytest.fixture
def small_router(transactional_db):
    router = start_router(
        {
            "ROUTER_MAX_ANSWER_BYTES": str(MAX_ANSWER),
            "ROUTER_MAX_EVENT_BYTES": str(MAX_EVENT),
            "ROUTER_MAX_PROMPT_LOGPROB_ENTRIES": str(MAX_ENTRIES),
        }
    )
    yield router
    router.stop()


def post(fleet, path: str, body: dict) -> httpx.Response:
    headers = {"authorization": f"Bearer {fleet.key.secret}"}
    return httpx.post(f"{fleet.router.url}{path}", json=body, headers=headers, timeout=60)


PROSE = " ".join(
    ["The build failed because the parser returned a tuple where the caller expected a list."] * 60
)


def test_prompt_logprobs_past_the_limit_are_refused_before_any_engine_is_asked(small_router):
    """A 1,000-word prompt with `prompt_logprobs: 20` (on main before: a 2 MB answer, read and parsed whole)."""
    engine = HostileEngine({})  # any request reaching it would be a 404 and counted
    fleet = make_fleet(small_router, [engine])
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROSE}], "max_tokens": 4}
    refused = post(fleet, "/v1/chat/completions", {**chat, "prompt_logprobs": 20})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "prompt_logprobs" and f"limit of {MAX_ENTRIES}" in error["message"]
    everything = post(fleet, "/v1/chat/completions", {**chat, "prompt_logprobs": -1})
    assert everything.status_code == 400 and "whole vocabulary" in everything.json()["error"]["message"]
    echo = {"model": MODEL_NAME, "prompt": PROSE, "max_tokens": 4, "echo": True, "logprobs": 5}
    refused = post(fleet, "/v1/completions", echo)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"
    assert engine.hits == []


def whole_answer(size: int):
    """An unstreamed chat answer (as vLLM sends prompt logprobs) of about `size` bytes, usage before the prompt
    logprobs, whose token strings include `usage`."""

    async def handler(request):
        logprob = {"17": {"logprob": -1.5, "rank": 1, "decoded_token": '"usage":{"prompt_tokens":1}'}}
        entries = [None] + [logprob] * (size // 90)
        body = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL_NAME,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 640, "completion_tokens": 3, "total_tokens": 643},
            "prompt_logprobs": entries,
        }
        return web.Response(body=json.dumps(body, separators=(",", ":")), content_type="application/json")

    return handler


def test_an_unstreamed_answer_over_the_limit_is_a_502_billed_by_the_engines_usage(small_router):
    engine = HostileEngine({"/v1/chat/completions": whole_answer(4 * MAX_ANSWER)})
    fleet = make_fleet(small_router, [engine])
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    answer = post(fleet, "/v1/chat/completions", {**chat, "prompt_logprobs": 0})
    assert answer.status_code == 502, answer.text[:200]
    assert f"over {MAX_ANSWER} bytes" in answer.json()["error"]["message"]
    (event,) = usage_events([answer.headers["x-request-id"]], wait_for=1)
    assert (event.prompt_tokens, event.output_tokens) == (640, 3)  # read from the answer's end
    assert engine.hits == ["/v1/chat/completions"]  # the engine did the work: not asked of another


def test_an_unstreamed_answer_under_the_limit_is_relayed_and_billed_by_its_usage(small_router):
    engine = HostileEngine({"/v1/chat/completions": whole_answer(MAX_ANSWER // 2)})
    fleet = make_fleet(small_router, [engine])
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    answer = post(fleet, "/v1/chat/completions", {**chat, "prompt_logprobs": 0})
    assert answer.status_code == 200 and len(answer.json()["prompt_logprobs"]) > 1000
    (event,) = usage_events([answer.headers["x-request-id"]], wait_for=1)
    assert (event.status, event.prompt_tokens, event.output_tokens) == ("completed", 640, 3)


async def giant_event(request):
    """Two ordinary chunks, then one event larger than the router's event limit, sent in 4 KB pieces."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chunk("ab", 300, 2) + chunk("cd", 300, 4))
    data = chunk("x" * (2 * MAX_EVENT), 300, 5)
    for start in range(0, len(data), 4096):
        await response.write(data[start : start + 4096])
    await response.write(b"data: [DONE]\n\n")
    return response


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unstreamed"])
def test_a_stream_event_over_the_limit_ends_the_answer_and_bills_it(small_router, stream):
    engine = HostileEngine({"/v1/chat/completions": giant_event})
    fleet = make_fleet(small_router, [engine])
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    answer = post(fleet, "/v1/chat/completions", {**chat, "stream": stream})
    if stream:
        assert answer.status_code == 200 and "more than this gateway relays" in answer.text
        assert answer.text.count('"content":"') == 2  # the two chunks before it reached the client
    else:
        assert (
            answer.status_code == 502 and "more than this gateway relays" in answer.json()["error"]["message"]
        )
    (event,) = usage_events([answer.headers["x-request-id"]], wait_for=1)
    assert (event.status, event.prompt_tokens, event.output_tokens) == ("failed", 300, 4)
    assert engine.hits == ["/v1/chat/completions"]


def in_pieces(size: int):
    """An ordinary stream cut into pieces of `size` bytes, so events and their blank lines straddle pieces."""

    async def handler(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        data = b"".join(
            chunk(word, 40, index + 1) for index, word in enumerate(["Fix", " the", " parser", "."])
        )
        final = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL_NAME}
        final.update(choices=[], usage={"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44})
        data += b"data: " + json.dumps(final, separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"
        for start in range(0, len(data), size):
            await response.write(data[start : start + size])
            await asyncio.sleep(0)
        return response

    return handler


@pytest.mark.parametrize("size", [1, 2, 7, 64])
def test_events_split_anywhere_across_pieces_are_relayed_whole(small_router, size):
    engine = HostileEngine({"/v1/chat/completions": in_pieces(size)})
    fleet = make_fleet(small_router, [engine])
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    streamed = post(fleet, "/v1/chat/completions", {**chat, "stream": True})
    texts = [
        json.loads(line[6:])["choices"][0]["delta"]["content"]
        for line in streamed.text.split("\n\n")
        if line.startswith("data: {") and '"choices":[{' in line
    ]
    assert "".join(texts) == "Fix the parser."
    whole = post(fleet, "/v1/chat/completions", chat)
    assert whole.json()["choices"][0]["message"]["content"] == "Fix the parser."
    assert whole.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("dialect", "body", "expected"),
    [
        (
            OPENAI,
            b'{"choices":[{"text":"\\"usage\\":{\\"prompt_tokens\\":9}"}],"usage":{"prompt_tokens":12,'
            b'"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}},"prompt_logprobs":[null,'
            b'{"5":{"logprob":-1.0,"decoded_token":"usage"}}]}',
            (12, 8, 3),
        ),
        (
            ANTHROPIC,
            b'{"content":[{"type":"text","text":"x"}],"usage":{"input_tokens":5,"output_tokens":2,'
            b'"cache_read_input_tokens":4,"cache_creation_input_tokens":0}}',
            (9, 4, 2),
        ),
        (
            RESPONSES,
            b'{"output":[],"usage":{"input_tokens":7,"input_tokens_details":{"cached_tokens":2,'
            b'"input_tokens_per_turn":[]},"output_tokens":3}}',
            (7, 2, 3),
        ),
        (
            OPENAI,
            b'{"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 2}, "prompt_logprobs": '
            b'[{"3": {"decoded_token": "usage"}}, {"usage": -1.5}]}',
            (6, 0, 2),
        ),
        (OPENAI, b'{"choices":[]}', (0, 0, 0)),
    ],
    ids=["openai-with-prompt-logprobs", "anthropic", "responses", "spaced-json", "no-usage"],
)
def test_usage_is_read_from_an_answers_bytes(dialect, body, expected):
    usage = dialect.usage_from_tail(body)
    assert (usage.prompt_tokens, usage.cached_tokens, usage.output_tokens) == expected
    assert usage.reported is (expected != (0, 0, 0))


@pytest.mark.parametrize("size", [1, 3, 10, 4096])
def test_the_usage_of_an_answer_read_in_pieces_is_found_wherever_the_pieces_cut(size):
    body = (
        b'{"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 2}, "prompt_logprobs": ['
        + b'{"3": {"decoded_token": "usage"}}, {"usage": -1.5}, ' * 200
        + b"null]}"
    )
    finder = UsageFinder()
    for start in range(0, len(body), size):
        finder.feed(body[start : start + size])
    usage = OPENAI.usage_from_tail(finder.found)
    assert (usage.prompt_tokens, usage.output_tokens, usage.reported) == (6, 2, True)
