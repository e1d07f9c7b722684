"""The agent-scale benchmark (bench/agent_scale.py): its traffic as the real CLIs send it, the balancer's choice, the
CPU arithmetic, and a tiny run of the whole benchmark whose table must hold sane numbers."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import pytest

from bench import agent_scale as a
from routing.rendering.tokenize import RouterTokenizer

unit = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)


@pytest.fixture(scope="module")
def shapes():
    cpt = a.chars_per_token()
    return a.Texts(cpt), {k: a.Shape.load(k, "ipk_bench", cpt) for k in ("claude-code", "codex")}


@unit
def test_agents_send_what_the_real_clis_send_with_their_own_session(shapes):
    texts, by_kind = shapes
    agents = a.make_agents(2, by_kind, texts, 60_000, seed=3)
    claude, codex = agents
    assert claude.shape.path == "/v1/messages?beta=true" and codex.shape.path == "/v1/responses"
    head = claude.conv.headers()
    assert head["X-Claude-Code-Session-Id"] == claude.session and head["x-api-key"] == "ipk_bench"
    body = claude.conv.payload()
    assert claude.session in body["metadata"]["user_id"] and len(body["tools"]) == 12
    assert body["messages"][-1]["content"][0]["type"] == "tool_result"  # started mid-life, after tool calls
    head = codex.conv.headers()
    assert head["session-id"] == codex.session and head["x-codex-window-id"] == f"{codex.session}:0"
    assert codex.session in head["x-codex-turn-metadata"] and head["Authorization"] == "Bearer ipk_bench"
    body = codex.conv.payload()
    assert body["prompt_cache_key"] == codex.session and body["input"][-1]["type"] == "function_call_output"
    # The same seed, the same traffic: every phase replays it.
    again = a.make_agents(2, by_kind, texts, 60_000, seed=3)
    assert again[0].conv.payload() == claude.conv.payload()


@unit
def test_conversations_grow_and_sub_agents_share_only_the_parents_system_prompt_and_tools(shapes):
    texts, by_kind = shapes
    tokenizer = RouterTokenizer(a.ROOT / "models" / a.MODEL)
    for kind, path in (("claude-code", "/v1/messages"), ("codex", "/v1/responses")):
        shape = by_kind[kind]
        conv = a.Conversation(shape, "s-1", "s-1-c0", "Fix the failing test.", texts)
        rng = random.Random(1)
        for turn in range(6):
            conv.add_round(rng, turn)
        before = tokenizer.encode_request(conv.payload(), path)
        # The estimate that sizes contexts is close to what the router counts.
        assert 0.8 < conv.tokens / len(before) < 1.25
        conv.add_subagents(["Find the callers of helper_0."], ["Found 3 callers."])
        conv.add_round(rng, 7)
        after = tokenizer.encode_request(conv.payload(), path)
        assert list(after[: len(before) - 8]) == list(before[: len(before) - 8])  # it grew at its end
        sub = a.Conversation(shape, "s-1", "s-1-c0-s1-0", "Find the callers of helper_0.", texts, sub=True)
        ids = tokenizer.encode_request(sub.payload(), path)
        shared = next(i for i, (x, y) in enumerate(zip(ids, before, strict=False)) if x != y)
        assert shared > 5_000  # the system prompt and the tools, then its own task
        if kind == "codex":
            assert sub.headers()["x-codex-window-id"] == "s-1-c0-s1-0:0"
            assert sub.headers()["session-id"] == "s-1"


@unit
def test_the_balancer_sends_in_turn_or_by_the_agents_session_header():
    claude = b"POST /v1/messages HTTP/1.1\r\nX-Claude-Code-Session-Id: abc\r\nHost: x\r\n\r\n"
    codex = b"POST /v1/responses HTTP/1.1\r\nsession-id: abc\r\nx-codex-window-id: abc:0\r\n\r\n"
    plain = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n"
    assert [a.pick_replica(claude, 4, "rr", turn) for turn in range(5)] == [0, 1, 2, 3, 0]
    assert {a.pick_replica(claude, 4, "session", turn) for turn in range(5)} == {
        a.pick_replica(codex, 4, "session", 9)
    }
    assert a.pick_replica(plain, 4, "session", 6) == 2  # no session named: in turn
    head = a.close_head(b"POST / HTTP/1.1\r\nConnection: keep-alive\r\nHost: x\r\n\r\n")
    assert head == b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def _record(
    conv: str, seq: int, replica: int | None, sent: float, done: float, new: bool = False
) -> a.Record:
    return a.Record(
        0, conv, seq, "main", new, 100, sent=sent, done=done, status=200, ttft=0.01, replica=replica
    )


@unit
def test_requests_are_cold_warm_or_new_by_the_replica_that_served_the_conversation_before():
    recs = [
        _record("c", 0, 0, 0.0, 1.0),  # the conversation's first in the phase: unseen
        _record("c", 1, 0, 2.0, 3.0),  # the same replica: warm
        _record("c", 2, 1, 4.0, 5.0),  # another: cold, unseen there
        _record("c", 3, 0, 6.0, 7.0),  # back on replica 0, which missed one turn: cold, not unseen
        _record("s", 0, 1, 0.5, 0.8, new=True),  # a sub-agent's first request
    ]
    a.classify(recs)
    assert [(r.klass, r.unseen) for r in recs] == [
        ("cold", True),
        ("warm", False),
        ("cold", True),
        ("cold", False),
        ("new", False),
    ]


@unit
def test_cpu_between_readings_goes_to_the_requests_in_flight_those_before_their_first_token_first():
    ms = 1_000_000  # ns
    first = _record("a", 0, 0, 1.0, 3.0)
    first.first = 2.0
    second = _record("b", 0, 0, 2.0, 4.0)
    second.first = 3.0
    other = _record("c", 0, 1, 1.0, 4.0)
    samples = [
        (0.0, [0, 0]),
        (1.0, [5 * ms, 0]),  # idle work before anything: nobody's
        (2.0, [15 * ms, 7 * ms]),  # first alone on replica 0: 10 ms; other alone on replica 1
        (3.0, [35 * ms, 7 * ms]),  # both in flight, first streaming: second's 20 ms
        (4.0, [41 * ms, 9 * ms]),  # second alone again
    ]
    result = a.PhaseResult([first, second, other], 4.0, samples)
    a.attribute(result, 2)
    assert (first.cpu_ms, first.alone_ms) == (10.0, 10.0)
    assert (second.cpu_ms, second.alone_ms) == (26.0, 6.0)
    assert (other.cpu_ms, other.alone_ms) == (9.0, 9.0)
    both = _record("d", 0, 0, 0.0, 1.0)  # two waiting at once: equal shares
    again = _record("e", 0, 0, 0.0, 1.0)
    a.attribute(a.PhaseResult([both, again], 1.0, [(0.0, [0]), (1.0, [8 * ms])]), 1)
    assert both.cpu_ms == again.cpu_ms == 4.0 and both.alone_ms == 0


@unit
def test_loop_lag_percentiles_are_bucket_bounds_over_the_phase():
    before = {
        "router_event_loop_lag_seconds_bucket@0.001": 50.0,
        "router_event_loop_lag_seconds_bucket@0.01": 50.0,
    }
    before |= {
        "router_event_loop_lag_seconds_bucket@0.25": 50.0,
        "router_event_loop_lag_seconds_bucket@+Inf": 50.0,
    }
    after = {
        "router_event_loop_lag_seconds_bucket@0.001": 148.0,
        "router_event_loop_lag_seconds_bucket@0.01": 149.0,
    }
    after |= {
        "router_event_loop_lag_seconds_bucket@0.25": 150.0,
        "router_event_loop_lag_seconds_bucket@+Inf": 150.0,
    }
    p99, top, count = a.lag_bounds(before, after)
    assert (p99, top, count) == (0.01, 0.25, 100)


def test_a_tiny_run_prints_both_tables_with_sane_numbers():
    """The whole benchmark, small: two agents, R = 1 and 2, no peer. Needs the suite's PostgreSQL and Redis."""
    cmd = [sys.executable, "-m", "bench.agent_scale", "--sessions", "2", "--duration", "5", "--rate", "3"]
    cmd += ["--replicas", "1", "2", "--max-context", "30000", "--skip-peer", "--engines", "2"]
    run = subprocess.run(cmd, cwd=a.ROOT, env=os.environ, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:  # once more: a port another test took between its choice and its use
        first = run.stderr[-3000:]
        run = subprocess.run(cmd, cwd=a.ROOT, env=os.environ, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"{first}\n--- again ---\n{run.stderr[-3000:]}"
    lines = run.stdout.splitlines()
    cpu_head = next(line for line in lines if line.startswith("| router | R | requests"))
    assert "cold: n: mean / p50 / p99" in cpu_head and "warm: n: mean / p50 / p99" in cpu_head
    lat_head = next(line for line in lines if line.startswith("| router | R | prompt tokens"))
    for column in (
        "TTFT p50 / p99",
        "loop lag p99 / max",
        "lookups: fallbacks / late",
        "predicted / reported",
    ):
        assert column in lat_head
    ours = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ours |")]
    cpu_rows = [cells for cells in ours if cells[2].endswith(")")]  # requests (errors)
    lat_rows = [cells for cells in ours if not cells[2].endswith(")")]
    assert [cells[1] for cells in cpu_rows] == ["1", "2"] and [cells[1] for cells in lat_rows] == ["1", "2"]
    for cells in cpu_rows:
        ok, errors = re.match(r"(\d+) \((\d+)\)", cells[2]).groups()
        assert int(ok) >= 4 and errors == "0"
        mean = float(cells[4].split("/")[0].replace(",", ""))
        assert 0.5 < mean < 2000  # ms of router CPU per request
    for cells in lat_rows:
        assert 0.9 <= float(cells[9].split()[0]) <= 1.1  # predicted / reported
        router_mb, tree_mb = (float(x) for x in cells[10].split("/"))
        assert 50 < router_mb <= tree_mb < 4000
    assert "cores(R) = rate x c(R) + R x idle" in run.stdout
    assert re.search(r"^\| 8 \| not run \|", run.stdout, re.M)
