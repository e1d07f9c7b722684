"""Autoscaling on a compressed day of agent traffic: real simulator engines started and stopped by the local
orchestrator, the router in front, the autoscaler deciding every second.

    .venv/bin/python -m bench.autoscale            # full: a 150 s day, about 10 minutes
    .venv/bin/python -m bench.autoscale --quick    # a 60 s day and a 40 s P/D run, about 5 minutes

Runs, each on a fresh deployment (engines started by `serving.services.deployment_reconcile`, as the Celery
worker does):

- `autoscaled`: an aggregated pool under an autoscaling policy (1 to MAX_REPLICAS replicas; targets: running
  sequences per replica, TTFT and ITL p90 objectives), from one replica.
- `static-peak`: the same pool with the replicas the load's peak needs, all day.
- `static-mean`: the replicas its mean needs, all day.
- `pd`: a prefill pool and a decode pool, each under its own policy (queued prompt tokens per replica and TTFT
  for prefill; running sequences and ITL for decode), through a prefill-heavy phase then a decode-heavy one.

The day: agent sessions ramp from a few to many and back, each a closed loop of streamed chat turns over a
growing context, with bursts of parallel sub-agent requests at the peak. What Celery beat does in production
runs here in one control thread, once a second: scrape the engines' /metrics, ingest the usage stream into the
ledger, run the autoscaler, reconcile. Engine-seconds come from the engines' recorded lifetimes; TTFT and ITL
from the streamed chunks' arrival at the client, p90 per 10 s window. A request fails when it is not answered 200
or its stream ends short of its tokens. It uses the database `bench_autoscale` (dropped and re-created) and Redis
database 12 (flushed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import harness as h
from bench.docs_section import write_section

ROOT, PYTHON, MODEL = h.ROOT, h.PYTHON, h.MODEL
BENCH_DB = "bench_autoscale"
BENCH_REDIS_DB = 12
log = h.log

WINDOW_S = 10.0
TTFT_OBJECTIVE_S = 1.0
ITL_OBJECTIVE_S = 0.06
RUNNING_PER_REPLICA = 6
MAX_REPLICAS = 5
MAX_TOKENS = 48
THINK_S = 0.3
SIM_ARGS = [
    "--decode-time",
    "0.01",  # 10 ms a token with one sequence running
    "--decode-time-per-seq",
    "0.004",  # + 4 ms per other running sequence: ITL 0.06 s at 13 sequences
    "--prefill-time-per-token",
    "0.00003",
    "--max-num-seqs",
    "32",
]
SYSTEM = "You are a coding agent working in a large repository. " * 60  # a shared prefix, about 700 tokens


@dataclass
class Day:
    """Sessions wanted at time t (seconds into the day), and when sub-agent bursts fire."""

    length: float
    low: int
    high: int

    def sessions(self, t: float) -> int:
        """Night (the first 30 % and the last 30 %), a morning ramp, a peak, an evening ramp."""
        x = t / self.length
        if x < 0.3 or x >= 0.7:
            return self.low
        if x < 0.4:
            return round(self.low + (self.high - self.low) * (x - 0.3) / 0.1)
        if x < 0.6:
            return self.high
        return round(self.high - (self.high - self.low) * (x - 0.6) / 0.1)

    def burst(self, t: float) -> bool:
        x = t / self.length
        return 0.4 <= x < 0.6

    def mean_sessions(self) -> float:
        steps = 1000
        return sum(self.sessions(self.length * i / steps) for i in range(steps)) / steps


@dataclass
class Result:
    started: float
    ttft: float | None
    itl: float | None
    ok: bool
    why: str = ""  # of a failure: the status, or how the stream ended


@dataclass
class Run:
    name: str
    results: list[Result] = field(default_factory=list)
    replicas: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    engine_seconds: float = 0.0
    events: list[str] = field(default_factory=list)
    began: float = 0.0


# --- the platform, in this process ------------------------------------------------------------------------


def setup_django(env: dict) -> None:
    os.environ.update(env)
    import django

    django.setup()


def make_deployment(name: str, pools: list[dict], policies: dict[str, dict] | None) -> tuple[str, int]:
    from inference_platform.config_version import bump_config_version
    from routing.models import RoutingPolicy
    from serving.models import AutoscalingPolicy, ModelDeployment, Pool
    from tenants.keys import api_key_create
    from tenants.models import Scope, Team, Tenant

    tenant, _ = Tenant.objects.get_or_create(slug="bench", defaults={"name": "Bench"})
    team, _ = Team.objects.get_or_create(tenant=tenant, slug="agents", defaults={"name": "Agents"})
    deployment = ModelDeployment.objects.create(
        name=name,
        served_model_name=MODEL,
        model_source=str(ROOT / "models" / MODEL),
        engine_kind="sim",
        orchestrator="local",
        max_model_len=32768,
    )
    for fields in pools:
        pool = Pool.objects.create(deployment=deployment, extra_engine_args=SIM_ARGS, **fields)
        if policies and pool.name in policies:
            AutoscalingPolicy.objects.create(pool=pool, enabled=True, **policies[pool.name])
    RoutingPolicy.objects.create(deployment=deployment, mode="least_loaded", pd_split_threshold_tokens=512)
    bump_config_version()
    key = api_key_create(team=team, name=f"bench-{name}", scopes=[Scope.INFERENCE]).secret
    return key, deployment.pk


class Control(threading.Thread):
    """Celery beat's work, once a second: scrape, ingest usage, autoscale, reconcile; replicas recorded."""

    def __init__(self, deployment_id: int, run: Run):
        super().__init__(daemon=True)
        self.deployment_id, self.run_ = deployment_id, run
        self.stop = threading.Event()

    def run(self) -> None:
        from django.db import close_old_connections

        from routing.scheduling.load_scraper import endpoint_loads_scrape
        from serving import services
        from serving.autoscaling import autoscale_all
        from serving.models import Pool
        from tenants.tasks import ingest_usage

        while not self.stop.wait(1.0):
            for step in (endpoint_loads_scrape, ingest_usage, autoscale_all):
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - one missed step is not fatal
                    log(f"{step.__name__} failed: {exc!r}")
            try:
                services.deployment_reconcile(deployment_id=self.deployment_id)
                pools = dict(
                    Pool.objects.filter(deployment_id=self.deployment_id).values_list("name", "replicas")
                )
                self.run_.replicas.append((time.monotonic() - self.run_.began, pools))
            except Exception as exc:  # noqa: BLE001
                log(f"reconcile failed: {exc!r}")
            finally:
                close_old_connections()


