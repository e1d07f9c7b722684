"""Fair share under overload: the noisy-neighbour case, on simulator engines behind one or two router processes.

    .venv/bin/python -m bench.fair_share            # full: six cases of 45 s, about 6 minutes
    .venv/bin/python -m bench.fair_share --quick    # three cases of 12 s, about a minute

Tenant A floods with bursts of parallel sub-agent requests, several times what the fleet can serve; tenant B runs a
few interactive agent sessions (closed loops with think time over a growing cached context), well within its
share. Cases, on the same engines, each with fresh router processes:

- `B alone`: the baseline;
- `A+B, no flow control`: `flow_control` off in the routing policy (the router before issue 21: every request goes
  to the engines' queues);
- `A+B, flow control, 1 router` and `... 2 routers` (each client's requests alternate between the two);
- `3:1 floods, 1 router` and `... 2 routers`: two tenants of fair-share weights 3 and 1 both flood.

Per tenant: TTFT p50/p90 from the arrival of the first streamed token at the client (requests started in the
measured window; one still unanswered when the case ends counts with its wait so far, a lower bound, marked >=),
output and work tokens per second (work: prompt tokens not cached plus output tokens) from the router's usage
events of the requests that ended in the window, errors (an answer other than 200, or a stream that ended short),
and the tenant's share of the fleet's work. Uses the database `bench_fair_share` (dropped and re-created) and Redis
database 13 (flushed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import orjson

from bench import harness as h
from bench.docs_section import write_section

ROOT, PYTHON, MODEL = h.ROOT, h.PYTHON, h.MODEL
BENCH_DB = "bench_fair_share"
BENCH_REDIS_DB = 13
log = h.log

ENGINES = 2
SLOTS = 16  # each engine's max_num_seqs, and the pool's (the router counts free slots from it)
BLOCK = 128
FULL_EXTRA_ITL_S = 0.03  # a full engine's token takes 20 + 30 = 50 ms, whatever its number of slots


def sim_timing(slots: int) -> list[str]:
    return [
        "--prefill-time-per-token",
        "0.0001",  # 10k uncached prompt tokens/s per engine, one prefill at a time
        "--prefill-overhead",
        "0.005",
        "--decode-time",
        "0.02",
        "--decode-time-per-seq",
        f"{FULL_EXTRA_ITL_S / max(1, slots - 1):.5g}",
    ]


# Tenant A: a burst of sub-agents every FLOOD_PERIOD_S, each a parent's context (shared, cached after the first)
# and a task of its own; tenant B: interactive sessions, each turn a fresh tool result on a growing context.
FLOOD_BURST = 48
FLOOD_PERIOD_S = 1.0
FLOOD_PARENTS = 4
PARENT_WORDS = 1800
TASK_WORDS = 220
FLOOD_TOKENS = (16, 64)  # output tokens, uniform: sub-agents answer at different lengths
AGENT_SESSIONS = 4
AGENT_THINK_S = 1.5
AGENT_SYSTEM_WORDS = 1500
AGENT_RESULT_WORDS = 1200
AGENT_TOKENS = (24, 72)
AGENT_CONTEXT_WORDS = 14_000  # past this, a session compacts: its context starts over from a summary

# name -> (fair-share weight, role)
TENANTS = {"a": 1, "b": 1, "heavy": 3, "light": 1}
TARGET_TTFT_RATIO = 1.5
TARGET_THROUGHPUT_DROP = 0.05
TARGET_SPLIT = (0.675, 0.825)  # 3:1 within 10 %: the heavy tenant's share of the two tenants' work

WORDS = (
    "the of and to in is for on with as by at from that this file line test code data value error result "
    "function class module return import call read write change update path name list item state check build "
    "run fix branch commit review merge config option query table index cache request response stream token "
    "model router engine pool deploy scale metric trace span log event queue worker task retry limit budget"
).split()


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    flooders: tuple[str, ...]
    agents: tuple[str, ...]
    routers: int
    flow_control: bool = True
    burst: int = FLOOD_BURST  # each flooder's burst


CASES = (
    Case("alone", "B alone", (), ("b",), 1),
    Case("off", "A+B, no flow control", ("a",), ("b",), 1, False),
    Case("fc1", "A+B, flow control, 1 router", ("a",), ("b",), 1),
    Case("fc2", "A+B, flow control, 2 routers", ("a",), ("b",), 2),
    # Two flooders of half A's burst each: together as far over the fleet as A alone.
    Case("w1", "3:1 floods, 1 router", ("heavy", "light"), (), 1, burst=FLOOD_BURST // 2),
    Case("w2", "3:1 floods, 2 routers", ("heavy", "light"), (), 2, burst=FLOOD_BURST // 2),
)
QUICK_CASES = ("alone", "fc1", "w2")
LABELS = {"a": "A (flood)", "b": "B (agent)", "heavy": "heavy (weight 3)", "light": "light (weight 1)"}


@dataclass
class Result:
    """One request as its client saw it."""

    tenant: str
    started: float  # seconds since the case began
    ttft: float | None = None
    status: int | None = None
    tokens: int = 0
    wanted: int = 0
    done: bool = False  # [DONE] came
    cut: bool = False  # still running or waiting when the case ended (its client went away)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.tokens >= self.wanted

    @property
    def error(self) -> bool:
        return not self.cut and not self.ok


@dataclass
class Usage:
    """One usage event of the router, as the ledger receives it."""

    tenant: str
    ended: float  # seconds since the case began
    prompt: int
    cached: int
    output: int
    status: str
    ttft_ms: int | None = None  # at the router, from the request's arrival (its wait in the queue included)
    queued_ms: int | None = None

    @property
    def work(self) -> int:
        return max(0, self.prompt - self.cached) + self.output


@dataclass
class Row:
    """One tenant's figures in one case."""

    tenant: str
    ttft_p50: float | None
    ttft_p90: float | None
    censored: bool  # the p90 is a lower bound: requests still unanswered at the end are in it
    output_rate: float
    work_rate: float
    errors: int
    requests: int
    share: float = 0.0
    # From the usage events: the wait in the router's queue, and the router's TTFT less that wait (seconds).
    queued: tuple[float | None, float | None] = (None, None)
    after_gate: tuple[float | None, float | None] = (None, None)


