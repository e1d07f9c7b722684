"""Commercial list prices say their age on the cost page, and are updated from a file by a management command."""

from __future__ import annotations

import json
from datetime import date, timedelta
from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from portal.models import CommercialPrice
from tenants.models import AuditLog

GPT = {
    "name": "OpenAI GPT-4.1",
    "input_per_mtok": 1.75,
    "cached_input_per_mtok": "0.4375",
    "output_per_mtok": 7,
    "currency": "USD",
    "as_of": "2026-11-30",
}


def _update(tmp_path, name: str, text: str, *args: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    out = StringIO()
    call_command("update_commercial_prices", str(path), *args, stdout=out)
    return out.getvalue()


def _prices() -> dict[str, tuple]:
    return {
        p.name: (p.input_per_mtok, p.cached_input_per_mtok, p.output_per_mtok, p.currency, p.as_of)
        for p in CommercialPrice.objects.all()
    }


def test_it_updates_and_adds_prices_from_json_and_audits_each(db, tmp_path):
    mistral = {**GPT, "name": "Mistral Medium 3", "input_per_mtok": "0.4", "currency": "EUR"}
    out = _update(tmp_path, "prices.json", json.dumps([GPT, mistral]))
    assert "Updated: OpenAI GPT-4.1" in out and "Added: Mistral Medium 3" in out
    prices = _prices()
    assert prices["OpenAI GPT-4.1"] == (
        Decimal("1.75"),
        Decimal("0.4375"),
        Decimal(7),
        "USD",
        date(2026, 11, 30),
    )
    assert prices["Mistral Medium 3"][0] == Decimal("0.4") and prices["Mistral Medium 3"][3] == "EUR"
    assert "Anthropic Claude Sonnet 4" in prices  # not in the file: left as it was
    [update] = AuditLog.objects.filter(action="commercial_price.update", source="system")
    assert update.actor_label == "update_commercial_prices"
    assert update.details["changes"]["as_of"] == ["2025-06-01", "2026-11-30"]
    assert AuditLog.objects.filter(action="commercial_price.create").count() == 1


def test_a_json_number_keeps_its_digits(db, tmp_path):
    _update(tmp_path, "prices.json", json.dumps([GPT]).replace("1.75", "1.123457"))
    assert _prices()["OpenAI GPT-4.1"][:3] == (Decimal("1.123457"), Decimal("0.4375"), Decimal(7))
    assert AuditLog.objects.filter(action="commercial_price.update", source="system").count() == 1
    # The same file again changes nothing and writes no audit row.
    out = _update(tmp_path, "prices.json", json.dumps([GPT]).replace("1.75", "1.123457"))
    assert out.strip() == "Unchanged: OpenAI GPT-4.1"
    assert AuditLog.objects.filter(action__startswith="commercial_price.").count() == 1


def test_it_reads_csv_with_a_day_and_a_currency_for_rows_without_them(db, tmp_path):
    text = (
        "name,input_per_mtok,cached_input_per_mtok,output_per_mtok,currency,as_of\n"
        "Anthropic Claude Sonnet 4.5,3,0.3,15,,\n"
        "Google Gemini 2.5 Pro,1.25,0.31,10,USD,2026-11-02\n"
    )
    _update(tmp_path, "prices.csv", text, "--as-of", "2026-12-01")
    prices = _prices()
    assert prices["Anthropic Claude Sonnet 4.5"] == (
        Decimal(3),
        Decimal("0.3"),
        Decimal(15),
        "USD",
        date(2026, 12, 1),
    )
    assert prices["Google Gemini 2.5 Pro"][4] == date(2026, 11, 2)
    assert AuditLog.objects.filter(action="commercial_price.create").count() == 2


@pytest.mark.parametrize(
    ("name", "text", "messages"),
    [
        ("prices.json", "[{", ["is not valid JSON"]),
        ("prices.json", '{"name": "x"}', ["must hold a JSON list of objects"]),
        ("prices.json", "[]", ["The file holds no prices"]),
        ("prices.txt", "name\n", ["give a .json or a .csv file"]),
        (
            "prices.json",
            json.dumps([{**GPT, "output_per_mtok": "-1"}, {**GPT, "name": "B", "as_of": "30/11/2026"}]),
            [
                "Nothing was changed",
                "row 1 (OpenAI GPT-4.1): output_per_mtok: Ensure this value is greater than or equal to 0.",
                "row 2 (B): as_of: Enter a valid date.",
            ],
        ),
        (
            "prices.json",
            json.dumps([{**GPT, "ouput_per_mtok": "1", "currency": "dollars"}]),
            ["unknown column 'ouput_per_mtok'", "currency: Use a three-letter ISO 4217 currency code"],
        ),
        ("prices.json", json.dumps([GPT, GPT]), ["row 2 (OpenAI GPT-4.1): 'OpenAI GPT-4.1' is given twice"]),
        (
            "prices.json",
            json.dumps([{**GPT, "input_per_mtok": "1.1234567"}]),
            ["input_per_mtok: Ensure that"],
        ),
        (
            "prices.csv",
            "name,input_per_mtok\nX,1\n",
            ["row 1 (X): cached_input_per_mtok: This field is required.", "as_of: This field is required."],
        ),
        ("prices.csv", "name,as_of\nX,2026-01-01,extra\n", ["a row has more cells than the header"]),
    ],
)
def test_bad_files_are_refused_whole_with_every_problem_named(db, tmp_path, name, text, messages):
    before = _prices()
    with pytest.raises(CommandError) as refused:
        _update(tmp_path, name, text)
    for message in messages:
        assert message in str(refused.value)
    assert _prices() == before
    assert not AuditLog.objects.filter(action__startswith="commercial_price.").exists()


def test_a_bad_as_of_option_is_refused(db, tmp_path):
    with pytest.raises(CommandError, match="give a day as YYYY-MM-DD"):
        _update(tmp_path, "prices.json", json.dumps([GPT]), "--as-of", "yesterday")


def test_the_cost_page_shows_each_prices_day_and_warns_when_older_than_90_days(world):
    today = timezone.now().date()
    CommercialPrice.objects.all().delete()
    for name, age in (("Fresh API", 90), ("Old API", 91)):
        CommercialPrice.objects.create(
            name=name,
            input_per_mtok=1,
            cached_input_per_mtok=Decimal("0.1"),
            output_per_mtok=4,
            as_of=today - timedelta(days=age),
        )
    client = Client()
    client.force_login(world.operator)
    page = client.get(f"/portal/deployments/{world.deployment.pk}/cost/").content.decode()
    fresh, old = (today - timedelta(days=90)).isoformat(), (today - timedelta(days=91)).isoformat()
    assert f"Fresh API (list price as of {fresh})" in page and f"Old API (list price as of {old})" in page
    assert 'id="stale-prices"' in page and "Old API" in page.split('id="stale-prices"')[1].split("</p>")[0]
    assert "Fresh API" not in page.split('id="stale-prices"')[1].split("</p>")[0]
    assert "manage.py update_commercial_prices" in page
    CommercialPrice.objects.filter(name="Old API").delete()
    assert (
        'id="stale-prices"'
        not in client.get(f"/portal/deployments/{world.deployment.pk}/cost/").content.decode()
    )
