"""Bad input gets a 4xx that says what to fix, never a 5xx; CSV exports cannot smuggle spreadsheet formulas."""

from __future__ import annotations

import csv
import io
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from tenants.models import ApiKey

from ..conftest import make_usage


@pytest.fixture
def signed_in():
    def make(user) -> Client:
        client = Client()
        client.force_login(user)
        return client

    return make


def test_the_portal_key_form_refuses_an_expiry_in_the_past(world, signed_in):
    past = (timezone.now() - timedelta(days=1)).strftime("%Y-%m-%d %H:%M:%S")
    response = signed_in(world.team_admin_a1).post(
        f"/portal/teams/{world.team_a1.pk}/keys/",
        {"name": "late agent", "scopes": ["inference"], "expires_at": past},
    )
    assert response.status_code == 400
    assert "Give a time in the future" in response.content.decode()
    assert not ApiKey.objects.filter(name="late agent").exists()


@pytest.mark.parametrize(
    "since",
    # Python accepts offsets up to 23:59, PostgreSQL only up to 15:59; both are valid ISO 8601.
    ["2026-01-01T00:00:00+23:59", "2026-01-01T00:00:00-20:00"],
)
def test_usage_since_with_a_large_utc_offset_is_read_in_utc(world, client_for, since):
    response = client_for(world.operator).get("/api/usage/", {"since": since})
    assert response.status_code == 200, response.content
    assert response.json()["count"] == 2  # both records are newer than 2026-01-01


@pytest.mark.parametrize(
    ("param", "value", "says"),
    [
        ("since", "2026-01-01T00:00:00+25:00", "Enter a valid date/time."),
        ("since", "0001-01-01T00:00:00+01:00", "out of range once converted to UTC"),
        ("until", "9999-12-31T23:59:59-01:00", "out of range once converted to UTC"),
    ],
)
def test_usage_since_out_of_range_is_a_400_that_says_why(world, client_for, param, value, says):
    response = client_for(world.operator).get("/api/usage/", {param: value})
    assert response.status_code == 400
    assert says in response.json()[param][0]


@pytest.mark.parametrize("period", ["month", "week"])
def test_a_report_period_past_the_calendar_is_a_400(world, client_for, period):
    response = client_for(world.operator).get("/api/reports/usage/", {"period": period, "at": "9999-12-31"})
    assert response.status_code == 400
    assert "beyond the years 1 to 9999" in response.json()["at"][0]


def test_the_portal_report_form_says_a_period_is_past_the_calendar(world, signed_in):
    page = signed_in(world.operator).get(
        "/portal/reports/", {"period": "month", "at": "9999-12-31", "group_by": "team"}
    )
    assert page.status_code == 200
    assert "beyond the years 1 to 9999" in page.content.decode()


FORMULAS = ['=HYPERLINK("http://x")', "+1+2", "-2+3", "@SUM(A1:A9)"]


@pytest.fixture
def formula_models(world):
    """Usage under model names that a spreadsheet would run as formulas (served model names are free text)."""
    for n, model in enumerate(FORMULAS):
        make_usage(world.key_a1, f"req-formula-{n}", model=model)


def _cells(text: str) -> list[str]:
    return [cell for row in csv.reader(io.StringIO(text)) for cell in row]


def test_csv_exports_write_formula_like_cells_as_text(world, client_for, signed_in, formula_models):
    query = {"group_by": "model", "period": "month"}
    api = client_for(world.admin_a).get("/api/reports/usage.csv", query)
    portal = signed_in(world.admin_a).get("/portal/reports/export.csv", query)
    for response in (api, portal):
        assert response.status_code == 200
        cells = _cells(response.content.decode())
        assert not [c for c in cells if c[:1] in ("=", "+", "-", "@")], cells
        for model in FORMULAS:
            assert "'" + model in cells


def test_a_value_of_the_wrong_json_type_is_refused_with_the_type_wanted(world, client_for):
    """The schema promises types; DRF alone would take 0 as the name "0", "5" as 5 and "yes" as true."""
    client = client_for(world.operator)
    for body, field, wanted in (
        ({"name": 0, "slug": "zero"}, "name", "a string"),
        ({"name": "Acme 2", "slug": "acme-2", "is_active": "yes"}, "is_active", "true or false"),
    ):
        response = client.post("/api/tenants/", body, format="json")
        assert response.status_code == 400, response.json()
        assert response.json()[field] == [
            f"Must be {wanted}, not {type(body[field]).__name__}: {body[field]!r}."
        ]
    quota = client.post(
        "/api/quotas/", {"team": world.team_a1.pk, "requests_per_minute": "60"}, format="json"
    )
    assert quota.status_code == 400 and quota.json()["requests_per_minute"][0].startswith(
        "Must be an integer"
    )
    assert client.post("/api/auth/token/", {"username": 7, "password": "x"}, format="json").status_code == 400
