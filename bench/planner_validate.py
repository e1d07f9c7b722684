"""The fleet planner against real runs: each run a benchmark recorded through the router's own traffic tracing
(`bench/prefix_routing.py --trace-out DIR`) simulated with the matching profile and configuration, and TTFT
p50 / p90, throughput and prefix-hit share compared (planner/validate.py), with the median relative error per
configuration against the target (10 %).

    .venv/bin/python -m bench.prefix_routing --quick --workloads agentic --skip-peer --repeat 2 \
        --policies round_robin least_loaded approximate precise --trace-out .local/bench/validation/agentic
    .venv/bin/python -m bench.planner_validate .local/bench/validation/agentic [--profile NAME] [--out FILE]

The recording side lives here too (`record_run`, used by the benchmark): after a run the routers' stream is
drained by the worker's own task (`routing.tasks.drain_traffic_trace`) and the run's period exported by
`manage.py export_trace`, the path an operator takes, at the deployment's block size so that the planner matches
prefixes block for block as the engines do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

TARGET = 0.10  # median relative error per configuration
MEASURED_KEYS = (
    "ttft_p50",
    "ttft_p90",
    "ttft_mean",
    "rps",
    "tps",
    "hit_share",
    "usage_hit_share",
    "requests",
    "router_added_ms",
    "own_prefill_p90",
    "host_share",
    "router_ttft_ms",
    "engine_ttft_ms",
    "engine_queue_ms",
    "engine_prefill_ms",
)


# --- recording (in the benchmark's process, Django set up) ---------------------------------------------------


def trace_clock() -> datetime:
    """The wall clock the router stamps its trace entries with (UTC)."""
    return datetime.now(UTC)


def wait_for_stream(client, expected: int, limit_s: float = 10.0) -> int:
    """Wait until the routers' traffic-trace stream holds `expected` entries, or stops growing for a second (a
    request that failed before the router settled it leaves none); the entries there."""
    from django.conf import settings

    stream = settings.ROUTER_TRAFFIC_TRACE_STREAM
    deadline = time.monotonic() + limit_s
    last, still_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = client.xlen(stream)
        if n >= expected:
            return n
        if n != last:
            last, still_since = n, time.monotonic()
        elif time.monotonic() - still_since > 1.0:
            break
        time.sleep(0.1)
    return client.xlen(stream)


def record_run(
    folder: Path,
    deployment: str,
    workload: str,
    policy: str,
    round_no: int,
    since: datetime,
    config: dict,
    summary: dict,
) -> Path:
    """The run's trace, drained and exported as an operator would, and its measured figures and configuration
    beside it (`<workload>-<policy>-<round>.jsonl` and `.json`); the JSON file's path."""
    from django.core.management import call_command

    from routing.tasks import drain_traffic_trace

    drained = drain_traffic_trace()
    until = trace_clock()
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{workload}-{policy.replace(' ', '_')}-{round_no}"
    trace = folder / f"{stem}.jsonl"
    call_command(
        "export_trace",
        "--deployment",
        deployment,
        "--since",
        since.isoformat(),
        "--until",
        until.isoformat(),
        "--out",
        str(trace),
        "--block-tokens",
        str(config["block_size"]),
    )
    exported = sum(1 for line in trace.read_text().splitlines() if line.strip())
    ok = summary["requests"] - summary["errors"]
    record = {
        "workload": workload,
        "policy": policy,
        "round": round_no,
        "trace": trace.name,
        "trace_requests": exported,
        "drained": drained,
        "since": since.isoformat(),
        "until": until.isoformat(),
        "config": config,
        "measured": {k: summary[k] for k in MEASURED_KEYS if k in summary},
        "ok_requests": ok,
    }
    if exported != summary["requests"]:
        record["note"] = f"{exported} trace entries for {summary['requests']} requests sent ({ok} answered)"
    path = folder / f"{stem}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


# --- validation ----------------------------------------------------------------------------------------------


def report(
    folders: list[str],
    profile: str | None,
    target: float = TARGET,
    router_latency: bool = False,
    host_share: bool = False,
    recorded_routes: bool = False,
) -> tuple[str, bool]:
    """The validation tables for every run recorded in `folders`; and whether every configuration met the
    target."""
    from planner.validate import (
        breakdown_table,
        by_configuration,
        compare,
        configuration_error,
        load_runs,
        summary_table,
        table,
    )

    comparisons = []
    for folder in folders:
        for run in load_runs(folder):
            started = time.process_time()
            comparisons.append(compare(run, profile, router_latency, host_share, recorded_routes))
            print(
                f"simulated {run.label}: {len(run.requests)} requests in {time.process_time() - started:.1f} CPU s",
                file=sys.stderr,
            )
    if not comparisons:
        raise SystemExit(f"no recorded runs in {', '.join(folders)} (record some with --trace-out)")
    configs = by_configuration(comparisons)
    met = all(configuration_error(group) <= target for group in configs.values())
    profiles = sorted({profile or c.run.config["profile"] for c in comparisons})
    text = "\n".join(
        [
            f"Profile: {', '.join(profiles)}"
            + (", request overhead plus the router's measured added latency" if router_latency else "")
            + (
                ", vLLM-CPU engines on the share of the host's cores the run measured they had"
                if host_share
                else ""
            )
            + (", each request sent to the engine the run sent it to" if recorded_routes else "")
            + f". Target: median relative error at most {target:.0%} per "
            "configuration (over TTFT p50, TTFT p90, req/s and hit share; each figure's error the median over "
            "the rounds).",
            "",
            summary_table(comparisons, target),
            "",
            "Every run:",
            "",
            table(comparisons),
            "",
            "Where the time to the first token went (means; the engines' from their own histograms, not part "
            "of the error):",
            "",
            breakdown_table(comparisons),
        ]
    )
    return text, met


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", help="folders of recorded runs (prefix_routing --trace-out)")
    p.add_argument("--profile", help="simulate with this profile instead of the one each run names")
    p.add_argument("--target", type=float, default=TARGET, help="the median relative error to meet (0.10)")
    p.add_argument(
        "--router-latency",
        action="store_true",
        help="add each run's measured router-added latency (the router's router_added_latency_seconds mean) to "
        "the profile's request overhead",
    )
    p.add_argument(
        "--host-share",
        action="store_true",
        help="engines that compute on the run's own cores (vLLM-CPU) slowed to the share of those cores the run "
        "measured they had (what the router, the client, Redis and anything else did not use)",
    )
    p.add_argument(
        "--recorded-routes",
        action="store_true",
        help="send each request to the engine the run sent it to (the trace's `endpoint`) instead of routing it "
        "by the planner's pipeline: the engines' model alone, apart from where the routing went another way",
    )
    p.add_argument("--out", help="also write the tables to this file")
    args = p.parse_args(argv)
    try:
        text, met = report(
            args.folders,
            args.profile,
            args.target,
            args.router_latency,
            args.host_share,
            args.recorded_routes,
        )
    except (ValueError, FileNotFoundError) as exc:
        p.error(str(exc))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
