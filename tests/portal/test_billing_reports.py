"""Billing reports: totals equal the ledger's sums, with and without roll-ups, for any period and grouping."""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenants.access import Access
from tenants.billing import Period, period_parse, report_csv_rows, usage_report, usage_rollup
from tenants.models import UsageDaily, UsageRecord

from ..conftest import make_usage

BASE = datetime(2025, 3, 1, tzinfo=UTC)  # far from the world fixture's own records (made now)

record_st = st.fixed_dictionaries(
    {
        "key": st.sampled_from(["key_a1", "key_a2", "key_b1"]),
        "minute": st.integers(min_value=0, max_value=40 * 24 * 60 - 1),
        "prompt": st.integers(min_value=0, max_value=300_000),
        "cached_share": st.floats(min_value=0, max_value=1),
        "output": st.integers(min_value=0, max_value=5_000),
        "cost": st.decimals(min_value=0, max_value=Decimal("99.99999999"), places=8),
        "model": st.sampled_from(["tiny-qwen", "big-qwen"]),
        "status": st.sampled_from(["completed", "completed", "failed", "cancelled"]),
        "priority_class": st.sampled_from(["interactive", "standard", "batch", ""]),
    }
)

period_st = st.one_of(
    st.tuples(st.sampled_from(["day", "week", "month"]), st.integers(min_value=0, max_value=39)),
    st.tuples(st.just("custom"), st.integers(0, 40 * 24 * 60), st.integers(1, 40 * 24 * 60)),
)


VISIBLE = {
    "operator": ["team_a1", "team_a2", "team_b1"],
    "admin_a": ["team_a1", "team_a2"],
    "team_admin_a1": ["team_a1"],
    "admin_b": ["team_b1"],
}


def _insert(world, specs, tag: str) -> list[UsageRecord]:
    records = []
    for n, spec in enumerate(specs):
        cached = int(spec["prompt"] * spec["cached_share"])
        records.append(
            make_usage(
                getattr(world, spec["key"]),
                f"{tag}-{n}",
                created_at=BASE + timedelta(minutes=spec["minute"]),
                prompt_tokens=spec["prompt"],
                cached_prompt_tokens=cached,
                output_tokens=spec["output"],
                cost=spec["cost"],
                model=spec["model"],
                status=spec["status"],
                priority_class=spec["priority_class"],
            )
        )
    return records


def _period(choice) -> Period:
    if choice[0] == "custom":
        start = BASE + timedelta(minutes=choice[1])
        return period_parse(period="custom", since=start, until=start + timedelta(minutes=choice[2]))
    return period_parse(period=choice[0], at=(BASE + timedelta(days=choice[1])).date())


def _expected(records, period: Period, group_by: str, visible_teams: set[int]) -> dict:
    """The report computed by hand from the records: what the ledger says."""
    out: dict = defaultdict(lambda: [0, 0, 0, 0, 0, Decimal(0)])
    key_of = {
        "team": lambda r: r.team_id,
        "tenant": lambda r: r.tenant_id,
        "key": lambda r: r.api_key_id,
        "model": lambda r: r.model,
        "priority_class": lambda r: r.priority_class,
        "day": lambda r: r.created_at.astimezone(UTC).date(),
    }[group_by]
    for r in records:
        if r.team_id not in visible_teams or not period.start <= r.created_at < period.end:
            continue
        acc = out[(key_of(r), r.currency)]
        for i, v in enumerate(
            [
                1,
                int(r.status != "completed"),
                r.prompt_tokens,
                r.cached_prompt_tokens,
                r.output_tokens,
                r.cost,
            ]
        ):
            acc[i] += v
    return {k: tuple(v) for k, v in out.items()}


