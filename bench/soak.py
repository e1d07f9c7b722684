"""A soak run: agent traffic at a steady fraction of the fleet's capacity for a long time, and whether anything
grows, fails or drifts.

    .venv/bin/python -m bench.soak                          # an hour, 5-minute windows
    .venv/bin/python -m bench.soak --minutes 3 --window 30  # the suite's short version (tests/bench/test_soak.py)

Without DATABASE_URL and REDIS_URL it re-runs itself under `python -m inference_platform.devstack exec`. It uses a
dedicated database (`bench_<tag>`, dropped and re-created each run) and Redis database 11 (flushed), and runs the
platform's own processes as production does: the router (one uvicorn worker, bench/harness.py), the Celery worker
(threads, as the devstack runs it) and beat, and the KV-event ingester. The deployment `tiny-qwen` (precise prefix
routing) runs on the `local` orchestrator with simulated engines, so the worker reconciles and supervises them,
ingests usage into the ledger and scrapes the engines' metrics, every few seconds, as it does in production.

Traffic: the agents of bench/agent_scale.py (half Claude Code-shaped, /v1/messages?beta=true; half Codex-shaped,
/v1/responses; tool sessions whose contexts grow by file text and compact past `--max-context`; sub-agent bursts;
all streamed), in closed loops whose think times aim at a rate. The rate is `--fraction` of the fleet's capacity:
what the same agents got through with no think time over `--calibrate` seconds before the soak (`--rate` sets it
instead). The calibration is also the warm-up of every cache; the soak's windows start after it.

At each window's end it reads:
- memory (RSS, and USS and PSS: what a process holds alone, and its share of what it shares) and CPU time of the
  router's process, of its tokenizing worker processes (together), of the ingester and of the Celery worker (its
  process alone: the engines it supervises are its children, measured apart); CPU per request is the window's CPU
  over the requests that ended in it;
- Redis's used memory, and of it the token-id pieces routers share (`tok:*`, which live
  ROUTER_SHARED_TOKENS_TTL_SECONDS after their last use, six hours by default): their payload (the ids' bytes) and
  their keys' overhead (Redis's MEMORY USAGE of each key less its payload, and the keys' share of the database's key
  tables); the median of five readings half a second apart, as what requests in flight hold comes and goes;
- the prefix index's size (its GPU and CPU entries, `px:*`, speculative ones left out) against the engines' cached
  blocks, which only the engines' own KV events tell (vLLM exports no such metric): a subscriber of its own in this
  process, apart from the ingester, keeps each engine's set of blocks from its BlockStored, BlockRemoved and
  AllBlocksCleared events; its count is taken before and after the index is read, and the mean compared;
- usage lag: from a request's end (the usage event's `created_at`, stamped by the router as the request ends) to its
  ledger row, seen by polling the ledger every quarter second;
- errors: requests not answered 200 with a streamed answer, and ledger rows not `completed`; at the end, requests
  with no ledger row (usage lost) count as errors too.

Targets: every process's USS (and Redis's memory less the shared token pieces' keys, payload and overhead) in the
last window within 10 % of the second's; no error; the index within 5 % of the engines at every window's end. With `--json PATH` the windows
and the verdict are written there too; the exit status is 0 whatever the verdict (the table says it).

With `--trace-memory` the router runs under tracemalloc (bench/memwatch/sitecustomize.py: no change to its code),
and the report adds what Python's allocators hold in it, the source lines that grew after warm-up, and what each of
its bounded caches holds against its bound. Tracing costs the router CPU: its CPU per request is not comparable
with an untraced run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import agent_scale as a
from bench import harness as h
from bench.docs_section import write_section
from routing.kvindex.kv_ingest import engine_hash

ROOT, PYTHON, MODEL, STATE = h.ROOT, h.PYTHON, h.MODEL, h.STATE
log = h.log

BENCH_REDIS_DB = 11
BLOCK = a.BLOCK
MAX_MODEL_LEN = a.MAX_MODEL_LEN
# Cheap engines, as in bench/agent_scale.py: what is soaked is the platform around them.
SIM_ARGS = dict(a.SIM_ARGS)
FLAT = 0.10  # memory: the last window within 10 % of the second
# The router's tokenizing workers fill caches that are bounded by design and take many hours to fill at a soak's
# rate, so they are held to those bounds rather than to flatness: per worker, the piece cache at its bound
# (196 MB at most, measured: docs/benchmarks.md "Soak"), the recent texts (about 32 MB) and the recent
# conversations (16 M characters of renders and their messages, about 100 MB allowed).
WORKER_CACHES_MB = 330
INDEX = 0.05  # the index within 5 % of the engines' cached blocks


# --- what the engines hold, from their own events ---------------------------------------------------------


class EngineBlocks(threading.Thread):
    """Each engine's cached GPU blocks, as its KV events announce them, from a SUB socket of its own per engine."""

    def __init__(self, endpoints: dict[int, str]):
        super().__init__(daemon=True, name="engine-blocks")
        self.endpoints = endpoints  # endpoint id -> its KV events address
        self.blocks: dict[int, set[int]] = {e: set() for e in endpoints}
        self.last_seq: dict[int, int] = {e: -1 for e in endpoints}
        self.gaps = 0  # batches this subscriber missed (its count is then not exact)
        self.restarts = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ready = threading.Event()

    def counts(self) -> dict[int, int]:
        with self.lock:
            return {e: len(s) for e, s in self.blocks.items()}

    def apply(self, endpoint: int, seq: int, events: list) -> None:
        with self.lock:
            held = self.blocks[endpoint]
            last = self.last_seq[endpoint]
            if seq <= last:  # the engine restarted: it holds nothing but what follows
                self.restarts += 1
                held.clear()
            elif last >= 0 and seq != last + 1:
                self.gaps += 1
            self.last_seq[endpoint] = seq
            for event in events:
                kind = event.get("type")
                if kind == "AllBlocksCleared":
                    held.clear()
                elif event.get("medium") not in (None, "GPU"):
                    continue
                elif kind == "BlockStored":
                    held.update(map(engine_hash, event["block_hashes"]))
                elif kind == "BlockRemoved":
                    held.difference_update(map(engine_hash, event["block_hashes"]))

    def run(self) -> None:
        import zmq

        from routing.kvindex.kv_ingest import decode_payload

        ctx = zmq.Context()
        poller = zmq.Poller()
        sockets = {}
        for endpoint, address in self.endpoints.items():
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.RCVHWM, 1_000_000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address.replace("*", "127.0.0.1"))
            poller.register(sock, zmq.POLLIN)
            sockets[sock] = endpoint
        self.ready.set()
        try:
            while not self.stop.is_set():
                for sock, _ in poller.poll(100):
                    while True:
                        try:
                            _topic, seq, payload = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.apply(sockets[sock], int.from_bytes(seq, "big"), decode_payload(payload))
        finally:
            for sock in sockets:
                sock.close()
            ctx.term()


