"""Sessions the agents name, used for session affinity as `x-session-id` is: Claude Code's
`X-Claude-Code-Session-Id` header and the `session_id` in its `metadata.user_id`, Codex's `x-codex-window-id` and
`prompt_cache_key`; hashed and scoped to the tenant, so two tenants naming the same session stay apart."""

from __future__ import annotations

import json
import uuid

import anthropic
import openai
import pytest
from aiohttp import web

from routing.models import RoutingPolicy
from routing.server.sessions import MAX_SESSION_CHARS, session_key
from tenants.keys import api_key_create
from tenants.models import Scope, Team, Tenant

from ..serving.engines import MODEL_NAME, start_engine
from .conftest import make_fleet
from .test_engine_errors import HostileEngine
from .usage import usage_events


@pytest.fixture
def four_engines():
    engines = [start_engine("sim", "--decode-time", "0.001", events=False) for _ in range(4)]
    yield engines
    for engine in engines:
        engine.stop()


def session_fleet(router_process, engines):
    """Routed on load and sessions only (no prefix scores), so only the session can keep requests together."""
    fleet = make_fleet(router_process, engines)
    RoutingPolicy.objects.create(deployment=fleet.deployment, mode="least_loaded", session_affinity_weight=5)
    fleet.sync()
    return fleet


def claude_code(router_url: str, secret: str, session: str, *, header: bool = True) -> anthropic.Anthropic:
    headers = {"x-app": "cli", "anthropic-beta": "claude-code-20250219"}
    if header:
        headers["X-Claude-Code-Session-Id"] = session
    return anthropic.Anthropic(base_url=router_url, api_key=secret, max_retries=0, default_headers=headers)


def claude_code_turn(client: anthropic.Anthropic, session: str, turn: int) -> str:
    user_id = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": session})
    raw = client.messages.with_raw_response.create(
        model=MODEL_NAME,
        max_tokens=2,
        metadata={"user_id": user_id},
        messages=[{"role": "user", "content": f"unrelated question {turn} {uuid.uuid4()}"}],
    )
    return raw.headers["x-request-id"]


def engines_of(request_ids: list[str]) -> set[str]:
    return {event.endpoint for event in usage_events(request_ids, wait_for=len(request_ids))}


@pytest.mark.parametrize("header", [True, False], ids=["session-header", "metadata-only"])
def test_a_claude_code_session_sticks_to_one_engine(router_process, four_engines, header):
    fleet = session_fleet(router_process, four_engines)
    session = str(uuid.uuid4())
    client = claude_code(fleet.router.url, fleet.key.secret, session, header=header)
    ids = [claude_code_turn(client, session, turn) for turn in range(6)]
    assert len(engines_of(ids)) == 1
    # Without a session the same kind of requests spread over the engines.
    anonymous = anthropic.Anthropic(base_url=fleet.router.url, api_key=fleet.key.secret, max_retries=0)
    spread = [
        anonymous.messages.with_raw_response.create(
            model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": f"question {turn}"}]
        ).headers["x-request-id"]
        for turn in range(6)
    ]
    assert len(engines_of(spread)) > 1


def test_two_tenants_naming_the_same_session_are_kept_apart(router_process, four_engines):
    fleet = session_fleet(router_process, four_engines)
    other_tenant = Tenant.objects.create(name="Globex", slug="globex")
    other_team = Team.objects.create(tenant=other_tenant, name="Agents", slug="agents")
    other_key = api_key_create(team=other_team, name="agent", scopes=[Scope.INFERENCE])
    fleet.sync()
    session = str(uuid.uuid4())
    first = claude_code(fleet.router.url, fleet.key.secret, session)
    ids = [claude_code_turn(first, session, turn) for turn in range(6)]
    (first_engine,) = engines_of(ids)
    second = claude_code(fleet.router.url, other_key.secret, session)
    ids = [claude_code_turn(second, session, turn) for turn in range(4)]
    (second_engine,) = engines_of(ids)  # its own session, which sticks too
    # Sharing the first tenant's mapping, it would have followed it to the first engine.
    assert second_engine != first_engine


