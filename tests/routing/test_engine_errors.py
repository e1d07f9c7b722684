"""Every error reaches the client as JSON in its own dialect (OpenAI chat and completions, Anthropic messages, OpenAI
Responses), through the official SDKs against the real router: an engine lacking the route, an engine's 5xx in
plain text or JSON, an engine's refusal in another shape, no connection, no first token in time, and an engine
dying in the middle of a stream. Never a plain-text body, never the engine's name or address.

The misbehaving engines are small aiohttp servers; the well-behaved one is the simulator."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest
from aiohttp import web

from inference_platform.ports import free_port
from serving.models import Endpoint, Health, ModelDeployment

from ..serving.engines import MODEL_NAME
from .conftest import make_fleet

CHAT = [{"role": "user", "content": "Fix the failing test."}]


@dataclass
class Engine:
    url: str


class HostileEngine:
    """An aiohttp server in a thread standing in for an engine: `routes` maps a path to a handler; every other
    path gets aiohttp's own plain-text `404: Not Found`, as the simulator answers a route it lacks."""

    def __init__(self, routes: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hits: list[str] = []
        self.routes = routes or {}
        self._ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        assert self._ready.wait(10)

    def _serve(self) -> None:
        @web.middleware
        async def count(request, handler):
            self.hits.append(request.path)
            return await handler(request)

        async def main():
            app = web.Application(middlewares=[count])
            for path, handler in self.routes.items():
                app.router.add_post(path, handler)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._ready.set()
            await asyncio.Event().wait()

        asyncio.run(main())


def on_every_route(handler) -> dict:
    return {
        path: handler for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
    }


async def plain_500(request):
    return web.Response(status=500, text="500 Internal Server Error: engine core died at 127.0.0.1")


async def json_500(request):
    return web.json_response(
        {"error": {"message": "EngineCore died", "type": "InternalServerError"}}, status=500
    )


def openai_client(fleet) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{fleet.router.url}/v1", api_key=fleet.key.secret, max_retries=0, timeout=60
    )


def anthropic_client(fleet) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fleet.router.url, api_key=fleet.key.secret, max_retries=0, timeout=60)


def assert_names_no_engine(message: str, *engines) -> None:
    assert "tiny-main" not in message
    for engine in engines:
        assert engine.url.removeprefix("http://") not in message


def openai_error(exc: openai.APIStatusError) -> dict:
    """The error object, checked to be the whole of an OpenAI error body."""
    body = exc.response.json()
    assert exc.response.headers["content-type"].startswith("application/json")
    assert set(body) == {"error"} and isinstance(body["error"]["message"], str)
    assert {"type", "param", "code"} <= set(body["error"])
    return body["error"]


def anthropic_error(exc: anthropic.APIStatusError) -> dict:
    body = exc.response.json()
    assert exc.response.headers["content-type"].startswith("application/json")
    assert body["type"] == "error" and isinstance(body["error"]["type"], str)
    assert isinstance(body["error"]["message"], str)
    return body["error"]


def call_each_dialect(fleet, stream: bool) -> dict:
    """One request per dialect through its SDK, each expected to fail: the SDK's exception per dialect."""
    failures = {}
    client = openai_client(fleet)
    with pytest.raises(openai.APIStatusError) as chat:
        reply = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, stream=stream)
        list(reply) if stream else None
    failures["chat"] = chat.value
    with pytest.raises(openai.APIStatusError) as responses:
        reply = client.responses.create(model=MODEL_NAME, input="Fix the failing test.", stream=stream)
        list(reply) if stream else None
    failures["responses"] = responses.value
    with pytest.raises(anthropic.APIStatusError) as messages:
        reply = anthropic_client(fleet).messages.create(
            model=MODEL_NAME, max_tokens=4, messages=CHAT, stream=stream
        )
        list(reply) if stream else None
    failures["messages"] = messages.value
    return failures


@pytest.mark.parametrize("stream", [False, True])
def test_it_answers_a_route_no_engine_serves_with_a_404_in_each_dialect(router_process, stream):
    engine = HostileEngine()  # no routes at all: aiohttp's plain-text 404 for every one
    fleet = make_fleet(router_process, [engine])
    failures = call_each_dialect(fleet, stream)
    for failure in failures.values():
        assert failure.status_code == 404
    for name in ("chat", "responses"):
        assert isinstance(failures[name], openai.NotFoundError)
        error = openai_error(failures[name])
        assert error["type"] == "not_found_error" and "do not offer POST" in error["message"]
        assert_names_no_engine(error["message"], engine)
    assert isinstance(failures["messages"], anthropic.NotFoundError)
    error = anthropic_error(failures["messages"])
    assert error["type"] == "not_found_error" and "/v1/messages" in error["message"]
    assert_names_no_engine(error["message"], engine)