def wait_ready(deployment_id: int, timeout: float = 120) -> None:
    from serving import services
    from serving.models import ModelDeployment, ObservedStatus

    deadline = time.monotonic() + timeout
    while True:
        services.deployment_reconcile(deployment_id=deployment_id)
        deployment = ModelDeployment.objects.get(pk=deployment_id)
        if deployment.observed_status == ObservedStatus.READY:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready: {deployment.status_message}")
        time.sleep(0.5)


def stop_deployment(deployment_id: int) -> None:
    from serving.models import ModelDeployment
    from serving.orchestrators.local import LocalOrchestrator

    ModelDeployment.objects.filter(pk=deployment_id).delete()
    remaining = set(ModelDeployment.objects.values_list("pk", flat=True))
    LocalOrchestrator().sweep(remaining, drain_first=False)


def engine_seconds(deployment_name: str, began_wall: float, ended_wall: float) -> float:
    """Seconds of engines running over the day, from their recorded lifetimes."""
    from serving.models import EndpointLifetime

    total = 0.0
    for life in EndpointLifetime.objects.filter(deployment_name=deployment_name):
        start = max(life.started_at.timestamp(), began_wall)
        stop = min(life.stopped_at.timestamp() if life.stopped_at else ended_wall, ended_wall)
        total += max(stop - start, 0.0)
    return total


# --- the load ----------------------------------------------------------------------------------------------


async def turn(
    client: httpx.AsyncClient, key: str, messages: list[dict], max_tokens: int, began: float
) -> Result:
    started = time.monotonic()
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    chunks: list[float] = []
    done = False
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        ) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:120]
                return Result(started - began, None, None, False, f"{response.status_code} {text}")
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    delta = choices[0].get("delta") or {}
                    # A token, even one whose text is empty (a byte of a character split over tokens); the
                    # first chunk's role with its empty content is not one.
                    if "content" in delta and "role" not in delta:
                        chunks.append(time.monotonic())
    except httpx.HTTPError as exc:
        return Result(started - began, None, None, False, repr(exc)[:120])
    ok = done and len(chunks) >= max_tokens
    ttft = chunks[0] - started if chunks else None
    itl = (chunks[-1] - chunks[0]) / (len(chunks) - 1) if len(chunks) > 1 else None
    why = "" if ok else f"{len(chunks)} of {max_tokens} tokens, {'[DONE]' if done else 'no [DONE]'}"
    return Result(started - began, ttft, itl, ok, why)


