"""What our router adds to a streamed chat completion, next to the gateways users would otherwise pick.

    .venv/bin/python -m bench.router_overhead            # 3 interleaved rounds, about 8 minutes
    .venv/bin/python -m bench.router_overhead --quick    # 1 round, about 2-3 minutes
    .venv/bin/python -m bench.router_overhead --upstream replay   # a replaying upstream instead of the simulator

Without DATABASE_URL and REDIS_URL it re-runs itself under `python -m inference_platform.devstack exec`, which
starts an embedded PostgreSQL and Redis. It then creates a dedicated database (`bench_router_overhead`, dropped
and re-created each run) on that server, uses Redis database 15, and sets up one tenant, two teams (one with a
quota, one without), one key each, and a deployment `tiny-qwen` whose only (healthy) Endpoint is the upstream.

Placement (2-core machine): every gateway under test is pinned to core 0; the upstream (the simulator, or the
replaying upstream) and the load generator (bench/loadgen.py) share core 1. The peers, LiteLLM proxy and
vllm-router, are installed on first use into virtual environments under .local/bench/ (a failed install skips
that peer with a note). Every process started here runs in its own session and is stopped at the end, on error
and on Ctrl-C.

Workload: streaming /v1/chat/completions, a ~2 KB prompt, max_tokens 16 (16 one-token chunks, the usage chunk
and [DONE]), closed loop at each concurrency, a fixed measuring window after a short warm-up, rounds that
visit every gateway once per concurrency (in a rotated order each round). "Added" latency is, per round, the
gateway's percentile minus the direct (client straight to the upstream) percentile at the same concurrency;
the table shows the median over rounds. req/s is the median over rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.server
import json
import os
import platform
import re
import select
import shutil
import signal
import statistics
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.docs_section import write_section
from bench.harness import (
    MODEL,
    PEERS,
    PYTHON,
    ROOT,
    STATE,
    Installer,
    Processes,
    command,
    free_port,
    fresh_database,
    http_get,
    http_post,
    log,
    log_tail,
    machine,
    migrate,
    now,
    peer_env,
    platform_env,
    quiesce,
    router_http,
    run,
    sim_deployment,
    tree_cpu,
    under_devstack,
    wait_until,
    with_path,
)

BENCH_DB = "bench_router_overhead"
BENCH_REDIS_DB = 15
GATEWAY_CORE, CLIENT_CORE = "0", "1"
CONCURRENCIES = (1, 16, 64, 256)
PYSPY_SPEC = "py-spy==0.4.3"
LITELLM_MASTER_KEY = "sk-bench-" + "7f3a9c2e41d8"
TARGETS = {"rps": 1000.0, "ttfb_p50_c1_ms": 1.0, "ttfb_p99_c16_ms": 5.0}

# A ~2 KB prompt that reads like an agent's request: a system prompt and some code.
SYSTEM = "You are a careful coding agent. Answer with a minimal diff and explain it in one sentence."
CODE = (
    "def load_snapshot(version):\n"
    "    snapshot = Snapshot(version=version)\n"
    "    for key in active_keys():\n"
    "        snapshot.keys[key.digest] = KeyInfo(key.id, key.prefix, key.team_id, key.tenant_id)\n"
    "    for deployment in running_deployments():\n"
    "        snapshot.deployments[deployment.name] = describe(deployment)\n"
    "    return snapshot\n"
)


def prompt_body() -> bytes:
    user = "Why does this function get slow with many keys, and how would you fix it?\n\n"
    while len(user) < 1900:
        user += CODE
    payload = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(payload, separators=(",", ":")).encode()


def check_stream(body: bytes) -> str | None:
    """None if the body is the workload's stream (16 content chunks, usage, [DONE]), else what is wrong."""
    events = [e for e in body.split(b"\n\n") if e.strip()]
    if not events or events[-1].strip() != b"data: [DONE]":
        return f"does not end with [DONE]: {body[-200:]!r}"
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1] if e.startswith(b"data: {")]
    content = [c for c in chunks if c.get("choices") and (c["choices"][0].get("delta") or {}).get("content")]
    usage = [c for c in chunks if c.get("usage") and not c.get("choices")]
    if len(content) != 16 or len(usage) != 1:
        return f"{len(content)} content chunks and {len(usage)} usage chunks (want 16 and 1)"
    return None