@dataclass
class Outcome:
    case: Case
    rows: dict[str, Row]
    fleet_output: float
    fleet_work: float
    engine_waiting: float | None = None  # requests waiting in the engines' queues, mean over the window


# --- arithmetic --------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of the values, None if there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def p50_p90(values: list[float]) -> tuple[float | None, float | None]:
    return percentile(values, 0.5), percentile(values, 0.9)


def ttfts(results: list[Result], start: float, end: float) -> tuple[list[float], list[float]]:
    """First-token times of the requests started in [start, end): answered ones, and the waits so far of those
    still unanswered when the case ended (lower bounds). Failed requests are errors, not latencies."""
    answered, waiting = [], []
    for r in results:
        if not start <= r.started < end:
            continue
        if r.ttft is not None:
            answered.append(r.ttft)
        elif r.cut:
            waiting.append(end - r.started)
    return answered, waiting


def tenant_row(tenant: str, results: list[Result], usage: list[Usage], window: tuple[float, float]) -> Row:
    start, end = window
    span = end - start
    answered, waiting = ttfts(results, start, end)
    p50, p90 = p50_p90(answered + waiting)
    # The p90 is a lower bound when a request still unanswered sits at or above it.
    censored = bool(waiting) and p90 is not None and max(waiting) >= p90
    ended = [u for u in usage if start <= u.ended < end and u.status == "completed"]
    started = [r for r in results if start <= r.started < end]
    return Row(
        tenant,
        p50,
        p90,
        censored,
        sum(u.output for u in ended) / span,
        sum(u.work for u in ended) / span,
        sum(1 for r in started if r.error),
        len(started),
        queued=p50_p90([(u.queued_ms or 0) / 1000 for u in ended]),
        after_gate=p50_p90([(u.ttft_ms - (u.queued_ms or 0)) / 1000 for u in ended if u.ttft_ms is not None]),
    )