def test_an_engine_lacking_a_route_is_passed_over_for_one_that_serves_it(router_process, sim_pair):
    lacking = HostileEngine()
    fleet = make_fleet(router_process, [lacking, sim_pair[0]])
    client = openai_client(fleet)
    for i in range(6):
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"task {i}"}], max_tokens=3
        )
        assert reply.usage.completion_tokens == 3
    assert lacking.hits  # it was tried, and its 404 never reached a client


def test_the_responses_api_on_the_simulator_answers_or_refuses_in_json(fleet):
    """The simulator engines are real processes; whether they serve /v1/responses or not, the client gets the
    Responses API's answer or its JSON error, never the engine's plain text."""
    try:
        reply = openai_client(fleet).responses.create(model=MODEL_NAME, input="hi", max_output_tokens=16)
    except openai.NotFoundError as exc:
        error = openai_error(exc)
        assert "do not offer POST /v1/responses" in error["message"]
        assert_names_no_engine(error["message"], *fleet.engines)
    else:
        assert reply.usage.output_tokens > 0


@pytest.mark.parametrize("answer", [plain_500, json_500], ids=["plain", "json"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_engines_5xx_becomes_a_502_in_each_dialect(router_process, answer, stream):
    engines = [HostileEngine(on_every_route(answer)), HostileEngine(on_every_route(answer))]
    fleet = make_fleet(router_process, engines)
    failures = call_each_dialect(fleet, stream)
    for name in ("chat", "responses"):
        assert isinstance(failures[name], openai.InternalServerError) and failures[name].status_code == 502
        error = openai_error(failures[name])
        assert "EngineCore" not in error["message"] and "unavailable" in error["message"]
        assert_names_no_engine(error["message"], *engines)
    failure = failures["messages"]
    assert isinstance(failure, anthropic.InternalServerError) and failure.status_code == 502
    error = anthropic_error(failure)
    assert error["type"] == "api_error"
    assert_names_no_engine(error["message"], *engines)
    assert all(engine.hits for engine in engines)  # both were tried before giving up


def test_an_engine_that_cannot_be_reached_is_a_502_in_each_dialect(router_process):
    nowhere = Engine(f"http://127.0.0.1:{free_port()}")
    fleet = make_fleet(router_process, [nowhere])
    failures = call_each_dialect(fleet, stream=True)
    for name in ("chat", "responses"):
        assert failures[name].status_code == 502
        assert_names_no_engine(openai_error(failures[name])["message"], nowhere)
    assert failures["messages"].status_code == 502
    assert_names_no_engine(anthropic_error(failures["messages"])["message"], nowhere)


def test_an_engine_that_sends_no_first_token_in_time_is_a_504_in_each_dialect(router_process):
    async def hang(request):
        await asyncio.sleep(30)
        return web.json_response({})

    engine = HostileEngine(on_every_route(hang))
    fleet = make_fleet(router_process, [engine])
    ModelDeployment.objects.filter(pk=fleet.deployment.pk).update(first_token_timeout_s=1)
    fleet.sync()
    failures = call_each_dialect(fleet, stream=True)
    for name in ("chat", "responses"):
        assert isinstance(failures[name], openai.APIStatusError) and failures[name].status_code == 504
        error = openai_error(failures[name])
        assert error["type"] == "timeout_error" and "within 1 s" in error["message"]
    assert failures["messages"].status_code == 504
    assert_names_no_engine(anthropic_error(failures["messages"])["message"], engine)


def test_an_engines_refusal_reaches_the_client_in_its_own_dialect(router_process):
    """vLLM answers a validation error on /v1/messages in OpenAI's shape; FastAPI writes `{"detail": [...]}`;
    an engine's message that names its own address loses it."""

    async def openai_shaped(request):
        message = f"max_tokens is too large for the engine at {request.host}"
        body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
        return web.json_response(body, status=400)

    async def fastapi_shaped(request):
        detail = [{"loc": ["body", "temperature"], "msg": "Input should be a valid number", "type": "float"}]
        return web.json_response({"detail": detail}, status=422)

    async def plain_400(request):
        return web.Response(status=400, text="Bad Request")

    engine = HostileEngine(
        {"/v1/messages": openai_shaped, "/v1/chat/completions": fastapi_shaped, "/v1/responses": plain_400}
    )
    fleet = make_fleet(router_process, [engine])
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic_client(fleet).messages.create(model=MODEL_NAME, max_tokens=4, messages=CHAT)
    error = anthropic_error(refused.value)
    assert error["type"] == "invalid_request_error"
    assert error["message"] == "max_tokens is too large for the engine at the engine"
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        openai_client(fleet).chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4)
    assert openai_error(refused.value)["message"] == "temperature: Input should be a valid number"
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(fleet).responses.create(model=MODEL_NAME, input="hi")
    assert "status 400" in openai_error(refused.value)["message"]


def test_an_engines_own_json_error_in_the_right_dialect_passes_through(router_process):
    body = {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }

    async def not_found(request):
        return web.json_response(body, status=404)

    engine = HostileEngine({"/v1/chat/completions": not_found})
    fleet = make_fleet(router_process, [engine])
    answer = httpx.post(
        f"{fleet.router.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {fleet.key.secret}"},
        json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4},
        timeout=60,
    )
    assert answer.status_code == 404 and answer.json() == body
    assert engine.hits == ["/v1/chat/completions"]  # a refusal in the dialect is an answer: not retried


