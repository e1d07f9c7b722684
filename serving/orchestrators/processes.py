"""Engine processes on this machine: start them marked as ours, find them again, stop them for good.

Every engine runs with three environment variables. PLATFORM_ENGINE names its endpoint (for people reading
`ps`); PLATFORM_ENGINE_SLOT says which deployment, pool and replica it is; PLATFORM_ENGINE_OWNER says which
platform instance (state folder and database) started it, so that two platforms on one machine (a demo and a
test run) never touch each other's engines. Engines start in a session of their own, so they outlive the Celery
worker that started them and the worker's restarts; the next reconcile finds them again by their marks.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from django.conf import settings
from django.db import connection

MARK_NAME = "PLATFORM_ENGINE"
MARK_SLOT = "PLATFORM_ENGINE_SLOT"
MARK_OWNER = "PLATFORM_ENGINE_OWNER"

# Environment passed on to engines; the platform's own secrets (database, pepper) stay behind.
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ", "USER")

# Popen objects of the engines this process started, kept so their exit can be reaped (no zombies).
_children: dict[int, subprocess.Popen] = {}


@dataclass(frozen=True, order=True)
class Slot:
    """One replica of one pool of one deployment."""

    deployment_id: int
    pool_id: int
    index: int

    def mark(self) -> str:
        return f"{self.deployment_id}/{self.pool_id}/{self.index}"

    @classmethod
    def parse(cls, text: str) -> Slot | None:
        try:
            deployment_id, pool_id, index = (int(part) for part in text.split("/"))
        except ValueError:
            return None
        return cls(deployment_id, pool_id, index)


def owner_id() -> str:
    """This platform instance: its state folder and its database."""
    identity = f"{Path(settings.STATE_DIR).resolve()}|{connection.settings_dict['NAME']}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def log_path(name: str) -> Path:
    path = Path(settings.STATE_DIR) / "engines" / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _reap() -> None:
    for pid, child in list(_children.items()):
        if child.poll() is not None:
            del _children[pid]


def find_engines() -> dict[Slot, list[psutil.Process]]:
    """Every live process (engines and their children) that this platform instance started, by slot."""
    _reap()
    owner = owner_id()
    found: dict[Slot, list[psutil.Process]] = {}
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if env.get(MARK_OWNER) != owner:
            continue
        slot = Slot.parse(env.get(MARK_SLOT, ""))
        if slot is not None:
            found.setdefault(slot, []).append(proc)
    return found


def is_leader(proc: psutil.Process) -> bool:
    """Whether this is an engine itself rather than one of its helpers: an engine leads its own session."""
    try:
        return os.getsid(proc.pid) == proc.pid
    except (ProcessLookupError, PermissionError):
        return False


def spawn(*, argv: list[str], env: dict[str, str], name: str, slot: Slot) -> int:
    """Start one engine in a session of its own, its output appended to its log; return its pid."""
    inherited = {key: os.environ[key] for key in INHERITED_ENV if key in os.environ}
    marks = {MARK_NAME: name, MARK_SLOT: slot.mark(), MARK_OWNER: owner_id()}
    path = log_path(name)
    with path.open("ab") as log:
        log.write(f"\n=== starting {name}: {' '.join(argv)}\n".encode())
        log.flush()
        child = subprocess.Popen(
            argv,
            env={**inherited, **env, **marks},
            cwd=settings.BASE_DIR,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _children[child.pid] = child
    return child.pid


def http_port(proc: psutil.Process) -> int | None:
    """The HTTP port an engine process was started with (`--port N`), if it is one."""
    try:
        argv = proc.cmdline()
    except psutil.Error:
        return None
    if "--port" in argv[:-1]:
        value = argv[argv.index("--port") + 1]
        return int(value) if value.isdigit() else None
    return None


def _signal(proc: psutil.Process, sig: signal.Signals) -> None:
    """Signal the engine's whole process group when it leads one (vLLM runs helper processes)."""
    with contextlib.suppress(ProcessLookupError, psutil.Error):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def stop(processes: Iterable[psutil.Process], grace: float | None = None) -> None:
    """SIGTERM, then SIGKILL whatever is left after the grace period; return once all are gone."""
    procs = list(processes)
    if not procs:
        return
    grace = settings.ENGINE_STOP_GRACE_S if grace is None else grace
    for proc in procs:
        _signal(proc, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        _signal(proc, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=10)
    _reap()


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=settings.ENGINE_HEALTH_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False
