"""What every benchmark needs around its measurement: the processes it starts, the peers it installs, the
database and Redis it uses, the re-run under the devstack, the teardown, and the header of its report.

Benchmarks are modules of the `bench` package, run from the repository root:

    .venv/bin/python -m bench.<name> [options]

so that `routing`, `serving` and the other apps import as the platform's own packages, as they do everywhere else.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import http.client
import json
import os
import platform
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from inference_platform.ports import free_port as free_port  # re-exported: the benchmarks' ports

ROOT = Path(__file__).resolve().parents[1]
STATE = ROOT / ".local" / "bench"
# The router's HTTP protocol, as deploy/base/router.yaml serves it (uvicorn's httptools with header limits).
ROUTER_HTTP = "routing.server.http_server:LimitedHttpToolsProtocol"


def router_http(source: Path) -> str:
    """The router's HTTP protocol in a checkout (`source`: this one, or a worktree of an older commit for a
    baseline): where that tree keeps it, or plain httptools for a tree from before it had its own."""
    for module in ("routing.server.http_server", "routing.http_server"):
        if (source / (module.replace(".", "/") + ".py")).exists():
            return f"{module}:LimitedHttpToolsProtocol"
    return "httptools"


PYTHON = sys.executable
MODEL = "tiny-qwen"  # models/tiny-qwen: the simulated engines' model
# The peers the gateway benchmarks compare against, installed on first use into .local/bench/<name>.
PEERS = {
    "vllm-router": {"spec": "vllm-router==0.1.17", "bin": "vllm-router"},
    "litellm": {"spec": "litellm[proxy]==1.108.7", "bin": "litellm"},
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- running a benchmark --------------------------------------------------------------------------------


def under_devstack(module: str, argv: list[str], needs: Iterable[str], state_dir: str | None = None) -> None:
    """Return if the environment has every variable in `needs`; otherwise re-run `python -m bench.<module>`
    under `python -m inference_platform.devstack exec`, which starts an embedded PostgreSQL and Redis and sets
    DATABASE_URL and REDIS_URL (its state under `state_dir`, relative to the repository root, when given)."""
    if all(os.environ.get(name) for name in needs):
        return
    if os.environ.get("BENCH_UNDER_DEVSTACK"):
        raise SystemExit(f"the devstack did not provide {' and '.join(needs)}")
    log(f"no {' / '.join(needs)}: re-running under the devstack (embedded PostgreSQL and Redis)")
    env = {**os.environ, "BENCH_UNDER_DEVSTACK": "1"}
    if state_dir:
        env.setdefault("PLATFORM_STATE_DIR", str(ROOT / state_dir))
    cmd = [PYTHON, "-m", "inference_platform.devstack", "exec", "--", PYTHON, "-m", f"bench.{module}", *argv]
    os.chdir(ROOT)
    os.execve(PYTHON, cmd, env)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(main: Callable[[list[str]], int | None]) -> None:
    """Run a benchmark's `main(argv)` and exit with its status; SIGTERM stops it as Ctrl-C does (130)."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = main(sys.argv[1:])
    except KeyboardInterrupt:
        code = 130
    sys.exit(code or 0)


# --- processes ------------------------------------------------------------------------------------------


class Processes:
    """Every child this benchmark starts, each in its own session, stopped (group and all) at the end.

    As a context manager it is the run's teardown: on leaving, by return, error or Ctrl-C, the clean-ups
    registered with `before_stop` run, every child is stopped, then those registered with `after_stop` run
    (each once, errors ignored)."""

    def __init__(self):
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.first: list[Callable[[], object]] = []
        self.last: list[Callable[[], object]] = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is KeyboardInterrupt:
            log("interrupted; stopping everything")
        for cleanup in self.first:
            with contextlib.suppress(Exception):
                cleanup()
        self.stop_all()
        for cleanup in self.last:
            with contextlib.suppress(Exception):
                cleanup()
        self.first.clear()
        self.last.clear()

    def before_stop(self, cleanup: Callable[[], object]) -> None:
        self.first.append(cleanup)

    def after_stop(self, cleanup: Callable[[], object]) -> None:
        self.last.append(cleanup)

    def start(self, name: str, argv: list[str], *, core: str | None, env: dict | None = None, **kw):
        if core is not None:
            argv = ["taskset", "-c", core, *argv]
        log_path = STATE / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = kw.pop("stdout", None) or log_path.open("wb")
        full_env = kw.pop("full_env", None) or {**os.environ, **(env or {})}
        proc = subprocess.Popen(
            argv,
            cwd=kw.pop("cwd", ROOT),
            env=full_env,
            stdout=out,
            stderr=kw.pop("stderr", subprocess.STDOUT),
            start_new_session=True,
            **kw,
        )
        self.children.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen, timeout: float = 8.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # Whatever the child left behind in its session (LiteLLM forks workers).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        for _, proc in reversed(self.children):
            with contextlib.suppress(Exception):
                self.stop(proc)
        self.children.clear()