def test_an_engine_dying_mid_stream_ends_the_stream_with_an_error_in_each_dialect(router_process):
    first = {
        "/v1/chat/completions": b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}\n\n',
        "/v1/messages": b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","type":"message",'
        b'"role":"assistant","model":"m","content":[],"stop_reason":null,"stop_sequence":null,'
        b'"usage":{"input_tokens":5,"output_tokens":0}}}\n\n'
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"text","text":""}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"Hel"}}\n\n',
        "/v1/responses": b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
        b'"response":{"id":"resp_1","object":"response","created_at":1,"model":"m","status":"in_progress",'
        b'"output":[],"parallel_tool_calls":true,"tool_choice":"auto","tools":[]}}\n\n',
    }

    async def die(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(first[request.path])
        await asyncio.sleep(0.2)
        request.transport.abort()
        return response

    engine = HostileEngine({path: die for path in first})
    fleet = make_fleet(router_process, [engine])
    received = []
    with pytest.raises(openai.APIError) as broke:
        for chunk in openai_client(fleet).chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=50, stream=True
        ):
            received.append(chunk.choices[0].delta.content)
    assert received == ["Hel"] and "stopped in the middle" in broke.value.message
    assert_names_no_engine(broke.value.message, engine)
    events = []
    with pytest.raises(openai.APIError) as broke:
        for event in openai_client(fleet).responses.create(model=MODEL_NAME, input="hi", stream=True):
            events.append(event.type)
    assert events == ["response.created"] and "stopped in the middle" in broke.value.message
    assert_names_no_engine(broke.value.message, engine)
    events = []
    with pytest.raises(anthropic.APIStatusError) as broke:
        for event in anthropic_client(fleet).messages.create(
            model=MODEL_NAME, max_tokens=50, messages=CHAT, stream=True
        ):
            events.append(event.type)
    assert events == ["message_start", "content_block_start", "content_block_delta"]
    assert broke.value.body["type"] == "error" and "stopped in the middle" in json.dumps(broke.value.body)
    assert_names_no_engine(json.dumps(broke.value.body), engine)


def test_a_route_the_router_lacks_is_a_404_in_the_callers_dialect(fleet):
    with pytest.raises(anthropic.NotFoundError) as missing:
        anthropic_client(fleet).messages.batches.list()
    anthropic_error(missing.value)
    with pytest.raises(openai.NotFoundError) as missing:
        openai_client(fleet).embeddings.create(model=MODEL_NAME, input="x")
    openai_error(missing.value)
    answer = httpx.get(f"{fleet.router.url}/v1/messages", headers={"x-api-key": fleet.key.secret}, timeout=10)
    assert answer.status_code == 405 and answer.json()["type"] == "error"


def test_endpoints_marked_unhealthy_leave_a_503_in_json(fleet):
    Endpoint.objects.filter(pool__deployment=fleet.deployment).update(health=Health.UNHEALTHY)
    fleet.sync()
    with pytest.raises(anthropic.APIStatusError) as unavailable:
        anthropic_client(fleet).messages.create(model=MODEL_NAME, max_tokens=4, messages=CHAT)
    assert unavailable.value.status_code == 503
    assert anthropic_error(unavailable.value)["type"] == "overloaded_error"


async def refuses_the_router_key(request):
    return web.json_response({"error": "Unauthorized"}, status=401)


def test_an_engine_refusing_the_routers_own_key_is_a_502_not_the_clients_bad_key(router_process):
    """vLLM's `--api-key` middleware answers 401 to a wrong engine key (a rotation not everywhere yet): that is the
    platform's fault, so another engine is tried and the client gets a 502, never an authentication error."""
    engines = [HostileEngine(on_every_route(refuses_the_router_key)) for _ in range(2)]
    fleet = make_fleet(router_process, engines)
    failures = call_each_dialect(fleet, stream=False)
    for name in ("chat", "responses"):
        assert isinstance(failures[name], openai.InternalServerError) and failures[name].status_code == 502
    assert isinstance(failures["messages"], anthropic.InternalServerError)
    assert all(engine.hits for engine in engines)


def test_an_engines_bare_host_name_is_hidden_too():
    from routing.rendering.dialects import OPENAI
    from routing.server.engine_errors import refusal

    body = b'{"error": {"message": "cannot reach Engine-A:8000 or engine-a from engine-a.prefill"}}'
    answer = refusal(OPENAI, 400, body, "http://engine-a:8000")
    message = json.loads(answer.body)["error"]["message"]
    assert "engine-a" not in message.lower(), message