def index_entries(client, deployment_id: int) -> dict[int, int]:
    """The prefix index's GPU and CPU entries per endpoint (speculative ones left out)."""
    out: dict[int, int] = {}
    batch: list[bytes] = []

    def count(keys: list[bytes]) -> None:
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            for fields in pipe.execute():
                for endpoint, tier in fields.items():
                    if tier in (b"g", b"c"):
                        out[int(endpoint)] = out.get(int(endpoint), 0) + 1

    for key in client.scan_iter(match=f"px:{deployment_id}:*", count=2000):
        batch.append(key)
        if len(batch) >= 1000:
            count(batch)
            batch = []
    if batch:
        count(batch)
    return out


def shared_token_bytes(client) -> tuple[int, int, int]:
    """(how many `tok:*` pieces, their payload bytes, Redis's memory for them with their keys' overhead)."""
    keys = payload = memory = 0
    batch: list[bytes] = []

    def add(items: list[bytes]) -> tuple[int, int]:
        with client.pipeline(transaction=False) as pipe:
            for key in items:
                pipe.strlen(key)
                pipe.memory_usage(key, samples=0)
            replies = pipe.execute()
        return sum(replies[0::2]), sum(r or 0 for r in replies[1::2])

    for key in client.scan_iter(match="tok:*", count=2000):
        batch.append(key)
        keys += 1
        if len(batch) >= 1000:
            got, held = add(batch)
            payload, memory, batch = payload + got, memory + held, []
    if batch:
        got, held = add(batch)
        payload, memory = payload + got, memory + held
    return keys, payload, memory


