"""The fair-share benchmark's arithmetic (bench/fair_share.py): percentiles with requests still waiting at the end,
rates and shares from usage events, and the targets' verdicts."""

from __future__ import annotations

from bench.fair_share import (
    CASES,
    QUICK_CASES,
    Case,
    Outcome,
    Result,
    Row,
    Usage,
    outcome,
    parse_args,
    percentile,
    report,
    targets,
    ttfts,
)


def test_percentiles_are_nearest_rank():
    assert percentile([], 0.9) is None
    assert percentile([0.1] * 9 + [5.0], 0.9) == 0.1
    assert percentile([0.1] * 8 + [5.0] * 2, 0.9) == 5.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_a_request_unanswered_at_the_end_counts_its_wait_so_far_and_a_failure_counts_as_an_error():
    results = [
        Result("a", 1.0, ttft=0.5, status=200, tokens=4, wanted=4, done=True),  # before the window
        Result("a", 3.0, ttft=0.2, status=200, tokens=4, wanted=4, done=True),
        Result("a", 4.0, cut=True),  # still waiting when the case ended at 10 s
        Result("a", 5.0, status=429),  # refused: an error, not a latency
        Result("a", 6.0, ttft=0.1, status=200, tokens=2, wanted=4, done=True),  # short stream: an error
    ]
    answered, waiting = ttfts(results, 2.0, 10.0)
    assert answered == [0.2, 0.1] and waiting == [6.0]
    assert [r.error for r in results] == [False, False, False, True, True]
    run = outcome(Case("x", "x", ("a",), (), 1), results, [], (2.0, 10.0))
    row = run.rows["a"]
    assert row.ttft_p90 == 6.0 and row.censored  # the p90 is a lower bound
    assert row.errors == 2 and row.requests == 4


def test_rates_and_shares_come_from_completed_usage_in_the_window():
    usage = [
        Usage("a", 5.0, prompt=2000, cached=1800, output=40, status="completed", ttft_ms=900, queued_ms=800),
        Usage("a", 5.0, prompt=2000, cached=1800, output=60, status="completed", ttft_ms=300, queued_ms=100),
        Usage("a", 5.0, prompt=2000, cached=0, output=10, status="cancelled"),  # not completed
        Usage("a", 12.0, prompt=2000, cached=0, output=10, status="completed"),  # after the window
        Usage("b", 6.0, prompt=1000, cached=400, output=100, status="completed", ttft_ms=250, queued_ms=0),
    ]
    assert usage[0].work == 240
    run = outcome(Case("x", "x", ("a",), ("b",), 1), [], usage, (0.0, 10.0), engine_waiting=1.5)
    a, b = run.rows["a"], run.rows["b"]
    assert (a.output_rate, a.work_rate) == (10.0, 50.0)  # (40 + 60) / 10 s; (240 + 260) / 10 s
    assert (b.output_rate, b.work_rate) == (10.0, 70.0)
    assert abs(a.share - 50 / 120) < 1e-9 and abs(a.share + b.share - 1) < 1e-9
    assert (run.fleet_output, run.fleet_work) == (20.0, 120.0)
    assert a.queued == (0.1, 0.8) and a.after_gate == (0.1, 0.2)  # router TTFT less the queue's wait
    assert run.engine_waiting == 1.5


def _row(tenant: str, p90: float, output: float, work: float, censored: bool = False) -> Row:
    return Row(tenant, p90 / 2, p90, censored, output, work, 0, 10)


def _run(name: str, rows: list[Row]) -> Outcome:
    case = next(c for c in CASES if c.name == name)
    run = Outcome(case, {r.tenant: r for r in rows}, sum(r.output_rate for r in rows), 0.0)
    run.fleet_work = sum(r.work_rate for r in rows)
    for r in rows:
        r.share = r.work_rate / run.fleet_work
    return run


def test_targets_are_judged_against_the_baselines():
    outcomes = {
        "alone": _run("alone", [_row("b", 0.2, 60, 2000)]),
        "off": _run("off", [_row("a", 9.0, 590, 7000), _row("b", 9.0, 10, 300)]),
        "fc1": _run("fc1", [_row("a", 9.0, 540, 6500), _row("b", 0.28, 50, 1900)]),
        "fc2": _run("fc2", [_row("a", 9.0, 500, 6000), _row("b", 0.5, 40, 1800)]),
        "w1": _run("w1", [_row("heavy", 5.0, 450, 6000), _row("light", 9.0, 150, 2000)]),
        "w2": _run("w2", [_row("heavy", 5.0, 520, 7000), _row("light", 9.0, 80, 1000)]),
    }
    verdicts = {t.what: t.met for t in targets(outcomes)}
    ttft = [m for w, m in verdicts.items() if w.startswith("B's TTFT")]
    assert ttft == [True, False]  # 1.4x, then 2.5x
    capacity = [m for w, m in verdicts.items() if w.startswith("A receives")]
    assert capacity == [True, False]  # 540 of 550 left; 500 of 560
    fleet = [m for w, m in verdicts.items() if w.startswith("fleet throughput")]
    assert fleet == [True, False]  # 590 of 600; 540 of 600 (-10 %)
    split = [m for w, m in verdicts.items() if w.startswith("weights 3:1")]
    assert split == [True, False]  # 0.75; 0.875
    assert any("drift of the 3:1 split" in w for w in verdicts)
    text = report(outcomes, [], ["a line"])
    assert "| B alone | B (agent) | 100 / 200 |" in text and "**missed**" in text


def test_a_censored_p90_never_meets_the_latency_target():
    outcomes = {
        "alone": _run("alone", [_row("b", 0.2, 60, 2000)]),
        "fc1": _run("fc1", [_row("a", 9.0, 540, 6500), _row("b", 0.25, 50, 1900, censored=True)]),
    }
    [target] = [t for t in targets(outcomes) if t.what.startswith("B's TTFT")]
    assert target.met is False and target.measured.startswith(">=")


def test_the_quick_mode_names_real_cases():
    assert set(QUICK_CASES) <= {c.name for c in CASES}
    args = parse_args(["--quick"])
    assert args.quick and args.slots == 16
