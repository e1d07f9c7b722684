"""A what-if's traffic multipliers (planner/whatif_traffic.py): whole agents copied or sampled, copies sharing no
prefix with the recorded traffic or with each other, and the export's rows read as the planner reads a trace."""

from __future__ import annotations

import pytest

from planner.trace import TRACE_BLOCK_TOKENS, TraceRequest, ceiling
from planner.whatif_traffic import RecordedTrace, Traffic, copies_of, held_blocks, multiply, trace_from_rows

pytestmark = pytest.mark.unit


def conversation(tenant: str, session: str, turns: int, first_id: int, start_s: float) -> list[TraceRequest]:
    """An agent's conversation: each turn's prompt is the one before plus a block (ids first_id...)."""
    return [
        TraceRequest(
            0,
            start_s + turn,
            (turn + 2) * TRACE_BLOCK_TOKENS + 100,
            40,
            tuple(range(first_id, first_id + turn + 3)),
            tenant,
            session,
        )
        for turn in range(turns)
    ]


def recorded(sessions_per_tenant: int = 40, turns: int = 3) -> RecordedTrace:
    requests = []
    for t, tenant in enumerate(("1", "2")):
        for s in range(sessions_per_tenant):
            first = (t * sessions_per_tenant + s) * 100
            requests += conversation(tenant, f"{tenant}-{s}", turns, first, start_s=s * 0.5)
    requests.sort(key=lambda r: (r.arrival_s, r.session))
    numbered = [
        TraceRequest(i, r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids, r.tenant, r.session)
        for i, r in enumerate(requests)
    ]
    teams = {r.index: ("10" if r.tenant == "1" else "20") for r in numbered}
    return RecordedTrace(numbered, teams)


def of(requests, tenant):
    return [r for r in requests if r.tenant == tenant]


def test_unchanged_traffic_is_the_recording():
    trace = recorded()
    assert multiply(trace, Traffic()) == trace.requests


def test_x2_doubles_a_tenant_and_leaves_the_other_alone():
    trace = recorded()
    out = multiply(trace, Traffic(tenants={"1": 2.0}))
    assert len(of(out, "1")) == 2 * len(of(trace.requests, "1"))
    assert of(out, "2") and len(of(out, "2")) == len(of(trace.requests, "2"))
    assert [r.index for r in out] == list(range(len(out)))
    assert [r.arrival_s for r in out] == sorted(r.arrival_s for r in out)


def test_copies_share_no_prefix_with_the_recording_nor_with_each_other():
    trace = recorded()
    out = multiply(trace, Traffic(tenants={"1": 3.0}))
    recorded_ids = {h for r in trace.requests for h in r.hash_ids}
    by_copy: dict[str, set[int]] = {}
    for r in of(out, "1"):
        copy = r.session.split("~")[1] if "~" in r.session else "0"
        by_copy.setdefault(copy, set()).update(r.hash_ids)
    assert sorted(by_copy) == ["0", "1", "2"]
    assert by_copy["0"] <= recorded_ids
    assert not by_copy["1"] & recorded_ids and not by_copy["2"] & recorded_ids
    assert not by_copy["1"] & by_copy["2"]
    # Within a copy, a conversation still reuses its own prefix turn after turn: the copy's cacheable share is
    # the recording's.
    copy1 = [r for r in of(out, "1") if r.session.endswith("~1")]
    assert ceiling(copy1) == ceiling(of(trace.requests, "1"))
    # And the three copies together reuse no more than three recordings would: nothing across copies.
    cached, total = ceiling(of(out, "1"))
    one_cached, one_total = ceiling(of(trace.requests, "1"))
    assert (cached, total) == (3 * one_cached, 3 * one_total)


def test_a_copy_keeps_prefixes_its_units_shared_with_each_other():
    """Two recorded conversations that open with the same blocks (a shared system prompt) still share them in
    a copy, with the copy's ids."""
    a = TraceRequest(0, 0.0, 3 * TRACE_BLOCK_TOKENS, 10, (1, 2, 3), "1", "a")
    b = TraceRequest(1, 1.0, 3 * TRACE_BLOCK_TOKENS, 10, (1, 2, 9), "1", "b")
    out = multiply(RecordedTrace([a, b], {}), Traffic(tenants={"1": 2.0}))
    copies = [r for r in out if r.session.endswith("~1")]
    assert copies[0].hash_ids[:2] == copies[1].hash_ids[:2]
    assert not set(copies[0].hash_ids) & {1, 2, 3, 9}


def test_a_fraction_keeps_whole_conversations_about_that_share():
    trace = recorded(sessions_per_tenant=400)
    out = multiply(trace, Traffic(tenants={"1": 0.5}))
    kept = of(out, "1")
    sessions = {r.session for r in kept}
    assert 0.4 * 400 < len(sessions) < 0.6 * 400
    assert len(kept) == 3 * len(sessions)  # every kept conversation has all its turns
    assert multiply(trace, Traffic(tenants={"1": 0.5})) == out  # the same draw every time


def test_x0_removes_a_tenant_and_a_team_multiplier_beats_its_tenants():
    trace = recorded()
    assert not of(multiply(trace, Traffic(tenants={"1": 0.0})), "1")
    out = multiply(trace, Traffic(tenants={"1": 0.0}, teams={"10": 2.0}))
    assert len(of(out, "1")) == 2 * len(of(trace.requests, "1"))
    assert not multiply(trace, Traffic(everyone=0.0))


def test_a_fractional_multiplier_above_one():
    assert copies_of("u", 2.0) == 2
    assert copies_of("u", 0.0) == 0
    draws = [copies_of(f"u{i}", 1.25) for i in range(2000)]
    assert set(draws) == {1, 2}
    assert 0.2 < draws.count(2) / 2000 < 0.3


def test_the_block_ids_a_replay_holds_are_counted_before_the_copies_are_made():
    """The recording's ids once (the baseline replays it, even a tenant multiplied by 0), and each further copy's
    own: what the replays hold, whether the fraction drew a unit or not."""
    trace = recorded()
    blocks = sum(len(r.hash_ids) for r in trace.requests)
    assert held_blocks(trace, Traffic()) == blocks
    traffic = Traffic(tenants={"1": 2.5, "2": 0.0})
    replayed = multiply(trace, traffic)
    removed = of(trace.requests, "2")
    assert held_blocks(trace, traffic) == sum(len(r.hash_ids) for r in replayed + removed)
    assert held_blocks(trace, traffic) > blocks


def test_export_rows_read_as_a_trace_with_their_teams():
    rows = [
        {
            "timestamp": 0,
            "input_length": 1100,
            "output_length": 5,
            "hash_ids": [0, 1, 2],
            "tenant": 7,
            "team": 70,
            "session": 0,
        },
        {
            "timestamp": 250,
            "input_length": 600,
            "output_length": 0,
            "hash_ids": [3, 4],
            "tenant": 8,
            "team": 80,
            "session": None,
        },
    ]
    trace = trace_from_rows(rows)
    assert [(r.tenant, r.session, r.arrival_s, r.output_tokens) for r in trace.requests] == [
        ("7", "0", 0.0, 5),
        ("8", None, 0.25, 1),
    ]
    assert trace.teams == {0: "70", 1: "80"}
    out = multiply(trace, Traffic(teams={"80": 2.0}))
    assert [r.tenant for r in out] == ["7", "8", "8"]
