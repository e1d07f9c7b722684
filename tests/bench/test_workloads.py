"""The routing benchmark's workloads and the reuse ceilings its targets are measured against."""

import pytest

from bench import routing_workloads as wl
from bench.routing_workloads import Req

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)

BLOCK = 128  # engine block size; each id expands to 512 tokens, four blocks


def test_ids_expand_to_the_same_tokens_every_time():
    a = Req(0.0, [1, 2], 1000, 4)
    b = Req(0.0, [1, 3], 600, 4)
    ta, tb = wl.prompt_tokens(a), wl.prompt_tokens(b)
    assert len(ta) == 1000 and len(tb) == 600
    assert ta[:512] == tb[:512]  # the same first id, the same first 512 tokens
    assert ta[512:600] != tb[512:600]
    assert all(wl.TOKEN_LO <= t < wl.TOKEN_HI for t in ta + tb)


def test_ceilings_count_leading_blocks_seen_before():
    first = Req(0.0, [1, 2], 1024, 4)  # 8 blocks
    second = Req(1.0, [1, 2, 3], 1536, 4)  # 12 blocks, the first 8 of them first's
    other = Req(2.0, [9], 512, 4)
    c = wl.ceilings([first, second, other], BLOCK, lru_blocks=64)
    assert c["prompt_tokens"] == 1024 + 1536 + 512
    assert c["ceiling"] == 1024 / 3072
    assert c["lru_fleet"] == c["ceiling"]  # room for everything: the LRU is the infinite cache
    # An LRU of 4 blocks keeps only first's last four: second's leading blocks are gone.
    assert wl.ceilings([first, second, other], BLOCK, lru_blocks=4)["lru_fleet"] == 0.0
    # The last prompt token is never served from cache: a repeat of a whole prompt reuses all but its last block.
    assert wl.ceilings([first, first], BLOCK)["ceiling"] == 7 * BLOCK / 2048


def test_the_timed_ceiling_counts_a_prefix_computed_before_the_requests_first_token():
    first = Req(0.0, [1, 2], 1024, 4)
    second = Req(0.1, [1, 2, 3], 1536, 4)
    done_first = {"ok": True, "sent": 0.0, "ttft": 0.05}
    assert wl.timed_ceiling([first, second], [done_first, {"ok": True, "sent": 0.1, "ttft": 0.1}], BLOCK) == (
        1024 / 2560
    )
    # Sent while the first was still prefilling, but its own first token came after that prefill ended: an
    # engine that scheduled it behind the first could have reused it.
    queued = {"ok": True, "sent": 0.02, "ttft": 0.1}
    assert wl.timed_ceiling([first, second], [done_first, queued], BLOCK) == 1024 / 2560
    # Its first token came before the first's prefill ended: it could reuse nothing, while the first, whose
    # first token came later, could have reused all of its own blocks but the last from it.
    early = {"ok": True, "sent": 0.01, "ttft": 0.02}
    assert wl.timed_ceiling([first, second], [done_first, early], BLOCK) == 7 * BLOCK / 2560
    # A prompt is not its own cache; failed requests count neither way.
    assert wl.timed_ceiling([first], [done_first], BLOCK) == 0.0
    assert wl.timed_ceiling([first, second], [{"ok": False}, early], BLOCK) == 0.0


def test_the_ttft_tail_tells_a_placement_behind_a_queue_from_a_burst_and_from_the_machine():
    per_token, overhead = 0.00003, 0.005  # a cold 10,000-token prompt: 0.305 s of its own prefill

    def req(rid, sent, prompt, ttft, cached=0):
        return {"ok": True, "request_id": rid, "sent": sent, "prompt": prompt, "cached": cached, "ttft": ttft}

    results = [
        req("r1", 0.00, 10_000, 0.31),  # nothing pending anywhere: its 5 ms of wait are the machine's
        req("r3", 0.05, 1_000, 0.04),  # on B while A prefills r1: the least-pending engine
        req("r2", 0.10, 10_000, 0.52),  # on A behind r1's last 0.21 s while B had nothing: placed behind
        req("r5", 0.25, 10_000, 0.31),  # on B, idle by then, while A had r1 and r2 to finish
        req("r4", 0.30, 1_000, 0.30),  # on B behind r5, but A had more: every engine busy
        req("lost", 0.40, 1_000, 0.9),  # not in the decision log: left out
        {"ok": False, "request_id": "failed", "sent": 0.5},
    ]
    engine_of = {"r1": "A", "r2": "A", "r3": "B", "r4": "B", "r5": "B"}
    tail = wl.ttft_tail(results, engine_of, per_token, overhead, q=0.0)
    assert (tail["tail"], tail["behind"], tail["burst"], tail["machine"]) == (5, 1, 1, 3)
    assert abs(tail["own_median"] - 0.305) < 1e-9
    # At p90 only the slowest is left: r2, placed behind.
    top = wl.ttft_tail(results, engine_of, per_token, overhead, q=0.9)
    assert (top["tail"], top["behind"], top["burst"], top["machine"]) == (1, 1, 0, 0)
    assert abs(top["wait_median"] - (0.52 - 0.305)) < 1e-9
    assert wl.ttft_tail(results, {}, per_token, overhead) == {"tail": 0}


def test_a_turn_waits_for_the_turn_it_continues():
    system = [100]  # an id every conversation starts with: not a conversation of its own
    turn1 = Req(0.0, system + [7, 8], 1500, 4)
    other = Req(0.5, system + [20, 21], 1500, 4)
    turn2 = Req(1.0, system + [7, 8, 9], 2000, 4)  # carries turn1's prompt (its full ids) and more
    stranger = Req(2.0, system + [30], 1000, 4)
    reqs = [turn1, other, turn2, stranger]
    wl.link_turns(reqs, [1, 1, 1, 1])  # each conversation's root is its first id after the system prompt
    assert [r.after for r in reqs] == [None, None, 0, None]