def _actual(report) -> dict:
    return {
        (row.key, row.currency): (
            row.requests,
            row.errors,
            row.input_tokens,
            row.cached_input_tokens,
            row.output_tokens,
            row.cost,
        )
        for row in report.rows
    }


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    before=st.lists(record_st, max_size=12),
    after=st.lists(record_st, max_size=6),
    choice=period_st,
    group_by=st.sampled_from(["team", "tenant", "key", "model", "priority_class", "day"]),
    viewer=st.sampled_from(["operator", "admin_a", "team_admin_a1", "admin_b"]),
)
def test_report_equals_the_ledger_whatever_is_rolled_up(world, before, after, choice, group_by, viewer):
    with transaction.atomic():
        records = _insert(world, before, "b")
        usage_rollup()  # some records rolled up, the later ones not yet
        records += _insert(world, after, "a")
        period = _period(choice)
        access = Access.for_user(getattr(world, viewer))
        visible = {getattr(world, name).id for name in VISIBLE[viewer]}
        report = usage_report(access=access, period=period, group_by=group_by)
        assert _actual(report) == _expected(records, period, group_by, visible)
        for total in report.totals:
            rows = [r for r in report.rows if r.currency == total.currency]
            assert total.cost == sum((r.cost for r in rows), Decimal(0))
            assert total.requests == sum(r.requests for r in rows)
        transaction.set_rollback(True)


def test_rollup_adds_each_record_once_and_catches_late_records(world):
    old = make_usage(world.key_a1, "old", created_at=BASE, cost=Decimal("0.10000001"))
    assert usage_rollup() >= 1
    assert usage_rollup() == 0  # nothing new: nothing added twice
    late = make_usage(world.key_a1, "late", created_at=BASE + timedelta(hours=3), cost=Decimal("0.2"))
    period = period_parse(period="day", at=BASE.date())
    access = Access.for_user(world.operator)
    # Before the next roll-up the late record comes from the ledger; after it, from the daily row.
    for _ in range(2):
        (row,) = usage_report(access=access, period=period, group_by="team").rows
        assert (row.requests, row.cost) == (2, old.cost + late.cost)
        usage_rollup()
    daily = UsageDaily.objects.get(day=BASE.date(), team=world.team_a1)
    assert (daily.requests, daily.cost) == (2, Decimal("0.30000001"))


def test_partial_days_at_the_edges_are_read_from_the_ledger(world):
    for hour in (1, 23):
        for day in range(3):
            make_usage(world.key_a1, f"r{day}-{hour}", created_at=BASE + timedelta(days=day, hours=hour))
    usage_rollup()
    period = period_parse(
        period="custom", since=BASE + timedelta(hours=12), until=BASE + timedelta(days=2, hours=2)
    )
    (row,) = usage_report(access=Access.for_user(world.operator), period=period, group_by="tenant").rows
    assert row.requests == 4  # day 0 23h, day 1 both, day 2 1h


def test_report_groups_by_day_with_dates(world):
    make_usage(world.key_a1, "d1", created_at=BASE + timedelta(hours=5))
    make_usage(world.key_a1, "d2", created_at=BASE + timedelta(days=1, hours=5))
    usage_rollup()
    make_usage(world.key_a1, "d3", created_at=BASE + timedelta(days=1, hours=6))
    report = usage_report(
        access=Access.for_user(world.operator),
        period=period_parse(period="month", at=BASE.date()),
        group_by="day",
    )
    assert [(r.key, r.requests) for r in report.rows] == [(date(2025, 3, 1), 1), (date(2025, 3, 2), 2)]


