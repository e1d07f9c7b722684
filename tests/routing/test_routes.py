"""The public generation routes are one table (routing/rendering/routes.py): dispatch, the field rules, the checks,
tokenising, answer assembly, the P/D step, the simulator and docs/request-fields.md read it, so a new route is a
new entry. These tests add entries for as long as they run and see every reader take them up."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import replace
from types import SimpleNamespace

import orjson
import pytest

from routing.rendering import routes
from routing.rendering.dialects import ANTHROPIC, OPENAI
from routing.rendering.routes import ANTHROPIC_MESSAGES, CHAT_MESSAGES, ROUTES, Route
from routing.rendering.tokenize import RouterTokenizer
from routing.rendering.tokenize_pool import prompt_tokens
from routing.scheduling.disagg import prefill_elsewhere
from routing.scheduling.pipeline import RequestContext
from routing.server import metrics
from routing.server.app import Router
from routing.server.assemble import ChatAssembler, MessagesAssembler, assembler_for
from routing.server.checks import HttpError, engine_fields, output_limit, over_context, validate
from routing.server.engine_errors import route_missing_body
from simulator.server import ServedModel, SimulatorApp
from simulator.tokenizer import ModelTokenizer

from ..serving.engines import MODEL_DIR, MODEL_NAME
from .test_checks import CONTEXT, MAX_CHOICES, MAX_MESSAGES, key_info, tiny

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)

# Two routes the platform does not have: an Anthropic route without extended thinking, and a plain chat route
# whose prompts may be prefilled elsewhere.
AGENT_MESSAGES = Route(
    path="/v1/agent/messages",
    dialect=ANTHROPIC,
    fields=routes.MESSAGES.fields - {"thinking"},
    prompt="messages",
    renders=ANTHROPIC_MESSAGES,
    output_limit=("max_tokens",),
)
PLAIN_CHAT = Route(
    path="/v1/plain/chat",
    dialect=OPENAI,
    fields=frozenset({"model", "messages", "max_tokens", "stream", "stream_options", "n", "temperature"}),
    prompt="messages",
    renders=CHAT_MESSAGES,
    output_limit=("max_tokens",),
    disaggregated=True,
)
CONVERSATION = [
    {"role": "user", "content": "Where is the bug?"},
    {"role": "assistant", "content": "In parse()."},
    {"role": "user", "content": "Fix it."},
]


@pytest.fixture
def extra_routes(monkeypatch):
    for route in (AGENT_MESSAGES, PLAIN_CHAT):
        monkeypatch.setitem(ROUTES, route.path, route)


@pytest.fixture(scope="module")
def tokenizer() -> RouterTokenizer:
    return RouterTokenizer(MODEL_DIR)


def test_the_written_table_of_request_fields_is_the_route_table():
    written = routes.DOC.read_text()
    assert written == routes.with_fields_table(written), (
        "docs/request-fields.md is out of date: run `python -m routing.rendering.routes`"
    )
    for route in ROUTES.values():
        assert f"| `{route.path}` | {route.dialect.name} | `{route.prompt}` |" in written


def test_an_entry_that_would_mean_two_things_is_refused():
    with pytest.raises(ValueError, match="only OpenAI's routes"):
        replace(AGENT_MESSAGES, disaggregated=True)
    with pytest.raises(ValueError, match="public fields"):
        replace(PLAIN_CHAT, output_limit=("max_completion_tokens",))
    with pytest.raises(ValueError, match="public fields"):
        replace(PLAIN_CHAT, prompt="input")
    with pytest.raises(ValueError, match="unknown rendering"):
        replace(PLAIN_CHAT, renders="xml")


# --- dispatch ---------------------------------------------------------------------------------------------------


def serve(method: str, path: str, headers: list | None = None) -> tuple[int, dict]:
    """One request through the app's dispatch (its `_serve`, as `__call__` runs it once the replica has started:
    these requests are refused before they need Redis or the database)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers or []}
    asyncio.run(Router()._serve(scope, receive, send))
    return sent[0]["status"], orjson.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_dispatch_serves_a_new_entry_in_its_dialect(extra_routes):
    status, body = serve("GET", AGENT_MESSAGES.path)
    assert status == 405 and body["type"] == "error"  # Anthropic's shape
    status, body = serve("POST", AGENT_MESSAGES.path)  # no key: refused by the generation handler
    assert status == 401 and body["type"] == "error" and "Missing API key" in body["error"]["message"]
    status, body = serve("POST", PLAIN_CHAT.path)
    assert status == 401 and "type" not in body and body["error"]["type"] == "authentication_error"
    status, body = serve("POST", "/v1/agent/messages/batches")
    assert status == 404 and body["type"] == "error"  # below an Anthropic route: in Anthropic's shape
    assert f"{AGENT_MESSAGES.path}, " in body["error"]["message"]
    assert (
        PLAIN_CHAT.path in orjson.loads(route_missing_body(OPENAI, MODEL_NAME, "/v1/x"))["error"]["message"]
    )


def test_without_the_entry_there_is_no_route():
    status, body = serve("POST", AGENT_MESSAGES.path)
    assert status == 404 and AGENT_MESSAGES.path not in body["error"]["message"].split(". ", 1)[1]