async def session(client, key, run: Run, index: int, alive, max_tokens, prompt_words: int, stop_at: float):
    rng = random.Random(index)
    history = [{"role": "system", "content": SYSTEM}]
    task = f"Session {index}: " + " ".join(f"file{rng.randrange(10_000)}.py" for _ in range(prompt_words))
    history.append({"role": "user", "content": task})
    while alive(index) and time.monotonic() < stop_at:
        run.results.append(await turn(client, key, history, max_tokens(), run.began))
        history = history[:2] + history[-6:]
        history.append({"role": "assistant", "content": "Read the files; next I will edit them."})
        history.append({"role": "user", "content": f"Tool result: {rng.randrange(10**9)} lines changed."})
        await asyncio.sleep(THINK_S)


async def drive(port: int, key: str, run: Run, day: Day, shape) -> None:
    """Keep `day.sessions(t)` sessions going; at the peak, bursts of three sub-agent turns from random sessions.
    `shape(t)` -> (max_tokens, prompt words) of the turns started at t."""
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120, limits=limits) as client:
        run.began = time.monotonic()
        stop_at = run.began + day.length
        tasks: dict[int, asyncio.Task] = {}
        bursts: list[asyncio.Task] = []
        rng = random.Random(7)

        def alive(index: int) -> bool:
            return index < day.sessions(time.monotonic() - run.began)

        next_burst = 0.0
        while (now := time.monotonic() - run.began) < day.length:
            wanted = day.sessions(now)
            tokens, words = shape(now)
            for index in range(wanted):
                if index not in tasks or tasks[index].done():
                    tasks[index] = asyncio.ensure_future(
                        session(
                            client,
                            key,
                            run,
                            index,
                            alive,
                            lambda: shape(time.monotonic() - run.began)[0],
                            words,
                            stop_at,
                        )
                    )
            if day.burst(now) and now >= next_burst:
                next_burst = now + 4.0
                for _ in range(3):
                    sub = [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"Sub-agent {rng.randrange(10**6)}: search the tests."},
                    ]
                    bursts.append(
                        asyncio.ensure_future(_keep(run, turn(client, key, sub, tokens, run.began)))
                    )
            await asyncio.sleep(0.2)
        await asyncio.gather(*tasks.values(), *bursts, return_exceptions=True)


async def _keep(run: Run, work) -> None:
    run.results.append(await work)


# --- the runs and the report ------------------------------------------------------------------------------


def one_run(
    procs: h.Processes, env: dict, name: str, pools: list[dict], policies, day: Day, shape, autoscale: bool
) -> Run:
    run = Run(name)
    key, deployment_id = make_deployment(name, pools, policies)
    log(f"{name}: starting engines")
    wait_ready(deployment_id)
    router, port = h.start_router(procs, f"autoscale-router-{name}", env)
    control = Control(deployment_id, run)
    if not autoscale:
        from serving.models import AutoscalingPolicy

        AutoscalingPolicy.objects.filter(pool__deployment_id=deployment_id).update(enabled=False)
    control.start()
    began_wall = time.time()
    log(f"{name}: the day begins ({day.length:.0f} s)")
    asyncio.run(drive(port, key, run, day, shape))
    ended_wall = time.time()
    control.stop.set()
    control.join(timeout=30)
    run.engine_seconds = engine_seconds(name, began_wall, ended_wall)
    from serving.models import ScalingEvent

    run.events = [
        f"{e.at:%H:%M:%S} {e.pool.name} {e.from_replicas}->{e.to_replicas}: {e.reason}"
        for e in ScalingEvent.objects.filter(pool__deployment_id=deployment_id).order_by("at", "id")
    ]
    stop_deployment(deployment_id)
    procs.stop(router)
    return run


def p90(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, math.ceil(0.9 * len(values)) - 1)]


def windows(run: Run, day: Day) -> list[tuple[float, float | None, float | None, int]]:
    out = []
    for start in range(0, int(day.length), int(WINDOW_S)):
        inside = [r for r in run.results if start <= r.started < start + WINDOW_S and r.ok]
        out.append((start, p90([r.ttft for r in inside]), p90([r.itl for r in inside]), len(inside)))
    return out