def create_objects(env: dict, upstream_url: str) -> dict[str, str]:
    """Tenant, two teams (one with a quota), one key each, the deployment and its one healthy endpoint."""
    os.environ.update(env)
    import django

    django.setup()
    from decimal import Decimal

    from django.utils import timezone

    from serving.models import Endpoint, Health, Pool
    from tenants.keys import api_key_create
    from tenants.models import PriceSheet, Quota, Scope, Team, Tenant

    tenant = Tenant.objects.create(name="Bench", slug="bench")
    free = Team.objects.create(tenant=tenant, name="No quota", slug="no-quota")
    limited = Team.objects.create(tenant=tenant, name="Quota", slug="quota")
    deployment = sim_deployment(max_model_len=8192)
    pool = Pool.objects.create(deployment=deployment, name="main", replicas=1)
    Endpoint.objects.create(
        pool=pool, name=f"{MODEL}-0", url=upstream_url, role="both", health=Health.HEALTHY
    )
    PriceSheet.objects.create(
        served_model_name=MODEL,
        effective_from=timezone.now() - dt.timedelta(days=1),
        input_per_mtok=Decimal("0.50"),
        cached_input_per_mtok=Decimal("0.05"),
        output_per_mtok=Decimal("1.50"),
    )
    # Limits far above what the benchmark reaches: every check in the admission script runs, none refuses.
    Quota.objects.create(
        team=limited,
        requests_per_minute=1_000_000_000,
        input_tokens_per_minute=10**15,
        output_tokens_per_minute=10**15,
        max_concurrent_requests=1_000_000,
        token_budget=10**17,
        spend_budget=Decimal("1000000000"),
    )
    return {
        "free": api_key_create(team=free, name="bench", scopes=[Scope.INFERENCE]).secret,
        "quota": api_key_create(team=limited, name="bench", scopes=[Scope.INFERENCE]).secret,
    }


def clean_redis(redis_url: str) -> None:
    """Drop what the runs wrote into the benchmark's Redis database (usage events, quota counters)."""
    import redis

    from inference_platform.config_version import CONFIG_VERSION_KEY

    client = redis.Redis.from_url(redis_url)
    try:
        for pattern in ("usage:*", "q:*", "endpoint:load:*", CONFIG_VERSION_KEY):
            keys = list(client.scan_iter(match=pattern, count=1000))
            for i in range(0, len(keys), 500):
                client.delete(*keys[i : i + 500])
    finally:
        client.close()


# --- gateways -------------------------------------------------------------------------------------------


@dataclass
class Gateway:
    name: str
    port: int = 0
    headers: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    note: str = ""
    skipped: bool = False

    def request(self, body: bytes) -> str:
        head = [
            "POST /v1/chat/completions HTTP/1.1",
            f"Host: 127.0.0.1:{self.port}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            *(f"{k}: {v}" for k, v in self.headers.items()),
            f"Content-Length: {len(body)}",
        ]
        return "\r\n".join(head) + "\r\n\r\n" + body.decode("latin-1")


def start_simulator(procs: Processes) -> tuple[subprocess.Popen, int]:
    port = free_port()
    argv = [PYTHON, "-m", "simulator", "--model", str(ROOT / "models" / MODEL)]
    argv += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port)]
    proc = procs.start("simulator", argv, core=CLIENT_CORE)
    wait_until(lambda: http_get(port, "/health") == 200, proc, "simulator", 120)
    return proc, port


def start_replay(procs: Processes, body: bytes) -> tuple[subprocess.Popen, int]:
    port = free_port()
    path = STATE / "replay-body.txt"
    path.write_bytes(body)
    argv = [PYTHON, str(ROOT / "bench" / "replay_upstream.py"), "--port", str(port), "--body", str(path)]
    proc = procs.start("replay-upstream", argv, core=CLIENT_CORE)
    wait_until(lambda: http_get(port, "/health") == 200, proc, "replay-upstream", 30)
    return proc, port


