"""Every portal page writes its figures for people (separators, units, currencies, shares, local times), while the
CSV exports and the API keep the exact values."""

from __future__ import annotations

import csv
import io
import re
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.test import Client
from django.utils import timezone

from ..conftest import make_usage

BIG = {
    "prompt_tokens": 45_602_087,
    "cached_prompt_tokens": 9_140_607,
    "output_tokens": 1_234_567,
    "cost": Decimal("9.70483930"),
}
DAY = datetime(2025, 3, 1, 12, tzinfo=UTC)
QUERY = {"period": "day", "at": "2025-03-01", "group_by": "team"}


def _signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_report_reads_for_people_and_the_csv_and_api_stay_exact(world, client_for):
    make_usage(world.key_a1, "big", created_at=DAY, deployment=world.deployment, **BIG)
    page = _signed_in(world.admin_a).get("/portal/reports/", QUERY).content.decode()
    row = page.split("<td>acme/agents</td>")[1].split("</tr>")[0]
    assert '<span title="45,602,087">45.6M</span>' in row
    assert '<span title="9,140,607">9.1M</span> <small class="muted">20.0%</small>' in row
    assert '<span title="1,234,567">1.2M</span>' in row
    assert '<span title="9.70483930 USD">$9.70</span>' in row
    assert (
        '<time datetime="2025-03-01T00:00:00Z" title="2025-03-01 00:00:00 UTC" data-local="minutes">' in page
    )

    exported = _signed_in(world.admin_a).get("/portal/reports/export.csv", QUERY).content.decode()
    api_csv = client_for(world.admin_a).get("/api/reports/usage.csv", QUERY).content.decode()
    for text in (exported, api_csv):
        [header, line, _total] = list(csv.reader(io.StringIO(text)))
        assert dict(zip(header, line, strict=True)) | {"period_start": "", "period_end": ""} == {
            "period_start": "",
            "period_end": "",
            "team": str(world.team_a1.pk),
            "label": "acme/agents",
            "currency": "USD",
            "requests": "1",
            "errors": "0",
            "input_tokens": "45602087",
            "cached_input_tokens": "9140607",
            "output_tokens": "1234567",
            "cost": "9.70483930",
        }
    [row] = client_for(world.admin_a).get("/api/reports/usage/", QUERY).json()["rows"]
    assert (row["input_tokens"], row["cached_input_tokens"], row["cost"]) == (45602087, 9140607, "9.70483930")
    record = client_for(world.admin_a).get("/api/usage/big/").json()
    assert (record["prompt_tokens"], record["cost"]) == (45602087, "9.70483930")


def test_times_on_the_team_page_are_for_the_viewers_timezone(world):
    key = world.key_a1.api_key
    key.last_used_at = datetime(2026, 11, 30, 8, 5, 9, tzinfo=UTC)
    key.save(update_fields=["last_used_at"])
    page = _signed_in(world.team_admin_a1).get(f"/portal/teams/{world.team_a1.pk}/").content.decode()
    assert (
        '<time datetime="2026-11-30T08:05:09Z" title="2026-11-30 08:05:09 UTC" data-local="minutes">'
        "2026-11-30 08:05 UTC</time>"
    ) in page
    assert '<script src="/static/portal/figures.js">' in page


# Visible text with a bare figure in it: five digits or more in a row (no separators), or six decimals or more.
RAW = re.compile(r"(?<![\w.,-])\d{5,}(?![\w])|\d\.\d{6,}")


def _visible_text(html: str) -> str:
    """The page's text as read, without markup or scripts (the charts are drawn in the browser from JSON)."""
    html = re.sub(r"<(script|svg)\b.*?</\1>", " ", html, flags=re.S)
    return re.sub(r"<[^>]+>", " ", html)


@pytest.mark.parametrize(
    "path",
    [
        "/portal/fleet/",
        "/portal/deployments/{deployment}/",
        "/portal/deployments/{deployment}/cost/",
        "/portal/live/",
        "/portal/teams/",
        "/portal/teams/{team}/",
        "/portal/reports/",
        "/portal/reports/?group_by=key",
        "/portal/reports/?group_by=priority_class",
    ],
)
def test_no_page_shows_a_bare_figure(world, path):
    """Large and exact figures everywhere the portal shows them: none is a bare integer or a long decimal."""
    world.quota_a1.token_budget = 250_000_000
    world.quota_a1.spend_budget = Decimal("12500.5")
    world.quota_a1.save()
    make_usage(world.key_a1, "big", created_at=timezone.now(), deployment=world.deployment, **BIG)
    url = path.format(deployment=world.deployment.pk, team=world.team_a1.pk)
    response = _signed_in(world.operator).get(url)
    assert response.status_code == 200
    text = _visible_text(response.content.decode())
    assert RAW.findall(text) == []
    assert "/static/portal/figures.js" in response.content.decode()