def log_tail(name: str, chars: int = 2000) -> str:
    path = STATE / "logs" / f"{name}.log"
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def host_cpu() -> float:
    """CPU seconds the host's cores have been busy (all of them, every process), since boot."""
    import psutil

    t = psutil.cpu_times()
    return (
        sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    )


def quiesce(pid: int, limit: float) -> float:
    """Wait until the process tree is idle (under 10 % of a core over 0.2 s); return the seconds waited."""
    start = time.monotonic()
    last = tree_cpu(pid)
    while time.monotonic() - start < limit:
        time.sleep(0.2)
        now = tree_cpu(pid)
        if now - last < 0.02:
            break
        last = now
    return time.monotonic() - start


# --- HTTP -----------------------------------------------------------------------------------------------


def http_get(port: int, path: str, timeout: float = 2.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def http_post(port: int, path: str, body: bytes, headers: dict, timeout: float = 30.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def wait_until(check, proc: subprocess.Popen, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last_error = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log_tail(name)}")
        try:
            if check():
                return
        except (OSError, http.client.HTTPException) as exc:
            last_error = repr(exc)
        time.sleep(0.25)
    raise TimeoutError(f"{name} not ready after {timeout:.0f} s ({last_error}):\n{log_tail(name)}")


# --- the platform's processes ---------------------------------------------------------------------------


def start_router(procs: Processes, name: str, env: dict, extra: dict | None = None, cwd: Path = ROOT):
    """The platform's router as production serves it (one uvicorn worker, uvloop, its HTTP protocol, no access
    log), reading a configuration change within half a second, `extra` added to its environment; returns the
    process and its port once /health answers."""
    port = free_port()
    argv = [PYTHON, "-m", "uvicorn", "inference_platform.asgi:application", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--loop", "uvloop", "--http", ROUTER_HTTP, "--no-access-log"]
    argv += ["--workers", "1", "--log-level", "warning"]
    env = {**env, "ROUTER_CONFIG_POLL_SECONDS": "0.5", **(extra or {})}
    proc = procs.start(name, argv, core=None, env=env, cwd=cwd)
    wait_until(lambda: http_get(port, "/health") == 200, proc, name, 120)
    return proc, port


def sim_deployment(**fields):
    """A deployment of the simulated model that nothing reconciles (orchestrator `kubernetes`, no cluster): the
    Endpoint rows a benchmark adds are all there is. Django must be set up."""
    from serving.models import ModelDeployment

    return ModelDeployment.objects.create(
        name=MODEL,
        served_model_name=MODEL,
        model_source=str(ROOT / "models" / MODEL),
        engine_kind="sim",
        orchestrator="kubernetes",
        **fields,
    )


def scrape_loads(procs: Processes) -> None:
    """Scrape the engines' /metrics into Redis every second from a thread of this process, as Celery beat does in
    production, until `procs` stops. Django must be set up."""
    stop = threading.Event()

    def scrape() -> None:
        from django.db import close_old_connections

        from routing.scheduling.load_scraper import endpoint_loads_scrape

        while not stop.wait(1.0):
            try:
                endpoint_loads_scrape()
            except Exception as exc:  # noqa: BLE001 - a missed scrape is not fatal
                log(f"scrape failed: {exc}")
            finally:
                close_old_connections()

    threading.Thread(target=scrape, name="load-scraper", daemon=True).start()
    procs.before_stop(stop.set)


# --- installing peers -----------------------------------------------------------------------------------


def venv_install(name: str, spec: str, timeout: float) -> Path:
    """A virtual environment under .local/bench/<name> with `spec` installed; reused when already there."""
    venv = STATE / name
    stamp = venv / ".bench-installed"
    if stamp.exists() and stamp.read_text() == spec:
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    log_path = STATE / "logs" / f"install-{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    uv = shutil.which("uv", path=str(Path(PYTHON).parent)) or shutil.which("uv")
    with log_path.open("wb") as out:
        if uv:
            cmds = [
                [uv, "venv", "--python", PYTHON, str(venv)],
                [uv, "pip", "install", "--python", str(venv / "bin" / "python"), spec],
            ]
        else:
            cmds = [
                [PYTHON, "-m", "venv", str(venv)],
                [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", spec],
            ]
        deadline = time.monotonic() + timeout
        for cmd in cmds:
            subprocess.run(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=max(1.0, deadline - time.monotonic()),
            )
    stamp.write_text(spec)
    return venv


class Installer(threading.Thread):
    """`venv_install` in the background, while the benchmark sets up; `venv` or `error` once joined."""

    def __init__(self, name: str, spec: str, timeout: float):
        super().__init__(daemon=True)
        self.name_, self.spec, self.timeout = name, spec, timeout
        self.venv: Path | None = None
        self.error = ""

    def run(self) -> None:
        try:
            self.venv = venv_install(self.name_, self.spec, self.timeout)
        except subprocess.TimeoutExpired:
            self.error = f"install of {self.spec} took over {self.timeout:.0f} s"
        except Exception as exc:  # noqa: BLE001 - reported in the table
            tail = log_tail(f"install-{self.name_}", 600)
            self.error = f"install of {self.spec} failed ({exc.__class__.__name__}): {tail.strip()[-300:]}"


# The platform's settings must not leak into the peers (LiteLLM reads DATABASE_URL and then wants Prisma).
PLATFORM_VARS = (
    "DATABASE_URL",
    "REDIS_URL",
    "SECRET_KEY",
    "API_KEY_PEPPER",
    "DJANGO_SETTINGS_MODULE",
    "DEBUG",
)


def peer_env(extra: dict | None = None) -> dict:
    return {k: v for k, v in {**os.environ, **(extra or {})}.items() if k not in PLATFORM_VARS}


# --- the platform's side: database, Redis, settings -----------------------------------------------------


def with_path(url: str, path: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=path))


def fresh_database(base_url: str, name: str) -> str:
    """The database `name` on `base_url`'s server, dropped and re-created; its URL."""
    import psycopg

    with psycopg.connect(base_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    return with_path(base_url, f"/{name}")


def flush_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def bench_secrets() -> dict[str, str]:
    """The throwaway secrets of the benchmarks' platform, made once under .local/bench."""
    secret_file = STATE / "secrets.json"
    values = json.loads(secret_file.read_text()) if secret_file.exists() else {}
    made = {
        "SECRET_KEY": lambda: secrets.token_urlsafe(50),
        "API_KEY_PEPPER": lambda: secrets.token_urlsafe(32),
        "ROUTER_METRICS_TOKEN": lambda: secrets.token_urlsafe(32),
    }
    missing = {name: make() for name, make in made.items() if name not in values}
    if missing:
        values |= missing
        secret_file.parent.mkdir(parents=True, exist_ok=True)
        secret_file.write_text(json.dumps(values))
    return values


def metrics_headers() -> dict[str, str]:
    """What the router's /metrics asks of its scraper (ROUTER_METRICS_TOKEN)."""
    return {"authorization": f"Bearer {bench_secrets()['ROUTER_METRICS_TOKEN']}"}


def platform_env(database_url: str, redis_url: str) -> dict[str, str]:
    """A production-like environment (DEBUG off) with throwaway secrets kept under .local/bench."""
    values = bench_secrets()
    return {
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "DEBUG": "false",
        "ALLOWED_HOSTS": "127.0.0.1,localhost",
        "DJANGO_SETTINGS_MODULE": "inference_platform.settings",
        **values,
    }


def migrate(env: dict) -> None:
    subprocess.run(
        [PYTHON, "manage.py", "migrate", "--no-input", "-v", "0"],
        cwd=ROOT,
        env={**os.environ, **env},
        check=True,
        timeout=300,
    )


# --- the report -----------------------------------------------------------------------------------------


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model or platform.processor()}, {os.cpu_count()} cores, Linux {platform.release()}"


def cpu_ticks() -> list[int]:
    """The machine's CPU time so far by kind, from /proc/stat (user, nice, system, idle, iowait, irq, softirq,
    steal, ...); empty where there is none."""
    with contextlib.suppress(OSError, ValueError):
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return []


def steal_share(before: list[int], after: list[int]) -> float | None:
    """The share of the machine's time between two `cpu_ticks` that its host gave to others (a VM's steal
    time): timings taken meanwhile are slower by about as much, on the core that was waiting."""
    if len(before) < 8 or len(after) < 8:
        return None
    spent = [b - a for a, b in zip(before, after, strict=False)]
    return spent[7] / sum(spent) if sum(spent) else None


def command(module: str, argv: list[str]) -> str:
    """The command line that reruns this benchmark, as the report shows it."""
    return (f".venv/bin/python -m bench.{module} " + shlex.join(argv)).strip()


def git_head(tree: Path = ROOT) -> str:
    """The tree's commit, with a mark when its routing code has changes not committed."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "?"
    return (
        f"{head} (with uncommitted changes to routing/)" if git("status", "--porcelain", "routing") else head
    )


def header(module: str, argv: list[str]) -> str:
    """The first line of a report: when, on what, and the command that reruns it."""
    return f"- Date: {now()}. Machine: {machine()}. Command: `{command(module, argv)}`."