def start_router(
    procs: Processes, env: dict, source: Path = ROOT, name: str = "router"
) -> tuple[subprocess.Popen, int]:
    """Our router, from this checkout or from `source` (a worktree of another commit, for --baseline)."""
    port = free_port()
    argv = [PYTHON, "-m", "uvicorn", "inference_platform.asgi:application", "--host", "127.0.0.1"]
    http = router_http(source)  # as that tree has it: a baseline may predate the router's own protocol
    argv += ["--port", str(port), "--loop", "uvloop", "--http", http, "--no-access-log"]
    argv += ["--workers", "1", "--log-level", "warning"]
    env = {**env, "PYTHONPATH": str(source)}
    proc = procs.start(name, argv, core=GATEWAY_CORE, env=env, cwd=source)
    wait_until(lambda: http_get(port, "/health") == 200, proc, "router", 120)
    return proc, port


def start_vllm_router(procs: Processes, venv: Path, upstream: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    argv = [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--worker-urls", upstream, "--policy", "round_robin"]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    proc = procs.start("vllm-router", argv, core=GATEWAY_CORE, full_env=peer_env())
    return proc, port


def start_litellm(procs: Processes, venv: Path, upstream: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    config = STATE / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: sk-upstream-unused\n"
        "general_settings:\n"
        f"  master_key: {LITELLM_MASTER_KEY}\n"
    )
    argv = [str(venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--num_workers", "1"]
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "NO_DOCKER": "1"}
    proc = procs.start("litellm", argv, core=GATEWAY_CORE, full_env=peer_env(env))
    return proc, port


def smoke(gw: Gateway, body: bytes, timeout: float) -> None:
    """Wait until the gateway streams the workload's answer correctly."""
    problem = ""

    def check() -> bool:
        nonlocal problem
        status, data = http_post(gw.port, "/v1/chat/completions", body, gw.headers)
        if status != 200:
            problem = f"status {status}: {data[:300]!r}"
            return False
        problem = check_stream(data) or ""
        if problem.startswith("16 content chunks and 0 usage") and gw.name in PEERS:
            gw.note = "(drops the usage chunk)"
        elif problem:
            raise RuntimeError(f"{gw.name} streams a different answer: {problem}")
        return True

    try:
        wait_until(check, gw.proc, gw.name, timeout)
    except TimeoutError as exc:
        raise TimeoutError(f"{problem}\n{exc}") from None


# --- measuring ------------------------------------------------------------------------------------------


class LoadGenerator:
    def __init__(self, procs: Processes):
        self.procs = procs
        self._restarts = 0
        self._start()

    def _start(self) -> None:
        self.proc = self.procs.start(
            "loadgen",
            [PYTHON, str(ROOT / "bench" / "loadgen.py")],
            core=CLIENT_CORE,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(STATE / "logs" / "loadgen.log").open("wb"),
        )

    def run(self, gw: Gateway, body: bytes, concurrency: int, warmup: float, duration: float) -> dict:
        job = {
            "host": "127.0.0.1",
            "port": gw.port,
            "request": gw.request(body),
            "concurrency": concurrency,
            "warmup": warmup,
            "duration": duration,
        }
        self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        self.proc.stdin.flush()
        # A point that never answers must not hang the whole run: the answer is read from the raw pipe as it
        # comes, up to a deadline, never with a blocking readline.
        complete, line = self._read_line(time.monotonic() + warmup + duration + 60)
        if complete is False:
            log(
                f"no answer from the load generator for {gw.name} at c={concurrency} "
                f"({len(line)} bytes of one, starting {line[:40]!r}; {self._pipe_report()}); restarting it"
            )
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGUSR1)  # its stack, into its log, before it goes
            time.sleep(0.5)
            self.procs.stop(self.proc)
            self._restarts += 1
            kept = STATE / "logs" / f"loadgen-stuck-{self._restarts}.log"
            (STATE / "logs" / "loadgen.log").replace(kept)
            log(f"its log, with where it was stuck: {kept}")
            self._start()
            why = "the load generator gave no answer for this point"
            return {
                "completed": 0,
                "errors": 1,
                "error_samples": [why],
                "reconnects": 0,
                "duration": duration,
                "ttfb": [],
                "total": [],
            }
        if complete is None:
            raise RuntimeError(f"the load generator died:\n{log_tail('loadgen')}")
        return json.loads(line)

    def _pipe_report(self) -> str:
        """What the answer pipe looks like from both ends, and who else holds it."""
        import fcntl
        import termios

        fd = self.proc.stdout.fileno()
        try:
            waiting = int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), "little")
            ours = os.readlink(f"/proc/self/fd/{fd}")
            theirs = os.readlink(f"/proc/{self.proc.pid}/fd/1")
        except OSError as exc:
            return f"pipe not inspectable: {exc!r}"
        holders = []
        for proc_dir in Path("/proc").iterdir():
            if not proc_dir.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                for link in (proc_dir / "fd").iterdir():
                    with contextlib.suppress(OSError):
                        if os.readlink(link) == ours:
                            holders.append(f"{proc_dir.name}:{link.name}")
        return f"{waiting} bytes waiting in {ours}, its end {theirs}, held by {holders}"

    def _read_line(self, deadline: float) -> tuple[bool | None, bytes]:
        """(True, the answer line); (False, what arrived of it) if the deadline passed first; (None, b"") if the
        load generator exited."""
        fd = self.proc.stdout.fileno()
        chunks: list[bytes] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False, b"".join(chunks)
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None, b""
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                return True, b"".join(chunks)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@dataclass
class Sample:
    rps: float
    errors: int
    ttfb: dict
    total: dict
    cpu_ms: float  # gateway CPU per completed request, ms (nan for direct)
    n: int


