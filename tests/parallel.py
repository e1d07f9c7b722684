"""What keeps pytest-xdist's workers out of each other's way (loaded with `-p tests.parallel`, as `make test` does).

Each worker (`gw0`, `gw1`, ...) gets, before Django reads its settings:
- its own Redis database (`gw0` the 1st, `gw1` the 2nd, ...; the session's is the 0th): streams, quotas, the Celery
  broker and the channel layer are per database, and nothing here uses Redis pub/sub, which is not;
- its own state folder (logs, journals, local secrets) under the session's;
- its own slice of TCP ports for the servers its tests start (`inference_platform.ports` reads
  `PLATFORM_PORT_RANGE`), below the kernel's ephemeral range, so that no two workers hand out the same port;
- PostgreSQL: pytest-django already gives each worker its own test database (`test_<name>_gw0`, ...).

Tests that share something expensive share an xdist group and so one worker: those on the session's vLLM engine
(one engine rather than one per worker; vLLM-CPU takes both cores while it starts) and the control-plane tier (one
API server); every other test goes with its module. `make test` runs with `--dist loadgroup`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _pytest.nodeid import NodeId

from bench.harness import with_path

# Below Linux's ephemeral range (32768-60999): no client socket takes them.
PORTS_FROM, PORTS_TO = 10_000, 32_000
PORTS_PER_WORKER = 2_000


def _worker_number() -> int | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


def _isolate(number: int) -> None:
    if number >= 15:
        raise pytest.UsageError("at most 15 xdist workers: Redis has 16 databases, the 0th is the session's")
    if url := os.environ.get("REDIS_URL"):
        os.environ["REDIS_URL"] = with_path(url, f"/{number + 1}")
    state = Path(os.environ.get("PLATFORM_STATE_DIR") or ".local/test")
    os.environ["PLATFORM_STATE_DIR"] = str(state / f"gw{number}")
    low = PORTS_FROM + number * PORTS_PER_WORKER
    if low + PORTS_PER_WORKER > PORTS_TO:
        raise pytest.UsageError(f"too many xdist workers for the ports {PORTS_FROM}-{PORTS_TO}")
    os.environ["PLATFORM_PORT_RANGE"] = f"{low}-{low + PORTS_PER_WORKER - 1}"


if (_number := _worker_number()) is not None:
    _isolate(_number)  # at import, before pytest-django sets Django up


def _unique_ids(items) -> None:
    """Tests that share an id get one from their names: schemathesis names each operation's test
    (`test_x[GET /api/...]`) but leaves pytest 9.2 the function's id for all of them, and xdist, which sends tests
    to workers by id, ran one of the 89 and dropped the rest."""
    seen: dict[str, int] = {}
    for item in items:
        seen[item.nodeid] = seen.get(item.nodeid, 0) + 1
    for item in items:
        if seen[item.nodeid] > 1:
            path = item.nodeid.split("::")[0]
            parents = [node.name for node in item.listchain()[1:-1] if node.path == item.path][1:]
            item._id = NodeId.parse("::".join([path, *parents, item.name]))


def _transactional(item) -> bool:
    """Whether pytest-django runs the test with the database flushed after it (as it orders them: last)."""
    marker = item.get_closest_marker("django_db")
    return bool(
        {"transactional_db", "live_server"} & set(item.fixturenames)
        or (marker and (marker.kwargs.get("transaction") or (marker.args and marker.args[0])))
    )


def group_of(item) -> str:
    """The tests on the session's vLLM engine together, the control-plane tier together, any other test with
    its module; a transactional test's group is marked `#late` (see LongestFirst)."""
    if marker := item.get_closest_marker("xdist_group"):
        group = marker.args[0] if marker.args else marker.kwargs.get("name", "default")
    elif "vllm_engine" in item.fixturenames:
        group = "vllm"
    elif item.get_closest_marker("kube"):
        group = "kube"
    else:
        group = item.nodeid.split("::")[0]
    return f"{group}#late" if _transactional(item) else group


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Each test's group into its id, where xdist's scheduler reads it (`id@group`). A module's fixtures (a
    router, say) are then built once rather than on each worker that gets one of its tests.

    xdist 3.8 writes the suffix into an attribute that pytest 9.2 no longer reads ids from (so every test was
    its own group): it is written here, where pytest keeps the id."""
    _unique_ids(items)
    if _number is None or not getattr(config.option, "loadgroup", False):  # xdist's worker's view of --dist
        return
    for item in items:
        if "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{group_of(item)}")


# --- the controller's side: which group goes first ------------------------------------------------------------
DURATIONS = Path(__file__).with_name("durations.json")


def expected_seconds(durations: dict[str, float], scope: str, tests: int) -> float:
    """A group's seconds from the last report (scripts/test_report.py writes tests/durations.json), or a
    second a test for a group it has not seen."""
    return durations.get(scope, float(tests))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which makes its plain one
def pytest_xdist_make_scheduler(config, log):
    """Longest first, so that no hour-long group starts last; and every group of tests that leave the database
    flushed (`#late`) after all the others, so that on each worker they run after every test that needs what
    the migrations put in the database, as pytest-django orders them in one process."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    durations = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

    class LongestFirst(LoadGroupScheduling):
        ordered = False

        def _assign_work_unit(self, node):
            if not self.ordered:
                self.ordered = True
                units = sorted(
                    self.workqueue.items(),
                    key=lambda unit: (
                        unit[0].endswith("#late"),
                        -expected_seconds(durations, unit[0], len(unit[1])),
                    ),
                )
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)