def outcome(
    case: Case,
    results: list[Result],
    usage: list[Usage],
    window: tuple[float, float],
    engine_waiting: float | None = None,
) -> Outcome:
    tenants = [*case.flooders, *case.agents]
    rows = {
        t: tenant_row(t, [r for r in results if r.tenant == t], [u for u in usage if u.tenant == t], window)
        for t in tenants
    }
    fleet_work = sum(r.work_rate for r in rows.values())
    for row in rows.values():
        row.share = row.work_rate / fleet_work if fleet_work else 0.0
    return Outcome(case, rows, sum(r.output_rate for r in rows.values()), fleet_work, engine_waiting)


@dataclass
class Target:
    what: str
    measured: str
    met: bool | None  # None: a measurement without a target


def targets(outcomes: dict[str, Outcome]) -> list[Target]:
    out: list[Target] = []
    alone, off = outcomes.get("alone"), outcomes.get("off")
    base = alone.rows["b"].ttft_p90 if alone else None
    runs = [outcomes[name] for name in ("fc1", "fc2") if name in outcomes]
    for run in runs:
        if not base:
            break
        b = run.rows["b"]
        ratio = (b.ttft_p90 or 0.0) / base
        out.append(
            Target(
                f"B's TTFT p90 within {TARGET_TTFT_RATIO:g}x of B alone ({run.case.label})",
                f"{'>=' if b.censored else ''}{ms(b.ttft_p90)} ms against {ms(base)} ms: {ratio:.2f}x",
                ratio <= TARGET_TTFT_RATIO and not b.censored,
            )
        )
    for run in runs:
        if off is None or not off.fleet_output or not off.fleet_work:
            break
        # The capacity B leaves: the fleet's output without flow control, less what B took with it.
        left = off.fleet_output - run.rows["b"].output_rate
        got = run.rows["a"].output_rate / left if left > 0 else 0.0
        out.append(
            Target(
                f"A receives the capacity B leaves ({run.case.label})",
                f"A {run.rows['a'].output_rate:,.0f} output tokens/s of the {left:,.0f} left: {got:.0%}",
                got >= 1 - TARGET_THROUGHPUT_DROP,
            )
        )
        output = run.fleet_output / off.fleet_output - 1
        work = run.fleet_work / off.fleet_work - 1
        out.append(
            Target(
                f"fleet throughput drops less than {TARGET_THROUGHPUT_DROP:.0%} against no flow control "
                f"({run.case.label})",
                f"output {run.fleet_output:,.0f} against {off.fleet_output:,.0f} tokens/s ({output:+.1%}), work "
                f"{run.fleet_work:,.0f} against {off.fleet_work:,.0f} ({work:+.1%})",
                min(output, work) > -TARGET_THROUGHPUT_DROP,
            )
        )
    low, high = TARGET_SPLIT
    shares = {}
    for name in ("w1", "w2"):
        run = outcomes.get(name)
        if run is None:
            continue
        heavy, light = run.rows["heavy"].work_rate, run.rows["light"].work_rate
        shares[name] = share = heavy / (heavy + light) if heavy + light else 0.0
        ratio = f"{heavy / light:.2f}:1" if light else "no light work"
        out.append(
            Target(
                f"weights 3:1 split the work within 10 % of 3:1, heavy share in [{low}, {high}] ({run.case.label})",
                f"{share:.3f} ({heavy:,.0f} : {light:,.0f} work tokens/s, {ratio})",
                low <= share <= high,
            )
        )
    if "w1" in shares and "w2" in shares:
        drift = shares["w2"] - shares["w1"]
        out.append(
            Target("two-replica drift of the 3:1 split (heavy share)", f"{drift * 100:+.1f} points", None)
        )
    if "fc1" in outcomes and "fc2" in outcomes:
        drift = outcomes["fc2"].rows["b"].share - outcomes["fc1"].rows["b"].share
        out.append(
            Target("two-replica drift of B's share of the work (A+B)", f"{drift * 100:+.1f} points", None)
        )
    return out


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def pair(values: tuple[float | None, float | None]) -> str:
    return f"{ms(values[0])} / {ms(values[1])}"


