"""The planner against real runs: a run recorded through the router's own traffic tracing (a Mooncake trace from
`manage.py export_trace`, with the run's configuration and measured figures beside it as JSON; see
`bench/prefix_routing.py --trace-out`) simulated with the matching profile and configuration, and the simulated
TTFT p50 / p90, throughput and prefix-hit share set against the measured ones, each with its relative error.

The figures are computed here as the benchmark computes them (bench/prefix_routing.py `summarize`): percentiles
by rank (the value at index int(q * n) of the sorted TTFTs), throughput as finished requests over the span from
the first arrival to the last end, the hit share as cached prompt tokens over prompt tokens (the engines'
`prefix_cache_hits / prefix_cache_queries`). A simulated TTFT runs from the request's arrival at the router (the
recorded arrival) to the first of its answer the client saw (`report.seen_ttft`: its first token, or later where the
trace says the client saw nothing of the first ones); a measured one from the client's send to the first streamed
content (a chat stream's role chunk, a Messages stream's first content block).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .profile import Profile
from .report import seen_ttft
from .trace import TraceRequest, load_trace

FIGURES = ("ttft_p50", "ttft_p90", "rps", "hit_share")
LABELS = {"ttft_p50": "TTFT p50 (ms)", "ttft_p90": "TTFT p90 (ms)", "rps": "req/s", "hit_share": "hit share"}
MODES = {"round_robin", "least_loaded", "approximate", "precise"}


@dataclass
class Run:
    """One recorded run: its trace, its configuration and what was measured."""

    path: Path  # the JSON file
    workload: str
    policy: str
    round: int
    config: dict
    measured: dict[str, float]
    trace: Path
    requests: list[TraceRequest] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.workload} / {self.policy} / round {self.round}"


def load_run(path: str | Path) -> Run:
    path = Path(path)
    data = json.loads(path.read_text())
    trace = path.parent / data["trace"]
    return Run(
        path=path,
        workload=data["workload"],
        policy=data["policy"],
        round=int(data.get("round", 1)),
        config=data["config"],
        measured={k: float(v) for k, v in data["measured"].items()},
        trace=trace,
        requests=load_trace(trace),
    )


def load_runs(folder: str | Path) -> list[Run]:
    """Every recorded run in a folder (its `*.json` files with a trace beside them), in name order."""
    runs = []
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        if "trace" in data and "measured" in data and data.get("config", {}).get("mode") in MODES:
            runs.append(load_run(path))
    return runs


def profile_for(
    run: Run, profile: str | Path | None = None, router_latency: bool = False, host_share: bool = False
) -> Profile:
    """The run's profile (the one it names unless `profile` is given) with the run's KV capacity and
    max_num_seqs; with `router_latency`, the router's own measured mean added latency in the run (its
    `router_added_latency_seconds`: parsing, tokenizing, the pick) added to the request overhead, so that a
    request reaches its engine's scheduler as late as the real router sent it. With `host_share`, engines that
    compute on the run's own cores (vLLM-CPU) get the share of those cores the run measured they had
    (`host_share`: one less what every other process used, the router, its clients and Redis among them),
    relative to the share the profile was measured with (its `host_share`: what the measuring clients left them;
    Profile.on_share_of_host)."""
    cfg = run.config
    base = Profile.load(profile or cfg["profile"])
    if host_share and cfg.get("engine") == "vllm":
        share = run.measured.get("host_share", math.nan)
        if math.isnan(share):
            raise ValueError(f"{run.path}: the run did not record the engines' share of the host")
        base = base.on_share_of_host(share)
    changes = {"max_num_seqs": int(cfg["max_num_seqs"])}
    if router_latency:
        added = run.measured.get("router_added_ms", math.nan)
        if math.isnan(added):
            raise ValueError(f"{run.path}: the run did not record the router's added latency")
        changes["request_overhead_s"] = base.request_overhead_s + added / 1000
    if cfg.get("kv_blocks"):
        changes["kv_capacity_tokens"] = int(cfg["kv_blocks"]) * int(cfg["block_size"])
    if cfg.get("max_num_batched_tokens"):
        changes["max_num_batched_tokens"] = int(cfg["max_num_batched_tokens"])
    return base.with_(**changes)


def rank_pct(values: list[float], q: float) -> float:
    """The benchmark's percentile: the value at index int(q * n) of the sorted values."""
    if not values:
        return math.nan
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def mean_ms(values: list[float]) -> float:
    return 1000 * statistics.fmean(values) if values else math.nan