def summarize(result: dict, cpu_s: float | None) -> Sample:
    n = result["completed"]
    return Sample(
        rps=n / result["duration"],
        errors=result["errors"],
        ttfb={q: pct(result["ttfb"], q) * 1000 for q in (0.5, 0.99)},
        total={q: pct(result["total"], q) * 1000 for q in (0.5, 0.99)},
        cpu_ms=(cpu_s * 1000 / n) if (cpu_s is not None and n) else float("nan"),
        n=n,
    )


def median(values):
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def fmt(value: float, digits: int = 2) -> str:
    return "n/a" if value != value else f"{value:,.{digits}f}"


def table(samples: dict, gateways: list[Gateway], concurrencies, rounds: int) -> tuple[str, dict]:
    """The markdown table and the medians per (gateway, concurrency)."""
    rows = [
        "| gateway | c | req/s | added TTFB p50 / p99 (ms) | added total p50 / p99 (ms) | gateway CPU "
        "per request (ms) | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    medians: dict = {}
    for gw in gateways:
        if gw.skipped:
            rows.append(f"| {gw.name} | - | skipped | | | | {gw.note} |")
            continue
        for c in concurrencies:
            per_round = [(samples.get((gw.name, c, r)), samples.get(("direct", c, r))) for r in range(rounds)]
            per_round = [(s, d) for s, d in per_round if s is not None and d is not None]
            if not per_round:
                continue
            m = {
                "rps": median([s.rps for s, _ in per_round]),
                "errors": sum(s.errors for s, _ in per_round),
                "cpu_ms": median([s.cpu_ms for s, _ in per_round]),
            }
            for kind in ("ttfb", "total"):
                for q in (0.5, 0.99):
                    m[f"{kind}{q}"] = median([getattr(s, kind)[q] for s, _ in per_round])
                    m[f"added_{kind}{q}"] = median(
                        [getattr(s, kind)[q] - getattr(d, kind)[q] for s, d in per_round]
                    )
            medians[(gw.name, c)] = m
            if gw.name == "direct":
                added_ttfb = f"({fmt(m['ttfb0.5'])} / {fmt(m['ttfb0.99'])} absolute)"
                added_total = f"({fmt(m['total0.5'])} / {fmt(m['total0.99'])} absolute)"
            else:
                added_ttfb = f"{fmt(m['added_ttfb0.5'])} / {fmt(m['added_ttfb0.99'])}"
                added_total = f"{fmt(m['added_total0.5'])} / {fmt(m['added_total0.99'])}"
            rows.append(
                f"| {gw.name} | {c} | {fmt(m['rps'], 0)} | {added_ttfb} | {added_total} | "
                f"{fmt(m['cpu_ms'], 3)} | {m['errors']}{' ' + gw.note if gw.note else ''} |"
            )
    return "\n".join(rows), medians


def verdicts(medians: dict, rows: list[str]) -> list[str]:
    lines = []
    for name in rows:
        best = max((medians.get((name, c), {}).get("rps", float("nan")) for c in CONCURRENCIES), default=0)
        c1 = medians.get((name, 1), {}).get("added_ttfb0.5", float("nan"))
        c16 = medians.get((name, 16), {}).get("added_ttfb0.99", float("nan"))
        checks = [
            (f"peak {fmt(best, 0)} req/s (target >= {TARGETS['rps']:,.0f})", best >= TARGETS["rps"]),
            (
                f"added TTFB p50 at c=1 {fmt(c1)} ms (target <= {TARGETS['ttfb_p50_c1_ms']} ms)",
                c1 <= TARGETS["ttfb_p50_c1_ms"],
            ),
            (
                f"added TTFB p99 at c=16 {fmt(c16)} ms (target <= {TARGETS['ttfb_p99_c16_ms']} ms)",
                c16 <= TARGETS["ttfb_p99_c16_ms"],
            ),
        ]
        lines.append(
            f"- {name}: " + "; ".join(f"{text} **{'met' if ok else 'MISSED'}**" for text, ok in checks)
        )
    return lines


# --- profiling ------------------------------------------------------------------------------------------


def profile_router(
    procs: Processes, loadgen: LoadGenerator, gw: Gateway, body: bytes, pyspy: Path, seconds: float
) -> list[str]:
    """Sample our router with py-spy while the load generator drives it at c=16; the top costs."""
    raw = STATE / f"profile-{gw.name.replace(' ', '-').replace('(', '').replace(')', '')}.txt"
    argv = [str(pyspy), "record", "--pid", str(gw.proc.pid), "--duration", str(int(seconds)), "--rate", "250"]
    argv += ["--format", "raw", "--nonblocking", "--output", str(raw)]
    spy = procs.start("py-spy", argv, core=CLIENT_CORE)
    time.sleep(0.5)
    result = loadgen.run(gw, body, 16, 0.0, seconds)
    spy.wait(timeout=seconds + 30)
    if not raw.exists():
        return [f"py-spy produced no profile: {log_tail('py-spy', 500)}"]
    inclusive, own = Counter(), Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[_short(frames[-1])] += n
        for frame in {_short(f) for f in frames}:
            inclusive[frame] += n
    if not total:
        return ["py-spy recorded no samples"]
    lines = [
        f"{total} samples at c=16 ({result['completed'] / seconds:,.0f} req/s while sampled); "
        f"raw stacks in {raw.relative_to(ROOT)}",
        "",
        "| inclusive | function (file:line) |",
        "|---:|---|",
    ]
    skip = ("<module>", "run (", "_run_module", "_run_code", "main (", "Server.serve", "Runner.run")
    for frame, n in inclusive.most_common(60):
        if frame.startswith(skip) or n == total:
            continue
        lines.append(f"| {100 * n / total:.1f} % | `{frame}` |")
        if len(lines) >= 4 + 22:
            break
    lines += ["", "| self | function (file:line) |", "|---:|---|"]
    for frame, n in own.most_common(15):
        lines.append(f"| {100 * n / total:.1f} % | `{frame}` |")
    return lines


def _short(frame: str) -> str:
    """`func (path:line)` -> `func (short/path)`: one row per function, whatever the line."""
    frame = re.sub(r":\d+\)$", ")", frame)
    for marker in ("site-packages/", "python3.11/", str(ROOT) + "/"):
        if marker in frame:
            head, _, tail = frame.partition("(")
            return f"{head.strip()} ({tail.split(marker)[-1]}"
    return frame


# --- the report -----------------------------------------------------------------------------------------


def versions(peer_venvs: dict) -> str:
    from importlib.metadata import version

    ours = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    parts = [f"our router at {ours.stdout.strip() or '?'}", f"Python {platform.python_version()}"]
    parts += [f"{p} {version(p)}" for p in ("uvicorn", "uvloop", "httptools", "aiohttp", "channels", "redis")]
    parts += [PEERS[name]["spec"] for name in peer_venvs]
    return ", ".join(parts)


# --- main -----------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one round, shorter windows")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 3, 1 with --quick)")
    p.add_argument("--duration", type=float, help="seconds measured per point (default 4, 2.5 with --quick)")
    p.add_argument("--warmup", type=float, help="warm-up seconds per point (default 1, 0.5 with --quick)")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCIES))
    p.add_argument(
        "--upstream",
        choices=("simulator", "replay"),
        default="simulator",
        help="simulator: simulator with no decode time; replay: bench/replay_upstream.py replaying "
        "the simulator's answer to the request our router sends it (running usage in every chunk), captured "
        "once (cheaper, for when the simulator is the bottleneck)",
    )
    p.add_argument("--skip-peers", action="store_true", help="only direct and our router")
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="also measure our router (no quota) at this commit, from a worktree, in the same rounds",
    )
    p.add_argument(
        "--profile",
        choices=("auto", "always", "never"),
        default="auto",
        help="py-spy our router (and the baseline) at c=16 (auto: when a target is missed)",
    )
    p.add_argument(
        "--docs",
        default=None,
        help="write the section into this file (default docs/benchmarks.md for full runs, none for --quick)",
    )
    p.add_argument("--budget", type=float, default=None, help="stop measuring after this many seconds")
    p.add_argument(
        "--tracing",
        type=float,
        nargs="+",
        metavar="RATIO",
        help="also measure our router (no quota) with traces on, one router per RATIO of the requests sampled, "
        "exporting over OTLP/HTTP to a local sink that drops them, in the same rounds",
    )
    return p.parse_args(argv)


