"""The autoscaling benchmark's day and its window arithmetic (bench/autoscale.py)."""

from __future__ import annotations

import pytest

from bench.autoscale import Day, Result, Run, met_share, p90, windows

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)


def test_the_day_has_a_night_a_peak_and_ramps_between():
    day = Day(100.0, 2, 14)
    assert [day.sessions(t) for t in (0, 29, 35, 45, 59, 65, 75, 99)] == [2, 2, 8, 14, 14, 8, 2, 2]
    assert day.burst(45) and not day.burst(20) and not day.burst(65)
    assert abs(day.mean_sessions() - (0.6 * 2 + 0.2 * 14 + 0.2 * 8)) < 0.2


def test_a_window_meets_the_objectives_only_when_both_p90s_do():
    assert p90([0.1] * 9 + [5.0]) == 0.1 and p90([0.1] * 8 + [5.0] * 2) == 5.0 and p90([]) is None
    run = Run("x")
    run.results = [Result(1.0, 0.2, 0.02, True)] * 10  # window 0-10 s: fine
    run.results += [Result(12.0, 0.2, 0.02, True)] * 5 + [Result(13.0, 3.0, 0.02, True)] * 5  # TTFT missed
    run.results += [Result(25.0, None, None, False, "503")]  # a failure is not a measurement
    day = Day(30.0, 1, 1)
    assert [(start, n) for start, _, _, n in windows(run, day)] == [(0, 10), (10, 10), (20, 0)]
    assert met_share(run, day) == 0.5  # of the two windows with requests