def tok_tables_share(client, tok_keys: int) -> int:
    """The shared token pieces' share of their database's key tables (the main one and the one of keys with a TTL,
    pro rata by keys): what each key costs Redis beyond MEMORY USAGE, which counts the key and its value only."""
    db = client.connection_pool.connection_kwargs.get("db", 0)
    tables = client.memory_stats().get(f"db.{db}") or {}
    space = client.info("keyspace").get(f"db{db}") or {}
    keys, expiring = int(space.get("keys", 0)), int(space.get("expires", 0))
    main = int(tables.get("overhead.hashtable.main", 0))
    expires = int(tables.get("overhead.hashtable.expires", 0))
    return (main * tok_keys // keys if keys else 0) + (expires * tok_keys // expiring if expiring else 0)


REDIS_READS = 5  # at each window's end, this many readings REDIS_READ_GAP s apart; the median one is kept
REDIS_READ_GAP = 0.5


def redis_reading(client) -> tuple[int, int, int, int]:
    """Redis's used memory and the shared token pieces' (count, payload, memory with their share of the key tables),
    as the median of REDIS_READS readings by used memory less the pieces: what requests in flight hold for a moment
    (speculative index entries, the usage stream's unacknowledged tail, client buffers) comes and goes with each
    request, and one reading alone can land on a crest of it."""
    readings = []
    for k in range(REDIS_READS):
        if k:
            time.sleep(REDIS_READ_GAP)
        keys, payload, memory = shared_token_bytes(client)
        memory += tok_tables_share(client, keys)
        used = int(client.info("memory")["used_memory"])
        readings.append((used - memory, used, keys, payload, memory))
    readings.sort()
    _, used, keys, payload, memory = readings[len(readings) // 2]
    return used, keys, payload, memory


# --- the ledger, as it fills ------------------------------------------------------------------------------


class Ledger(threading.Thread):
    """Polls the usage ledger for new rows every quarter second; for each, its request's end (the event's
    `created_at`, epoch seconds), when this poll first saw it, and its status."""

    def __init__(self):
        super().__init__(daemon=True, name="ledger")
        self.rows: list[tuple[float, float, str]] = []
        self.last_id = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def poll(self) -> None:
        from tenants.models import UsageRecord

        rows = list(
            UsageRecord.objects.filter(id__gt=self.last_id)
            .order_by("id")
            .values_list("id", "created_at", "status")[:5000]
        )
        seen = time.time()
        with self.lock:
            for row_id, created, status in rows:
                self.rows.append((created.timestamp(), seen, status))
                self.last_id = max(self.last_id, row_id)

    def run(self) -> None:
        from django.db import close_old_connections

        while not self.stop.wait(0.25):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a missed poll only delays what it sees
                log(f"ledger poll failed: {exc!r}")
                close_old_connections()

    def count(self, since: float = 0.0) -> int:
        """Rows of requests that ended at or after `since` (epoch seconds)."""
        with self.lock:
            return sum(end >= since for end, _, _ in self.rows)


# --- the platform's processes, measured -------------------------------------------------------------------


@dataclass
class Memory:
    """A part's memory in bytes: RSS, USS (its own pages) and PSS (its own plus its share of shared ones)."""

    rss: int = 0
    uss: int = 0
    pss: int = 0


class Measured:
    """Memory and CPU seconds of a process (`name`) and, when `children` names them, of its descendants together
    as a part of their own."""

    def __init__(self, name: str, pid: int, children: str | None = None):
        self.name, self.pid, self.children = name, pid, children

    @property
    def parts(self) -> list[str]:
        return [self.name, *([self.children] if self.children else [])]

    def read(self) -> tuple[dict[str, Memory], dict[str, float]]:
        import psutil

        memory = {part: Memory() for part in self.parts}
        cpu = dict.fromkeys(self.parts, 0.0)
        try:
            root = psutil.Process(self.pid)
            procs = [(self.name, root)]
            if self.children:
                procs += [(self.children, child) for child in root.children(recursive=True)]
        except psutil.Error:
            return memory, cpu
        for part, proc in procs:
            with contextlib.suppress(psutil.Error):
                info = proc.memory_full_info()
                memory[part].rss += info.rss
                memory[part].uss += info.uss
                memory[part].pss += getattr(info, "pss", 0)
                t = proc.cpu_times()
                cpu[part] += t.user + t.system
        return memory, cpu


@dataclass
class Sample:
    """What was read at a window's end (t: seconds from the soak's start)."""

    t: float
    memory: dict[str, Memory]
    cpu: dict[str, float]
    redis_used: int
    tok_keys: int
    tok_bytes: int  # the pieces' payload
    tok_memory: int  # Redis's memory for the pieces, their keys' overhead included
    index: int
    engines: float
    stream_len: int


@dataclass
class Window:
    index: int  # 1-based
    start: float
    end: float
    requests: int
    errors: int
    rss_mb: dict[str, float]
    uss_mb: dict[str, float]
    pss_mb: dict[str, float]
    cpu_ms: dict[str, float]  # per request
    redis_mb: float
    redis_less_tok_mb: float  # less the pieces' keys, payload and overhead
    tok_mb: float  # the pieces' payload
    tok_overhead_mb: float  # their keys' overhead
    index_blocks: int
    engine_blocks: float
    lag_p50: float
    lag_p99: float
    lag_max: float
    ledger_rows: int
    notes: list[str] = field(default_factory=list)

    @property
    def index_ratio(self) -> float:
        return self.index_blocks / self.engine_blocks if self.engine_blocks else float("nan")


PROCS = ("router", "router workers", "ingester", "worker")


def sample(t: float, measured: list[Measured], client, deployment_id: int, blocks: EngineBlocks) -> Sample:
    memory, cpu = {}, {}
    for m in measured:
        got, spent = m.read()
        memory.update(got)
        cpu.update(spent)
    before = sum(blocks.counts().values())
    index = sum(index_entries(client, deployment_id).values())
    after = sum(blocks.counts().values())
    used, tok_keys, tok_bytes, tok_memory = redis_reading(client)
    from django.conf import settings

    try:
        stream_len = int(client.xlen(settings.USAGE_STREAM))
    except Exception:  # noqa: BLE001 - no stream yet
        stream_len = 0
    engines = (before + after) / 2
    return Sample(t, memory, cpu, used, tok_keys, tok_bytes, tok_memory, index, engines, stream_len)


# --- windows and targets (pure) ---------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def windows(
    samples: list[Sample],
    ends: list[tuple[float, bool]],
    ledger: list[tuple[float, float, str]],
    began_wall: float,
) -> list[Window]:
    """One window between each two samples: the requests that ended in it (`ends`: seconds from the soak's start,
    and whether it went well), CPU per request from the samples' CPU times, memory at its end, usage lag of the
    ledger rows whose requests ended in it (`ledger`: end and seen, epoch seconds, and status)."""
    out = []
    for k, (s0, s1) in enumerate(zip(samples, samples[1:], strict=False), start=1):
        done = [ok for t, ok in ends if s0.t <= t < s1.t]
        rows = [(end, seen, st) for end, seen, st in ledger if s0.t <= end - began_wall < s1.t]
        lags = [seen - end for end, seen, _ in rows]
        n = len(done)
        cpu = {p: 1000 * (s1.cpu[p] - s0.cpu[p]) / n if n else float("nan") for p in s1.cpu}
        bad_rows = sum(st != "completed" for _, _, st in rows)
        notes = [f"{bad_rows} ledger rows not completed"] if bad_rows else []
        out.append(
            Window(
                index=k,
                start=s0.t,
                end=s1.t,
                requests=n,
                errors=sum(not ok for ok in done) + bad_rows,
                rss_mb={p: m.rss / 2**20 for p, m in s1.memory.items()},
                uss_mb={p: m.uss / 2**20 for p, m in s1.memory.items()},
                pss_mb={p: m.pss / 2**20 for p, m in s1.memory.items()},
                cpu_ms=cpu,
                redis_mb=s1.redis_used / 2**20,
                redis_less_tok_mb=(s1.redis_used - s1.tok_memory) / 2**20,
                tok_mb=s1.tok_bytes / 2**20,
                tok_overhead_mb=(s1.tok_memory - s1.tok_bytes) / 2**20,
                index_blocks=s1.index,
                engine_blocks=s1.engines,
                lag_p50=pct(lags, 0.5),
                lag_p99=pct(lags, 0.99),
                lag_max=max(lags, default=float("nan")),
                ledger_rows=len(rows),
                notes=notes,
            )
        )
    return out


def slope_per_hour(values: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) pairs, per hour."""
    if len(values) < 2:
        return float("nan")
    ts = [t for t, _ in values]
    vs = [v for _, v in values]
    mt, mv = statistics.mean(ts), statistics.mean(vs)
    den = sum((t - mt) ** 2 for t in ts)
    return 3600 * sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / den if den else float("nan")


@dataclass
class Verdict:
    target: str
    met: bool
    detail: str


def memory_series(rows: list[Window]) -> dict[str, list[tuple[float, float]]]:
    """What the memory targets judge: each process's USS (its RSS where USS could not be read), and Redis less the
    shared token pieces."""
    series = {}
    for p in rows[0].rss_mb if rows else ():
        uss = all(w.uss_mb[p] > 0 for w in rows)
        series[p] = [(w.end, w.uss_mb[p] if uss else w.rss_mb[p]) for w in rows]
    if rows:
        series["Redis less token pieces"] = [(w.end, w.redis_less_tok_mb) for w in rows]
    return series


def verdicts(rows: list[Window], lost: int, errors: int | None = None, workers: int = 2) -> list[Verdict]:
    """The targets, against the windows: memory flat after the first window (last within 10 % of the second), no
    error (nor usage lost; `errors`: the whole run's, when some fell outside the windows), the index within 5 % of
    the engines at every window's end. The router's `workers` tokenizing workers are held to their caches' bounds
    (WORKER_CACHES_MB each over the first window) rather than to flatness."""
    out = []
    if len(rows) < 3:
        return [
            Verdict("windows", False, f"{len(rows)} windows: at least 3 are needed (warm-up, second, last)")
        ]
    for name, series in memory_series(rows).items():
        second, last = series[1][1], series[-1][1]
        change = last / second - 1 if second else float("nan")
        slope = slope_per_hour(series[1:])
        detail = f"{second:.1f} -> {last:.1f} MB ({change:+.1%}; slope after warm-up {slope:+.1f} MB/h)"
        if name in rows[0].rss_mb:
            rss = rows[1].rss_mb[name], rows[-1].rss_mb[name]
            detail = f"USS {detail}; RSS {rss[0]:.1f} -> {rss[1]:.1f} MB"
        if name == "router workers":
            bound = series[0][1] + workers * WORKER_CACHES_MB
            detail += (
                f"; bound {bound:.0f} MB ({workers} x {WORKER_CACHES_MB} MB of caches over the first window)"
            )
            out.append(Verdict(f"{name} memory within their caches' bounds", last <= bound, detail))
            continue
        out.append(Verdict(f"{name} memory flat", abs(change) <= FLAT, detail))
    errors = max(errors or 0, sum(w.errors for w in rows))
    requests = sum(w.requests for w in rows)
    out.append(
        Verdict(
            "no error",
            errors == 0 and lost == 0,
            f"{errors} errors, "
            + (f"{lost} usage lost" if lost >= 0 else f"{-lost} ledger rows more than requests")
            + f", of {requests}",
        )
    )
    worst = max(rows, key=lambda w: abs(w.index_ratio - 1) if w.engine_blocks else 0.0)
    off = worst.index_ratio - 1
    out.append(
        Verdict(
            "index within 5 % of the engines",
            all(w.engine_blocks and abs(w.index_ratio - 1) <= INDEX for w in rows),
            f"worst window {worst.index}: {worst.index_blocks:,} vs {worst.engine_blocks:,.0f} ({off:+.2%})",
        )
    )
    return out


# --- the report -------------------------------------------------------------------------------------------


def fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value != value else f"{value:,.{digits}f}"


def clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def table(rows: list[Window]) -> list[str]:
    procs = " | ".join(f"{p} RSS / USS / PSS MB, CPU ms per req" for p in PROCS)
    lines = [
        f"| window | requests (errors) | {procs} | Redis MB (tok payload / key overhead MB) "
        "| index / engines blocks | usage lag p50 / p99 / max (s) |",
        "|---|---:|" + "---:|" * len(PROCS) + "---:|---:|---:|",
    ]
    for w in rows:
        procs = " | ".join(
            f"{fmt(w.rss_mb[p], 0)} / {fmt(w.uss_mb[p], 0)} / {fmt(w.pss_mb[p], 0)}, {fmt(w.cpu_ms[p])}"
            for p in PROCS
        )
        ratio = f"{w.index_blocks:,} / {w.engine_blocks:,.0f} ({w.index_ratio - 1:+.1%})"
        lines.append(
            f"| {w.index}: {clock(w.start)}-{clock(w.end)} | {w.requests} ({w.errors}) | {procs} | "
            f"{fmt(w.redis_mb)} ({fmt(w.tok_mb)} / {fmt(w.tok_overhead_mb)}) | {ratio} | "
            f"{fmt(w.lag_p50, 2)} / {fmt(w.lag_p99, 2)} / {fmt(w.lag_max, 2)} |"
        )
    return lines


def report(args, argv: list[str], run: dict) -> str:
    rows: list[Window] = run["windows"]
    lines = [
        f"### {args.title}",
        "",
        h.header("soak", argv),
        f"- Platform at {h.git_head()}: the router (one uvicorn worker), the Celery worker (threads, 2) and beat, the "
        f"KV-event ingester; {args.engines} simulated engines on the `local` orchestrator (the worker supervises "
        f"them), {args.kv_blocks} KV blocks of {BLOCK} tokens each, "
        + ", ".join(f"`{k} {v}`" for k, v in SIM_ARGS.items())
        + "; precise prefix routing (policy defaults); embedded PostgreSQL and Redis. Nothing pinned: "
        f"{os.cpu_count()} cores shared by everything.",
        f"- Traffic: {args.sessions} agent sessions (half Claude Code-shaped, /v1/messages?beta=true; half "
        f"Codex-shaped, /v1/responses), streamed, contexts growing by tool results and compacted past "
        f"{args.max_context:,} tokens, sub-agent bursts of 3-5 at {args.burst:.0%} of turns. Capacity: "
        f"{run['capacity']}; aimed at {run['rate']:.2f} requests/s, got {run['achieved']:.2f} over "
        f"{args.minutes:g} min in windows of {args.window:g} s (the first is the warm-up).",
        "- Per window: memory at its end, RSS / USS (the process's own pages) / PSS (its own and its share of shared "
        "ones): the router's process, its tokenizing workers together, the ingester, the worker's process alone; "
        "CPU per request: the process's CPU over the window / requests ended in it; Redis: used memory, and of it "
        "the shared token-id pieces (`tok:*`, kept six hours after last use): their payload and their keys' "
        "overhead; index: the prefix index's GPU/CPU entries "
        "against the engines' cached blocks from their own KV events (a subscriber apart from the ingester); usage "
        "lag: a request's end (its usage event's `created_at`) to its ledger row, seen by polling every 0.25 s.",
        "",
        *table(rows),
        "",
        f"Targets (memory flat: the last window within {FLAT:.0%} of the second, the router's tokenizing workers "
        f"within their bounded caches ({WORKER_CACHES_MB} MB each); no error; the index within {INDEX:.0%} of the "
        "engines at every window's end):",
        "",
        "| target | met | detail |",
        "|---|---|---|",
        *(f"| {v.target} | {'yes' if v.met else 'NO'} | {v.detail} |" for v in run["verdicts"]),
        "",
        f"Requests: {run['requests']} sent, {run['ok']} answered, ledger rows {run['ledger_rows']} "
        f"(requests less rows: {run['lost']}); engine events missed by the bench's subscriber: {run['gaps']}, engine "
        f"restarts: {run['restarts']}; usage stream at the end: {run['stream_len']} entries; "
        f"shared token pieces at the end: {run['tok_keys']:,}.",
    ]
    if run.get("inside"):
        lines += ["", *run["inside"]]
    if run["notes"]:
        lines += ["", "Notes:", "", *(f"- {n}" for n in run["notes"])]
    lines += ["", f"Run took {run['took']:.0f} s."]
    return "\n".join(lines)


# --- inside the router (--trace-memory) ------------------------------------------------------------------


def memwatch_env(env: dict, watch_dir: Path, every: float) -> dict[str, str]:
    """The router's environment additions that load bench/memwatch/sitecustomize.py into it."""
    import shutil

    shutil.rmtree(watch_dir, ignore_errors=True)
    watch_dir.mkdir(parents=True)
    path = [str(ROOT / "bench" / "memwatch"), env.get("PYTHONPATH") or os.environ.get("PYTHONPATH", "")]
    return {
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        "SOAK_MEMWATCH_DIR": str(watch_dir),
        "SOAK_MEMWATCH_EVERY": str(every),
    }


def inside_router(path: Path, second_wall: float, top: int = 8) -> list[str]:
    """The report's lines on the router's insides: Python-traced memory per look, the source lines that grew most
    from the look nearest the second window's end to the last, and the bounded caches at the last look."""
    if not path.exists():
        return ["Inside the router: no memory looks were written (bench/memwatch did not load)."]
    looks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(looks) < 2:
        return [f"Inside the router: {len(looks)} memory look(s), too few to compare."]
    base = min(looks, key=lambda r: abs(r["wall"] - second_wall))
    last = looks[-1]
    grew = sorted(
        (
            (last["lines"].get(line, [0])[0] - base["lines"].get(line, [0])[0], line)
            for line in set(last["lines"]) | set(base["lines"])
        ),
        reverse=True,
    )[:top]
    out = [
        "Inside the router (tracemalloc, `--trace-memory`): memory Python's allocators hold, per look: "
        + ", ".join(f"{r['traced_mb']:.0f}" for r in looks)
        + f" MB. Grown most from the look at {base['t']:.0f} s to the last at {last['t']:.0f} s "
        "(by source line of the allocation):",
        "",
        "| source line | grew MB | at the last look MB |",
        "|---|---:|---:|",
    ]
    for delta, line in grew:
        held = last["lines"].get(line, [0])[0]
        out.append(f"| `{line.replace(str(ROOT) + '/', '')}` | {delta / 2**20:+.1f} | {held / 2**20:.1f} |")
    held = [("router", last)]
    for worker in sorted(path.parent.glob("router-worker-*.jsonl")):
        lines = worker.read_text().splitlines()
        if lines:
            look = json.loads(lines[-1])
            held.append((f"worker {worker.stem.rsplit('-', 1)[1]} ({look['traced_mb']:.0f} MB traced)", look))
    out += ["", "The bounded caches at the last look (MB estimated from a sample of their entries):", ""]
    out += ["| process | cache | entries | MB | bound |", "|---|---|---:|---:|---|"]
    for process, look in held:
        for cache in look["caches"]:
            if "error" in cache:
                out.append(f"| {process} | {cache['cache']} | | | could not read it: {cache['error']} |")
            else:
                row = f"{cache['entries']:,} | {cache['mb']:.1f} | {cache['bound']}"
                out.append(f"| {process} | {cache['cache']} | {row} |")
    return out


# --- the platform -----------------------------------------------------------------------------------------


def setup_objects(env: dict, args) -> tuple[str, int]:
    """Tenant, team, key; the deployment on the local orchestrator (simulated engines with KV events)."""
    os.environ.update(env)
    import django

    django.setup()
    from inference_platform.config_version import bump_config_version
    from routing.models import RoutingPolicy
    from serving.models import ModelDeployment, Pool
    from tenants.keys import api_key_create
    from tenants.models import Scope, Team, Tenant

    tenant = Tenant.objects.create(name="Bench", slug="bench")
    team = Team.objects.create(tenant=tenant, name="Agents", slug="agents")
    deployment = ModelDeployment.objects.create(
        name=MODEL,
        served_model_name=MODEL,
        model_source=str(ROOT / "models" / MODEL),
        engine_kind="sim",
        orchestrator="local",
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
    )
    extra = [x for k, v in SIM_ARGS.items() if k != "--max-num-seqs" for x in (k, v)]
    extra += ["--num-gpu-blocks-override", str(args.kv_blocks)]
    Pool.objects.create(
        deployment=deployment,
        name="main",
        replicas=args.engines,
        max_num_seqs=int(SIM_ARGS["--max-num-seqs"]),
        enable_kv_events=True,
        extra_engine_args=extra,
    )
    RoutingPolicy.objects.update_or_create(deployment=deployment, defaults={"mode": "precise"})
    bump_config_version()
    key = api_key_create(team=team, name="soak", scopes=[Scope.INFERENCE]).secret
    return key, deployment.id


def wait_engines(deployment_id: int, count: int, timeout: float) -> dict[int, str]:
    """Wait until the worker has the deployment's engines up and healthy; their KV event addresses by endpoint."""
    from django.db import close_old_connections

    from serving.models import Endpoint, Health

    deadline = time.monotonic() + timeout
    found: dict[int, str] = {}
    while time.monotonic() < deadline:
        rows = Endpoint.objects.filter(pool__deployment_id=deployment_id, health=Health.HEALTHY)
        found = {e.id: e.kv_events_endpoint for e in rows if e.kv_events_endpoint}
        up = 0
        for endpoint in rows:
            with contextlib.suppress(OSError):
                port = int(endpoint.url.rsplit(":", 1)[1])
                up += h.http_get(port, "/health") == 200
        close_old_connections()
        if len(found) >= count and up >= count:
            return found
        time.sleep(1.0)
    raise TimeoutError(f"the worker had {len(found)} of {count} engines healthy after {timeout:.0f} s")


def stop_engines() -> None:
    from serving.orchestrators.local import LocalOrchestrator

    LocalOrchestrator().sweep(set(), drain_first=False)


def start_platform(procs: h.Processes, env: dict, tag: str) -> dict[str, object]:
    celery = [PYTHON, "-m", "celery", "-A", "inference_platform", "--quiet"]
    beat_file = STATE / f"{tag}-celerybeat-schedule"
    beat_file.unlink(missing_ok=True)
    worker = procs.start(
        f"{tag}-worker",
        [
            *celery,
            "worker",
            "--pool",
            "threads",
            "--concurrency",
            "2",
            "--loglevel",
            "INFO",
            "--queues",
            "celery,alerts",
        ],
        core=None,
        env=env,
    )
    beat = procs.start(
        f"{tag}-beat",
        [*celery, "beat", "--schedule", str(beat_file), "--loglevel", "INFO"],
        core=None,
        env=env,
    )
    ingester = procs.start(f"{tag}-kv-ingester", [PYTHON, "manage.py", "run_kv_ingester"], core=None, env=env)
    return {"worker": worker, "beat": beat, "ingester": ingester}


def calibrate(agents, port: int, args) -> tuple[float, str]:
    """Requests/s the agents got through with no think time over the calibration's second half."""
    result = asyncio.run(
        a.run_phase(agents, a.Target([port]), [], args.calibrate, 1e6, args.burst, args.max_context)
    )
    half = result.wall / 2
    ok = [r for r in result.records if r.ok and r.done >= half]
    bad = [r for r in result.records if not r.ok]
    capacity = len(ok) / (result.wall - half) if result.wall > half else 0.0
    desc = (
        f"{capacity:.2f} requests/s (the agents with no think time over {args.calibrate:g} s, second half; "
        f"{len(result.records)} requests, {len(bad)} not ok)"
    )
    if bad:
        log(f"calibration: {len(bad)} requests not ok, e.g. {bad[0].error or bad[0].status}")
    return capacity, desc


class Sampler(threading.Thread):
    """Takes a Sample at the soak's start and at every window's end."""

    def __init__(self, began: float, every: float, take):
        super().__init__(daemon=True, name="sampler")
        self.began, self.every, self.take = began, every, take
        self.samples: list[Sample] = []
        self.stop = threading.Event()

    def run(self) -> None:
        k = 0
        while True:
            due = self.began + k * self.every
            if self.stop.wait(max(0.0, due - time.perf_counter())):
                return
            try:
                self.samples.append(self.take(time.perf_counter() - self.began))
            except Exception as exc:  # noqa: BLE001 - reported by the window it leaves out
                log(f"sample {k} failed: {exc!r}")
            k += 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="how long the soak runs (after calibration)")
    p.add_argument("--window", type=float, default=300.0, help="seconds per reported window")
    p.add_argument("--fraction", type=float, default=0.25, help="of the capacity measured by the calibration")
    p.add_argument("--rate", type=float, help="requests/s to aim at (no calibration beyond a warm-up)")
    p.add_argument("--calibrate", type=float, default=40.0, help="seconds of the capacity calibration")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--max-context", type=int, default=100_000, help="tokens a conversation grows to")
    p.add_argument("--burst", type=float, default=0.2, help="share of turns that start sub-agents")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks per engine (128 tokens each)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tag", default="soak", help="names this run's database, logs and processes")
    p.add_argument("--title", default="One hour of agent traffic")
    p.add_argument("--section", default="soak")
    p.add_argument("--docs", default=None, help="write the section into this file (none by default)")
    p.add_argument("--json", default=None, help="write the windows and the verdict into this file")
    p.add_argument(
        "--trace-memory",
        action="store_true",
        help="run the router under tracemalloc and report what grows in it and what its caches hold",
    )
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    h.under_devstack("soak", argv, ("DATABASE_URL", "REDIS_URL"))
    started = time.monotonic()
    STATE.mkdir(parents=True, exist_ok=True)
    import redis

    redis_url = h.with_path(os.environ["REDIS_URL"], f"/{BENCH_REDIS_DB}")
    notes: list[str] = []
    with h.Processes() as procs:
        procs.after_stop(stop_engines)
        procs.after_stop(lambda: h.flush_redis(redis_url))
        h.flush_redis(redis_url)
        database = "bench_" + args.tag.replace("-", "_")
        log(f"database {database} (dropped and re-created), Redis db {BENCH_REDIS_DB} (flushed)")
        env = h.platform_env(h.fresh_database(os.environ["DATABASE_URL"], database), redis_url)
        h.migrate(env)
        key, deployment_id = setup_objects(env, args)
        platform = start_platform(procs, env, args.tag)
        endpoints = wait_engines(deployment_id, args.engines, 180)
        blocks = EngineBlocks(endpoints)
        blocks.start()
        blocks.ready.wait(10)
        time.sleep(1.0)  # its sockets connected before the first event
        extra = {"ROUTER_APPROX_BLOCKS_PER_ENDPOINT": str(args.kv_blocks)}
        watch_dir = STATE / f"{args.tag}-memwatch"
        if args.trace_memory:
            extra |= memwatch_env(env, watch_dir, args.window)
        router, port = h.start_router(procs, f"{args.tag}-router", env, extra)
        status, answer = h.http_post(
            port, "/v1/chat/completions", a.warm_body(), {"Authorization": f"Bearer {key}"}, 60
        )
        if status != 200:
            raise RuntimeError(f"the warm-up request failed: {status} {answer[:300]!r}")
        ledger = Ledger()
        ledger.start()
        procs.before_stop(ledger.stop.set)
        procs.before_stop(blocks.stop.set)

        cpt = a.chars_per_token()
        texts = a.Texts(cpt)
        shapes = {k: a.Shape.load(k, key, cpt) for k in ("claude-code", "codex")}
        agents = a.make_agents(args.sessions, shapes, texts, args.max_context, args.seed)
        if args.rate:
            rate, capacity = args.rate, f"not measured (--rate {args.rate:g})"
        else:
            log(f"calibrating: {args.sessions} agents with no think time for {args.calibrate:g} s")
            measured, capacity = calibrate(agents, port, args)
            rate = max(0.05, args.fraction * measured)
            capacity += f"; {args.fraction:.0%} of it"
        log(f"soak: {rate:.2f} requests/s for {args.minutes:g} min, windows of {args.window:g} s")

        measured_procs = [
            Measured("router", router.pid, children="router workers"),
            Measured("ingester", platform["ingester"].pid),
            Measured("worker", platform["worker"].pid),
        ]
        client = redis.Redis.from_url(redis_url)
        began_wall = time.time()
        began = time.perf_counter()
        sampler = Sampler(
            began, args.window, lambda t: sample(t, measured_procs, client, deployment_id, blocks)
        )
        sampler.start()
        duration = args.minutes * 60
        result = asyncio.run(
            a.run_phase(agents, a.Target([port]), [], duration, rate, args.burst, args.max_context)
        )
        # The records' clock started with the phase, milliseconds after `began`.
        offset = time.perf_counter() - result.wall - began
        # The last window closes at the duration (requests still in flight then were waited for): sample now if
        # the sampler has not reached it.
        windows_due = int(duration // args.window)
        while len(sampler.samples) < windows_due + 1 and time.perf_counter() - began < duration + args.window:
            time.sleep(0.2)
        sampler.stop.set()
        sampler.join(timeout=60)
        ends = [(r.done + offset, r.ok) for r in result.records]
        # Every request's ledger row (those of the soak: the calibration's and the warm-up's ended before it began):
        # wait for the stragglers.
        deadline = time.monotonic() + 60
        while ledger.count(since=began_wall) < len(result.records) and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(1.0)
        ledger.stop.set()
        ledger.join(timeout=5)
        ledger.poll()
        soaked = [row for row in ledger.rows if row[0] >= began_wall]
        rows = windows(sampler.samples, ends, soaked, began_wall)
        lost = len(result.records) - len(soaked)  # negative: rows of requests the client never sent
        bad = [r for r in result.records if not r.ok]
        # Every error, in a window or not (a request still in flight at the end, its ledger row).
        errors = len(bad) + sum(status != "completed" for _, _, status in soaked)
        if bad:
            notes.append(
                f"{len(bad)} requests failed, e.g. {(bad[0].error or f'status {bad[0].status}')[:160]}"
            )
        for name, proc in platform.items():
            if proc.poll() is not None:
                notes.append(f"the {name} exited with {proc.returncode} during the run")
        last = sampler.samples[-1] if sampler.samples else None
        run = {
            "windows": rows,
            "verdicts": verdicts(rows, lost, errors),
            "capacity": capacity,
            "rate": rate,
            "achieved": len(result.records) / result.wall if result.wall else 0.0,
            "requests": len(result.records),
            "ok": len(result.records) - len(bad),
            "ledger_rows": len(soaked),
            "lost": lost,
            "gaps": blocks.gaps,
            "restarts": blocks.restarts,
            "stream_len": last.stream_len if last else 0,
            "tok_keys": last.tok_keys if last else 0,
            "notes": notes,
            "took": time.monotonic() - started,
        }
        if args.trace_memory:
            second = began_wall + args.window * 2
            run["inside"] = inside_router(watch_dir / "router.jsonl", second)
        client.close()

    block = report(args, argv, run)
    print()
    print(block)
    if args.json:
        out = {
            **{k: v for k, v in run.items() if k not in ("windows", "verdicts")},
            "windows": [asdict(w) | {"index_ratio": w.index_ratio} for w in rows],
            "verdicts": [asdict(v) for v in run["verdicts"]],
            "met": all(v.met for v in run["verdicts"]),
        }
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    if args.docs:
        write_section(Path(args.docs), args.section, block, "Soak", "bench/soak.py")
        log(f"wrote {args.docs}")
    return 0


if __name__ == "__main__":
    h.run(main)
