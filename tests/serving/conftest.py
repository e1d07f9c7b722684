"""Engines for the serving tests: started once per test session, stopped at its end."""

from __future__ import annotations

import contextlib

import psutil
import pytest

from serving.orchestrators import processes

from .engines import BOTH_ENGINES, RunningEngine


@pytest.fixture(params=BOTH_ENGINES)
def engine(request) -> RunningEngine:
    """Each conformance test runs once against the simulator and once against real vLLM."""
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture
def live_engines(transactional_db) -> str:
    """Engines the local orchestrator starts in a test, seen by other processes (a router) through committed
    rows; every engine this platform instance left is killed at teardown, pass or fail."""
    mark = processes.owner_id()
    yield mark
    leftovers = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(processes.MARK_OWNER) == mark:
                leftovers.append(proc)
    for proc in leftovers:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(leftovers, timeout=10)
