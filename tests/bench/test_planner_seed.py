"""The seed-scale planner benchmark (bench/planner_seed.py) runs end to end on a tiny fleet and prints every row,
or why a row could not run on this simulator."""

from __future__ import annotations

import re

import pytest

from bench import planner_seed

pytestmark = pytest.mark.unit


@pytest.mark.heavy
def test_a_tiny_run_prints_every_row_next_to_the_published_figures(capsys):
    argv = ["--agents", "40", "--gpus", "32", "--minutes", "2", "--prefill-engines", "2"]
    assert planner_seed.main(argv) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for label in ("precise", "approximate", "round robin"):
        cells = [c.strip() for c in rows[label].split("|")[2:-1]]
        assert cells[0] == "4"  # 32 GPUs in engines of 8
        assert re.fullmatch(r"[\d,]+ of [\d,]+", cells[1])
        assert float(cells[2]) >= 0 and float(cells[3]) >= float(cells[2])  # TTFT p50 <= p90
        assert re.fullmatch(r"\d+\.\d% of \d+\.\d%", cells[6])
        assert float(cells[11]) > 0  # cost per million tokens
    others = [line for label, line in rows.items() if label.startswith(("P/D", "precise, HBM"))]
    assert len(others) == 3
    for line in others:
        assert "not run:" in line or re.search(r"\| \d+\.\d\d \|", line)
    assert "published: 7,612 requests/min at 2,500 agents" in out
    assert "here: precise against approximate" in out


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        planner_seed.main(["--gpus", "8"])  # one engine: nothing to compare
    with pytest.raises(SystemExit):
        planner_seed.main(["--gpus", "32", "--prefill-engines", "4"])
