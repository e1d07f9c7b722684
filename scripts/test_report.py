"""Where the suite's time goes: docs/testing.md from one run's JUnit XML.

    rm -rf .local/test && make test TEST_WORKERS=3 PYTEST_ARGS="--junitxml=.local/suite.xml"
    .venv/bin/python -m inference_platform.devstack exec -- .venv/bin/python scripts/test_report.py .local/suite.xml

Each test's time is pytest's own (setup, call and teardown together), so a fixture built once is charged to the
first test that uses it. Tiers come from the markers the suite gives each test (tests/conftest.py and the
modules' own `pytestmark`), collected here again without running anything. It also writes each xdist group's
seconds to tests/durations.json, which tests/parallel.py reads to start the longest groups first. What the expensive things cost (each
engine, router, control plane, browser and test database built, and its start-up time) comes from the
`costs.jsonl` files that tests/costs.py writes in the run's state folders (`--costs`, `.local/test` by default:
start from an empty one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests import parallel  # noqa: E402  (the groups the suite's workers run, and their durations file)

# The first of these a test carries is its tier; a test with none of them is "fast".
TIERS = ("kube", "vllm", "browser", "agents", "kubectl", "unit")


def plain_name(name: str) -> str:
    """A JUnit test name without the `@group` xdist's scheduling adds after the name and its parameters."""
    head, at, _ = name.rpartition("@")
    return head if at and (head.endswith("]") or "[" not in head) else name


class _Markers:
    """A pytest plugin that keeps each collected test's marker names and xdist group (tests/parallel.py)."""

    def __init__(self) -> None:
        self.by_test: dict[tuple[str, str], set[str]] = {}
        self.group: dict[tuple[str, str], str] = {}

    def pytest_collection_finish(self, session) -> None:
        for item in session.items:
            path, *rest = item.nodeid.split("[")[0].split("::")  # a parameter may hold "::" (an IPv6 address)
            classname = ".".join([path.removesuffix(".py").replace("/", "."), *rest[:-1]])
            self.by_test[(classname, item.name)] = {mark.name for mark in item.iter_markers()}
            self.group[(classname, item.name)] = parallel.group_of(item)


def tier_of(markers: set[str]) -> str:
    return next((tier for tier in TIERS if tier in markers), "fast")


def collect() -> _Markers:
    plugin = _Markers()
    code = pytest.main(
        ["--collect-only", "-q", "-p", "no:cacheprovider", str(ROOT / "tests")], plugins=[plugin]
    )
    if code not in (0, 5):
        sys.exit(f"collection failed ({code})")
    return plugin


def cost_lines(state: Path) -> list[str]:
    """The table of what the suite built, from the costs.jsonl files under `state` (one per worker)."""
    builds: dict[str, list[dict]] = defaultdict(list)
    for path in sorted(state.glob("**/costs.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            builds[entry["kind"]].append(entry)
    if not builds:
        return []
    lines = [
        "",
        "## What the expensive things cost",
        "",
        "Each build of an engine, a router, the control plane, a browser or a worker's test database, with its "
        "start-up wall time (on a busy machine: the other workers run beside it), and the file that builds it most.",
        "",
        "| what | builds | seconds each (median) | seconds in all | built most by |",
        "|---|---:|---:|---:|---|",
    ]
    for kind, entries in sorted(builds.items(), key=lambda kv: -sum(e["seconds"] for e in kv[1])):
        seconds = [e["seconds"] for e in entries]
        files: dict[str, int] = defaultdict(int)
        for entry in entries:
            files[entry["test"].split("::")[0] or "(outside a test)"] += 1
        top, count = max(files.items(), key=lambda kv: kv[1])
        lines.append(
            f"| {kind} | {len(entries)} | {statistics.median(seconds):.1f} | {sum(seconds):.0f} | "
            f"`{top}` ({count}) |"
        )
    return lines


def report(xml_path: Path, state: Path, durations_path: Path) -> str:
    tree = ET.parse(xml_path)
    suite = tree.getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    collected = collect()
    markers = collected.by_test
    per_group: dict[str, float] = defaultdict(float)
    per_file: dict[str, list[float]] = defaultdict(list)
    per_tier: dict[str, list[float]] = defaultdict(list)
    tests: list[tuple[float, str, str]] = []
    outcomes: dict[str, int] = defaultdict(int)
    for case in suite.iter("testcase"):
        classname, name, seconds = case.get("classname", ""), case.get("name", ""), float(case.get("time", 0))
        name = plain_name(name)
        outcome = next(
            (child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed"
        )
        outcomes[outcome] += 1
        tier = tier_of(markers.get((classname, name), set()))
        per_group[collected.group.get((classname, name), f"{classname}::{name}")] += seconds
        module = classname.split(".")
        while module and not module[-1].startswith("test_"):
            module.pop()
        file = "/".join(module) + ".py"
        per_file[file].append(seconds)
        per_tier[tier].append(seconds)
        tests.append((seconds, f"{file}::{name}", tier))
    total = sum(seconds for seconds, _, _ in tests)
    wall = float(suite.get("time", total))
    run = "one `make test` run"
    if len(tests) < len(markers):
        run = f"one `make test` run stopped after {len(tests)} of the {len(markers)} tests collected now"
    lines = [
        "# Where the suite's time goes",
        "",
        f"Generated by `scripts/test_report.py` from {run} ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
        f"{len(tests)} tests: {', '.join(f'{count} {kind}' for kind, count in sorted(outcomes.items()))}; "
        f"{wall / 60:.1f} minutes of wall time; the tests' own times add up to {total / 60:.1f} minutes, the "
        "workers running side by side). Regenerate it as its docstring says. A test's time is setup, call and "
        "teardown together, on a machine the other workers share: an expensive fixture is charged to the first "
        "test that builds it.",
        "",
        "## Per tier",
        "",
        "| tier | tests | minutes | share |",
        "|---|---:|---:|---:|",
    ]
    for tier, times in sorted(per_tier.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {tier} | {len(times)} | {sum(times) / 60:.1f} | {sum(times) / total:.0%} |")
    lines += ["", "## Per file (the 40 costliest)", "", "| file | tests | seconds | slowest test (s) |"]
    lines.append("|---|---:|---:|---:|")
    for file, times in sorted(per_file.items(), key=lambda kv: -sum(kv[1]))[:40]:
        lines.append(f"| `{file}` | {len(times)} | {sum(times):.0f} | {max(times):.0f} |")
    lines += ["", "## The 30 slowest tests", "", "| test | tier | seconds |", "|---|---|---:|"]
    for seconds, test, tier in sorted(tests, reverse=True)[:30]:
        lines.append(f"| `{test}` | {tier} | {seconds:.0f} |")
    lines += cost_lines(state)
    durations_path.write_text(
        json.dumps({g: round(t, 1) for g, t in sorted(per_group.items())}, indent=0) + "\n"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("junit_xml", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "testing.md")
    parser.add_argument("--costs", type=Path, default=ROOT / ".local" / "test", help="the run's state folder")
    parser.add_argument("--durations", type=Path, default=parallel.DURATIONS, help="seconds per xdist group")
    args = parser.parse_args()
    args.out.write_text(report(args.junit_xml, args.costs, args.durations))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
