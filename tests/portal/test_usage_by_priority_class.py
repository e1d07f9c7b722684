"""Usage by the priority class each request was served in: in the daily roll-ups, the reports API, its CSV and the
portal's reports page."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.test import Client

from tenants.billing import usage_rollup
from tenants.models import UsageDaily

from ..conftest import make_usage

BASE = datetime(2025, 3, 1, tzinfo=UTC)
MONTH = {"period": "month", "at": "2025-03-10"}


def _traffic(world) -> None:
    """Two days: the first rolled up, the second still in the ledger only."""
    for n, (cls, cost) in enumerate(
        [("batch", "0.5"), ("interactive", "0.25"), ("batch", "1"), ("", "0.125")]
    ):
        make_usage(
            world.key_a1,
            f"c{n}",
            created_at=BASE + timedelta(hours=n),
            priority_class=cls,
            cost=Decimal(cost),
        )
    usage_rollup()
    make_usage(world.key_a2, "late", created_at=BASE + timedelta(days=1), priority_class="standard")
    make_usage(world.key_b1, "other-tenant", created_at=BASE, priority_class="interactive")


def test_the_rollup_keeps_each_class_apart(world):
    _traffic(world)
    rows = UsageDaily.objects.filter(day=BASE.date(), team=world.team_a1).order_by("priority_class")
    assert [(r.priority_class, r.requests, r.cost) for r in rows] == [
        ("", 1, Decimal("0.125")),
        ("batch", 2, Decimal("1.5")),
        ("interactive", 1, Decimal("0.25")),
    ]


def test_the_api_reports_usage_by_class_in_the_order_classes_are_served(world, client_for):
    _traffic(world)
    body = (
        client_for(world.admin_a).get("/api/reports/usage/", {**MONTH, "group_by": "priority_class"}).json()
    )
    rows = [(r["key"], r["label"], r["requests"], r["cost"]) for r in body["rows"]]
    assert rows == [
        ("interactive", "Interactive", 1, "0.25000000"),
        ("standard", "Standard", 1, "0.00012000"),
        ("batch", "Batch", 2, "1.50000000"),
        ("", "(not recorded)", 1, "0.12500000"),
    ]  # tenant B's interactive request is not Acme's admin's to see
    assert body["totals"][0]["requests"] == 5


def test_the_api_filters_by_class(world, client_for):
    _traffic(world)
    query = {**MONTH, "group_by": "team", "priority_class": "batch"}
    body = client_for(world.operator).get("/api/reports/usage/", query).json()
    assert [(r["label"], r["requests"]) for r in body["rows"]] == [("acme/agents", 2)]
    refused = client_for(world.operator).get("/api/reports/usage/", {**query, "priority_class": "urgent"})
    assert refused.status_code == 400 and "priority_class" in refused.json()


def test_the_csv_has_a_row_per_class_with_exact_amounts(world, client_for):
    _traffic(world)
    text = client_for(world.admin_a).get("/api/reports/usage.csv", {**MONTH, "group_by": "priority_class"})
    rows = list(csv.reader(io.StringIO(text.content.decode())))
    assert rows[0][2] == "priority_class"
    assert [(r[2], r[3], r[5], r[-1]) for r in rows[1:]] == [
        ("interactive", "Interactive", "1", "0.25000000"),
        ("standard", "Standard", "1", "0.00012000"),
        ("batch", "Batch", "2", "1.50000000"),
        ("", "(not recorded)", "1", "0.12500000"),
        ("TOTAL", "Total", "5", "1.87512000"),
    ]


def test_the_reports_page_shows_usage_by_class_beside_any_grouping(world):
    _traffic(world)
    client = Client()
    client.force_login(world.admin_a)
    page = client.get("/portal/reports/", {**MONTH, "group_by": "team"}).content.decode()
    section = page.split('id="by-priority-class"')[1].split("</section>")[0]
    assert "<th>Priority class</th>" in section
    for label in ("Interactive", "Standard", "Batch", "(not recorded)"):
        assert f"<td>{label}</td>" in section
    assert "$1.50" in section
    # Grouped by class, the page's own table is the breakdown, and the CSV export follows the grouping.
    grouped = client.get("/portal/reports/", {**MONTH, "group_by": "priority_class"})
    assert grouped.context["form"].is_valid() and 'id="by-priority-class"' not in grouped.content.decode()
    assert "<td>Batch</td>" in grouped.content.decode()
    exported = client.get(
        "/portal/reports/export.csv", {**MONTH, "group_by": "priority_class"}
    ).content.decode()
    assert exported.splitlines()[0].split(",")[2] == "priority_class"