def otlp_sink(received: list[int]) -> int:
    """A collector stand-in for the traced routers: answers every OTLP/HTTP export with 200 and keeps nothing but
    the bytes' count in `received`."""

    class Sink(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(len(self.rfile.read(int(self.headers.get("content-length") or 0))))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1]


def baseline_worktree(rev: str) -> Path:
    """A detached worktree of `rev` under .local/bench/, made afresh, whose router runs beside this one."""
    path = STATE / "baseline"
    if path.exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)
        shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=True)
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True)
    return path


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    under_devstack("router_overhead", argv, ("DATABASE_URL", "REDIS_URL"))

    quick = args.quick
    rounds = args.rounds or (1 if quick else 3)
    duration = args.duration or (2.5 if quick else 4.0)
    warmup = args.warmup if args.warmup is not None else (0.5 if quick else 1.0)
    budget = args.budget or (150.0 if quick else 540.0)
    docs = Path(args.docs) if args.docs else (None if quick else ROOT / "docs" / "benchmarks.md")
    concurrencies = args.concurrency
    STATE.mkdir(parents=True, exist_ok=True)
    if shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        raise SystemExit("needs `taskset` and at least 2 cores (gateways on core 0, clients on core 1)")

    started = time.monotonic()
    installers: dict[str, Installer] = {}
    redis_url = with_path(os.environ["REDIS_URL"], f"/{BENCH_REDIS_DB}")
    with Processes() as procs:
        procs.after_stop(lambda: clean_redis(redis_url))
        if not args.skip_peers:
            for name, peer in PEERS.items():
                installers[name] = Installer(name, peer["spec"], 600)
                installers[name].start()
        pyspy_installer = None
        if args.profile != "never":
            pyspy_installer = Installer("py-spy", PYSPY_SPEC, 300)
            pyspy_installer.start()

        log(f"database {BENCH_DB} (dropped and re-created), Redis db {BENCH_REDIS_DB}")
        env = platform_env(fresh_database(os.environ["DATABASE_URL"], BENCH_DB), redis_url)
        migrate(env)
        clean_redis(redis_url)

        body = prompt_body()
        sim_proc, sim_port = start_simulator(procs)
        # Captured as the engine answers our router, which asks for the running usage in every chunk (so that
        # a stream cut short still bills its prompt): the replay streams what an engine streams to it.
        engine_body = json.loads(body)
        engine_body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        status, answer = http_post(sim_port, "/v1/chat/completions", json.dumps(engine_body).encode(), {})
        if status != 200 or check_stream(answer):
            raise RuntimeError(
                f"the simulator's answer is not the workload's: {status} {check_stream(answer)}"
            )
        if args.upstream == "replay":
            procs.stop(sim_proc)
            up_proc, up_port = start_replay(procs, answer)
        else:
            up_proc, up_port = sim_proc, sim_port
        upstream = f"http://127.0.0.1:{up_port}"
        log(f"upstream ({args.upstream}) at {upstream}, pid {up_proc.pid}, core {CLIENT_CORE}")

        keys = create_objects(env, upstream)
        router_proc, router_port = start_router(procs, env)
        gateways = [
            Gateway("direct", up_port, proc=up_proc),
            Gateway("ours, no quota", router_port, {"Authorization": f"Bearer {keys['free']}"}, router_proc),
            Gateway(
                "ours, team quota", router_port, {"Authorization": f"Bearer {keys['quota']}"}, router_proc
            ),
        ]
        if args.baseline:
            source = baseline_worktree(args.baseline)
            base_proc, base_port = start_router(procs, env, source, "router-baseline")
            gateways.append(
                Gateway(
                    f"ours @ {args.baseline}, no quota",
                    base_port,
                    {"Authorization": f"Bearer {keys['free']}"},
                    base_proc,
                )
            )
        exports: list[int] = []
        sink = otlp_sink(exports) if args.tracing else None
        for ratio in args.tracing or ():
            traced_env = {
                **env,
                "ROUTER_TRACES_ENDPOINT": f"http://127.0.0.1:{sink}/v1/traces",
                "ROUTER_TRACES_SAMPLE_RATIO": str(ratio),
            }
            traced_proc, traced_port = start_router(procs, traced_env, name=f"router-traced-{ratio:g}")
            gateways.append(
                Gateway(
                    f"ours, traces sampled {ratio:g}, no quota",
                    traced_port,
                    {"Authorization": f"Bearer {keys['free']}"},
                    traced_proc,
                )
            )
        for gw in gateways:
            smoke(gw, body, 30)

        peer_venvs: dict[str, Path] = {}
        for name, installer in installers.items():
            log(f"waiting for the {name} install (.local/bench/{name})")
            installer.join(timeout=620)
            gw = Gateway(name)
            if installer.venv is None:
                gw.skipped, gw.note = True, installer.error or "install did not finish"
                gateways.append(gw)
                continue
            peer_venvs[name] = installer.venv
            try:
                starter = start_vllm_router if name == "vllm-router" else start_litellm
                gw.proc, gw.port = starter(procs, installer.venv, upstream)
                if name == "litellm":
                    gw.headers = {"Authorization": f"Bearer {LITELLM_MASTER_KEY}"}
                smoke(gw, body, 180)
            except Exception as exc:  # noqa: BLE001 - a peer that does not run is skipped, with the reason
                log(f"{name} skipped: {exc}")
                if gw.proc is not None:
                    procs.stop(gw.proc)
                gw.skipped, gw.note = True, f"did not start: {str(exc).splitlines()[0][:200]}"
            gateways.append(gw)

        loadgen = LoadGenerator(procs)
        live = [gw for gw in gateways if not gw.skipped]
        samples: dict = {}
        done_rounds = 0
        stopped_early = ""
        log(f"measuring {len(live)} gateways x {concurrencies} x {rounds} rounds, {warmup}+{duration} s each")
        for r in range(rounds):
            for c in concurrencies:
                order = live[r % len(live) :] + live[: r % len(live)]
                for gw in order:
                    if time.monotonic() - started > budget:
                        stopped_early = f"stopped at round {r + 1} after the {budget:.0f} s budget"
                        break
                    cpu0 = tree_cpu(gw.proc.pid) if gw.name != "direct" else None
                    result = loadgen.run(gw, body, c, warmup, duration)
                    cpu = (
                        (tree_cpu(gw.proc.pid) - cpu0) * duration / (duration + warmup)
                        if cpu0 is not None
                        else None
                    )
                    sample = summarize(result, cpu)
                    samples[(gw.name, c, r)] = sample
                    waited = quiesce(gw.proc.pid, 20.0)
                    log(
                        f"round {r + 1} c={c:<3} {gw.name:<18} {sample.rps:8,.0f} req/s  "
                        f"TTFB p50 {sample.ttfb[0.5]:7.2f} p99 {sample.ttfb[0.99]:7.2f} ms  "
                        f"total p50 {sample.total[0.5]:7.2f} p99 {sample.total[0.99]:7.2f} ms  "
                        f"errors {sample.errors}{'  ' + str(result['error_samples'][:1]) if sample.errors else ''}"
                        f"{f'  (idle after {waited:.1f} s)' if waited > 1 else ''}"
                    )
                if stopped_early:
                    break
            if stopped_early:
                break
            done_rounds = r + 1
        rounds_run = max(done_rounds, 1)
        if args.tracing:
            log(f"the OTLP sink took {len(exports)} exports, {sum(exports):,} bytes")

        text, medians = table(samples, gateways, concurrencies, rounds_run)
        ours = ["ours, no quota", "ours, team quota"]
        verdict = verdicts(medians, ours + [g.name for g in gateways if g.name in PEERS and not g.skipped])
        missed = any("MISSED" in line for line in verdict[:2])

        profile: list[str] = []
        if args.profile == "always" or (args.profile == "auto" and missed):
            pyspy_installer.join(timeout=320)
            if pyspy_installer.venv is None:
                profile = [f"no profile: {pyspy_installer.error}"]
            else:
                log("profiling our router (py-spy, c=16)")
                # Ours, and the baseline where one is measured: a regression shows as the rows that differ.
                for gw in [g for g in gateways if g.name.startswith("ours")]:
                    profile += [f"**{gw.name}**: "]
                    profile += profile_router(
                        procs, loadgen, gw, body, pyspy_installer.venv / "bin" / "py-spy", 6.0
                    )
                    profile.append("")

        block = "\n".join(
            [
                f"### Upstream: {args.upstream} ({'quick, ' if quick else ''}{rounds_run} round"
                f"{'s' if rounds_run > 1 else ''}, {warmup:g} s warm-up + {duration:g} s per point)",
                "",
                f"- Date: {now()}. Machine: {machine()}.",
                f"- Versions: {versions(peer_venvs)}.",
                f"- Command: `{command('router_overhead', argv)}`"
                + (f" ({stopped_early})" if stopped_early else ""),
                "- Placement: gateway on core 0 (`taskset -c 0`); upstream and load generator on core 1; "
                "PostgreSQL and Redis unpinned. Our router: one uvicorn worker, uvloop, httptools, no access log, "
                "DEBUG off.",
                "- req/s: median over rounds. Added latency: per round, gateway percentile minus direct "
                "percentile at the same concurrency; the median over rounds. TTFB: from writing the request to "
                "the first byte of the response body. Gateway CPU per request: the gateway's process tree CPU "
                "time during the point over requests completed (warm-up pro-rated).",
                "",
                text,
                "",
                "Targets for our round-robin path (one core):",
                "",
                *verdict,
                "",
            ]
            + (
                ["Where our router's time goes (py-spy, inclusive share of samples):", "", *profile]
                if profile
                else []
            )
        )
        print()
        print(block)
        if docs:
            write_section(
                docs, f"router-overhead:{args.upstream}", block, "Router overhead", "bench/router_overhead.py"
            )
            log(f"wrote {docs.relative_to(ROOT) if docs.is_relative_to(ROOT) else docs}")
        log(f"done in {time.monotonic() - started:.0f} s")
        return 0


if __name__ == "__main__":
    run(main)