def figures(seqs, request_overhead_s: float = 0.0) -> dict[str, float]:
    """A simulation's figures, defined as the benchmark defines its own; and beside them (BREAKDOWN) the means
    the engines' own histograms give: TTFT from the request's arrival at its engine, its wait in the scheduler's
    queue (from the engine's request overhead on to its first admission) and its prefill (from then to its
    first token)."""
    done = [s for s in seqs if s.first_token_s >= 0]
    ttft = [seen_ttft(s) for s in done]
    prompt = sum(s.request.input_tokens for s in done)
    cached = sum(max(0, s.cached_tokens) for s in done)
    start = min((s.request.arrival_s for s in seqs), default=0.0)
    end = max((s.finished_s for s in done), default=0.0)
    here = [s for s in done if s.admitted_s >= 0]  # prefilled on the engine it was routed to
    return {
        "ttft_p50": rank_pct(ttft, 0.5) * 1000,
        "ttft_p90": rank_pct(ttft, 0.9) * 1000,
        "rps": len(done) / (end - start) if end > start else math.nan,
        "hit_share": cached / prompt if prompt else math.nan,
        "ttft_mean": mean_ms(ttft),
        "router_ttft_ms": mean_ms([s.first_token_s - s.request.arrival_s for s in done]),
        "engine_ttft_ms": mean_ms([s.first_token_s - s.routed_s for s in here]),
        "engine_queue_ms": mean_ms([s.admitted_s - s.routed_s - request_overhead_s for s in here]),
        "engine_prefill_ms": mean_ms([s.first_token_s - s.admitted_s for s in here]),
    }


# Where the time to the first token went, client and engines (means, ms): diagnostic, not part of the error.
BREAKDOWN = {
    "ttft_mean": "client TTFT",
    "router_ttft_ms": "router TTFT",
    "engine_ttft_ms": "engine TTFT",
    "engine_queue_ms": "queued",
    "engine_prefill_ms": "prefill",
}


def simulate_run(
    run: Run,
    profile: str | Path | None = None,
    router_latency: bool = False,
    host_share: bool = False,
    recorded_routes: bool = False,
) -> dict[str, float]:
    """The run replayed on the planner: the same arrivals, engines, mode, policy overrides, block size, KV
    capacity (engines' and the approximate index's) and max_num_seqs. With `recorded_routes`, each request goes
    to the engine the run sent it to rather than where the planner's routing would: what is left is the engines'
    model (raises ValueError for a trace that recorded no routes)."""
    if recorded_routes and not any(r.endpoint is not None for r in run.requests):
        raise ValueError(f"{run.trace}: the trace records no routes (exported before `endpoint` was)")
    from .sim import Simulation

    cfg = run.config
    prof = profile_for(run, profile, router_latency, host_share)
    policy = dict(cfg.get("policy_overrides") or {})
    sim = Simulation(
        run.requests,
        int(cfg["engines"]),
        prof,
        cfg["mode"],
        block_tokens=int(cfg["block_size"]),
        policy=policy,
        approx_capacity_blocks=int(cfg["kv_blocks"]) if cfg.get("kv_blocks") else None,
        recorded_routes=recorded_routes,
    )
    return figures(sim.run().seqs, prof.request_overhead_s)


def rel_error(simulated: float, measured: float) -> float:
    if measured == 0 or math.isnan(measured) or math.isnan(simulated):
        return math.nan
    return abs(simulated - measured) / abs(measured)


@dataclass
class Comparison:
    run: Run
    simulated: dict[str, float]
    errors: dict[str, float]

    @property
    def median_error(self) -> float:
        values = [e for e in self.errors.values() if not math.isnan(e)]
        return statistics.median(values) if values else math.nan


def compare(
    run: Run,
    profile: str | Path | None = None,
    router_latency: bool = False,
    host_share: bool = False,
    recorded_routes: bool = False,
) -> Comparison:
    simulated = simulate_run(run, profile, router_latency, host_share, recorded_routes)
    return Comparison(run, simulated, {k: rel_error(simulated[k], run.measured[k]) for k in FIGURES})


