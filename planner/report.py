"""What a run reports, as the benchmarks report it: TTFT and ITL percentiles (overall and per tenant), throughput,
cache hits against the ceiling, queueing, preemptions, engine-hours and the cost per million tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .sim import Result
from .trace import ceiling


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the nearest ranks; nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    at = (len(xs) - 1) * q / 100
    lo = math.floor(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def weighted_percentile(pairs: Sequence[tuple[float, int]], q: float) -> float:
    """The q-th percentile of values given with their counts."""
    total = sum(n for _, n in pairs)
    if not total:
        return math.nan
    line = total * q / 100
    seen = 0
    for value, n in sorted(pairs):
        seen += n
        if seen >= line:
            return value
    return sorted(pairs)[-1][0]


@dataclass
class Summary:
    mode: str
    engines: int
    requests: int
    finished: int
    rejected: int
    ttft_p50: float
    ttft_p90: float
    itl_p50: float
    itl_p90: float
    queue_p50: float
    queue_p90: float
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens_per_s: float
    hit_share: float
    ceiling_share: float
    preemptions: int
    evictions: int
    engine_hours: float
    gpu_hours: float
    cost: float
    cost_per_mtok: float  # per million tokens, prompt and output
    cost_per_m_output: float
    busy_share: float  # of engine time spent computing
    makespan_s: float
    cpu_s: float
    sim_requests_per_cpu_s: float
    per_tenant: dict[str, dict[str, float]]
    # Flow control: seconds waited at the router's gate (requests let through or refused), refused past the limit.
    flow_wait_p50: float = 0.0
    flow_wait_p90: float = 0.0
    timed_out: int = 0
    cpu_tier_share: float = 0.0  # of prompt tokens, loaded from the CPU tier instead of computed
    # Under the autoscaler: the fewest and most engines ready, and (time, replicas asked, ready) at each pass.
    engines_min: int = 0
    engines_max: int = 0
    engines_over_time: list[tuple[float, int, int]] | None = None
    # Prefill/decode pools and peer pulls: KV moved to the decode engines over NIXL.
    transfers: int = 0
    transferred_tokens: int = 0
    transfer_s: float = 0.0


def from_cache(seq) -> int:
    """A request's prompt tokens no engine computed for it: what its engine found cached (its own cache, a CPU
    tier, KV pulled from a peer's cache), and with a prefill leg on another engine (P/D) what that leg found
    cached there, less what the decode engine computed again. The prompt less every prompt token computed."""
    prompt = seq.request.input_tokens
    computed = prompt - max(0, seq.cached_tokens)
    if seq.remote_cached >= 0:
        computed += prompt - seq.remote_cached
    return max(0, prompt - computed)


def seen_ttft(seq) -> float:
    """Seconds from a request's arrival to the first of its answer its client saw: its first token, or where
    its trace says the client saw none of its first `output_before_visible` tokens (a tool call an engine's
    parser held back; an answer not streamed), when it had made one more than those, its tokens taken as evenly
    spaced between its first and its last (a sequence not finished by the end: its first token)."""
    r = seq.request
    unseen = min(r.output_before_visible, r.output_tokens - 1)
    if unseen <= 0 or seq.finished_s < seq.first_token_s:
        return seq.first_token_s - r.arrival_s
    span = seq.finished_s - seq.first_token_s
    return seq.first_token_s + span * unseen / (r.output_tokens - 1) - r.arrival_s


def summarize(result: Result) -> Summary:
    seqs = result.seqs
    done = [s for s in seqs if s.first_token_s >= 0]
    rejected = len(seqs) - len(done)
    ttft = [seen_ttft(s) for s in done]
    queue = [s.admitted_s - s.request.arrival_s for s in done]
    itl_by_tenant: dict[str, list[tuple[float, int]]] = {}
    for engine in result.engine_objs:
        for tenant, pairs in engine.itl.items():
            itl_by_tenant.setdefault(tenant, []).extend(pairs)
    all_itl = [p for pairs in itl_by_tenant.values() for p in pairs]
    prompt = sum(s.request.input_tokens for s in done)
    output = sum(s.request.output_tokens for s in done)
    cached = sum(from_cache(s) for s in done)
    loaded = sum(s.loaded_tokens for s in done)
    flow_waits = [w for waits in result.flow_waits.values() for w in waits]
    ceil_cached, ceil_total = ceiling([s.request for s in seqs])
    start = min((s.request.arrival_s for s in seqs), default=0.0)
    span = max(result.makespan_s - start, 1e-9)
    engines = result.engines
    profile = result.profile
    if result.lifetimes:  # the autoscaler's engines: each for its lifetime
        engine_hours = sum(stop - start for start, stop in result.lifetimes) / 3600
    else:
        engine_hours = engines * result.makespan_s / 3600
    ready = [n for _, _, n in result.timeline] or [engines]
    gpu_hours = engine_hours * profile.gpus_per_engine
    cost = gpu_hours * profile.gpu_price_per_hour
    per_tenant: dict[str, dict[str, float]] = {}
    tenants = sorted({s.request.tenant for s in done})
    if len(tenants) > 1:
        for t in tenants:
            mine = [s for s in done if s.request.tenant == t]
            p = sum(s.request.input_tokens for s in mine)
            per_tenant[t] = {
                "requests": len(mine),
                "ttft_p50": percentile([seen_ttft(s) for s in mine], 50),
                "ttft_p90": percentile([seen_ttft(s) for s in mine], 90),
                "itl_p50": weighted_percentile(itl_by_tenant.get(t, []), 50),
                "itl_p90": weighted_percentile(itl_by_tenant.get(t, []), 90),
                "hit_share": sum(s.cached_tokens for s in mine) / p if p else 0.0,
                "flow_wait_p50": percentile(result.flow_waits[t], 50) if result.flow_waits.get(t) else 0.0,
                "flow_wait_p90": percentile(result.flow_waits[t], 90) if result.flow_waits.get(t) else 0.0,
                "timed_out": sum(1 for r in result.timed_out if r.tenant == t),
                # Its share of the cost: by the tokens it had computed (uncached prompt and output).
                "work_share": 0.0,
            }
        work = {
            t: sum(
                s.request.input_tokens - s.cached_tokens + s.request.output_tokens
                for s in done
                if s.request.tenant == t
            )
            for t in tenants
        }
        total_work = sum(work.values()) or 1
        for t in tenants:
            per_tenant[t]["work_share"] = work[t] / total_work
    busy = sum(e.busy_s for e in result.engine_objs)
    return Summary(
        mode=result.mode,
        engines=engines,
        requests=len(seqs),
        finished=len(done),
        rejected=rejected,
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        itl_p50=weighted_percentile(all_itl, 50),
        itl_p90=weighted_percentile(all_itl, 90),
        queue_p50=percentile(queue, 50),
        queue_p90=percentile(queue, 90),
        requests_per_s=len(done) / span,
        output_tokens_per_s=output / span,
        prompt_tokens_per_s=prompt / span,
        hit_share=cached / prompt if prompt else 0.0,
        ceiling_share=ceil_cached / ceil_total if ceil_total else 0.0,
        preemptions=sum(e.preemptions for e in result.engine_objs),
        evictions=sum(e.evictions for e in result.engine_objs),
        engine_hours=engine_hours,
        gpu_hours=gpu_hours,
        cost=cost,
        cost_per_mtok=cost / ((prompt + output) / 1e6) if prompt + output else math.nan,
        cost_per_m_output=cost / (output / 1e6) if output else math.nan,
        busy_share=busy / (engine_hours * 3600) if engine_hours else 0.0,
        makespan_s=result.makespan_s,
        cpu_s=result.cpu_s,
        sim_requests_per_cpu_s=len(seqs) / result.cpu_s if result.cpu_s else math.inf,
        per_tenant=per_tenant,
        flow_wait_p50=percentile(flow_waits, 50) if flow_waits else 0.0,
        flow_wait_p90=percentile(flow_waits, 90) if flow_waits else 0.0,
        timed_out=len(result.timed_out),
        cpu_tier_share=loaded / prompt if prompt else 0.0,
        engines_min=min(ready),
        engines_max=max(ready),
        engines_over_time=list(result.timeline) or None,
        transfers=len(result.transfers),
        transferred_tokens=sum(t for t, _ in result.transfers),
        transfer_s=sum(x for _, x in result.transfers),
    )


ROWS = (
    ("requests finished", lambda s: f"{s.finished}/{s.requests}"),
    ("TTFT p50 (s)", lambda s: f"{s.ttft_p50:.3f}"),
    ("TTFT p90 (s)", lambda s: f"{s.ttft_p90:.3f}"),
    ("ITL p50 (ms)", lambda s: f"{s.itl_p50 * 1000:.1f}"),
    ("ITL p90 (ms)", lambda s: f"{s.itl_p90 * 1000:.1f}"),
    ("queued p50 (s)", lambda s: f"{s.queue_p50:.3f}"),
    ("queued p90 (s)", lambda s: f"{s.queue_p90:.3f}"),
    ("at the router's gate p50 (s)", lambda s: f"{s.flow_wait_p50:.3f}"),
    ("at the router's gate p90 (s)", lambda s: f"{s.flow_wait_p90:.3f}"),
    ("refused after waiting", lambda s: f"{s.timed_out}"),
    ("requests/s", lambda s: f"{s.requests_per_s:.2f}"),
    ("output tokens/s", lambda s: f"{s.output_tokens_per_s:.0f}"),
    ("prompt tokens/s", lambda s: f"{s.prompt_tokens_per_s:.0f}"),
    ("cache hit share", lambda s: f"{s.hit_share:.1%}"),
    (
        "of the ceiling",
        lambda s: f"{s.hit_share / s.ceiling_share:.1%} of {s.ceiling_share:.1%}" if s.ceiling_share else "-",
    ),
    ("loaded from the CPU tier", lambda s: f"{s.cpu_tier_share:.1%}"),
    ("KV transfers (tokens, s)", lambda s: f"{s.transfers} ({s.transferred_tokens}, {s.transfer_s:.1f})"),
    ("preemptions", lambda s: f"{s.preemptions}"),
    ("engine busy share", lambda s: f"{s.busy_share:.1%}"),
    ("engines ready (fewest-most)", lambda s: f"{s.engines_min}-{s.engines_max}"),
    ("engine-hours", lambda s: f"{s.engine_hours:.2f}"),
    ("cost", lambda s: f"{s.cost:.2f}"),
    ("cost / M tokens", lambda s: f"{s.cost_per_mtok:.4f}"),
    ("cost / M output tokens", lambda s: f"{s.cost_per_m_output:.3f}"),
    ("simulated requests / CPU s", lambda s: f"{s.sim_requests_per_cpu_s:.0f}"),
)


def table(summaries: list[Summary]) -> str:
    """The runs side by side, one column each, as a Markdown table."""
    head = ["", *(f"{s.mode} ({s.engines})" for s in summaries)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, fmt in ROWS:
        lines.append("| " + " | ".join([label, *(fmt(s) for s in summaries)]) + " |")
    return "\n".join(lines)


def tenant_table(summary: Summary) -> str:
    if not summary.per_tenant:
        return ""
    lines = [
        f"{summary.mode}: per tenant",
        "| tenant | requests | TTFT p50 (s) | TTFT p90 (s) | ITL p50 (ms) | ITL p90 (ms) | hit share | share of work "
        "| gate p50 (s) | gate p90 (s) | refused |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t, row in summary.per_tenant.items():
        lines.append(
            f"| {t} | {row['requests']:.0f} | {row['ttft_p50']:.3f} | {row['ttft_p90']:.3f} | "
            f"{row['itl_p50'] * 1000:.1f} | {row['itl_p90'] * 1000:.1f} | {row['hit_share']:.1%} | "
            f"{row['work_share']:.1%} | {_num(row['flow_wait_p50'])} | {_num(row['flow_wait_p90'])} | "
            f"{row['timed_out']:.0f} |"
        )
    return "\n".join(lines)


def _num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"
