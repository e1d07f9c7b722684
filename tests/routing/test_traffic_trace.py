"""Traces of our own traffic (routing/metering/traffic_trace.py): sampled requests through the real router become entries
after the worker's drain, export as a Mooncake trace the planner replays, and carry no text, token id or raw block
key; with the ratio at 0 nothing is written."""

from __future__ import annotations

import hashlib
import json
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import redis
from django.conf import settings
from django.core.management import call_command

from planner.__main__ import main as planner_main
from planner.profile import Profile
from planner.report import summarize
from planner.sim import simulate
from planner.trace import ceiling, load_trace
from routing.kvindex.blocks import block_keys, chain_seed
from routing.metering.traffic_trace import hashed_blocks, traffic_trace_prune
from routing.models import RoutingPolicy, TrafficTraceEntry
from routing.rendering.tokenize import RouterTokenizer
from routing.snapshot import cache_salt
from routing.tasks import drain_traffic_trace
from tenants.keys import api_key_create
from tenants.models import Scope, Team, Tenant

from ..serving.engines import MODEL_DIR, MODEL_NAME
from .conftest import make_fleet, start_router
from .usage import usage_events

SECRET = "trace-secret-for-tests"
CHAT = "/v1/chat/completions"
SYSTEM = "You are a coding agent working on the repository's files, carefully and tidily. " * 90
SYSTEM_BLOCKS = 3  # the system prompt alone fills this many 512-token blocks