def fmt(key: str, value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if key == "hit_share":
        return f"{value:.1%}"
    if key == "rps":
        return f"{value:.2f}"
    return f"{value:,.0f}"


def table(comparisons: list[Comparison]) -> str:
    """One row per run: measured / simulated and the relative error of each figure, and their median."""
    head = ["workload", "policy", "round", "requests"]
    head += [f"{LABELS[k]}: real / sim (error)" for k in FIGURES]
    head.append("median error")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 4 + "---:|" * (len(FIGURES) + 1)]
    for c in comparisons:
        r = c.run
        cells = [r.workload, r.policy, str(r.round), str(len(r.requests))]
        for k in FIGURES:
            cells.append(f"{fmt(k, r.measured[k])} / {fmt(k, c.simulated[k])} ({c.errors[k]:.0%})")
        cells.append(f"**{c.median_error:.1%}**")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def breakdown_table(comparisons: list[Comparison]) -> str:
    """One row per run: the mean time to the first token (by the client's clock and the engines'), the wait in
    the engines' queues and the prefill, real against simulated (n/a where the engines report none)."""
    head = ["workload", "policy", "round"] + [f"{label} (ms): real / sim" for label in BREAKDOWN.values()]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * len(BREAKDOWN)]
    for c in comparisons:
        r = c.run
        cells = [r.workload, r.policy, str(r.round)]
        for k in BREAKDOWN:
            real = r.measured.get(k, math.nan)
            cells.append(f"{fmt(k, real)} / {fmt(k, c.simulated.get(k, math.nan))}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def by_configuration(comparisons: list[Comparison]) -> dict[tuple[str, str], list[Comparison]]:
    out: dict[tuple[str, str], list[Comparison]] = {}
    for c in comparisons:
        out.setdefault((c.run.workload, c.run.policy), []).append(c)
    return out


def summary_table(comparisons: list[Comparison], target: float) -> str:
    """Per configuration (workload and policy, over its rounds): the median error of each figure, the spread of
    the measured figures over the rounds, and the median error against the target."""
    head = ["workload", "policy", "rounds"]
    head += [f"{LABELS[k]} error (real spread)" for k in FIGURES]
    head += ["median error", f"target {target:.0%}", "real rounds against each other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(FIGURES) + 3)]
    for (workload, policy), group in by_configuration(comparisons).items():
        cells = [workload, policy, str(len(group))]
        for k in FIGURES:
            errs = [c.errors[k] for c in group if not math.isnan(c.errors[k])]
            real = [c.run.measured[k] for c in group]
            spread = f"{fmt(k, min(real))}-{fmt(k, max(real))}" if len(real) > 1 else fmt(k, real[0])
            err = statistics.median(errs) if errs else math.nan
            cells.append(f"{err:.0%} ({spread})")
        med = configuration_error(group)
        repeat = repeat_error(group)
        cells += [
            f"**{med:.1%}**",
            "met" if med <= target else "MISSED",
            "n/a" if math.isnan(repeat) else f"{repeat:.1%}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def repeat_error(group: list[Comparison]) -> float:
    """How well the real runs of one configuration predict each other, the floor under the planner's error: each
    round's figures against the median of the other rounds' (the same replay, routed and timed afresh), as
    `configuration_error` weighs the planner's (the median over the figures of each figure's median over the
    rounds). NaN with fewer than 2 rounds."""
    if len(group) < 2:
        return math.nan
    per_figure = []
    for k in FIGURES:
        real = [c.run.measured[k] for c in group]
        errs = [rel_error(statistics.median(real[:i] + real[i + 1 :]), x) for i, x in enumerate(real)]
        errs = [e for e in errs if not math.isnan(e)]
        if errs:
            per_figure.append(statistics.median(errs))
    return statistics.median(per_figure) if per_figure else math.nan


def configuration_error(group: list[Comparison]) -> float:
    """A configuration's median error: the median over its figures of each figure's median error over rounds."""
    per_figure = []
    for k in FIGURES:
        errs = [c.errors[k] for c in group if not math.isnan(c.errors[k])]
        if errs:
            per_figure.append(statistics.median(errs))
    return statistics.median(per_figure) if per_figure else math.nan