def report(outcomes: dict[str, Outcome], argv: list[str], describe: list[str]) -> str:
    lines = [h.header("fair_share", argv) + f" Router at commit {h.git_head()}.", ""]
    lines += [f"- {line}" for line in describe]
    lines += [
        "",
        "| case | tenant | TTFT p50 / p90 (ms) | output tok/s | work tok/s | share of work | requests | errors |"
        " fleet output / work tok/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in outcomes.values():
        for i, row in enumerate(run.rows.values()):
            mark = ">=" if row.censored else ""
            fleet = f"{run.fleet_output:,.0f} / {run.fleet_work:,.0f}" if i == 0 else ""
            lines.append(
                f"| {run.case.label if i == 0 else ''} | {LABELS[row.tenant]} | "
                f"{ms(row.ttft_p50)} / {mark}{ms(row.ttft_p90)} | {row.output_rate:,.0f} | "
                f"{row.work_rate:,.0f} | {row.share:.1%} | {row.requests} | {row.errors} | {fleet} |"
            )
    lines += [
        "",
        "Where the first token waits (requests completed in the window, from the router's usage events): in the "
        "router's queue, then after the gate (the router's TTFT less that wait: routing, the engine's queue, "
        "prefill); and the requests waiting in the engines' queues, sampled every 0.5 s.",
        "",
        "| case | tenant | router queue p50 / p90 (ms) | after the gate p50 / p90 (ms) | waiting in engines (mean) |",
        "|---|---|---:|---:|---:|",
    ]
    for run in outcomes.values():
        for i, row in enumerate(run.rows.values()):
            waiting = f"{run.engine_waiting:,.1f}" if i == 0 and run.engine_waiting is not None else ""
            lines.append(
                f"| {run.case.label if i == 0 else ''} | {LABELS[row.tenant]} | {pair(row.queued)} | "
                f"{pair(row.after_gate)} | {waiting} |"
            )
    lines += ["", "Targets:", ""]
    for target in targets(outcomes):
        verdict = "measured" if target.met is None else ("met" if target.met else "**missed**")
        lines.append(f"- {target.what}: {target.measured}: {verdict}.")
    return "\n".join(lines)


# --- the platform --------------------------------------------------------------------------------------------


class Engine:
    def __init__(self, index: int, slots: int):
        self.index, self.slots = index, slots
        self.port = h.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"{MODEL}-main-{index}"
        self.proc = None

    def start(self, procs: h.Processes) -> None:
        argv = [PYTHON, "-m", "simulator", "--model", str(ROOT / "models" / MODEL)]
        argv += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--block-size", str(BLOCK), "--max-num-seqs", str(self.slots), "--max-model-len", "32768"]
        argv += ["--enable-prompt-tokens-details", *sim_timing(self.slots)]
        self.proc = procs.start(f"fair-share-engine-{self.index}", argv, core=None)

    def wait(self) -> None:
        h.wait_until(lambda: h.http_get(self.port, "/health") == 200, self.proc, self.name, 120)

    def requests(self) -> tuple[float, float]:
        """(running, waiting) in the engine."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        found = {
            family.name: sum(s.value for s in family.samples)
            for family in text_string_to_metric_families(text)
            if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        }
        return found.get("vllm:num_requests_running", 0.0), found.get("vllm:num_requests_waiting", 0.0)


class QueueSampler(threading.Thread):
    """The requests waiting in the engines' queues, summed over the engines, every 0.5 s."""

    def __init__(self, engines: list[Engine], began: float, window: tuple[float, float]):
        super().__init__(daemon=True)
        self.engines, self.began, self.window = engines, began, window
        self.samples: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            at = time.monotonic() - self.began
            if at >= self.window[1]:
                return
            if at >= self.window[0]:
                try:
                    self.samples.append(sum(engine.requests()[1] for engine in self.engines))
                except (httpx.HTTPError, OSError):
                    continue

    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def setup_django(env: dict) -> None:
    os.environ.update(env)
    import django

    django.setup()


def create_objects(engines: list[Engine]) -> tuple[int, dict[str, str], dict[int, str]]:
    """The deployment over the engines, a tenant per role with its weight; (deployment id, key per tenant,
    tenant per tenant id)."""
    from routing.models import RoutingPolicy
    from serving.models import Endpoint, Health, Pool
    from tenants.keys import api_key_create
    from tenants.models import Scope, Team, Tenant

    deployment = h.sim_deployment(max_model_len=32768, block_size=BLOCK)
    pool = Pool.objects.create(
        deployment=deployment, name="main", replicas=len(engines), max_num_seqs=engines[0].slots
    )
    for engine in engines:
        Endpoint.objects.create(
            pool=pool, name=engine.name, url=engine.url, role="both", health=Health.HEALTHY
        )
    RoutingPolicy.objects.create(deployment=deployment, mode="approximate")
    keys, ids = {}, {}
    for slug, weight in TENANTS.items():
        tenant = Tenant.objects.create(name=f"Tenant {slug}", slug=f"tenant-{slug}", fair_share_weight=weight)
        team = Team.objects.create(tenant=tenant, name="Agents", slug="agents")
        keys[slug] = api_key_create(team=team, name=f"bench-{slug}", scopes=[Scope.INFERENCE]).secret
        ids[tenant.pk] = slug
    return deployment.pk, keys, ids


def set_policy(deployment_id: int, **fields) -> None:
    from inference_platform.config_version import bump_config_version
    from routing.models import RoutingPolicy

    RoutingPolicy.objects.filter(deployment_id=deployment_id).update(**fields)
    bump_config_version()


def read_usage(redis_client, after: str, tenant_ids: dict[int, str], began_wall: float) -> list[Usage]:
    """The usage events the routers emitted since the stream entry `after`."""
    from datetime import datetime

    from django.conf import settings

    out = []
    for _, fields in redis_client.xrange(settings.USAGE_STREAM, min=f"({after}" if after != "0" else "-"):
        event = json.loads(fields[b"e"])
        tenant = tenant_ids.get(event.get("tenant_id"))
        if tenant is None:
            continue
        ended = datetime.fromisoformat(event["created_at"]).timestamp() - began_wall
        out.append(
            Usage(
                tenant,
                ended,
                int(event.get("prompt_tokens") or 0),
                int(event.get("cached_prompt_tokens") or 0),
                int(event.get("output_tokens") or 0),
                event.get("status", ""),
                event.get("ttft_ms"),
                event.get("queued_ms"),
            )
        )
    return out


# --- the load ------------------------------------------------------------------------------------------------


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


async def stream_chat(
    session: aiohttp.ClientSession, url: str, key: str, messages: list[dict], max_tokens: int, result: Result
) -> None:
    """One streamed chat request, its first token's time and its tokens counted into `result`. The lines are
    only looked at, not parsed: the client must stay cheap next to what it measures (2 cores)."""
    body = orjson.dumps(
        {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    )
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    result.wanted = max_tokens
    sent = time.monotonic()
    try:
        async with session.post(url, data=body, headers=headers) as response:
            result.status = response.status
            if response.status != 200:
                await response.read()
                return
            async for line in response.content:
                if line.startswith(b"data: [DONE]"):
                    result.done = True
                # A token, even one whose text is empty (a byte of a split character); the role chunk is not.
                elif b'"content"' in line and b'"role"' not in line:
                    if result.ttft is None:
                        result.ttft = time.monotonic() - sent
                    result.tokens += 1
    except asyncio.CancelledError:
        result.cut = True
        raise
    except (aiohttp.ClientError, TimeoutError):
        result.status = result.status or -1


class Load:
    """The clients of one case: flooders' bursts and agents' sessions, over one or two routers."""

    def __init__(
        self, session: aiohttp.ClientSession, urls: list[str], keys: dict[str, str], began: float, seed: int
    ):
        self.session, self.urls, self.keys, self.began = session, urls, keys, began
        self.results: list[Result] = []
        self.tasks: set[asyncio.Task] = set()
        self.rng = random.Random(seed)
        self.turns = 0

    def url(self, index: int) -> str:
        return self.urls[index % len(self.urls)]

    def spawn(self, work) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def request(self, tenant: str, client_index: int, messages: list[dict], max_tokens: int) -> Result:
        result = Result(tenant, time.monotonic() - self.began)
        self.results.append(result)
        await stream_chat(
            self.session, self.url(client_index), self.keys[tenant], messages, max_tokens, result
        )
        return result

    async def flood(self, tenant: str, burst: int, period: float, stop_at: float) -> None:
        rng = random.Random(f"{tenant}-{self.rng.random()}")
        parents = [words(rng, PARENT_WORDS) for _ in range(FLOOD_PARENTS)]
        n = 0
        next_at = time.monotonic()
        while next_at < stop_at:
            parent = parents[n % FLOOD_PARENTS]
            for i in range(burst):
                messages = [
                    {"role": "system", "content": f"Parent agent {tenant}-{n % FLOOD_PARENTS}. {parent}"},
                    {"role": "user", "content": f"Sub-agent {n}.{i}: {words(rng, TASK_WORDS)}"},
                ]
                self.spawn(self.request(tenant, i, messages, rng.randint(*FLOOD_TOKENS)))
            n += 1
            next_at += period
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def agent(self, tenant: str, index: int, stop_at: float) -> None:
        rng = random.Random(f"{tenant}-{index}-{self.rng.random()}")
        system = {"role": "system", "content": f"Coding agent of {tenant}. {words(rng, AGENT_SYSTEM_WORDS)}"}
        await asyncio.sleep(rng.uniform(0, AGENT_THINK_S))  # sessions out of step
        history = [system, {"role": "user", "content": f"Task {index}: {words(rng, 200)}"}]
        size = AGENT_SYSTEM_WORDS + 200
        while time.monotonic() < stop_at:
            await self.request(tenant, index, history, rng.randint(*AGENT_TOKENS))
            self.turns += 1
            history.append({"role": "assistant", "content": f"Calling a tool: {words(rng, 30)}"})
            history.append({"role": "user", "content": f"Tool result: {words(rng, AGENT_RESULT_WORDS)}"})
            size += AGENT_RESULT_WORDS + 30
            if size > AGENT_CONTEXT_WORDS:  # compaction: a summary replaces the history
                history = [system, {"role": "user", "content": f"Summary so far: {words(rng, 600)}"}]
                size = AGENT_SYSTEM_WORDS + 600
            await asyncio.sleep(AGENT_THINK_S)


async def drive(case: Case, ports: list[int], keys: dict[str, str], length: float, seed: int) -> Load:
    urls = [f"http://127.0.0.1:{port}/v1/chat/completions" for port in ports]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:
        began = time.monotonic()
        load = Load(session, urls, keys, began, seed)
        stop_at = began + length
        for tenant in case.flooders:
            load.spawn(load.flood(tenant, case.burst, FLOOD_PERIOD_S, stop_at))
        for tenant in case.agents:
            for index in range(AGENT_SESSIONS):
                load.spawn(load.agent(tenant, index, stop_at))
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
        # The end of the case: whatever still runs or waits is cancelled (its client goes away).
        pending = list(load.tasks)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return load


# --- a case --------------------------------------------------------------------------------------------------


def run_case(
    procs: h.Processes,
    env: dict,
    case: Case,
    engines: list[Engine],
    deployment_id: int,
    keys: dict[str, str],
    tenant_ids: dict[int, str],
    redis_client,
    warmup: float,
    measure: float,
    seed: int,
) -> Outcome:
    set_policy(deployment_id, flow_control=case.flow_control)
    no_decision_log = {"ROUTER_DECISION_LOG_SAMPLE": "0"}
    routers = [
        h.start_router(procs, f"fair-share-router-{case.name}-{i}", env, no_decision_log)
        for i in range(case.routers)
    ]
    last = redis_client.xrevrange(_stream(), count=1)
    after = last[0][0].decode() if last else "0"
    log(f"{case.label}: {warmup + measure:.0f} s")
    window = (warmup, warmup + measure)
    began_wall = time.time()
    sampler = QueueSampler(engines, time.monotonic(), window)
    sampler.start()
    load = asyncio.run(drive(case, [port for _, port in routers], keys, warmup + measure, seed))
    sampler.stop.set()
    # Let the cancelled requests leave the engines and their usage events reach the stream.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(sum(e.requests()) for e in engines):
        time.sleep(0.5)
    time.sleep(1.0)
    usage = read_usage(redis_client, after, tenant_ids, began_wall)
    for proc, _ in routers:
        procs.stop(proc)
    result = outcome(case, load.results, usage, window, sampler.mean())
    for row in result.rows.values():
        log(
            f"  {row.tenant}: TTFT p50/p90 {ms(row.ttft_p50)}/{ms(row.ttft_p90)} ms, work {row.work_rate:,.0f}/s, "
            f"share {row.share:.1%}, errors {row.errors}/{row.requests}"
        )
    return result


def _stream() -> str:
    from django.conf import settings

    return settings.USAGE_STREAM


def describe(
    warmup: float, measure: float, slots: int, burst: int, prefill: int | None, spare: float | None = None
) -> list[str]:
    changed = []
    if prefill is not None:
        changed.append(f"`saturation_prefill_tokens_per_engine` {prefill:,}")
    if spare is not None:
        changed.append(f"`saturation_spare_slots_per_engine` {spare:g}")
    thresholds = (
        f"{' and '.join(changed)} and the other thresholds at their defaults"
        if changed
        else "the policy's default thresholds (saturated when no engine has a free slot; two spare slots per "
        "engine kept for the tenants behind their share)"
    )
    return [
        f"Fleet: {ENGINES} simulator engines, `--max-num-seqs {slots}` (the pool's `max_num_seqs` too), "
        f"`{' '.join(sim_timing(slots))}`, {BLOCK}-token blocks, prefix caching; routing mode approximate; flow control "
        f"with {thresholds} and class limits; "
        "every tenant `standard`. Fresh router processes for each case (one uvicorn worker each); the engines' "
        "/metrics scraped every second.",
        f"Tenant A (flood): a burst of {burst} parallel streamed chat requests every {FLOOD_PERIOD_S:g} s, "
        f"each a parent agent's context of about {PARENT_WORDS:,} tokens (one of {FLOOD_PARENTS}, cached after "
        f"its first use) and a sub-task of about {TASK_WORDS} new tokens, {FLOOD_TOKENS[0]} to {FLOOD_TOKENS[1]} "
        "output tokens (uniform, `ignore_eos`). The 3:1 cases: two such tenants of fair-share weights 3 and 1, "
        f"each a burst of {burst // 2} a second.",
        f"Tenant B (interactive agent): {AGENT_SESSIONS} closed-loop sessions, {AGENT_THINK_S:g} s of think time "
        f"between turns, each turn a tool result of about {AGENT_RESULT_WORDS:,} new tokens on a growing cached "
        f"context (system prompt {AGENT_SYSTEM_WORDS:,} tokens; compacted past {AGENT_CONTEXT_WORDS:,}), "
        f"{AGENT_TOKENS[0]} to {AGENT_TOKENS[1]} output tokens.",
        f"Each case: {warmup:g} s of warm-up, then {measure:g} s measured; at the end the clients disconnect "
        "whatever still runs or waits. TTFT from requests started in the measured window (`>=`: a lower bound, "
        "requests still unanswered at the end counted with their wait so far); tokens/s and shares from the "
        "router's usage events of the requests that completed in it.",
    ]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.fair_share", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"cases {', '.join(QUICK_CASES)}, 12 s each")
    parser.add_argument("--cases", nargs="+", choices=[c.name for c in CASES], help="only these cases")
    parser.add_argument("--measure", type=float, help="seconds measured per case (40; quick 10)")
    parser.add_argument("--slots", type=int, default=SLOTS, help="each engine's max_num_seqs")
    parser.add_argument(
        "--burst", type=int, default=FLOOD_BURST, help="tenant A's burst (each flooder's half)"
    )
    parser.add_argument(
        "--prefill-threshold",
        type=int,
        help="the policy's saturation_prefill_tokens_per_engine (default: the policy's default)",
    )
    parser.add_argument(
        "--spare-slots",
        type=float,
        help="the policy's saturation_spare_slots_per_engine (default: the policy's default)",
    )
    parser.add_argument("--docs", help="write the table to this file's fair-share section")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    h.under_devstack("fair_share", argv, ("DATABASE_URL", "REDIS_URL"))
    h.STATE.mkdir(parents=True, exist_ok=True)
    warmup = 2.0 if args.quick else 5.0
    measure = args.measure or (10.0 if args.quick else 40.0)
    names = args.cases or (QUICK_CASES if args.quick else [c.name for c in CASES])
    cases = [
        dataclasses.replace(c, burst=args.burst if c.burst == FLOOD_BURST else args.burst // 2)
        for c in CASES
        if c.name in names
    ]
    redis_url = h.with_path(os.environ["REDIS_URL"], f"/{BENCH_REDIS_DB}")
    h.flush_redis(redis_url)
    env = h.platform_env(h.fresh_database(os.environ["DATABASE_URL"], BENCH_DB), redis_url)
    env["PLATFORM_STATE_DIR"] = str(h.STATE / "fair-share")
    h.migrate(env)
    setup_django(env)
    import redis

    redis_client = redis.Redis.from_url(redis_url)
    outcomes: dict[str, Outcome] = {}
    with h.Processes() as procs:
        procs.after_stop(lambda: h.flush_redis(redis_url))
        engines = [Engine(i, args.slots) for i in range(ENGINES)]
        for engine in engines:
            engine.start(procs)
        for engine in engines:
            engine.wait()
        deployment_id, keys, tenant_ids = create_objects(engines)
        if args.prefill_threshold is not None:
            set_policy(deployment_id, saturation_prefill_tokens_per_engine=args.prefill_threshold)
        if args.spare_slots is not None:
            set_policy(deployment_id, saturation_spare_slots_per_engine=args.spare_slots)
        h.scrape_loads(procs)
        for seed, case in enumerate(cases):
            outcomes[case.name] = run_case(
                procs,
                env,
                case,
                engines,
                deployment_id,
                keys,
                tenant_ids,
                redis_client,
                warmup,
                measure,
                seed,
            )
    text = report(
        outcomes,
        argv,
        describe(warmup, measure, args.slots, args.burst, args.prefill_threshold, args.spare_slots),
    )
    print(text)
    varied = args.quick or args.cases or args.measure or args.slots != SLOTS or args.burst != FLOOD_BURST
    varied = varied or args.prefill_threshold is not None
    if args.docs or not varied:
        path = Path(args.docs) if args.docs else ROOT / "docs" / "benchmarks.md"
        write_section(path, "fair-share", text, "Fair share under overload", "bench/fair_share.py")
    return 0


if __name__ == "__main__":
    h.run(main)
