"""The fault benchmark (bench/faults.py), short: the faults no other test injects into a running platform (a router
replica SIGKILLed with streams in flight, Redis stopped and Redis emptied under load, PostgreSQL stopped, a
router-engine partition, the KV-event ingester killed, the worker killed mid-reconcile), each under agent traffic
through two real router replicas, with the real worker, beat and ingester. Engines killed or hung mid-stream and
the worker killed mid-ingestion have their own tests (tests/routing/test_robustness.py,
tests/serving/test_local_orchestrator.py, tests/tenants/test_usage_ingest.py).

Targets, per fault: no request failed otherwise than cleanly in its dialect, every stream the client saw start is
in the ledger exactly once with the client's output tokens, the quota counter within one request of the ledger,
no process the fault did not aim at exited, and a recovery: a first good answer, then none failed after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench import faults as f

SHORT = [
    "router-kill",
    "redis-stop",
    "redis-empty",
    "postgres-stop",
    "partition",
    "kv-ingester",
    "worker-reconcile",
]


def test_every_fault_fails_cleanly_and_bills_every_request_exactly_once(tmp_path):
    rows_file = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "bench.faults", "--faults", ",".join(SHORT), "--sessions", "8"]
    # The state under the checkout, not tmp_path: PostgreSQL runs as its own user (pgserver, as root), which must
    # reach its data folder, and pytest makes its temporary folders private to the user running it.
    cmd += ["--outage", "4", "--after", "6", "--state", ".local/faults-test-bench", "--json", str(rows_file)]
    run = subprocess.run(cmd, cwd=f.ROOT, env=os.environ, capture_output=True, text=True, timeout=600)
    assert rows_file.exists(), run.stderr[-4000:]
    rows = {row["fault"]: row for row in json.loads(rows_file.read_text())}
    assert list(rows) == SHORT
    table = run.stdout
    for fault, row in rows.items():
        where = f"{fault}: {row}\n{table}"
        assert row["sent"] > 0 and row["answered"] > 0, where
        assert row["other"] == 0 and row["late"] == 0, where
        assert row["started"] == row["in_ledger"] and row["missing"] == 0, where
        assert row["mismatched"] == 0, where
        assert row["quota_ok"], where
        assert row["survivors_ok"], where
        assert row["first_good_s"] is not None, where
    # The kill cuts the streams on the killed replica itself, and those are billed all the same.
    assert rows["router-kill"]["cut"] > 0
    assert rows["kv-ingester"]["recovered_s"] is not None
    assert rows["worker-reconcile"]["recovered_s"] is not None
    assert run.returncode == 0, table
