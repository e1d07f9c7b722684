"""The soak run (bench/soak.py): its windows, its targets, its count of the engines' blocks, and a three-minute run
of the whole platform under agent traffic that must meet the targets the hour-long run is held to."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from bench import soak

unit = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)


def _sample(t: float, rss_mb: float, cpu_s: float, index: int = 100, engines: float = 100.0) -> soak.Sample:
    mb = int(rss_mb * 2**20)
    return soak.Sample(
        t=t,
        memory={p: soak.Memory(rss=mb + 2**20, uss=mb, pss=mb) for p in soak.PROCS},
        cpu={p: cpu_s for p in soak.PROCS},
        redis_used=int(3 * 2**20),
        tok_keys=0,
        tok_bytes=int(0.75 * 2**20),
        tok_memory=int(1 * 2**20),
        index=index,
        engines=engines,
        stream_len=0,
    )


@unit
def test_a_window_holds_the_requests_that_ended_in_it_their_cpu_and_their_usage_lag():
    samples = [_sample(0, 100, 0.0), _sample(10, 110, 1.0), _sample(20, 111, 1.5)]
    ends = [(1.0, True), (9.9, True), (10.0, False), (15.0, True), (25.0, True)]  # the last after the windows
    began = 1_000.0
    ledger = [
        (began + 1.0, began + 2.0, "completed"),
        (began + 9.9, began + 13.9, "completed"),
        (began + 10.0, began + 10.5, "failed"),  # the failed request's row
        (began + 15.0, began + 16.0, "completed"),
    ]
    first, second = soak.windows(samples, ends, ledger, began)
    assert (first.requests, first.errors, second.requests, second.errors) == (2, 0, 2, 2)
    assert first.cpu_ms["router"] == pytest.approx(500.0) and second.cpu_ms["worker"] == pytest.approx(250.0)
    assert first.uss_mb["ingester"] == pytest.approx(110.0)  # memory at the window's end
    assert first.rss_mb["router workers"] == pytest.approx(111.0)
    assert (first.lag_max, first.lag_p50) == (pytest.approx(4.0), pytest.approx(4.0))
    assert second.lag_max == pytest.approx(1.0) and second.ledger_rows == 2
    # Redis less the token pieces' keys, payload and overhead; the payload and the overhead apart.
    assert first.redis_less_tok_mb == pytest.approx(2.0) and first.index_ratio == 1.0
    assert (first.tok_mb, first.tok_overhead_mb) == (pytest.approx(0.75), pytest.approx(0.25))
    assert second.notes == ["1 ledger rows not completed"]


@unit
def test_the_targets_memory_flat_after_warm_up_no_error_and_the_index_near_the_engines():
    grow = [_sample(0, 100, 0), _sample(10, 200, 1), _sample(20, 205, 2), _sample(30, 218, 3)]
    rows = soak.windows(grow, [(5.0, True), (15.0, True), (25.0, True)], [], 0.0)
    met = {v.target: v.met for v in soak.verdicts(rows, lost=0)}
    # The first window (warm-up) grew by half; the last is within 10 % of the second: flat.
    assert met["router memory flat"] and met["no error"] and met["index within 5 % of the engines"]
    leak = [*grow[:3], _sample(30, 230, 3)]
    rows = soak.windows(leak, [(5.0, True)], [], 0.0)
    verdicts = {v.target: v for v in soak.verdicts(rows, lost=0)}
    assert (
        not verdicts["worker memory flat"].met
        and "USS 205.0 -> 230.0 MB (+12.2%" in verdicts["worker memory flat"].detail
    )
    # The tokenizing workers' caches fill for hours: held to their bounds, not to flatness.
    workers = "router workers memory within their caches' bounds"
    assert verdicts[workers].met
    first_window = 200  # the first window ends at the second sample
    filling = [*grow[:3], _sample(30, first_window + 2 * soak.WORKER_CACHES_MB + 1, 3)]
    rows = soak.windows(filling, [], [], 0.0)
    over = {v.target: v for v in soak.verdicts(rows, lost=0)}[workers]
    assert not over.met and f"bound {first_window + 2 * soak.WORKER_CACHES_MB} MB" in over.detail
    assert not {v.target: v.met for v in soak.verdicts(rows, lost=1)}["no error"]
    assert not {v.target: v.met for v in soak.verdicts(rows, lost=0, errors=1)}["no error"]
    drift = [*grow[:3], _sample(30, 218, 3, index=94, engines=100.0)]
    rows = soak.windows(drift, [], [], 0.0)
    verdict = {v.target: v for v in soak.verdicts(rows, lost=0)}["index within 5 % of the engines"]
    assert not verdict.met and "worst window 3" in verdict.detail
    assert soak.verdicts(rows[:2], lost=0)[0].met is False  # too few windows to judge


@unit
def test_the_slope_is_per_hour():
    assert soak.slope_per_hour([(0, 100.0), (1800, 101.0), (3600, 102.0)]) == pytest.approx(2.0)
    assert math.isnan(soak.slope_per_hour([(0, 1.0)]))


@unit
def test_the_engines_blocks_follow_their_events_and_an_engine_restart():
    blocks = soak.EngineBlocks({7: "tcp://*:1"})
    blocks.apply(7, 0, [{"type": "BlockStored", "block_hashes": [1, 2, 3], "medium": "GPU"}])
    blocks.apply(7, 1, [{"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}])
    blocks.apply(7, 2, [{"type": "BlockStored", "block_hashes": [9], "medium": "CPU"}])  # another tier
    assert blocks.counts() == {7: 2} and blocks.gaps == 0
    blocks.apply(7, 4, [{"type": "BlockStored", "block_hashes": [b"\x00" * 24 + b"\x00" * 7 + b"\x05"]}])
    assert blocks.counts() == {7: 3} and blocks.gaps == 1  # seq 3 was missed
    blocks.apply(7, 5, [{"type": "AllBlocksCleared"}])
    assert blocks.counts() == {7: 0}
    blocks.apply(7, 6, [{"type": "BlockStored", "block_hashes": [4]}])
    blocks.apply(7, 0, [{"type": "BlockStored", "block_hashes": [5]}])  # back to 0: the engine restarted
    assert blocks.counts() == {7: 1} and blocks.restarts == 1


def test_redis_is_read_with_the_token_pieces_share_of_the_key_tables_and_the_median_reading(monkeypatch):
    """On the suite's Redis (the soak's own database, flushed): the pieces' count and payload are exact, their memory holds their
    keys, values and share of the key tables, and the reading kept is one of those taken."""
    import redis
    from django.conf import settings

    from bench.harness import with_path

    client = redis.Redis.from_url(with_path(settings.REDIS_URL, f"/{soak.BENCH_REDIS_DB}"))
    client.flushdb()
    try:
        for k in range(300):
            client.set(f"tok:{k}", b"\x01" * (800 + k), ex=600)
        for k in range(100):
            client.set(f"px:1:{k}", b"x")  # no TTL: in the main table only
        keys, payload, memory = soak.shared_token_bytes(client)
        assert (keys, payload) == (300, sum(800 + k for k in range(300))) and memory > payload
        share = soak.tok_tables_share(client, keys)
        tables = client.memory_stats()[f"db.{soak.BENCH_REDIS_DB}"]
        assert 0 < share < tables["overhead.hashtable.main"] + tables["overhead.hashtable.expires"]
        assert (
            share >= tables["overhead.hashtable.expires"]
        )  # every expiring key is a piece: all of that table
        monkeypatch.setattr(soak, "REDIS_READ_GAP", 0.01)
        used, keys, payload, held = soak.redis_reading(client)
        assert (keys, payload) == (300, sum(800 + k for k in range(300)))
        assert held == memory + share and used > held
    finally:
        client.flushdb()


def test_three_minutes_of_agent_traffic_keep_memory_flat_with_no_error_and_the_index_on_the_engines(tmp_path):
    """The soak, short: 3 minutes in 30-s windows after a 15-s calibration, the platform's own processes (router,
    Celery worker and beat, KV-event ingester, engines on the local orchestrator). Needs the suite's PostgreSQL and
    Redis."""
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "bench.soak", "--minutes", "3", "--window", "30", "--calibrate", "15"]
    cmd += ["--tag", "soak-ci", "--title", "Soak, three minutes", "--json", str(out)]
    run = subprocess.run(cmd, cwd=soak.ROOT, env=os.environ, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and out.exists(), run.stderr[-4000:]
    result = json.loads(out.read_text())
    windows = result["windows"]
    assert len(windows) == 6, run.stdout[-3000:]
    table = run.stdout
    assert "| window | requests (errors) |" in table and "| target | met | detail |" in table
    for window in windows:
        assert window["requests"] > 0 and window["errors"] == 0
        assert all(0 < window["rss_mb"][p] < 4000 for p in soak.PROCS)
        assert all(0 < window["uss_mb"][p] <= window["rss_mb"][p] for p in soak.PROCS)
        assert 0 < window["lag_max"] < 30  # the ledger follows within seconds (beat: every 2 s)
        assert window["engine_blocks"] > 0  # the engines hold blocks: the index is compared with something
    assert result["lost"] == 0 and result["gaps"] == 0 and result["restarts"] == 0
    failed = [v for v in result["verdicts"] if not v["met"]]
    assert not failed, f"{failed}\n{table[-3000:]}"
