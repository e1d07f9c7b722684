"""The fleet simulator's invariants, on small slices of the public traces and on made-up ones."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from planner.profile import Profile
from planner.report import seen_ttft, summarize
from planner.sim import Simulation, simulate
from planner.trace import TraceRequest, assign_tenants, ceiling, load_trace, parse, tenant_rule
from routing.scheduling.pipeline import REGISTRY

pytestmark = pytest.mark.unit

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
CONVERSATION = TRACES / "mooncake_conversation_trace.jsonl"
needs_traces = pytest.mark.skipif(not CONVERSATION.exists(), reason="the public traces are not here")

FAST = Profile(name="test", kv_capacity_tokens=200_000, max_num_seqs=16)


def conversation(limit: int) -> list[TraceRequest]:
    return load_trace(CONVERSATION, limit)


def made_up(n: int = 60, gap_s: float = 0.05) -> list[TraceRequest]:
    """Conversations of growing prompts over a shared first block, interleaved."""
    out = []
    for i in range(n):
        conv, turn = i % 5, i // 5
        blocks = (1, *(100 * conv + 10 + k for k in range(turn + 2)))
        out.append(TraceRequest(i, i * gap_s, len(blocks) * 512 - 100, 20 + i % 7, blocks))
    return out


def test_parse_reads_the_mooncake_form():
    rows = parse(
        [
            '{"timestamp": 1500, "input_length": 1100, "output_length": 3, "hash_ids": [7, 8, 9]}',
            "",
            '{"timestamp": 500, "input_length": 10, "output_length": 0, "hash_ids": [7]}',
        ]
    )
    assert [r.arrival_s for r in rows] == [0.5, 1.5]
    assert rows[0].output_tokens == 1  # at least the one token a prefill samples
    assert rows[1].full_blocks() == (7, 8)  # the partial last block is not cacheable
    assert rows[0].output_before_visible == 0  # the public traces do not say: every first token seen
    ours = parse(
        [
            '{"timestamp": 0, "input_length": 600, "output_length": 9, "hash_ids": [1, 2], '
            '"output_before_visible": 5}'
        ]
    )
    assert ours[0].output_before_visible == 5


def test_a_first_token_the_client_did_not_see_is_timed_when_it_saw_one():
    """TTFT as the client saw it: where the trace says it saw nothing of the first k output tokens, the time
    its sequence had made k + 1, between its first and last token as evenly spaced; none unseen, the first."""
    base = made_up(20)
    unseen = {3: 4, 7: 100, 11: 1}  # 100: more than the answer has, so its last token
    trace = [replace(r, output_before_visible=unseen.get(r.index, 0)) for r in base]
    plain = {s.request.index: s for s in simulate(base, 2, FAST, "precise").seqs}
    seen = {s.request.index: s for s in simulate(trace, 2, FAST, "precise").seqs}
    for i, s in seen.items():
        assert (s.first_token_s, s.finished_s) == (plain[i].first_token_s, plain[i].finished_s)  # same run
        out, k = s.request.output_tokens, min(unseen.get(i, 0), s.request.output_tokens - 1)
        step = (s.finished_s - s.first_token_s) / (out - 1)
        expected = s.first_token_s + k * step - s.request.arrival_s
        assert seen_ttft(s) == pytest.approx(expected)
        assert seen_ttft(s) >= seen_ttft(plain[i]) - 1e-12
    assert seen_ttft(seen[7]) == pytest.approx(seen[7].finished_s - seen[7].request.arrival_s)
    assert (
        summarize(simulate(trace, 2, FAST, "precise")).ttft_p90
        >= summarize(simulate(base, 2, FAST, "precise")).ttft_p90
    )


def test_tenant_rules():
    rows = made_up(10)
    assert {r.tenant for r in assign_tenants(rows, tenant_rule("index", 3))} == {"t0", "t1", "t2"}
    by_prefix = assign_tenants(rows, tenant_rule("prefix", 4))
    # A conversation keeps its tenant.
    for r in by_prefix:
        assert r.tenant == by_prefix[r.index % 5].tenant


@pytest.mark.parametrize("mode", ["precise", "approximate", "least_loaded", "round_robin"])
def test_every_request_finishes_once_and_tokens_are_conserved(mode):
    rows = made_up(80, gap_s=0.01)
    result = simulate(rows, 3, FAST.with_(kv_capacity_tokens=20 * 512), mode)
    assert sorted(s.request.index for s in result.seqs) == list(range(80))
    for s in result.seqs:
        assert s.first_token_s >= s.request.arrival_s
        assert s.finished_s >= s.first_token_s
        assert s.generated == s.request.output_tokens
        assert 0 <= s.cached_tokens < s.request.input_tokens
    for engine in result.engine_objs:
        assert not engine.running and not engine.waiting
        assert engine.private_total == 0
        assert all(count == 0 for count in engine.ref.values())  # nothing left pinned
    summary = summarize(result)
    assert summary.finished == 80


def test_a_cache_never_exceeds_its_capacity_and_preempts_when_full():
    rows = [replace(r, output_tokens=600) for r in made_up(40, gap_s=0.001)]
    profile = FAST.with_(kv_capacity_tokens=24 * 512, max_num_seqs=32)
    result = simulate(rows, 2, profile, "least_loaded")
    for engine in result.engine_objs:
        assert engine.peak_resident <= engine.capacity
    assert sum(e.preemptions for e in result.engine_objs) > 0
    assert all(s.generated == s.request.output_tokens for s in result.seqs)


def test_an_infinite_cache_reaches_the_ceiling_computed_independently():
    # One engine, arrivals far apart: each request finds every block an earlier one computed.
    rows = [replace(r, arrival_s=r.index * 100.0) for r in made_up(40)]
    summary = summarize(simulate(rows, 1, FAST.with_(kv_capacity_tokens=0), "precise"))
    cached, total = 0, 0
    seen: set[int] = set()
    for r in rows:  # counted here by hand, not by planner.trace.ceiling
        full = r.hash_ids[: r.input_tokens // 512]
        n = next((i for i, h in enumerate(full) if h not in seen), len(full))
        cached += min(n * 512, r.input_tokens - 1)
        total += r.input_tokens
        seen.update(full)
    assert summary.hit_share == pytest.approx(cached / total)
    assert ceiling(rows) == (cached, total)


@needs_traces
def test_an_infinite_cache_reaches_the_ceiling_on_the_conversation_trace():
    rows = [replace(r, arrival_s=r.index * 1000.0) for r in conversation(300)]
    summary = summarize(simulate(rows, 1, FAST.with_(kv_capacity_tokens=0), "round_robin"))
    assert summary.hit_share == pytest.approx(summary.ceiling_share)


@needs_traces
def test_precise_routing_beats_round_robin_on_hit_share():
    rows = conversation(1500)
    profile = FAST.with_(kv_capacity_tokens=2_000_000, max_num_seqs=64)
    precise = summarize(simulate(rows, 4, profile, "precise"))
    rr = summarize(simulate(rows, 4, profile, "round_robin"))
    assert precise.hit_share > rr.hit_share + 0.05
    assert precise.hit_share <= precise.ceiling_share + 1e-9


class Pinned:
    """Scores one endpoint 1, the rest 0."""

    def __init__(self, endpoint: int):
        self.endpoint = endpoint

    def score(self, ctx, candidates, policy):
        return [1.0 if c.endpoint.id == self.endpoint else 0.0 for c in candidates]


def test_the_routing_goes_through_the_platforms_pipeline():
    from routing.scheduling.pipeline import Pipeline

    registry = REGISTRY.copy()
    # Weighed by the prefix weight (3.0 by default): more than any load score can make up.
    registry.scorer("pinned", Pinned(3), weight="prefix_weight")
    registry.mode("pinned", ("not_excluded", "pinned", "queue"))
    picks = []
    sim = Simulation(
        made_up(30), 4, FAST, "pinned", pipeline=Pipeline(registry), on_pick=lambda r, e: picks.append(e)
    )
    result = sim.run()
    assert picks == [3] * 30
    assert result.picks == {1: 0, 2: 0, 3: 30, 4: 0}
    assert "pinned" not in REGISTRY.scorers  # the router's registry is untouched


def test_the_pipeline_reads_the_virtual_clock():
    seen = []

    class Clocked:
        def score(self, ctx, candidates, policy):
            seen.append(ctx.now)
            return [0.0] * len(candidates)

    from routing.scheduling.pipeline import Pipeline

    registry = REGISTRY.copy()
    registry.scorer("clocked", Clocked(), weight="queue_weight", key="clocked")
    registry.mode("clocked", ("clocked", "fewest_sent_lately"))
    rows = made_up(5, gap_s=7.0)
    Simulation(rows, 2, FAST, "clocked", pipeline=Pipeline(registry)).run()
    assert seen == [r.arrival_s for r in rows]


def test_no_routing_module_reads_the_time_during_a_pick():
    """Every plugin of a pick reads ctx.now, which the pipeline sets from its clock: none imports `time`."""
    import routing.scheduling.picker
    import routing.scheduling.scorers.queue
    import routing.scheduling.steps

    for module in (routing.scheduling.picker, routing.scheduling.steps, routing.scheduling.scorers.queue):
        assert not hasattr(module, "time"), module.__name__


def test_round_robin_spreads_evenly():
    result = simulate(made_up(40), 4, FAST, "round_robin")
    assert sorted(result.picks.values()) == [10, 10, 10, 10]


def test_report_per_tenant_and_cost():
    rows = assign_tenants(made_up(60), tenant_rule("index", 2))
    summary = summarize(simulate(rows, 2, FAST.with_(gpu_price_per_hour=4.0, gpus_per_engine=2), "precise"))
    assert set(summary.per_tenant) == {"t0", "t1"}
    assert sum(t["work_share"] for t in summary.per_tenant.values()) == pytest.approx(1.0)
    assert summary.gpu_hours == pytest.approx(2 * summary.engine_hours)
    assert summary.cost == pytest.approx(summary.gpu_hours * 4.0)
    assert summary.ttft_p50 > 0 and summary.itl_p50 > 0


def test_the_command_line_runs_pd_pools_under_their_autoscalers(tmp_path, capsys):
    """`python -m planner` with a prefill pool, each pool under its autoscaler; --prefill-autoscale alone is an
    error that says what it needs."""
    import json

    from planner.__main__ import main

    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {"timestamp": i * 50, "input_length": 4000, "output_length": 20, "hash_ids": [i, i + 1000]}
            )
            + "\n"
            for i in range(200)
        )
    )
    args = ["--trace", str(trace), "--engines", "1", "--profile", "sim-bench", "--startup", "2"]
    assert (
        main([*args, "--prefill-engines", "1", "--autoscale", "1", "3", "--prefill-autoscale", "1", "3"]) == 0
    )
    out = capsys.readouterr().out
    assert "| requests finished | 200/200 |" in out
    assert "| engines ready (fewest-most) | 2-" in out
    with pytest.raises(SystemExit):
        main([*args, "--prefill-autoscale", "1", "3"])
    assert "--prefill-autoscale needs --prefill-engines" in capsys.readouterr().err