class ResponsesEngines:
    """Four small engines answering the Responses API, each recording the requests it served."""

    def __init__(self):
        self.served: dict[str, list[str]] = {}
        self.engines = [HostileEngine({"/v1/responses": self._answer}) for _ in range(4)]

    async def _answer(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.served.setdefault(request.host, []).append(body["input"][-1]["content"])
        return web.json_response(
            {
                "id": f"resp_{uuid.uuid4().hex}",
                "object": "response",
                "created_at": 1,
                "model": MODEL_NAME,
                "status": "completed",
                "output": [
                    {
                        "id": "msg_1",
                        "type": "message",
                        "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": "ok", "annotations": []}],
                    }
                ],
                "parallel_tool_calls": True,
                "tool_choice": "auto",
                "tools": [],
                "usage": {
                    "input_tokens": 10,
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": 1,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": 11,
                },
            }
        )

    def where(self, text: str) -> set[str]:
        return {host for host, inputs in self.served.items() if text in inputs}


def codex_turn(client: openai.OpenAI, text: str, cache_key: str | None, window: str | None) -> None:
    headers = {"x-codex-window-id": window} if window else {}
    client.responses.create(
        model=MODEL_NAME,
        input=[
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Be brief."}],
            },
            {"type": "message", "role": "user", "content": text},
        ],
        store=False,
        extra_body={"prompt_cache_key": cache_key} if cache_key else None,
        extra_headers=headers,
    )


@pytest.mark.parametrize("ids", ["prompt_cache_key", "window"])
def test_a_codex_session_sticks_to_one_engine(router_process, ids):
    engines = ResponsesEngines()
    fleet = session_fleet(router_process, engines.engines)
    client = openai.OpenAI(base_url=f"{fleet.router.url}/v1", api_key=fleet.key.secret, max_retries=0)
    session = str(uuid.uuid4())
    cache_key, window = (session, None) if ids == "prompt_cache_key" else (None, f"{session}:0")
    turns = [f"turn {turn} {uuid.uuid4()}" for turn in range(6)]
    for text in turns:
        codex_turn(client, text, cache_key, window)
    assert len(set().union(*(engines.where(text) for text in turns))) == 1
    others = [f"lone {turn} {uuid.uuid4()}" for turn in range(6)]
    for text in others:
        codex_turn(client, text, None, None)
    assert len(set().union(*(engines.where(text) for text in others))) > 1


def test_the_session_key_is_the_clients_first_named_id_hashed_per_tenant():
    def scope(**headers):
        return {
            "headers": [(name.replace("_", "-").encode(), value.encode()) for name, value in headers.items()]
        }

    user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": "meta"})
    claude = {"metadata": {"user_id": user_id}}
    assert session_key(scope(), {}, 1) is None
    assert session_key(scope(), {"metadata": {"user_id": "not json"}}, 1) is None
    named = {
        "explicit": session_key(scope(x_session_id="s", x_claude_code_session_id="c"), claude, 1),
        "claude header": session_key(scope(x_claude_code_session_id="c"), claude, 1),
        "claude metadata": session_key(scope(x_codex_window_id="w"), {**claude, "prompt_cache_key": "k"}, 1),
        "codex window": session_key(scope(x_codex_window_id="w"), {"prompt_cache_key": "k"}, 1),
        "codex key": session_key(scope(), {"prompt_cache_key": "k"}, 1),
    }
    assert named["explicit"] == session_key(scope(x_session_id="s"), {}, 1)
    assert named["claude header"] == session_key(scope(x_claude_code_session_id="c"), {}, 1)
    assert named["claude metadata"] == session_key(scope(), claude, 1)
    assert named["codex window"] == session_key(scope(x_codex_window_id="w"), {}, 1)
    assert len(set(named.values())) == 5
    assert session_key(scope(x_session_id="s"), {}, 2) != named["explicit"]  # another tenant's
    assert all(len(key) == 32 for key in named.values())  # a bounded key, whatever the client sent
    longest = session_key(scope(x_session_id="s" * MAX_SESSION_CHARS), {}, 1)
    assert len(longest) == 32
    assert session_key(scope(x_session_id="s" * (MAX_SESSION_CHARS + 1)), {}, 1) is None  # no session id