def met_share(run: Run, day: Day) -> float:
    measured = [(t, i) for _, t, i, n in windows(run, day) if n]
    met = sum(1 for t, i in measured if t <= TTFT_OBJECTIVE_S and i <= ITL_OBJECTIVE_S)
    return met / len(measured) if measured else 0.0


def mean_replicas(run: Run, pool: str, start: float, end: float) -> float:
    values = [r[pool] for t, r in run.replicas if start <= t < end and pool in r]
    return statistics.fmean(values) if values else 0.0


def report(runs: dict[str, Run], day: Day, pd_day: Day | None, argv: list[str]) -> str:
    peak = runs["static-peak"].engine_seconds
    lines = [
        h.header("autoscale", argv),
        "",
        f"Day: {day.length:.0f} s, {day.low} to {day.high} agent sessions (mean {day.mean_sessions():.1f}), "
        f"{MAX_TOKENS}-token streamed turns; objectives TTFT p90 <= {TTFT_OBJECTIVE_S:g} s and ITL p90 <= "
        f"{ITL_OBJECTIVE_S:g} s per {WINDOW_S:.0f} s window.",
        "",
        "| fleet | engine-seconds | vs peak-sized | windows meeting both objectives | requests | failed |"
        " scaling events |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("autoscaled", "static-peak", "static-mean"):
        run = runs[name]
        failed = sum(1 for r in run.results if not r.ok)
        lines.append(
            f"| {name} | {run.engine_seconds:.0f} | {run.engine_seconds / peak:.0%} | "
            f"{met_share(run, day):.0%} | {len(run.results)} | {failed} | {len(run.events)} |"
        )
    lines += ["", "Per 10 s window (autoscaled): replicas, TTFT p90, ITL p90, requests finished.", ""]
    lines += ["| window | replicas | TTFT p90 (s) | ITL p90 (s) | requests |", "|---|---:|---:|---:|---:|"]
    auto = runs["autoscaled"]
    for start, ttft, itl, n in windows(auto, day):
        reps = mean_replicas(auto, "main", start, start + WINDOW_S)
        lines.append(
            f"| {start:.0f}-{start + WINDOW_S:.0f} s | {reps:.1f} | {_f(ttft)} | {_f(itl, 3)} | {n} |"
        )
    if "pd" in runs and pd_day is not None:
        run = runs["pd"]
        half = pd_day.length / 2
        failed = sum(1 for r in run.results if not r.ok)
        lines += [
            "",
            f"P/D: {pd_day.length:.0f} s, first half prefill-heavy (long prompts, 2-token answers), second half "
            "decode-heavy (short prompts, 160-token answers). Mean replicas per phase:",
            "",
            "| pool | prefill-heavy phase | decode-heavy phase |",
            "|---|---:|---:|",
            f"| prefill | {mean_replicas(run, 'prefill', 0, half):.1f} | "
            f"{mean_replicas(run, 'prefill', half, pd_day.length):.1f} |",
            f"| decode | {mean_replicas(run, 'decode', 0, half):.1f} | "
            f"{mean_replicas(run, 'decode', half, pd_day.length):.1f} |",
            "",
            f"P/D requests: {len(run.results)}, failed {failed}, engine-seconds {run.engine_seconds:.0f}.",
        ]
    failures = Counter(
        f"{name}: {r.why.split(':')[0][:60]}" for name, run in runs.items() for r in run.results if not r.ok
    )
    if failures:
        lines += ["", "Failed requests, by fleet and reason:", ""]
        lines += [f"- {why} x{count}" for why, count in sorted(failures.items())]
    lines += ["", "Scaling events (autoscaled):", ""]
    lines += [f"- {event}" for event in auto.events] or ["- none"]
    if "pd" in runs:
        lines += ["", "Scaling events (P/D):", ""]
        lines += [f"- {event}" for event in runs["pd"].events] or ["- none"]
    return "\n".join(lines)


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.autoscale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 60 s day and a 40 s P/D run")
    parser.add_argument("--skip-pd", action="store_true", help="leave out the P/D run")
    parser.add_argument("--only-pd", action="store_true", help="the P/D run alone (no table is written)")
    parser.add_argument("--docs", help="write the table to this file's autoscaling section")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    h.under_devstack("autoscale", argv, ("DATABASE_URL", "REDIS_URL"))
    h.STATE.mkdir(parents=True, exist_ok=True)
    redis_url = h.with_path(os.environ["REDIS_URL"], f"/{BENCH_REDIS_DB}")
    h.flush_redis(redis_url)
    env = h.platform_env(h.fresh_database(os.environ["DATABASE_URL"], BENCH_DB), redis_url)
    env.update(
        {
            "PLATFORM_STATE_DIR": str(h.STATE / "autoscale"),
            "AUTOSCALER_LATENCY_WINDOW_S": str(WINDOW_S),
            "AUTOSCALER_DEFAULT_STARTUP_S": "3",
            "ROUTER_CONFIG_POLL_SECONDS": "0.5",
        }
    )
    h.migrate(env)
    setup_django(env)
    day = Day(60.0 if args.quick else 150.0, 2, 14)
    pd_day = Day(40.0 if args.quick else 60.0, 6, 6)
    peak_replicas = math.ceil((day.high + 3) / RUNNING_PER_REPLICA)
    mean_replicas_ = max(1, round(day.mean_sessions() / RUNNING_PER_REPLICA))
    policy = {
        "min_replicas": 1,
        "max_replicas": MAX_REPLICAS,
        "running_requests_per_replica": RUNNING_PER_REPLICA,
        "ttft_p90_s": TTFT_OBJECTIVE_S,
        "itl_p90_s": ITL_OBJECTIVE_S,
        "scale_up_window_s": 0,
        "scale_down_window_s": 8,
        "max_scale_up_step": 2,
        "max_scale_down_step": 1,
    }

    def steady(_t: float) -> tuple[int, int]:
        return MAX_TOKENS, 40

    runs: dict[str, Run] = {}
    with h.Processes() as procs:
        from serving.orchestrators.local import LocalOrchestrator

        # The engines the orchestrator started (this run's state directory and database mark them) go too.
        procs.before_stop(lambda: LocalOrchestrator().sweep(set(), drain_first=False))
        procs.after_stop(lambda: h.flush_redis(redis_url))
        fleets = [
            ("autoscaled", 1, True),
            ("static-peak", peak_replicas, False),
            ("static-mean", mean_replicas_, False),
        ]
        for name, replicas, autoscale in [] if args.only_pd else fleets:
            pools = [{"name": "main", "replicas": replicas}]
            runs[name] = one_run(procs, env, name, pools, {"main": policy}, day, steady, autoscale)
        if not args.skip_pd:
            split = {"kv_connector": "NixlConnector"}
            pools = [
                {"name": "prefill", "role": "prefill", "replicas": 1, **split},
                {"name": "decode", "role": "decode", "replicas": 1, **split},
            ]
            policies = {
                "prefill": {
                    "min_replicas": 1,
                    "max_replicas": 3,
                    "queued_prompt_tokens_per_replica": 3000,
                    "ttft_p90_s": TTFT_OBJECTIVE_S,
                    "scale_up_window_s": 0,
                    "scale_down_window_s": 8,
                },
                "decode": {
                    "min_replicas": 1,
                    "max_replicas": 3,
                    "running_requests_per_replica": RUNNING_PER_REPLICA,
                    "itl_p90_s": ITL_OBJECTIVE_S,
                    "scale_up_window_s": 0,
                    "scale_down_window_s": 8,
                },
            }

            def phases(t: float) -> tuple[int, int]:
                # Prefill-heavy: long fresh prompts, 2-token answers; then decode-heavy: short prompts, long answers.
                return (2, 500) if t < pd_day.length / 2 else (160, 10)

            runs["pd"] = one_run(procs, env, "pd", pools, policies, pd_day, phases, True)
    if args.only_pd:
        run = runs["pd"]
        half = pd_day.length / 2
        for pool in ("prefill", "decode"):
            print(
                f"{pool}: {mean_replicas(run, pool, 0, half):.1f} replicas in the prefill-heavy phase, "
                f"{mean_replicas(run, pool, half, pd_day.length):.1f} in the decode-heavy one"
            )
        print(f"requests {len(run.results)}, failed {sum(1 for r in run.results if not r.ok)}")
        for why in sorted({r.why for r in run.results if not r.ok}):
            print(f"  failed: {why} x{sum(1 for r in run.results if r.why == why)}")
        print("\n".join(run.events))
        return 0
    text = report(runs, day, None if args.skip_pd else pd_day, argv)
    print(text)
    if args.docs or not args.quick:
        path = Path(args.docs) if args.docs else ROOT / "docs" / "benchmarks.md"
        write_section(path, "autoscaling", text, "Autoscaling", "bench/autoscale.py")
    return 0


if __name__ == "__main__":
    h.run(main)
