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
    args = p.parse_args(argv)

    from .report import summarize, table, tenant_table
    from .sim import simulate

    profile = Profile.load(args.profile)
    if args.kv_tokens is not None:
        profile = profile.with_(kv_capacity_tokens=args.kv_tokens)
    if args.gpu_price is not None:
        profile = profile.with_(gpu_price_per_hour=args.gpu_price)
    requests = load_trace(args.trace, args.limit)
    if args.speed != 1.0:
        from dataclasses import replace

        requests = [replace(r, arrival_s=r.arrival_s / args.speed) for r in requests]
    if args.tenants:
        requests = assign_tenants(requests, tenant_rule(args.tenant_rule, args.tenants))
    summaries = []
    for mode in args.modes or [args.mode]:
        summaries.append(summarize(simulate(requests, args.engines, profile, mode)))
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
