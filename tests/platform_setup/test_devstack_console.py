"""`make run`'s console (inference_platform/devstack.py): the serving processes' output goes to log files under the
state folder, the console shows their warnings and errors, and the banner (URLs, operator password, demo key) comes
once the web side, the router and the demo's engines answer, and stays the last thing on screen. Ctrl-C, before
the banner or after it, stops every process the run started and leaves the password and the key on screen once."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid

import psutil
import pytest

from inference_platform import devstack
from inference_platform.ports import free_port

CELERY_INFO = "[2026-12-04 06:58:17,498: INFO/MainProcess] Task tenants.tasks.ingest_usage[c19a] received"
CELERY_WARNING = "[2026-12-04 06:58:17,498: WARNING/MainProcess] engine 1/1/0 did not answer /health"
GUNICORN_INFO = "[2026-12-04 06:57:09 +0000] [14425] [INFO] Application startup complete."
GUNICORN_ERROR = "[2026-12-04 06:57:09 +0000] [14425] [ERROR] Exception in ASGI application"
UVICORN_INFO = "INFO:     Uvicorn running on http://127.0.0.1:8080 (Press CTRL+C to quit)"
UVICORN_WARNING = "WARNING:  Invalid HTTP request received."
# Python logging with the level first ("%(levelname)s %(name)s: %(message)s", or logging's default format).
LOGGING_INFO = "INFO routing.kvindex.kv_ingest_stream: following endpoint 1"
LOGGING_WARNING = "WARNING:routing.kvindex.kv_ingest:dropped 3 events from an unknown engine"


def _shown(lines: list[str]) -> list[str]:
    console_filter = devstack.ConsoleFilter()
    return [line for line in lines if console_filter.show(line)]


def test_it_shows_warnings_and_errors_in_every_childs_format_and_not_info():
    lines = [CELERY_INFO, CELERY_WARNING, GUNICORN_INFO, GUNICORN_ERROR, UVICORN_INFO, UVICORN_WARNING]
    lines += [LOGGING_INFO, LOGGING_WARNING]
    assert _shown(lines) == [CELERY_WARNING, GUNICORN_ERROR, UVICORN_WARNING, LOGGING_WARNING]


def test_it_judges_a_record_by_its_level_not_by_its_words():
    assert _shown(["[2026-12-04 06:58:17,577: INFO/MainProcess] Task x succeeded: {'status': 'ERROR'}"]) == []


def test_it_keeps_a_records_continuation_lines_with_it():
    traceback = [
        "Traceback (most recent call last):",
        '  File "routing/server/app.py", line 1, in <module>',
        "ValueError: bad",
    ]
    lines = [CELERY_INFO, "  an INFO record's second line", CELERY_WARNING, "  its second line", *traceback]
    assert _shown(lines) == [CELERY_WARNING, "  its second line", *traceback]
    assert _shown(["/x/celery/platforms.py:893: SecurityWarning: You're running the worker as root"]) != []


def test_it_writes_everything_to_the_log_file_and_only_warnings_to_the_console(tmp_path):
    log = tmp_path / "worker.log"
    console = io.StringIO()
    devstack.relay(io.StringIO(f"{CELERY_INFO}\n{CELERY_WARNING}\n{CELERY_INFO}\n"), log, "worker", console)
    assert log.read_text() == f"{CELERY_INFO}\n{CELERY_WARNING}\n{CELERY_INFO}\n"
    assert console.getvalue() == f"     worker | {CELERY_WARNING}\n"


def test_it_waits_for_every_check_and_names_those_that_never_pass():
    calls = {"web": 0}

    def web_after_three_tries() -> bool:
        calls["web"] += 1
        return calls["web"] >= 3

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pending = devstack.wait_until_ready(
            {"web": web_after_three_tries, "engines": lambda: False}, [child], timeout=2.5
        )
    finally:
        child.kill()
        child.wait()
    assert pending == ["engines"] and calls["web"] == 3
    # A child that exits ends the wait at once.
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    started = time.monotonic()
    assert devstack.wait_until_ready({"web": lambda: False}, [done], timeout=30) == ["web"]
    assert time.monotonic() - started < 5


def test_the_banner_holds_the_urls_the_credentials_once_and_where_the_logs_are():
    demo = "Operator:  operator / pw-123   (shown once)\nAPI key:   ipk_secret   (shown once; keep it now)\n"
    text = devstack.banner(web="127.0.0.1:8000", router="127.0.0.1:8080", demo=demo, pending=[])
    for part in ("/portal/", "/admin/", "/api/docs/", "http://127.0.0.1:8080/v1", "pw-123", "logs/"):
        assert part in text
    assert text.count("ipk_secret") == 1 and "The platform is up." in text
    late = devstack.banner(web="w", router="r", demo=demo, pending=["demo engines"])
    assert "still waiting: demo engines" in late


def _get(url: str, **headers: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _read_lines(stream, into: list[str]) -> None:
    for line in stream:
        into.append(line)


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie; `is_running` also tells a reused pid from the process seen before."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _command_lines(procs) -> dict[psutil.Process, str]:
    found = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if _alive(proc):
                found[proc] = " ".join(proc.cmdline())
    return found


# What `run` starts, as their command lines show: the embedded PostgreSQL and Redis, the web side, the router,
# the Celery workers and beat, and the KV-event ingester.
SERVING = ("postgres", "redis-server", "gunicorn", "uvicorn", "worker", "beat", "run_kv_ingester")


def _all_serving(running: dict[psutil.Process, str]) -> bool:
    return all(any(part in command for command in running.values()) for part in SERVING)


class DevstackRun:
    """`devstack run` as on a fresh clone: its own embedded PostgreSQL and Redis in an empty state folder, its
    own ports, its console captured line by line. `hold_banner` keeps the banner back (DEVSTACK_TEST_HOLD_BANNER)
    so that a Ctrl-C lands before it whatever the host's load."""

    def __init__(self, *, hold_banner: bool = False) -> None:
        self.state = devstack.state_dir() / f"devstack-run-{uuid.uuid4().hex[:8]}"
        self.web, self.router = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env |= {
            "PLATFORM_STATE_DIR": str(self.state),
            "WEB_BIND": self.web,
            "ROUTER_BIND": self.router,
            "DEBUG": "true",
            "DEVSTACK_READY_TIMEOUT": "240",
            "DEVSTACK_TEST_HOLD_BANNER": "1" if hold_banner else "",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "inference_platform.devstack", "run"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, which Ctrl-C is sent to
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(target=_read_lines, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=_read_lines, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def console(self) -> str:
        return "".join(self.out + self.err)

    def wait_until(self, condition, timeout: float = 420) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, self.console()
            assert time.monotonic() < deadline, self.console()
            time.sleep(0.2)

    def wait_for(self, text: str, lines: list[str]) -> None:
        self.wait_until(lambda: any(text in line for line in lines))

    def running(self) -> dict[psutil.Process, str]:
        """What this run has running, with its command lines: the launcher's descendants (engines too, while the
        worker that started them lives) and whatever names the state folder (PostgreSQL, which pgserver detaches)."""
        descendants = _command_lines(psutil.Process(self.proc.pid).children(recursive=True))
        return descendants | self.naming_the_state()

    def naming_the_state(self) -> dict[psutil.Process, str]:
        named = _command_lines(psutil.process_iter())
        return {proc: command for proc, command in named.items() if str(self.state) in command}

    def interrupt(self) -> None:
        """Ctrl-C, and wait for it to stop."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for reader in self.readers:
            reader.join(timeout=5)

    def engine_ports(self) -> list[int]:
        """The ports of every engine this run started, as their logs recorded them."""
        return [
            int(match.group(1))
            for path in (self.state / "engines").glob("*.log")
            for match in re.finditer(r"--port (\d+)", path.read_text())
        ]

    def assert_everything_stopped(self, seen: dict[psutil.Process, str]) -> None:
        """After the Ctrl-C: a clean exit, and nothing of what ran before it (`seen`) or of what the run started
        later is left running; the engines' ports are closed."""
        assert _all_serving(seen), seen
        assert self.proc.returncode == 0, self.console()
        assert any("devstack: stopped engines" in line for line in self.err), self.console()
        left = _command_lines(seen) | self.naming_the_state()
        assert not left, left
        assert all(_get(f"http://127.0.0.1:{port}/health") == 0 for port in self.engine_ports())


@pytest.fixture
def start_run():
    """Start `devstack run`s; whatever a test leaves running is stopped, and the state folders removed."""
    runs: list[DevstackRun] = []

    def start(**kwargs) -> DevstackRun:
        runs.append(DevstackRun(**kwargs))
        return runs[-1]

    yield start
    for run in runs:
        run.interrupt()
        shutil.rmtree(run.state, ignore_errors=True)


def test_make_run_prints_the_banner_once_everything_answers_and_keeps_task_logs_off_the_console(start_run):
    run = start_run()
    web, router, state, out, err = run.web, run.router, run.state, run.out, run.err
    run.wait_for("Ctrl-C stops everything", out)
    banner = "".join(out)
    assert "The platform is up." in banner, run.console()
    # Printed after health: everything it names answers now.
    assert _get(f"http://{web}/healthz") == 200 and _get(f"http://{router}/health") == 200
    assert "2 of 2 sim engines healthy" in banner
    assert f"http://{web}/portal/" in banner and f"http://{router}/v1" in banner
    assert re.search(r"Operator:  operator / \S+", banner)
    key = re.search(r"API key:   (ipk_\S+)", banner).group(1)
    assert "context 131072 tokens" in banner
    models = urllib.request.urlopen(
        urllib.request.Request(f"http://{router}/v1/models", headers={"Authorization": f"Bearer {key}"}),
        timeout=5,
    )
    assert json.loads(models.read())["data"][0]["max_model_len"] == 131072

    # The beat sends a task every second: in the worker's log, not on the console.
    seen = len(out) + len(err)
    time.sleep(4)
    worker_log = (state / "logs" / "worker.log").read_text()
    assert "INFO/MainProcess] Task" in worker_log
    assert len(out) + len(err) == seen, "".join(out[-5:] + err[-5:])
    assert not any(key in path.read_text() for path in (state / "logs").glob("*.log"))

    # Ctrl-C after the banner: everything stops, the engines too, and the credentials are not shown again.
    running = run.running()
    assert run.engine_ports() and any("PLATFORM_ENGINE" in str(proc.environ()) for proc in running)
    run.interrupt()
    run.assert_everything_stopped(running)
    assert run.console().count(key) == 1 and run.console().count("Operator:  operator /") == 1


def test_ctrl_c_before_the_banner_shows_the_password_and_the_key_once_and_stops_everything(start_run):
    # The banner is held back, so the Ctrl-C lands before it however fast the stack comes up: once every serving
    # process has started, while they are still coming up.
    run = start_run(hold_banner=True)
    run.wait_until(lambda: _all_serving(run.running()))
    running = run.running()
    run.interrupt()
    run.assert_everything_stopped(running)
    console = run.console()
    assert "The platform is up." not in console and "Ctrl-C stops everything" not in console, console
    assert re.search(r"API key:   ipk_\S+", console) and re.search(r"Operator:  operator / \S+", console)
    assert console.count("API key:   ipk_") == 1 and console.count("Operator:  operator /") == 1