def test_agentic_sessions_grow_and_their_sub_agents_share_the_session_context():
    reqs, info = wl.agentic(sessions=4, duration_s=12.0, max_output=8, seed=3)
    again, _ = wl.agentic(sessions=4, duration_s=12.0, max_output=8, seed=3)
    assert [(r.at, r.ids, r.length) for r in reqs] == [(r.at, r.ids, r.length) for r in again]
    assert [r.at for r in reqs] == sorted(r.at for r in reqs)
    assert {r.session for r in reqs} == {f"sess-{s}" for s in range(4)}
    turns = len(reqs) - info["subagent_requests"]
    assert info["bursts"] >= 1 and 6 * 4 <= turns <= 9 * 4  # 6-9 turns a session, plus the bursts
    system = reqs[0].ids[:4]
    for session in {r.session for r in reqs}:
        mine = [r for r in reqs if r.session == session]
        assert all(r.ids[:4] == system for r in mine)  # the system prompt every session shares
        task = mine[0].ids[:6]
        assert all(r.ids[:6] == task for r in mine)  # the session's own task, kept by its sub-agents
        assert all(wl.ID_TOKENS * (len(r.ids) - 1) < r.length <= wl.ID_TOKENS * len(r.ids) for r in mine)


def test_router_costs_read_the_routers_own_metrics_summed_over_replicas():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    texts = []
    for added, lookups, fallbacks in (([0.002, 0.004], [0.001], 1), ([0.003], [0.003], 0)):
        registry = CollectorRegistry()
        a = Histogram("router_added_latency_seconds", "", ["model"], registry=registry)
        b = Histogram("router_prefix_index_lookup_seconds", "", ["model"], registry=registry)
        c = Counter("router_prefix_index_fallbacks", "", ["model", "reason"], registry=registry)
        for value in added:
            a.labels("m").observe(value)
        for value in lookups:
            b.labels("m").observe(value)
        c.labels("m", "timeout").inc(fallbacks)
        texts.append(generate_latest(registry).decode())
    costs = wl.router_costs(texts)
    assert round(costs["added_ms"], 6) == 3.0 and round(costs["lookup_ms"], 6) == 2.0
    assert costs["lookups"] == 2 and costs["fallbacks"] == 1
    assert wl.router_costs([""])["lookups"] == 0  # a replica that did not answer


def _chat(dialect: str):
    from pathlib import Path

    from routing.rendering.tokenize import RouterTokenizer

    tokenizer = RouterTokenizer(Path(__file__).resolve().parents[2] / "models" / "tiny-qwen")
    return wl.chat_agentic(dialect, 3, 6.0, 8, tokenizer, 20_000), tokenizer


def _consume(value) -> None:
    """Walk a validated request, so that pydantic's lazy validators of its Iterable fields run."""
    if isinstance(value, dict):
        for item in value.values():
            _consume(item)
    elif not isinstance(value, str | bytes | int | float | bool | type(None)):
        for item in value:
            _consume(item)


@pytest.mark.heavy
def test_chat_workloads_are_deterministic_and_render_as_the_router_renders_them():
    import pydantic
    from anthropic.types.message_create_params import MessageCreateParamsStreaming
    from openai.types.chat.completion_create_params import CompletionCreateParamsStreaming

    sdk_types = {
        "claude-code": pydantic.TypeAdapter(MessageCreateParamsStreaming),
        "openai-tools": pydantic.TypeAdapter(CompletionCreateParamsStreaming),
    }
    for dialect in ("claude-code", "openai-tools"):
        (reqs, info), tokenizer = _chat(dialect)
        (again, _), _ = _chat(dialect)
        assert [(r.at, r.payload, r.tokens, r.after) for r in reqs] == [
            (r.at, r.payload, r.tokens, r.after) for r in again
        ]
        assert info["subagent_requests"] > 0 and 0 <= reqs[0].at <= reqs[-1].at < 2 * 6.0
        for i, req in enumerate(reqs):
            assert req.path == wl.CHAT_PATHS[dialect]
            assert 0 < len(req.tokens) <= 20_000 and req.length == len(req.tokens)
            assert list(tokenizer.encode_request(req.payload, req.path)) == req.tokens
            assert len(req.payload["tools"]) == 16
            _consume(sdk_types[dialect].validate_python(req.payload))  # the official SDK's request type
            if req.after is not None:  # a continuation: the earlier prompt is a prefix of this one's text
                assert req.after < i
                earlier = reqs[req.after]
                assert len(earlier.tokens) < len(req.tokens)
        if dialect == "claude-code":
            assert all(b["cache_control"] for b in reqs[0].payload["system"])
            kinds = {b["type"] for r in reqs for m in r.payload["messages"] for b in m["content"]}
            assert {"text", "tool_use", "tool_result"} <= kinds
        else:
            roles = {m["role"] for r in reqs for m in r.payload["messages"]}
            assert roles == {"system", "user", "assistant", "tool"}
            calls = [m for r in reqs for m in r.payload["messages"] if m["role"] == "assistant"]
            assert all(
                m["content"] is None and isinstance(m["tool_calls"][0]["function"]["arguments"], str)
                for m in calls
            )
            assert reqs[0].payload["stream_options"] == {"include_usage": True}
        # Sessions share the system prompt and tools: the ceiling counts that prefix and the history.
        assert wl.ceilings(reqs, BLOCK)["ceiling"] > 0.5