# --- fields and checks ------------------------------------------------------------------------------------------


def test_the_checks_read_a_new_entry(extra_routes):
    payload = {
        "model": MODEL_NAME,
        "messages": CONVERSATION,
        "max_tokens": 64,
        "thinking": {"type": "enabled"},
    }
    kept = engine_fields(dict(payload), AGENT_MESSAGES.path, key_info())
    assert "thinking" not in kept and kept["cache_salt"] == key_info().cache_salt
    assert "thinking" in engine_fields(dict(payload), routes.MESSAGES.path, key_info())
    assert output_limit(kept, AGENT_MESSAGES.path) == ("max_tokens", 64)
    without = {name: value for name, value in kept.items() if name != "max_tokens"}
    with pytest.raises(HttpError, match="`max_tokens` is required"):
        validate(without, tiny(), ANTHROPIC, None, AGENT_MESSAGES.path, MAX_MESSAGES, MAX_CHOICES, None)

    chat = {"model": MODEL_NAME, "messages": CONVERSATION, "max_tokens": 100, "max_completion_tokens": 10}
    kept = engine_fields(dict(chat), PLAIN_CHAT.path, key_info())
    assert "max_completion_tokens" not in kept
    ctx = RequestContext(model=MODEL_NAME, prompt_tokens_estimate=CONTEXT - 50)
    refused = over_context(tiny(), kept, ctx, PLAIN_CHAT.path)
    assert refused.param == "max_tokens" and "at most 50 output tokens" in refused.message


# --- tokenising and answers -------------------------------------------------------------------------------------


def test_a_new_entry_renders_as_its_kind(extra_routes, tokenizer):
    anthropic = {"model": MODEL_NAME, "system": "You review code.", "messages": CONVERSATION, "max_tokens": 8}
    expected = list(tokenizer.encode_request(copy.deepcopy(anthropic), routes.MESSAGES.path))
    assert list(tokenizer.encode_request(copy.deepcopy(anthropic), AGENT_MESSAGES.path)) == expected
    assert list(prompt_tokens(tokenizer, copy.deepcopy(anthropic), AGENT_MESSAGES.path)) == expected
    chat = {"model": MODEL_NAME, "messages": CONVERSATION}
    expected = list(tokenizer.encode_chat(copy.deepcopy(CONVERSATION)))
    assert list(prompt_tokens(tokenizer, copy.deepcopy(chat), PLAIN_CHAT.path)) == expected
    assert isinstance(assembler_for(AGENT_MESSAGES.path), MessagesAssembler)
    assert isinstance(assembler_for(PLAIN_CHAT.path), ChatAssembler)


# --- the P/D step -----------------------------------------------------------------------------------------------


def test_only_an_entry_that_may_be_disaggregated_is_planned(extra_routes):
    """A route that may be disaggregated gets a plan (here: aggregated, there being no prefill pool); another
    is sent on as it came, unplanned."""

    def planned(path: str) -> float:
        model = f"plan-{path}"
        request = SimpleNamespace(
            scope={"path": path},
            body=b"{}",
            deployment=SimpleNamespace(endpoints=()),
            ctx=RequestContext(model=model),
        )
        exchange = SimpleNamespace(request=request, services=SimpleNamespace(), model=model)
        decode = SimpleNamespace(endpoint=SimpleNamespace(kv_both=False))
        prefilled = asyncio.run(prefill_elsewhere(exchange, decode, [], False))
        assert prefilled.body == b"{}" and not prefilled.remotely
        return metrics.registry.get_sample_value("router_plans_total", {"model": model, "kind": "aggregated"})

    assert planned(PLAIN_CHAT.path) == 1
    assert planned(AGENT_MESSAGES.path) is None


# --- the simulator and the docs ---------------------------------------------------------------------------------


@pytest.mark.heavy
def test_the_simulator_serves_a_new_entry_as_vllm_serves_its_kind(extra_routes):
    model = ServedModel(
        names=[MODEL_NAME],
        root=MODEL_NAME,
        max_model_len=CONTEXT,
        prompt_tokens_details=False,
        kv_events_config=None,
    )
    simulator = SimulatorApp(None, ModelTokenizer(str(MODEL_DIR)), model)
    served = {
        (route.method, route.resource.canonical): route.handler for route in simulator.app().router.routes()
    }
    assert served[("POST", AGENT_MESSAGES.path)] == simulator.messages
    assert served[("POST", PLAIN_CHAT.path)] == simulator.chat_completions
    assert served[("POST", routes.COMPLETIONS.path)] == simulator.completions


def test_the_docs_table_lists_a_new_entry(extra_routes):
    table = routes.fields_table()
    row = next(line for line in table.splitlines() if line.startswith(f"| `{PLAIN_CHAT.path}` |"))
    assert row.startswith(
        f"| `{PLAIN_CHAT.path}` | openai | `messages` | `max_tokens` | yes | `max_tokens`, "
    )
    assert f"| `{AGENT_MESSAGES.path}` | anthropic | `messages` | `max_tokens` | no |" in table