def test_csv_lists_rows_then_totals_with_exact_decimals(world):
    make_usage(
        world.key_a1,
        "c1",
        created_at=BASE,
        cost=Decimal("0.00000001"),
        prompt_tokens=10,
        cached_prompt_tokens=4,
        output_tokens=3,
    )
    make_usage(
        world.key_a2,
        "c2",
        created_at=BASE,
        cost=Decimal("12.34567891"),
        prompt_tokens=20,
        cached_prompt_tokens=0,
        output_tokens=7,
        status="failed",
    )
    report = usage_report(
        access=Access.for_user(world.admin_a),
        period=period_parse(period="day", at=BASE.date()),
        group_by="team",
    )
    text = io.StringIO()
    csv.writer(text).writerows(report_csv_rows(report))
    rows = list(csv.reader(io.StringIO(text.getvalue())))
    assert rows[0] == [
        "period_start", "period_end", "team", "label", "currency",
        "requests", "errors", "input_tokens", "cached_input_tokens", "output_tokens", "cost",
    ]  # fmt: skip
    start, end = "2025-03-01T00:00:00+00:00", "2025-03-02T00:00:00+00:00"
    assert rows[1:] == [
        [start, end, str(world.team_a1.id), "acme/agents", "USD", "1", "0", "10", "4", "3", "0.00000001"],
        [start, end, str(world.team_a2.id), "acme/research", "USD", "1", "1", "20", "0", "7", "12.34567891"],
        [start, end, "TOTAL", "Total", "USD", "2", "1", "30", "4", "10", "12.34567892"],
    ]


@pytest.mark.parametrize(
    ("viewer", "teams"),
    [
        ("team_admin_a1", {"team_a1"}),
        ("member_a1", {"team_a1"}),
        ("admin_a", {"team_a1", "team_a2"}),
        ("admin_b", {"team_b1"}),
    ],
)
def test_api_report_and_csv_show_only_the_viewers_scope(world, client_for, viewer, teams):
    for name in ("key_a1", "key_a2", "key_b1"):
        make_usage(getattr(world, name), f"iso-{name}", created_at=BASE)
    client = client_for(getattr(world, viewer))
    params = {"period": "month", "at": "2025-03-10", "group_by": "team"}
    body = client.get("/api/reports/usage/", params).json()
    assert {row["key"] for row in body["rows"]} == {str(getattr(world, t).id) for t in teams}
    assert body["totals"][0]["requests"] == len(teams)
    text = client.get("/api/reports/usage.csv", params).content.decode()
    ids = {line.split(",")[2] for line in text.splitlines()[1:-1]}
    assert ids == {str(getattr(world, t).id) for t in teams}
    # Asking for another tenant's team finds nothing rather than leaking it.
    other = world.team_b1 if "team_b1" not in teams else world.team_a1
    body = client.get("/api/reports/usage/", {**params, "team": other.id}).json()
    assert body["rows"] == [] and body["totals"] == []


def test_api_report_refuses_a_bad_period(world, client_for):
    client = client_for(world.operator)
    response = client.get("/api/reports/usage/", {"period": "custom", "since": "2025-03-02T00:00:00Z"})
    assert response.status_code == 400
    assert client.get("/api/reports/usage/", {"group_by": "colour"}).status_code == 400


def test_api_report_json_totals(world, client_for):
    make_usage(world.key_a1, "j1", created_at=BASE + timedelta(hours=1), cost=Decimal("1.5"))
    usage_rollup()
    make_usage(world.key_a1, "j2", created_at=BASE + timedelta(hours=2), cost=Decimal("0.25000001"))
    body = (
        client_for(world.operator)
        .get("/api/reports/usage/", {"period": "week", "at": "2025-03-01", "group_by": "model"})
        .json()
    )
    assert body["start"] == "2025-02-24T00:00:00Z"
    assert body["rows"] == [
        {
            "key": "tiny-qwen", "label": "tiny-qwen", "currency": "USD", "requests": 2, "errors": 0,
            "input_tokens": 2000, "cached_input_tokens": 1200, "output_tokens": 100, "cost": "1.75000001",
        }
    ]  # fmt: skip


def test_the_beat_task_rolls_up_and_is_scheduled(world):
    from inference_platform.celery import app
    from portal.tasks import rollup_usage

    make_usage(world.key_b1, "beat-1", created_at=BASE)
    assert rollup_usage() == 3  # the world's two records and this one
    assert rollup_usage() == 0
    assert "rollup-usage" in app.conf.beat_schedule
