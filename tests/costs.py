"""What the suite's expensive things cost: each engine, router, control plane, browser and test database the
tests build is recorded with its start-up time and the test that built it, one JSON line per build in
`costs.jsonl` of the (worker's) state folder. `scripts/test_report.py` sums them into docs/testing.md.

Also a pytest plugin (`-p tests.costs`, as `make test` loads it): it records each worker's test database, whose
fixture is session-scoped and so out of reach of tests/conftest.py's hooks."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def record(kind: str, seconds: float) -> None:
    state = Path(os.environ.get("PLATFORM_STATE_DIR") or ".local/test")
    state.mkdir(parents=True, exist_ok=True)
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    line = json.dumps({"kind": kind, "seconds": round(seconds, 3), "test": test})
    with (state / "costs.jsonl").open("a") as out:
        out.write(line + "\n")


@contextlib.contextmanager
def timed(kind: str) -> Iterator[None]:
    """Record `kind` with the time the block took, if it completed."""
    started = time.monotonic()
    yield
    record(kind, time.monotonic() - started)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.argname != "django_db_setup":
        return (yield)
    with timed("test database"):
        return (yield)
