"""One request, read one way: the fields the router acts on must be of their public JSON type, and what the engine
sends decides how its answer is relayed and billed.

vLLM's pydantic models read `"stream": "false"` (or "0", "no") as false; a router reading the same value by
Python truthiness relayed a whole answer as a stream it never parsed and billed it nothing. Now such a value is a
400 on every route, before any engine or quota is touched; and an engine's JSON answer to a request taken for a
stream is read and billed as the answer it is.
"""

from __future__ import annotations

import httpx
import pytest
from aiohttp import web

from ..serving.engines import MODEL_NAME
from .conftest import make_fleet
from .test_engine_errors import HostileEngine
from .usage import usage_events

ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/responses": {"input": "hi", "max_output_tokens": 16},
}


def post(fleet, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        f"{fleet.router.url}{path}",
        headers={"authorization": f"Bearer {fleet.key.secret}"},
        json={"model": MODEL_NAME, **body},
        timeout=60,
    )


def error_of(reply: httpx.Response) -> dict:
    body = reply.json()
    return body["error"]


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_stream_flag_that_is_not_a_boolean_is_refused_on_every_route(fleet, path):
    for value in ["false", "0", "no", "true", 0, 1, [], {}]:
        reply = post(fleet, path, {**ROUTES[path], "stream": value})
        assert reply.status_code == 400, (value, reply.text)
        error = error_of(reply)
        assert "`stream` must be a JSON boolean" in error["message"]
        if path != "/v1/messages":
            assert error["param"] == "stream"
    # Nothing reached an engine, nothing billed.
    assert not [e for e in usage_events(timeout=0) if e.api_key_id == fleet.key.api_key.id]


MISTYPED = [
    ("/v1/chat/completions", "n", "2"),
    ("/v1/chat/completions", "n", 2.0),
    ("/v1/chat/completions", "max_tokens", "4"),
    ("/v1/chat/completions", "max_completion_tokens", 4.5),
    ("/v1/chat/completions", "logprobs", "true"),
    ("/v1/chat/completions", "logprobs", 1),
    ("/v1/chat/completions", "top_logprobs", "5"),
    ("/v1/chat/completions", "stream_options", {"include_usage": "yes"}),
    ("/v1/chat/completions", "stream_options", {"continuous_usage_stats": 1}),
    ("/v1/completions", "echo", "false"),
    ("/v1/completions", "logprobs", True),
    ("/v1/completions", "prompt_logprobs", "20"),
    ("/v1/responses", "max_output_tokens", "16"),
    ("/v1/messages", "max_tokens", "4"),
]


def test_the_other_fields_the_router_acts_on_must_be_of_their_type(fleet):
    for path, field, value in MISTYPED:
        reply = post(fleet, path, {**ROUTES[path], field: value})
        assert reply.status_code == 400, (field, value, reply.text)
        message = error_of(reply)["message"]
        assert "must be a JSON" in message or "must be a positive integer" in message, message


@pytest.mark.parametrize("path", list(ROUTES))
def test_real_booleans_and_nulls_are_served(fleet, path):
    for stream in (False, None, True):
        reply = post(fleet, path, {**ROUTES[path], "stream": stream})
        assert reply.status_code == 200, reply.text
        assert ("text/event-stream" in reply.headers["content-type"]) is bool(stream)


def test_a_json_answer_to_a_request_taken_for_a_stream_is_billed_as_an_answer(router_process):
    """An engine that answers a stream request with one JSON body (as vLLM does when it reads `stream` as false)
    is relayed as that body and billed its usage, not settled as a stream that carried nothing."""

    async def whole(request):
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1,
                "model": MODEL_NAME,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "Hello"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1500, "completion_tokens": 700, "total_tokens": 2200},
            }
        )

    engine = HostileEngine({"/v1/chat/completions": whole})
    fleet = make_fleet(router_process, [engine])
    reply = post(fleet, "/v1/chat/completions", {**ROUTES["/v1/chat/completions"], "stream": True})
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "Hello"
    (event,) = usage_events([reply.headers["x-request-id"]], wait_for=1)
    assert (event.prompt_tokens, event.output_tokens, event.status) == (1500, 700, "completed")


@pytest.mark.vllm
def test_vllm_reads_the_string_false_as_false_and_the_router_refuses_it(router_process, vllm_engine):
    """The hole, on the real engine: vLLM answers `"stream": "false"` with one JSON body. Through the router the
    same request is a 400, so no answer leaves unbilled."""
    body = {"model": MODEL_NAME, **ROUTES["/v1/chat/completions"], "stream": "false"}
    direct = httpx.post(f"{vllm_engine.url}/v1/chat/completions", json=body, timeout=120)
    assert direct.status_code == 200 and "application/json" in direct.headers["content-type"]
    assert direct.json()["usage"]["completion_tokens"] > 0
    fleet = make_fleet(router_process, [vllm_engine])
    reply = post(fleet, "/v1/chat/completions", {**ROUTES["/v1/chat/completions"], "stream": "false"})
    assert reply.status_code == 400 and error_of(reply)["param"] == "stream"
