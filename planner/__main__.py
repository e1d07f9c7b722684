"""python -m planner: replay a trace through the platform's routing onto simulated engines (docs/planner.md)."""

from __future__ import annotations

import argparse
import sys

from .profile import Profile, profile_names
from .trace import assign_tenants, load_trace, tenant_rule


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planner", description=__doc__)
    p.add_argument("--trace", required=True, help="a Mooncake-style JSON-lines trace")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--mode", default="precise", help="the routing policy's mode")
    p.add_argument("--modes", nargs="+", help="several modes, compared side by side")
    p.add_argument(
        "--profile",
        help=f"a profile JSON file, or the name of one in planner/profiles/ ({', '.join(profile_names())}); "
        "measure one with `manage.py profile_engine`",
    )
    p.add_argument("--limit", type=int, help="the first N requests only")
    p.add_argument("--speed", type=float, default=1.0, help="arrivals this many times faster")
    p.add_argument("--tenants", type=int, default=0, help="assign this many tenants by --tenant-rule")
    p.add_argument("--tenant-rule", default="prefix", choices=("index", "random", "prefix"))
    p.add_argument("--kv-tokens", type=int, help="override the profile's KV capacity (0: unbounded)")
    p.add_argument("--gpu-price", type=float, help="override the profile's price per GPU-hour")
    p.add_argument("--prefill-engines", type=int, default=0, help="a prefill pool of N (--engines: decode)")
    p.add_argument("--flow-control", action="store_true", help="the router's gate in front of the engines")
    p.add_argument("--max-wait", type=float, help="with --flow-control: every class's limit in the queue (s)")
    p.add_argument("--cpu-tier-tokens", type=int, help="a CPU tier of this many KV tokens per engine")
    p.add_argument("--spec", nargs=2, type=float, metavar=("DRAFT", "ACCEPT"), help="speculative decoding")
    p.add_argument(
        "--autoscale",
        nargs=2,
        type=int,
        metavar=("MIN", "MAX"),
        help="the autoscaler between MIN and MAX engines (--engines: at the start)",
    )
    p.add_argument("--running-per-engine", type=int, default=32, help="with --autoscale: its target")
    p.add_argument(
        "--prefill-autoscale",
        nargs=2,
        type=int,
        metavar=("MIN", "MAX"),
        help="with --prefill-engines: the autoscaler over the prefill pool (--autoscale: over the decode pool)",
    )
    p.add_argument(
        "--queued-per-prefill-engine",
        type=int,
        default=16384,
        help="with --prefill-autoscale: its target, uncached prompt tokens queued per prefill engine",
    )
    p.add_argument("--startup", type=float, default=60.0, help="with --autoscale: an engine's start-up (s)")
    args = p.parse_args(argv)

    from .report import summarize, table, tenant_table
    from .sim import simulate

    profile = Profile.load(args.profile)
    if args.kv_tokens is not None:
        profile = profile.with_(kv_capacity_tokens=args.kv_tokens)
    if args.gpu_price is not None:
        profile = profile.with_(gpu_price_per_hour=args.gpu_price)
    if args.cpu_tier_tokens is not None:
        profile = profile.with_(cpu_tier_tokens=args.cpu_tier_tokens)
    if args.spec:
        profile = profile.with_(spec_draft_tokens=int(args.spec[0]), spec_acceptance=args.spec[1])
    policy: dict = {"flow_control": args.flow_control}
    if args.max_wait is not None:
        policy.update({f"max_wait_{c}_s": args.max_wait for c in ("interactive", "standard", "batch")})
    if args.prefill_autoscale and not args.prefill_engines:
        p.error("--prefill-autoscale needs --prefill-engines")

    def autoscaled(bounds, target: str, value: int):
        """The autoscaler between (MIN, MAX) engines held to one target, or None without bounds."""
        if not bounds:
            return None
        from .autoscale_sim import Autoscale

        low, high = bounds
        return Autoscale(
            policy={"min_replicas": low, "max_replicas": high, target: value}, startup_s=args.startup
        )

    autoscale = autoscaled(args.autoscale, "running_requests_per_replica", args.running_per_engine)
    prefill_autoscale = autoscaled(
        args.prefill_autoscale, "queued_prompt_tokens_per_replica", args.queued_per_prefill_engine
    )
    requests = load_trace(args.trace, args.limit)
    if args.speed != 1.0:
        from dataclasses import replace

        requests = [replace(r, arrival_s=r.arrival_s / args.speed) for r in requests]
    if args.tenants:
        requests = assign_tenants(requests, tenant_rule(args.tenant_rule, args.tenants))
    summaries = []
    for mode in args.modes or [args.mode]:
        result = simulate(
            requests,
            args.engines,
            profile,
            mode,
            policy=policy,
            autoscale=autoscale,
            prefill_engines=args.prefill_engines,
            prefill_autoscale=prefill_autoscale,
        )
        summaries.append(summarize(result))
        print(f"simulated {mode}: {summaries[-1].cpu_s:.1f} CPU s", file=sys.stderr)
    print(f"trace {args.trace}: {len(requests)} requests, {args.engines} engines, profile {profile.name}")
    print(table(summaries))
    for s in summaries:
        extra = tenant_table(s)
        if extra:
            print()
            print(extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
