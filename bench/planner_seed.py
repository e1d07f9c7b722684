"""The seed's scale in the fleet simulator: coding agents (planner.synth, 3,000 by default) for an hour on 544 H100s
(68 engines of 8 GPUs, profile moe-753b-h100), compared row by row: precise against approximate prefix routing
(round robin as a floor), prefill/decode pools against aggregated engines at the same GPU count, a CPU tier of KV
against none. Printed next to the published figures of the deployment the profile is fitted to.

    .venv/bin/python -m bench.planner_seed                     # an hour, every row (tens of CPU minutes)
    .venv/bin/python -m bench.planner_seed --minutes 10 --rows precise approximate
    .venv/bin/python -m bench.planner_seed --agents 60 --gpus 16 --minutes 2   # a small check

Agents join over the first minutes (`--ramp`, default a quarter of the run, at most 5): each one's first request
finds none of its history cached, so the fleet starts cold. The table counts the requests that arrive after
`--warmup` minutes (default a third of the run, at most 10); their ceiling counts every earlier prompt, warm-up
included. Throughput: the requests finished a minute between the warm-up's end and the last arrival, against the
requests that arrived a minute meanwhile (`served/min of offered`). Rows whose simulator options are missing
(`simulate(..., prefill_engines=K)`, the profile's `cpu_tier_tokens`, `cpu_tier_load_per_token_s`,
`nixl_fixed_s`, `nixl_per_token_s`) are listed as not run, with why.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import time

from planner.profile import Profile
from planner.report import summarize
from planner.sim import Result, simulate
from planner.synth import (
    PUBLISHED_AGENTS,
    PUBLISHED_CACHED_SHARE,
    PUBLISHED_REQUESTS_PER_MINUTE,
    AgentTraffic,
    generate,
    reused_tokens,
    shape,
    shape_lines,
)

PROFILE = "moe-753b-h100"
SEED_GPUS = 544
PUBLISHED_PRECISE_THROUGHPUT = 0.79  # precise against approximate: +79 % throughput
PUBLISHED_PRECISE_TTFT = -0.67  # and -67 % TTFT
# HBM alone, for the row without a CPU tier: 8 x 80 GB x 0.9, less 400 GB of weights and 32 GB of activations, at
# 43,188 bytes a token (the profile's comment); the profile's kv_capacity_tokens is the fitted cache.
HBM_ONLY_TOKENS = 3_330_000
# The host tier and the transfers, where the profile leaves them at 0 (the profile's comment gives the sources):
# 1.5 TB of the node's 2 TB of DRAM at 43,188 bytes a token; loaded over 8 PCIe Gen5 x16 links at about 55 GB/s each;
# NIXL over 8 x 400 Gb/s RDMA NICs at 80 %, with a millisecond to set a transfer up.
HOST_TIER = {"cpu_tier_tokens": 34_700_000, "cpu_tier_load_per_token_s": 9.8e-8}
NIXL = {"nixl_fixed_s": 0.001, "nixl_per_token_s": 1.35e-7}
ROWS = ("precise", "approximate", "round_robin", "pd", "cpu_tier", "no_cpu_tier")


def missing_options(row: str, profile: Profile) -> str | None:
    """Why a row cannot run on this simulator, or None."""
    names = {f.name for f in dataclasses.fields(Profile)}
    if row == "pd":
        if not _sim_takes("prefill_engines"):
            return "simulate() has no prefill_engines"
        lack = {"nixl_fixed_s", "nixl_per_token_s"} - names
        return f"Profile has no {', '.join(sorted(lack))}" if lack else None
    if row in ("cpu_tier", "no_cpu_tier"):
        lack = {"cpu_tier_tokens", "cpu_tier_load_per_token_s"} - names
        return f"Profile has no {', '.join(sorted(lack))}" if lack else None
    return None


def _sim_takes(name: str) -> bool:
    from planner.sim import Simulation

    return name in inspect.signature(Simulation.__init__).parameters


def run_row(row: str, requests, engines: int, profile: Profile, prefill_engines: int) -> Result:
    if row in ("precise", "approximate", "round_robin"):
        return simulate(requests, engines, profile, row)
    if row == "pd":
        profile = profile.with_(**{k: getattr(profile, k) or v for k, v in NIXL.items()})
        return simulate(
            requests, engines - prefill_engines, profile, "precise", prefill_engines=prefill_engines
        )
    if row == "cpu_tier":  # the GPUs' own cache, and the host's behind it
        tier = {k: getattr(profile, k) or v for k, v in HOST_TIER.items()}
        return simulate(
            requests, engines, profile.with_(kv_capacity_tokens=HBM_ONLY_TOKENS, **tier), "precise"
        )
    if row == "no_cpu_tier":
        return simulate(
            requests, engines, profile.with_(kv_capacity_tokens=HBM_ONLY_TOKENS, cpu_tier_tokens=0), "precise"
        )
    raise ValueError(f"unknown row {row!r} ({', '.join(ROWS)})")


def measure(result: Result, warm_s: float, last_arrival_s: float, reused: dict[int, int]) -> dict:
    late = [s for s in result.seqs if s.request.arrival_s >= warm_s]
    summary = summarize(dataclasses.replace(result, seqs=late))
    # The ceiling of the counted requests with every earlier prompt known, warm-up included.
    prompt = sum(s.request.input_tokens for s in late)
    summary.ceiling_share = sum(reused[s.request.index] for s in late) / prompt if prompt else 0.0
    window = max(last_arrival_s - warm_s, 1e-9)
    served = sum(1 for s in result.seqs if warm_s <= s.finished_s <= last_arrival_s and s.first_token_s >= 0)
    return {
        "summary": summary,
        "served_per_min": served / window * 60.0,
        "offered": len(late) / window * 60.0,
    }


def fmt_row(label: str, m: dict) -> str:
    s = m["summary"]
    ceiling = f"{s.hit_share:.1%} of {s.ceiling_share:.1%}"
    return (
        f"| {label} | {s.engines} | {m['served_per_min']:,.0f} of {m['offered']:,.0f} | {s.ttft_p50:.2f} | "
        f"{s.ttft_p90:.2f} | {s.itl_p50 * 1000:.0f} | {s.itl_p90 * 1000:.0f} | {ceiling} | {s.queue_p50:.2f} | "
        f"{s.queue_p90:.2f} | {s.preemptions} | {s.engine_hours:.1f} | {s.cost_per_mtok:.3f} | {s.cpu_s:.0f} |"
    )


HEAD = (
    "| row | engines | served/min of offered | TTFT p50 (s) | TTFT p90 (s) | ITL p50 (ms) | ITL p90 (ms) | "
    "cache hits of the ceiling | queued p50 (s) | queued p90 (s) | preemptions | engine-hours | $ / M tokens | "
    "CPU s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)
LABELS = {
    "precise": "precise",
    "approximate": "approximate",
    "round_robin": "round robin",
    "pd": "P/D, precise",
    "cpu_tier": "precise, HBM + CPU tier",
    "no_cpu_tier": "precise, HBM only",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.planner_seed", description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=3_000)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--gpus", type=int, default=SEED_GPUS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=PROFILE)
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    p.add_argument(
        "--prefill-engines", type=int, help="of the engines, prefill ones in the P/D row (default 3/4)"
    )
    p.add_argument("--ramp", type=float, help="minutes over which agents join (default min(5, minutes/4))")
    p.add_argument("--warmup", type=float, help="minutes not counted (default min(10, minutes/3))")
    args = p.parse_args(argv)
    profile = Profile.load(args.profile)
    engines = args.gpus // max(1, profile.gpus_per_engine)
    if engines < 2 or args.minutes <= 0 or args.agents < 1:
        p.error("need at least 2 engines' GPUs, a positive --minutes and --agents")
    prefill_engines = args.prefill_engines if args.prefill_engines is not None else round(engines * 0.75)
    if not 0 < prefill_engines < engines:
        p.error(f"--prefill-engines must leave decode engines: 1 to {engines - 1}")
    ramp = args.ramp if args.ramp is not None else min(5.0, args.minutes / 4)
    warm = args.warmup if args.warmup is not None else min(10.0, args.minutes / 3)
    started = time.process_time()
    requests = generate(
        AgentTraffic(agents=args.agents, minutes=args.minutes, seed=args.seed, ramp_minutes=ramp)
    )
    gen_s = time.process_time() - started
    print(
        f"{args.agents:,} agents, {args.minutes:g} minutes (joining over {ramp:g}, the first {warm:g} not counted), "
        f"{engines} engines of {profile.gpus_per_engine} GPUs ({profile.name}); generated in {gen_s:.1f} CPU s",
        file=sys.stderr,
    )
    print(shape_lines(shape(requests, with_ceiling=False)))
    last = requests[-1].arrival_s if requests else 0.0
    reused = dict(zip((r.index for r in requests), reused_tokens(requests), strict=True))
    measured: dict[str, dict] = {}
    lines = [HEAD]
    for row in args.rows:
        why = missing_options(row, profile)
        if why:
            lines.append(f"| {LABELS[row]} | not run: {why} |")
            continue
        try:
            result = run_row(row, requests, engines, profile, prefill_engines)
        except ValueError as e:  # an option the simulator declares but does not simulate yet
            lines.append(f"| {LABELS[row]} | not run: {e} |")
            continue
        measured[row] = measure(result, warm * 60.0, last, reused)
        label = LABELS[row] + (f" ({prefill_engines} prefill)" if row == "pd" else "")
        lines.append(fmt_row(label, measured[row]))
        print(f"{row}: {result.cpu_s:.0f} CPU s", file=sys.stderr)
    print()
    print("\n".join(lines))
    print()
    rate = PUBLISHED_REQUESTS_PER_MINUTE / PUBLISHED_AGENTS
    print(
        f"published: {PUBLISHED_REQUESTS_PER_MINUTE:,.0f} requests/min at {PUBLISHED_AGENTS:,} agents "
        f"({rate * args.agents:,.0f} at {args.agents:,}), {PUBLISHED_CACHED_SHARE:.1%} of input from cache, "
        f"precise against approximate {PUBLISHED_PRECISE_THROUGHPUT:+.0%} throughput, "
        f"{PUBLISHED_PRECISE_TTFT:+.0%} TTFT"
    )
    if "precise" in measured and "approximate" in measured:
        a, b = measured["precise"], measured["approximate"]
        ttft = a["summary"].ttft_p50 / b["summary"].ttft_p50 - 1 if b["summary"].ttft_p50 else float("nan")
        print(
            f"here: precise against approximate {a['served_per_min'] / b['served_per_min'] - 1:+.0%} served/min, "
            f"{ttft:+.0%} TTFT p50"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
