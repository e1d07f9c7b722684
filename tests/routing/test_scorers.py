"""The routing pipeline's scorers and picker on their own: plain data in, an endpoint out (no processes)."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from routing.info import DeploymentInfo, EndpointInfo, PolicyInfo
from routing.kvindex.prefix_index import Held
from routing.scheduling.load import RECENT_WINDOW_S, EndpointLoad
from routing.scheduling.picker import prefill_ahead
from routing.scheduling.pipeline import Candidate, Pipeline, RequestContext
from routing.scheduling.scorers.prefix_match import distinct_shares
from routing.scheduling.steps import request_weight

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)


def deployment(count: int, mode: str = "precise") -> DeploymentInfo:
    endpoints = tuple(EndpointInfo(i, f"e{i}", f"http://e{i}", "both", 1) for i in range(count))
    return DeploymentInfo(1, "tiny", "tiny", 4096, 128, PolicyInfo(mode=mode), endpoints, 0)


def test_blocks_most_candidates_hold_do_not_set_one_apart():
    # Six of eight engines hold a 16-block system prompt of a 25-block prompt; two hold nothing.
    assert distinct_shares([16, 16, 16, 16, 16, 16, 0, 0], 25) == [0.0] * 8
    # One engine also holds this session's context: it alone scores, by what it holds beyond the others.
    shares = distinct_shares([24, 16, 16, 16, 16, 16, 0, 0], 25)
    assert shares[0] == 8 / 9 and shares[1:] == [0.0] * 7
    # With two candidates there is no majority to discount.
    assert distinct_shares([16, 0], 25) == [16 / 25, 0.0]
    assert distinct_shares([], 0) == []


def test_new_sessions_spread_over_engines_that_hold_only_the_shared_system_prompt():
    dep = deployment(8)
    pipeline = Pipeline()
    loads = {i: EndpointLoad() for i in range(8)}
    held = {i: Held(gpu=16) for i in range(6)}  # engines 6 and 7 have seen nothing yet
    chosen = Counter()
    for _ in range(16):
        ctx = RequestContext(model="tiny", block_keys=["k"] * 25, block_count=25, held=held)
        pick, _ = pipeline.choose(dep, ctx, loads)
        chosen[pick.endpoint.id] += 1
    assert chosen == {i: 2 for i in range(8)}  # every engine, evenly


def test_a_new_session_goes_where_fewer_requests_were_sent_lately():
    # Sessions stick to the engine holding their context, so where a new one lands decides the balance for
    # its whole life: among engines that score the same, the ones sent the fewest requests lately come first.
    dep = deployment(8)
    pipeline = Pipeline()
    loads = {i: EndpointLoad() for i in range(8)}
    now = time.monotonic()
    for i in range(4):  # engines 0-3 serve live sessions (nothing in flight at this instant)
        for _ in range(6):
            loads[i].assigned(now, RECENT_WINDOW_S)
    chosen = Counter()
    for _ in range(8):
        ctx = RequestContext(model="tiny", block_keys=["k"] * 25, block_count=25, held={})
        pick, _ = pipeline.choose(dep, ctx, loads)
        pick.load.assigned(time.monotonic(), RECENT_WINDOW_S)  # as the router does on sending
        chosen[pick.endpoint.id] += 1
    assert chosen == {4: 2, 5: 2, 6: 2, 7: 2}


def test_a_conversation_stays_with_its_holder_while_it_has_a_request_in_flight():
    dep = deployment(4)
    loads = {i: EndpointLoad() for i in range(4)}
    loads[0].active = 1  # the holder is serving the previous turn's sub-agent
    ctx = RequestContext(model="tiny", block_keys=["k"] * 100, block_count=100, held={0: Held(gpu=45)})
    pick, candidates = Pipeline().choose(dep, ctx, loads)
    assert pick.endpoint.id == 0
    assert candidates[0].scores["queue"] < candidates[1].scores["queue"]  # the load still counts against it


def test_a_deep_queue_outweighs_a_cached_prefix():
    dep = deployment(4)
    loads = {i: EndpointLoad() for i in range(4)}
    loads[0].waiting = 12
    ctx = RequestContext(model="tiny", block_keys=["k"] * 100, block_count=100, held={0: Held(gpu=45)})
    pick, _ = Pipeline().choose(dep, ctx, loads)
    assert pick.endpoint.id != 0


def test_the_queue_score_counts_requests_other_router_replicas_have_in_flight():
    dep = deployment(2)
    loads = {0: EndpointLoad(others_active=6), 1: EndpointLoad()}
    ctx = RequestContext(model="tiny", block_keys=["k"] * 10, block_count=10, held={})
    pick, candidates = Pipeline().choose(dep, ctx, loads)
    assert candidates[0].scores["queue"] == 0.0 and candidates[1].scores["queue"] == 1.0
    assert pick.endpoint.id == 1


def test_a_long_prefill_in_progress_sends_the_next_cold_prompt_elsewhere():
    # Both engines have one request in flight; engine 0's is still computing a 20,000-token prompt, engine 1's
    # is decoding. A cold 8,000-token prompt would wait behind that prefill on engine 0.
    dep = deployment(2)
    loads = {0: EndpointLoad(active=1, prefill=20_000), 1: EndpointLoad(active=1)}
    ctx = RequestContext(model="tiny", prompt_tokens_estimate=8000, block_keys=["k"] * 62, block_count=62)
    pick, candidates = Pipeline().choose(dep, ctx, loads)
    assert candidates[0].scores["queue"] == candidates[1].scores["queue"]  # the same count of requests
    assert candidates[0].scores["prefill"] == 0.0 and candidates[1].scores["prefill"] == 1.0
    assert pick.endpoint.id == 1


def test_the_prefill_backlog_is_counted_in_the_prompts_own_length_and_from_every_replica():
    dep = deployment(3)
    loads = {0: EndpointLoad(prefill=1000), 1: EndpointLoad(others_prefill=2000), 2: EndpointLoad()}
    ctx = RequestContext(model="tiny", prompt_tokens_estimate=4000, block_keys=["k"] * 31, block_count=31)
    _, candidates = Pipeline().choose(dep, ctx, loads)
    assert [c.scores["prefill"] for c in candidates] == [0.75, 0.5, 1.0]


def test_the_prefill_backlog_drains_at_the_speed_the_engine_showed():
    load = EndpointLoad()
    first = load.prefill_began(10_000, now=0.0)
    assert load.prefill_left(0.5) == 10_000  # no speed known yet: the whole backlog
    load.prefill_ended(first, now=1.0)  # its first token a second after it was sent: 0.1 ms per token
    assert load.prefill_s_per_token == 1e-4 and load.prefill == 0
    head = load.prefill_began(10_000, now=10.0)
    behind = load.prefill_began(4_000, now=10.2)
    # Half a second into the oldest, half of it is computed; the one behind it has not begun.
    assert abs(load.prefill_left(10.5) - 9_000) < 1e-6
    # Past its expected end, the oldest counts as done, never more: what is behind it is still to come.
    assert load.prefill_left(12.0) == 4_000
    # A prefill that ends out of turn leaves the lane without teaching the speed; the oldest is still where it was.
    load.prefill_ended(behind, now=10.6)
    assert load.prefill_s_per_token == 1e-4 and abs(load.prefill_left(10.5) - 5_000) < 1e-6
    # Prefills of equal size are told apart: a fully cached one behind a fully cached oldest ends first, and
    # the oldest is still the oldest (its lane position, not its size, decides).
    cached_head, cached_behind = load.prefill_began(0, now=10.7), load.prefill_began(0, now=10.8)
    load.prefill_ended(cached_behind, now=10.9)
    assert load._lane[-1] is cached_head and len(load._lane) == 2
    load.prefill_ended(cached_head, now=10.95)
    # The oldest ending without a first token (an answer not streamed) does not teach it either.
    load.prefill_ended(head, now=11.0, first_token=False)
    assert load.prefill_s_per_token == 1e-4 and load.prefill_left(11.0) == 0
    # A prompt the engine found cached comes back fast: the estimate moves a fifth of the way to half of it.
    quick = load.prefill_began(10_000, now=20.0)
    load.prefill_ended(quick, now=20.01)
    assert abs(load.prefill_s_per_token - (1e-4 + (0.5e-4 - 1e-4) / 5)) < 1e-12
    # Short prefills are mostly the engine's fixed overhead: they teach nothing.
    short = load.prefill_began(500, now=30.0)
    load.prefill_ended(short, now=31.0)
    assert abs(load.prefill_s_per_token - 0.9e-4) < 1e-12


def test_a_cold_prompt_goes_where_the_prefill_ahead_ends_soonest_not_where_fewer_tokens_are_queued():
    # Engine 0 has 20,000 tokens to prefill, three quarters of them computed by now; engine 1 has 12,000 that
    # have not begun (its oldest was sent just now). Counted in tokens sent, engine 1 looks lighter.
    dep = deployment(2)
    now = time.monotonic()
    loads = {0: EndpointLoad(active=1), 1: EndpointLoad(active=1)}
    for load in loads.values():
        load.prefill_s_per_token = 3e-5  # 30 us per token: 20,000 tokens in 0.6 s
    loads[0].prefill_began(20_000, now - 0.45)
    loads[1].prefill_began(12_000, now)
    ctx = RequestContext(model="tiny", prompt_tokens_estimate=8000, block_keys=["k"] * 62, block_count=62)
    pick, candidates = Pipeline().choose(dep, ctx, loads)
    assert candidates[0].scores["prefill"] > candidates[1].scores["prefill"]
    assert pick.endpoint.id == 0


def test_the_load_guard_weighs_requests_by_the_prefill_they_bring():
    assert request_weight(1000, 0) == 1.0
    assert request_weight(1000, 1000) == 0.25
    assert request_weight(0, 0) == 1.0

    def guarded_after(weight: float) -> bool:
        dep = deployment(4)
        loads = {i: EndpointLoad() for i in range(4)}
        for i in range(1, 4):  # the other engines each compute one fresh prompt
            loads[i].begin()
            loads[i].assigned(time.monotonic(), RECENT_WINDOW_S)
        for _ in range(4):  # four requests in flight on the holder, each of `weight`
            loads[0].begin(weight)
            loads[0].assigned(time.monotonic(), RECENT_WINDOW_S, weight)
        ctx = RequestContext(model="tiny", block_keys=["k"] * 100, block_count=100, held={0: Held(gpu=90)})
        pick, candidates = Pipeline().choose(dep, ctx, loads)
        return candidates[0].guarded

    assert guarded_after(1.0)  # four fresh prompts: the holder is overloaded, its affinity is dropped
    # Four sub-agents whose context the holder has: light work, it keeps them.
    assert not guarded_after(request_weight(9000, 8500))


def test_a_new_session_goes_where_fewer_were_sent_when_the_scores_differ_only_by_a_moment():
    dep = deployment(2)
    loads = {0: EndpointLoad(), 1: EndpointLoad(kv_usage=0.06)}  # engine 1 scores a little lower now
    now = time.monotonic()
    for _ in range(10):
        loads[0].assigned(now, RECENT_WINDOW_S)  # but engine 0 was sent ten requests lately
    ctx = RequestContext(model="tiny", block_keys=["k"] * 10, block_count=10, held={})
    pick, candidates = Pipeline().choose(dep, ctx, loads)
    assert candidates[0].scores["kv_utilization"] > candidates[1].scores["kv_utilization"]
    assert pick.endpoint.id == 1
    # Two more requests in flight is more than a moment's difference: the score decides.
    loads[1].active = 2
    pick, _ = Pipeline().choose(dep, ctx, loads)
    assert pick.endpoint.id == 0


def test_among_equals_the_engine_with_less_prefill_ahead_wins():
    dep = deployment(2)
    now = time.monotonic()
    # Engine 0 decodes two requests (nothing left to prefill); engine 1 has one in flight with 9,000 prompt
    # tokens still to prefill. The scores put them within the tie margin of each other.
    loads = {0: EndpointLoad(active=2), 1: EndpointLoad(active=1, prefill=9000)}
    for _ in range(10):
        loads[0].assigned(now, RECENT_WINDOW_S)  # and engine 0 was sent more lately
    ctx = RequestContext(model="tiny", prompt_tokens_estimate=20000, block_keys=["k"] * 156, block_count=156)
    pick, candidates = Pipeline().choose(dep, ctx, loads)
    totals = [sum(c.scores.values()) for c in candidates]
    assert abs(totals[0] - totals[1]) < 0.5
    assert pick.endpoint.id == 0  # the first token comes 9,000 tokens of prefill sooner there
    # Without a backlog between them, the engine sent fewer lately takes the new session, as before.
    loads[1].prefill = 0
    pick, _ = Pipeline().choose(dep, ctx, loads)
    assert pick.endpoint.id == 1


def test_what_most_engines_hold_does_not_make_equals_unequal():
    # Engines 0-5 hold a system prompt engines 6 and 7 lack: among otherwise equal engines it does not pull
    # new sessions to 0-5 (as in distinct_shares), so they still spread over all eight.
    dep = deployment(8)
    pipeline = Pipeline()
    loads = {i: EndpointLoad() for i in range(8)}
    held = {i: Held(gpu=16) for i in range(6)}
    chosen = Counter()
    for _ in range(16):
        ctx = RequestContext(
            model="tiny", prompt_tokens_estimate=25 * 128, block_keys=["k"] * 25, block_count=25, held=held
        )
        pick, _ = pipeline.choose(dep, ctx, loads)
        chosen[pick.endpoint.id] += 1
    assert chosen == {i: 2 for i in range(8)}


def test_prefill_ahead_counts_the_queue_and_what_the_engine_lacks_beyond_the_common_part():
    dep = deployment(4)
    loads = [EndpointLoad(prefill=1000), EndpointLoad(), EndpointLoad(others_prefill=300), EndpointLoad()]
    candidates = [Candidate(e, load) for e, load in zip(dep.endpoints, loads, strict=True)]
    prompt = 40 * 128
    # Precise: engine 0 holds 30 blocks, 1 and 2 the 10-block system prompt, 3 nothing. The median (10 blocks)
    # is common ground: 3 is not charged for lacking it, 0 is credited for its 20 blocks beyond it.
    held = {0: Held(gpu=20, speculative=10), 1: Held(gpu=10), 2: Held(gpu=10)}
    ctx = RequestContext(model="tiny", prompt_tokens_estimate=prompt, block_count=40, held=held)
    span = prompt - 10 * 128
    assert prefill_ahead(ctx, candidates, 128) == [1000 + span - 20 * 128, span, 300 + span, span]
    # The load guard took engine 0's prefix away: it counts as holding nothing more than the others.
    candidates[0].guarded = True
    assert prefill_ahead(ctx, candidates, 128)[0] == 1000 + prompt
    # Approximate: the blocks this router sent there stand in for what the engine holds.
    candidates[0].guarded = False
    ctx = RequestContext(model="tiny", prompt_tokens_estimate=prompt, block_count=40, approx_held={3: 40})
    assert prefill_ahead(ctx, candidates, 128) == [1000 + prompt, prompt, 300 + prompt, 0]


def test_the_load_guard_spares_a_sessions_engine_while_its_first_token_comes_soonest_there():
    # The session's engine was sent a burst lately and serves two requests now: over the guard's line by load,
    # with almost no prefill queued. Anywhere else the turn would compute its 12,800-token context again. The
    # other engines serve sessions of their own (sent as many over the last half minute, but not lately).
    def pick(session_endpoint: int | None, queued_prefill: float = 0.0, burst: int = 6):
        dep = deployment(4)
        loads = {i: EndpointLoad() for i in range(4)}
        now = time.monotonic()
        for i in range(1, 4):
            for _ in range(8):
                loads[i].assigned(now - 20, RECENT_WINDOW_S)
        for _ in range(burst):
            loads[0].assigned(now, RECENT_WINDOW_S)
        loads[0].begin()
        loads[0].begin()
        loads[0].prefill = queued_prefill
        ctx = RequestContext(
            model="tiny",
            prompt_tokens_estimate=12_900,
            block_keys=["k"] * 100,
            block_count=100,
            held={0: Held(gpu=100)},
            session_endpoint=session_endpoint,
        )
        return Pipeline().choose(dep, ctx, loads)

    chosen, candidates = pick(session_endpoint=0)
    assert chosen.endpoint.id == 0 and not candidates[0].guarded
    # A request of no session there (a new session whose prompt that engine happens to hold) is spread.
    chosen, candidates = pick(session_endpoint=None)
    assert candidates[0].guarded and chosen.endpoint.id != 0
    # With a long prefill queued there, the first token would come sooner elsewhere: guarded after all.
    chosen, candidates = pick(session_endpoint=0, queued_prefill=20_000)
    assert candidates[0].guarded and chosen.endpoint.id != 0
    # An engine sent far more than its share over the last half minute (more sessions live there than
    # elsewhere) is not spared: the session moves, and the fleet evens out.
    chosen, candidates = pick(session_endpoint=0, burst=20)
    assert candidates[0].guarded and chosen.endpoint.id != 0


def test_a_new_session_does_not_follow_a_shared_prompt_to_engines_that_serve_more_than_their_share():
    # Engines 0-3 were the first to hold the system prompt (16 of a new session's 24 blocks) and serve the
    # sessions placed so far; engines 4-7 hold nothing and were sent nothing.
    dep = deployment(8)
    loads = {i: EndpointLoad() for i in range(8)}
    now = time.monotonic()
    for i in range(4):
        for _ in range(6):
            loads[i].assigned(now - 10, RECENT_WINDOW_S)
    held = {i: Held(gpu=16) for i in range(4)}

    def pick(session_id: str | None):
        ctx = RequestContext(
            model="tiny", block_keys=["k"] * 24, block_count=24, held=held, session_id=session_id
        )
        return Pipeline().choose(dep, ctx, loads)

    chosen, candidates = pick("new-session")
    assert chosen.endpoint.id >= 4 and all(c.guarded for c in candidates[:4])
    # A request of no session is not placed for the long run: it takes the prefix.
    chosen, _ = pick(None)
    assert chosen.endpoint.id < 4
