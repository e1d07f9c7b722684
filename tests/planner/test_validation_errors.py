"""How the validation weighs its errors (planner/validate.py), on runs made up with known figures: the planner's
error per configuration, and the real rounds' error against each other beside it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from planner.validate import FIGURES, Comparison, Run, configuration_error, repeat_error, summary_table

pytestmark = pytest.mark.unit


def comparison(round_no: int, real: dict[str, float], simulated: dict[str, float]) -> Comparison:
    run = Run(Path(f"r{round_no}.json"), "agentic", "precise", round_no, {}, real, Path("t.jsonl"))
    errors = {k: abs(simulated[k] - real[k]) / real[k] for k in FIGURES}
    return Comparison(run, simulated, errors)


def figures(ttft: float, rps: float, hit: float = 0.9) -> dict[str, float]:
    return {"ttft_p50": ttft, "ttft_p90": 2 * ttft, "rps": rps, "hit_share": hit}


def test_real_rounds_that_agree_set_no_floor_and_the_planners_error_stands_alone():
    same = figures(1000, 8.0)
    group = [comparison(r, same, figures(1100, 8.0)) for r in (1, 2, 3)]
    assert repeat_error(group) == 0
    # TTFT p50 and p90 10 % off, req/s and hit share exact: the median of the four figures' errors.
    assert configuration_error(group) == pytest.approx(0.05)


def test_each_real_round_is_set_against_the_median_of_the_others():
    # TTFT p50 over the rounds 1000, 1250, 800: each against the median of the other two (1025, 900, 1125) is
    # 2.5 %, 28 % and 40.6 % off; their median 28 %; the same for p90; req/s and hit share agree.
    reals = [figures(1000, 8.0), figures(1250, 8.0), figures(800, 8.0)]
    group = [comparison(i + 1, real, real) for i, real in enumerate(reals)]
    assert repeat_error(group) == pytest.approx((0.28 + 0.0) / 2)
    assert configuration_error(group) == 0  # the planner matched every round
    row = summary_table(group, 0.10).splitlines()[-1]
    assert row.endswith("| **0.0%** | met | 14.0% |"), row


def test_one_round_has_no_floor():
    group = [comparison(1, figures(1000, 8.0), figures(1000, 8.0))]
    assert math.isnan(repeat_error(group))
    assert summary_table(group, 0.10).splitlines()[-1].endswith("| met | n/a |")
