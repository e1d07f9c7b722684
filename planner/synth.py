"""Coding-agent traffic for the planner, made up with the published shape of a large deployment's agent traffic:
huge prompts that grow turn by turn, short answers, and sub-agents spawned in bursts.

Each agent runs one main conversation: a system prompt with tool definitions shared by every agent of its client
kind, then turns, each the previous prompt plus the previous answer plus new tool results (file contents, mostly).
A conversation that would pass `max_context` is compacted: it starts again from the system prompt and a summary.
Now and then a turn spawns a burst of sub-agents at once: new conversations that share the parent's system prompt,
tools and a leading part of its context (up to a fork point common to the burst), each with a task of its own and
a few turns; their findings come back as the tool results of the parent's next turn. Agents start in the middle of
their lives (a context drawn uniformly between a restart and `max_context`, its history unseen), at staggered times.

Arrivals are open-loop, as the planner replays them. Gaps scale so that the trace carries `requests_per_minute`
(default: the published 7,612 a minute at 2,500 agents, per agent). Block ids are chained as real block keys are:
equal ids mean equal prefixes, one id per `block_tokens` tokens, the partial last block the request's own.
Sessions: `a<agent>` for a main conversation (kept across compactions), `a<agent>/<n>` for its n-th sub-agent.

    python -m planner.synth --agents 3000 --minutes 60 --out agents.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from .trace import TRACE_BLOCK_TOKENS, TraceRequest, ceiling

PUBLISHED_AGENTS = 2_500
PUBLISHED_REQUESTS_PER_MINUTE = 7_612.0  # served at 2,500 agents
PUBLISHED_CACHED_SHARE = 0.852  # of input tokens, from cache
PUBLISHED_MEDIAN_PROMPT = 195_000
PUBLISHED_MEDIAN_OUTPUT = 317


@dataclass(frozen=True)
class AgentTraffic:
    agents: int = 3_000
    minutes: float = 60.0
    seed: int = 0
    # All agents together; None: the published rate per agent (7,612 a minute at 2,500 agents) times `agents`.
    requests_per_minute: float | None = None
    block_tokens: int = TRACE_BLOCK_TOKENS
    client_kinds: int = 4  # system prompts with tool definitions, each shared by the agents of one kind
    prefix_tokens: tuple[int, int] = (16_000, 26_000)  # their sizes, drawn uniformly per kind
    max_context: int = 400_000  # compaction once the next prompt would pass it
    restart_tokens: tuple[int, int] = (
        40_000,
        100_000,
    )  # after a compaction: summary, re-read files (uniform)
    tool_median: float = 1_500.0  # tokens of tool results a turn (lognormal)
    tool_sigma: float = 1.2
    tool_max: int = 80_000
    output_median: float = float(PUBLISHED_MEDIAN_OUTPUT)  # tokens an answer (lognormal)
    output_sigma: float = 0.8
    output_max: int = 32_000
    task_median: float = 600.0  # a sub-agent's own instructions (lognormal, sigma 0.8)
    burst_share: float = 0.12  # of main turns, those that spawn a burst of sub-agents
    burst_size: tuple[int, int] = (3, 6)  # sub-agents a burst (uniform)
    sub_turns: tuple[int, int] = (2, 5)  # requests a sub-agent (uniform)
    fork_share: tuple[float, float] = (0.6, 1.0)  # of the parent's context after its system prompt, shared
    sub_gap_ratio: float = 0.5  # a sub-agent's gap between turns against a main agent's
    # Agents join over this many first minutes (each one's first request then finds nothing of its history cached,
    # so a fleet starting cold meets them spread out); 0: all start within their first gap.
    ramp_minutes: float = 0.0
    tenants: int = 1  # agents dealt out to tenants t0..t{n-1} in turn; 1: no tenants ("-")

    @property
    def rate_per_minute(self) -> float:
        if self.requests_per_minute is not None:
            return self.requests_per_minute
        return self.agents * PUBLISHED_REQUESTS_PER_MINUTE / PUBLISHED_AGENTS


class _Ids:
    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> tuple[int, ...]:
        start = self.next
        self.next += n
        return tuple(range(start, start + n))


class _Conv:
    """A conversation's prompt so far: its full blocks' ids and the tokens of its partial last block."""

    __slots__ = ("blocks", "tail")

    def __init__(self, blocks: tuple[int, ...], tail: int):
        self.blocks = blocks
        self.tail = tail

    def tokens(self, bt: int) -> int:
        return len(self.blocks) * bt + self.tail

    def extend(self, n: int, ids: _Ids, bt: int) -> None:
        """Append n tokens: the partial block fills up (a new content, so a new id) and new blocks follow."""
        total = self.tail + n
        if total >= bt:
            self.blocks = self.blocks + ids.take(total // bt)
        self.tail = total % bt


def _lognormal(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, int(median * math.exp(rng.gauss(0.0, sigma)))))


def _gap(rng: random.Random, mean: float) -> float:
    """A gap between turns: the answer's latency and the tools' time, lognormal with the given mean."""
    return mean * math.exp(rng.gauss(-0.245, 0.7))  # exp(-sigma^2 / 2) keeps the mean


def _cycle_units(cfg: AgentTraffic, seed: int) -> tuple[float, float]:
    """Mean requests (exact) and mean duration (in main-gap units, by drawing 50,000) of one main turn and the
    burst it may spawn."""
    mean_size = sum(cfg.burst_size) / 2
    mean_turns = sum(cfg.sub_turns) / 2
    requests = 1 + cfg.burst_share * mean_size * mean_turns
    rng = random.Random(seed)
    n, dur = 50_000, 0.0
    for _ in range(n):
        if rng.random() < cfg.burst_share:
            end = 0.0
            begin = _gap(rng, cfg.sub_gap_ratio)
            for _ in range(rng.randint(*cfg.burst_size)):
                t = begin + rng.uniform(0, 0.1)
                t += sum(_gap(rng, cfg.sub_gap_ratio) for _ in range(rng.randint(*cfg.sub_turns) - 1))
                end = max(end, t)
            dur += end
        dur += 1.0
    return requests, dur / n


def generate(cfg: AgentTraffic = AgentTraffic()) -> list[TraceRequest]:
    """The trace, in order of arrival (index = position)."""
    rng = random.Random(cfg.seed)
    bt = cfg.block_tokens
    ids = _Ids()
    horizon = cfg.minutes * 60.0
    kinds = []
    for _ in range(cfg.client_kinds):
        size = rng.randint(*cfg.prefix_tokens)
        kinds.append((ids.take(size // bt), size % bt))
    per_cycle, cycle_units = _cycle_units(cfg, cfg.seed + 1)
    per_agent_s = cfg.rate_per_minute / 60.0 / max(1, cfg.agents)
    unit = per_cycle / (per_agent_s * cycle_units) if per_agent_s > 0 else math.inf
    sub_unit = unit * cfg.sub_gap_ratio
    rows: list[tuple[float, int, int, tuple[int, ...], str, str]] = []

    def emit(at: float, conv: _Conv, output: int, tenant: str, session: str) -> None:
        tokens = conv.tokens(bt)
        hash_ids = conv.blocks + ids.take(1) if conv.tail else conv.blocks
        rows.append((at, tokens, output, hash_ids, tenant, session))

    def restart(kind: int, extra: int) -> _Conv:
        blocks, tail = kinds[kind]
        conv = _Conv(blocks, tail)
        conv.extend(extra, ids, bt)
        return conv

    for agent in range(cfg.agents):
        kind = agent % cfg.client_kinds
        tenant = f"t{agent % cfg.tenants}" if cfg.tenants > 1 else "-"
        session = f"a{agent}"
        prefix_tokens = len(kinds[kind][0]) * bt + kinds[kind][1]
        start_tokens = rng.uniform(cfg.restart_tokens[0], cfg.max_context)
        conv = restart(kind, max(1, int(start_tokens) - prefix_tokens))
        subs = 0
        t = rng.uniform(0.0, cfg.ramp_minutes * 60.0 if cfg.ramp_minutes > 0 else unit * cycle_units)
        while t < horizon:
            output = _lognormal(rng, cfg.output_median, cfg.output_sigma, cfg.output_max)
            emit(t, conv, output, tenant, session)
            gap_from = t
            if rng.random() < cfg.burst_share:
                # A burst: the sub-agents share the parent's prompt up to one fork point, past its system prompt.
                shared = len(kinds[kind][0])
                own = len(conv.blocks) - shared
                fork = shared + int(own * rng.uniform(*cfg.fork_share))
                begin = t + _gap(rng, sub_unit)
                end = begin
                findings = 0
                for _ in range(rng.randint(*cfg.burst_size)):
                    subs += 1
                    sub = _Conv(conv.blocks[:fork], 0)
                    sub.extend(_lognormal(rng, cfg.task_median, 0.8, 8_000), ids, bt)
                    st = begin + rng.uniform(0.0, 0.1 * unit)
                    turns = rng.randint(*cfg.sub_turns)
                    for turn in range(turns):
                        sub_out = _lognormal(rng, cfg.output_median, cfg.output_sigma, cfg.output_max)
                        if st < horizon:
                            emit(st, sub, sub_out, tenant, f"{session}/{subs}")
                        if turn == turns - 1:
                            findings += sub_out
                        else:
                            tool = _lognormal(rng, cfg.tool_median, cfg.tool_sigma, cfg.tool_max)
                            sub.extend(sub_out + tool, ids, bt)
                            st += _gap(rng, sub_unit)
                    end = max(end, st)
                gap_from = end
                added = output + findings + 50 * subs
            else:
                added = output + _lognormal(rng, cfg.tool_median, cfg.tool_sigma, cfg.tool_max)
            if conv.tokens(bt) + added > cfg.max_context:
                conv = restart(kind, max(1, rng.randint(*cfg.restart_tokens) - prefix_tokens))
            else:
                conv.extend(added, ids, bt)
            t = gap_from + _gap(rng, unit)
    rows.sort(key=lambda row: row[0])
    return [
        TraceRequest(i, at, tokens, output, hash_ids, tenant, session)
        for i, (at, tokens, output, hash_ids, tenant, session) in enumerate(rows)
    ]


def is_sub_agent(r: TraceRequest) -> bool:
    return r.session is not None and "/" in r.session


def reused_tokens(requests: list[TraceRequest], block_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """Per request (in the order given, which must be arrival order), the prompt tokens its leading full blocks
    share with some earlier prompt: the ceiling's count (planner.trace.ceiling), found by bisection, which holds
    for chained block ids (a block seen means every block before it was seen with it)."""
    seen: set[int] = set()
    out = []
    for r in requests:
        blocks = r.full_blocks(block_tokens)
        lo, hi = 0, len(blocks)  # blocks[:lo] seen; blocks[hi:] not
        while lo < hi:
            mid = (lo + hi) // 2
            if blocks[mid] in seen:
                lo = mid + 1
            else:
                hi = mid
        out.append(max(0, min(lo * block_tokens, r.input_tokens - 1)))
        seen.update(blocks)
    return out


def shape(
    requests: list[TraceRequest], block_tokens: int = TRACE_BLOCK_TOKENS, with_ceiling: bool = True
) -> dict:
    """The trace's measured shape, to compare with the published one."""
    if not requests:
        raise ValueError("no requests")
    reused = reused_tokens(requests, block_tokens)
    main = [(r, u) for r, u in zip(requests, reused, strict=True) if not is_sub_agent(r)]
    first: set[str] = set()
    later = []
    for r, u in main:
        if r.session in first:
            later.append((r, u))
        first.add(r.session)
    span_s = max(requests[-1].arrival_s - requests[0].arrival_s, 1e-9)
    subs = sum(1 for r in requests if is_sub_agent(r))
    out = {
        "requests": len(requests),
        "sessions": len({r.session for r in requests}),
        "requests_per_minute": len(requests) / span_s * 60.0,
        "median_prompt": statistics.median(r.input_tokens for r in requests),
        "mean_prompt": statistics.fmean(r.input_tokens for r in requests),
        "median_output": statistics.median(r.output_tokens for r in requests),
        "main_requests": len(main),
        "reuse_share": sum(u >= 0.9 * r.input_tokens for r, u in main) / max(1, len(main)),
        # Without each main conversation's first request in the window: its history precedes the window.
        "reuse_share_after_first": sum(u >= 0.9 * r.input_tokens for r, u in later) / max(1, len(later)),
        "burst_share": subs / len(requests),
    }
    if with_ceiling:
        cached, total = ceiling(requests, block_tokens)
        out["ceiling"] = cached / total if total else 0.0
    return out