def chat(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def ask(fleet, key, messages, **headers) -> str:
    response = httpx.post(
        f"{fleet.router.url}{CHAT}",
        headers={"authorization": f"Bearer {key.secret}", **headers},
        json={"model": MODEL_NAME, "messages": messages, "max_tokens": 3},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.headers["x-request-id"]


def stream_length(client, wait_for: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while (
        length := client.xlen(settings.ROUTER_TRAFFIC_TRACE_STREAM)
    ) < wait_for and time.monotonic() < deadline:
        time.sleep(0.05)
    return length


@pytest.fixture
def client():
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(settings.ROUTER_TRAFFIC_TRACE_STREAM)
    yield client
    client.delete(settings.ROUTER_TRAFFIC_TRACE_STREAM)
    client.close()


def traced_router(ratio: str):
    return start_router({"ROUTER_TRAFFIC_TRACE_RATIO": ratio, "ROUTER_TRAFFIC_TRACE_SECRET": SECRET})


@pytest.fixture
def traced_fleet(transactional_db, sim_pair):
    router = traced_router("1")
    yield make_fleet(router, sim_pair)
    router.stop()


@pytest.fixture
def untraced_fleet(transactional_db, sim_pair):
    router = traced_router("0")
    yield make_fleet(router, sim_pair)
    router.stop()


def raw_keys(tenant_id: int, messages: list[dict]) -> list[bytes]:
    """The router's own block keys of a chat prompt, as it computes them (tenant's cache salt, block size 128)."""
    tokens = RouterTokenizer(MODEL_DIR).encode_request({"model": MODEL_NAME, "messages": messages}, CHAT)
    seed = chain_seed(MODEL_NAME, cache_salt=cache_salt(f"tenant:{tenant_id}"))
    return block_keys(tokens, 128, seed)


def test_it_records_sampled_requests_and_exports_a_trace_the_planner_replays(traced_fleet, client, tmp_path):
    fleet = traced_fleet
    other_tenant = Tenant.objects.create(name="Other", slug="other")
    other_team = Team.objects.create(tenant=other_tenant, name="Bots", slug="bots")
    other_key = api_key_create(team=other_team, name="bot", scopes=[Scope.INFERENCE])
    fleet.sync()
    since = datetime.now(UTC) - timedelta(minutes=1)

    # Three turns of one tenant sharing the system prompt (one in a session), then the same prompt from another.
    # The first two are routed round-robin (no block keys: the trace keys them after their end), the rest by
    # prefix (the trace takes the router's keys).
    ids = [
        ask(fleet, fleet.key, chat("fix the failing test in parser.py")),
        ask(fleet, fleet.key, chat("add a docstring to the loader"), **{"x-session-id": "agent-7"}),
    ]
    RoutingPolicy.objects.create(deployment=fleet.deployment, mode="approximate")
    fleet.sync()
    ids += [
        ask(fleet, fleet.other_key, chat("rename the helper module")),
        ask(fleet, other_key, chat("fix the failing test in parser.py")),
    ]
    events = {e.request_id: e for e in usage_events(ids, wait_for=4)}
    assert stream_length(client, 4) == 4

    assert drain_traffic_trace() == 4
    assert client.xlen(settings.ROUTER_TRAFFIC_TRACE_STREAM) == 0
    entries = {e.request_id: e for e in TrafficTraceEntry.objects.all()}
    assert set(entries) == set(ids)
    first = entries[ids[0]]
    assert (first.tenant_id, first.team_id, first.api_key_id) == (
        fleet.team.tenant_id,
        fleet.team.id,
        fleet.key.api_key.id,
    )
    assert entries[ids[3]].tenant_id == other_tenant.id and entries[ids[3]].api_key_id == other_key.api_key.id
    assert first.priority_class == "standard" and first.deployment_id == fleet.deployment.id
    assert first.endpoint.startswith("tiny-main-") and first.block_size == 128
    assert entries[ids[1]].session and not first.session and entries[ids[1]].session != "agent-7"
    for request_id, entry in entries.items():
        event = events[request_id]
        # Not streamed: the client saw nothing until the whole answer, after its last token.
        assert entry.output_before_visible == entry.output_tokens - 1
        assert (entry.prompt_tokens, entry.cached_tokens, entry.output_tokens) == (
            event.prompt_tokens,
            event.cached_prompt_tokens,
            event.output_tokens,
        )
        assert len(entry.block_hashes) == entry.prompt_tokens // 128 * 8

    # The stored hashes are the router's keys under the secret (whether the router or the trace keyed the prompt):
    # not the keys themselves, nor the keys under another secret.
    secret = hashlib.sha256(SECRET.encode()).digest()
    keys = raw_keys(fleet.team.tenant_id, chat("fix the failing test in parser.py"))
    other_keys = raw_keys(other_tenant.id, chat("fix the failing test in parser.py"))
    stored = bytes(first.block_hashes)
    assert stored == hashed_blocks([k.hex() for k in keys], secret)
    assert bytes(entries[ids[3]].block_hashes) == hashed_blocks([k.hex() for k in other_keys], secret)
    assert stored != hashed_blocks([k.hex() for k in keys], hashlib.sha256(b"another secret").digest())
    assert not any(k in stored for k in keys)

    # Drained twice (a drain that died before deleting): still one row each.
    client.xadd(settings.ROUTER_TRAFFIC_TRACE_STREAM, {"e": json.dumps({"request_id": ids[0]})})  # malformed
    assert drain_traffic_trace() == 0 and TrafficTraceEntry.objects.count() == 4

    out = tmp_path / "trace.jsonl"
    call_command("export_trace", "--deployment", "tiny", "--since", since.isoformat(), "--out", str(out))
    text = out.read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    by_id = dict(zip(sorted(ids, key=lambda i: (entries[i].arrived_at, entries[i].id)), rows, strict=True))
    assert rows[0]["timestamp"] == 0 and [r["timestamp"] for r in rows] == sorted(
        r["timestamp"] for r in rows
    )
    for request_id, row in by_id.items():
        entry = entries[request_id]
        assert row["input_length"] == entry.prompt_tokens and row["output_length"] == entry.output_tokens
        assert len(row["hash_ids"]) == -(-entry.prompt_tokens // 512)
        assert (
            row["tenant"] == entry.tenant_id
            and row["team"] == entry.team_id
            and row["key"] == entry.api_key_id
        )
    acme = [by_id[i]["hash_ids"][:SYSTEM_BLOCKS] for i in ids[:3]]
    assert acme[0] == acme[1] == acme[2] == [0, 1, 2]
    assert len(set(by_id[ids[0]]["hash_ids"]) & set(by_id[ids[3]]["hash_ids"])) == 0  # another tenant's salt
    assert by_id[ids[1]]["session"] == 0 and by_id[ids[0]]["session"] is None
    assert SYSTEM_BLOCKS * 512 < rows[0]["input_length"]

    # Privacy: no text, no token id, no raw block key, no stored hash, no session as sent.
    assert "repository" not in text and "parser" not in text and "agent-7" not in text
    assert set(rows[0]) == {
        "timestamp",
        "input_length",
        "output_length",
        "hash_ids",
        "cached_length",
        "output_before_visible",
        "tenant",
        "team",
        "key",
        "priority",
        "session",
        "endpoint",
    }
    # The route, numbered in order of first appearance: the same engine the same number, never its name.
    numbers: dict[str, int] = {}
    for request_id, row in by_id.items():
        assert numbers.setdefault(entries[request_id].endpoint, row["endpoint"]) == row["endpoint"]
    assert sorted(numbers.values()) == list(range(len(numbers))) and rows[0]["endpoint"] == 0
    assert all(name not in text for name in numbers)
    distinct = len({h for r in rows for h in r["hash_ids"]})
    assert all(0 <= h < distinct for r in rows for h in r["hash_ids"])
    for raw in keys + other_keys:
        assert raw.hex() not in text and str(int.from_bytes(raw, "big")) not in text
    for entry in entries.values():
        assert entry.session == "" or entry.session not in text
        assert bytes(entry.block_hashes)[:8].hex() not in text

    # The planner replays it as it does the public traces: the shared prompt is the cacheable share.
    trace = load_trace(out)
    assert len(trace) == 4 and trace[1].session in (None, "0")
    assert [r.endpoint for r in trace] == [row["endpoint"] for row in rows]
    assert ceiling(trace)[0] >= 2 * SYSTEM_BLOCKS * 512
    summary = summarize(simulate(trace, 2, Profile.load("sim-bench"), "precise"))
    assert summary.finished == 4
    assert planner_main(["--trace", str(out), "--engines", "2", "--profile", "sim-bench"]) == 0


def test_it_records_nothing_with_the_ratio_at_zero(untraced_fleet, client):
    ids = [ask(untraced_fleet, untraced_fleet.key, chat(f"task {n}")) for n in range(3)]
    assert len(usage_events(ids, wait_for=3)) == 3
    time.sleep(0.3)  # an entry would be written just after the request's end
    assert client.xlen(settings.ROUTER_TRAFFIC_TRACE_STREAM) == 0
    assert drain_traffic_trace() == 0 and not TrafficTraceEntry.objects.exists()


def test_it_prunes_entries_past_their_keeping(db, settings):
    settings.ROUTER_TRAFFIC_TRACE_KEEP_DAYS = 7
    now = datetime.now(UTC)
    for n, age in enumerate((8, 6)):
        TrafficTraceEntry.objects.create(
            request_id=f"r{n}",
            arrived_at=now - timedelta(days=age),
            deployment_id=1,
            tenant_id=1,
            team_id=1,
            api_key_id=1,
            prompt_tokens=1,
            cached_tokens=0,
            output_tokens=1,
            block_size=128,
        )
    assert traffic_trace_prune(now=now) == 1
    assert list(TrafficTraceEntry.objects.values_list("request_id", flat=True)) == ["r1"]


WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_it_records_the_output_the_client_saw_nothing_of(traced_fleet, client):
    """A replay times the first token as the client saw it: a chat stream shows its role chunk with the first
    token; a Messages stream that calls a tool opens its first content block only once the engine's parser has
    the call's name, some tokens later; an answer not streamed shows nothing before its last token."""
    fleet = traced_fleet
    auth = {"authorization": f"Bearer {fleet.key.secret}"}
    ids = []
    with httpx.stream(
        "POST",
        f"{fleet.router.url}{CHAT}",
        headers=auth,
        json={"model": MODEL_NAME, "messages": chat("list the files"), "max_tokens": 12, "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200 and list(r.iter_lines())
        ids.append(r.headers["x-request-id"])
    with httpx.stream(
        "POST",
        f"{fleet.router.url}/v1/messages",
        headers={**auth, "anthropic-version": "2023-06-01"},
        json={
            "model": MODEL_NAME,
            "max_tokens": 200,
            "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "any"},
            "stream": True,
        },
        timeout=60,
    ) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())  # read to its end: a client that leaves early cancels the request
        assert any("tool_use" in line for line in lines)
        ids.append(r.headers["x-request-id"])
    ids.append(ask(fleet, fleet.key, chat("and the tests")))
    assert stream_length(client, 3) == 3
    assert drain_traffic_trace() == 3
    seen = {e.request_id: e for e in TrafficTraceEntry.objects.all()}
    streamed, tool_call, whole = (seen[i] for i in ids)
    assert streamed.output_tokens == 12 and streamed.output_before_visible == 0
    # `<tool_call>`, a newline and `{"name": "get_weather"` come before the block opens; arguments follow it.
    assert 3 <= tool_call.output_before_visible < tool_call.output_tokens - 3, (
        tool_call.output_before_visible,
        tool_call.output_tokens,
    )
    assert whole.output_before_visible == whole.output_tokens - 1 == 2
