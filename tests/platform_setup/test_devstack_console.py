"""`make run`'s console (inference_platform/devstack.py): the serving processes' output goes to log files under the
state folder, the console shows their warnings and errors, and the banner (URLs, operator password, demo key) comes
once the web side, the router and the demo's engines answer, and stays the last thing on screen."""

from __future__ import annotations

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


class DevstackRun:
    """`devstack run` as on a fresh clone: its own embedded PostgreSQL and Redis in an empty state folder, its
    own ports, its console captured line by line."""

    def __init__(self) -> None:
        self.state = devstack.state_dir() / f"devstack-run-{uuid.uuid4().hex[:8]}"
        self.web, self.router = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env |= {
            "PLATFORM_STATE_DIR": str(self.state),
            "WEB_BIND": self.web,
            "ROUTER_BIND": self.router,
            "DEBUG": "true",
            "DEVSTACK_READY_TIMEOUT": "240",
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

    def wait_for(self, text: str, lines: list[str], timeout: float = 420) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in lines):
            assert self.proc.poll() is None, self.console()
            assert time.monotonic() < deadline, self.console()
            time.sleep(0.2)

    def interrupt(self) -> list[int]:
        """Ctrl-C; wait for everything to stop; the ports its engines had."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for reader in self.readers:
            reader.join(timeout=5)
        ports = [
            int(match.group(1))
            for path in (self.state / "engines").glob("*.log")
            for match in re.finditer(r"--port (\d+)", path.read_text())
        ]
        shutil.rmtree(self.state, ignore_errors=True)
        return ports


def test_make_run_prints_the_banner_once_everything_answers_and_keeps_task_logs_off_the_console():
    run = DevstackRun()
    web, router, state, out, err = run.web, run.router, run.state, run.out, run.err
    try:
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
        # The key is shown once, on the console and nowhere else.
        assert run.console().count(key) == 1
        assert not any(key in path.read_text() for path in (state / "logs").glob("*.log"))
    finally:
        engines = run.interrupt()
    assert run.proc.returncode == 0, run.console()
    assert any("devstack: stopped engines" in line for line in err), run.console()
    assert engines and all(_get(f"http://127.0.0.1:{port}/health") == 0 for port in engines)


def test_ctrl_c_before_the_banner_still_shows_the_key():
    run = DevstackRun()
    try:
        # The serving processes start right after the engines left by an earlier run are stopped.
        run.wait_for("devstack: stopped engines", run.err)
    finally:
        run.interrupt()
    console = run.console()
    # The Ctrl-C lands while the serving processes start, or (on some hosts, in a full run) only once the banner
    # is out: either way the password and the key are on the console, once.
    assert re.search(r"API key:   ipk_\S+", console) and re.search(r"Operator:  operator / \S+", console)
    assert console.count("API key:   ipk_") == 1