def shape_lines(s: dict) -> str:
    lines = [
        f"requests {s['requests']:,} ({s['requests_per_minute']:,.0f} a minute), sessions {s['sessions']:,}",
        f"prompt median {s['median_prompt']:,.0f} (mean {s['mean_prompt']:,.0f}), output median "
        f"{s['median_output']:,.0f}",
        f"main requests reusing >= 90 % of an earlier prompt: {s['reuse_share']:.1%} "
        f"({s['reuse_share_after_first']:.1%} after each conversation's first in the window)",
        f"requests from sub-agent bursts: {s['burst_share']:.1%}",
    ]
    if "ceiling" in s:
        lines.append(f"ceiling (one infinite cache): {s['ceiling']:.1%} of prompt tokens")
    return "\n".join(lines)


def write_jsonl(requests: list[TraceRequest], path: str | Path) -> None:
    """The Mooncake JSON-lines form (planner.trace.load_trace reads it back), with sessions and tenants."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            row = {
                "timestamp": round(r.arrival_s * 1000),
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "hash_ids": list(r.hash_ids),
                "session": r.session,
            }
            if r.tenant != "-":
                row["tenant"] = r.tenant
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planner.synth", description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=3_000)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rate", type=float, help="requests a minute, all agents together (default: 7,612 per 2,500 agents)"
    )
    p.add_argument("--tenants", type=int, default=1)
    p.add_argument("--out", help="write the trace here as Mooncake JSON lines")
    p.add_argument("--no-ceiling", action="store_true", help="skip the ceiling (seconds at an hour of 3,000)")
    args = p.parse_args(argv)
    if args.agents < 1 or args.minutes <= 0 or (args.rate is not None and args.rate <= 0):
        p.error("--agents, --minutes and --rate must be positive")
    cfg = AgentTraffic(
        agents=args.agents,
        minutes=args.minutes,
        seed=args.seed,
        requests_per_minute=args.rate,
        tenants=args.tenants,
    )
    requests = generate(cfg)
    if args.out:
        write_jsonl(requests, args.out)
        print(f"wrote {len(requests):,} requests to {args.out}", file=sys.stderr)
    print(shape_lines(shape(requests, cfg.block_tokens, with_ceiling=not args.no_ceiling)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
