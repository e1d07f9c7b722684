"""A request's stop sequences are bounded on every route: `stop` on chat and text completions and on Responses,
`stop_sequences` on Anthropic's messages. Past ROUTER_MAX_STOP_SEQUENCES (64) of them, or ROUTER_MAX_STOP_BYTES
(4 KiB, UTF-8) in all, or of another type than strings, the router answers a 400 in the route's dialect before any
engine is asked; at the bound, the request is served. Sent with the official OpenAI and Anthropic SDKs.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from ..serving.engines import MODEL_NAME
from .conftest import make_fleet
from .test_engine_errors import HostileEngine
from .test_sdk_clients import anthropic_client, openai_client

MESSAGES = [{"role": "user", "content": "Fix the failing test."}]
AT_THE_BOUND = [f"{n:02d}" + "x" * 62 for n in range(64)]  # 64 sequences, 4,096 bytes
TOO_MANY = ["x"] * 65
TOO_LONG = ["é" * 2049]  # 2,049 characters, 4,098 bytes


def openai_route(client: openai.OpenAI, route: str, stop) -> object:
    if route == "chat":
        return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, stop=stop)
    if route == "completions":
        return client.completions.create(model=MODEL_NAME, prompt="def f():", max_tokens=4, stop=stop)
    # The Responses API's own clients send no `stop`; vLLM takes it there as an extra.
    return client.responses.create(
        model=MODEL_NAME, input="Fix it.", max_output_tokens=16, extra_body={"stop": stop}
    )


@pytest.fixture
def unreachable_fleet(router_process):
    """A router whose only engine answers nothing and counts what it was asked."""
    engine = HostileEngine()
    return make_fleet(router_process, [engine]), engine


def test_openai_routes_refuse_too_many_or_too_long_stop_sequences(unreachable_fleet):
    fleet, engine = unreachable_fleet
    client = openai_client(fleet)
    for route in ("chat", "completions", "responses"):
        for stop, said in ((TOO_MANY, "holds 65 stop sequences; the limit is 64"), (TOO_LONG, "4098 bytes")):
            with pytest.raises(openai.BadRequestError) as caught:
                openai_route(client, route, stop)
            assert caught.value.status_code == 400, route
            assert said in caught.value.message and caught.value.param == "stop", route
    assert engine.hits == []


def test_anthropic_messages_refuse_too_many_or_too_long_stop_sequences(unreachable_fleet):
    fleet, engine = unreachable_fleet
    client = anthropic_client(fleet)
    for stop, said in ((TOO_MANY, "holds 65 stop sequences; the limit is 64"), (TOO_LONG, "4098 bytes")):
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model=MODEL_NAME, max_tokens=4, messages=MESSAGES, stop_sequences=stop)
        body = caught.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "`stop_sequences`" in body["error"]["message"] and said in body["error"]["message"]
    assert engine.hits == []


MISTYPED = [
    ("/v1/chat/completions", "stop", 5),
    ("/v1/chat/completions", "stop", ["ok", 7]),
    ("/v1/completions", "stop", {"a": "b"}),
    ("/v1/messages", "stop_sequences", "END"),
    ("/v1/responses", "stop", [None]),
]
BODIES = {
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 4},
    "/v1/completions": {"prompt": "def f():", "max_tokens": 4},
    "/v1/messages": {"messages": MESSAGES, "max_tokens": 4},
    "/v1/responses": {"input": "Fix it.", "max_output_tokens": 16},
}


def test_stop_sequences_that_are_not_strings_are_refused(unreachable_fleet):
    fleet, engine = unreachable_fleet
    for path, field, value in MISTYPED:
        reply = httpx.post(
            f"{fleet.router.url}{path}",
            json={"model": MODEL_NAME, **BODIES[path], field: value},
            headers={"authorization": f"Bearer {fleet.key.secret}"},
            timeout=60,
        )
        assert reply.status_code == 400, (path, value, reply.text)
        message = reply.json()["error"]["message"]
        assert message.startswith(f"`{field}") and "must be" in message, message
    assert engine.hits == []


def test_every_route_serves_stop_sequences_at_the_bound(fleet):
    client = openai_client(fleet)
    chat = openai_route(client, "chat", AT_THE_BOUND)
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert openai_route(client, "completions", AT_THE_BOUND).usage.completion_tokens > 0
    assert openai_route(client, "responses", AT_THE_BOUND).usage.output_tokens > 0
    message = anthropic_client(fleet).messages.create(
        model=MODEL_NAME, max_tokens=4, messages=MESSAGES, stop_sequences=AT_THE_BOUND
    )
    assert message.usage.output_tokens > 0
