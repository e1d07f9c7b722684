"""The portal's figure filters: how a number, an amount, a share or a time reads on a page."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from portal.templatetags.figures import compact, count, money, number, percent, when

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (45602087, "45,602,087"),
        (Decimal("9140607"), "9,140,607"),
        (0, "0"),
        (999, "999"),
        (None, "–"),
        ("", "–"),
    ],
)
def test_counts_have_thousands_separators(value, shown):
    assert count(value) == shown


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (9_999, "9,999"),
        (45_602_087, '<span title="45,602,087">45.6M</span>'),
        (123_456_789, '<span title="123,456,789">123M</span>'),
        (99_950, '<span title="99,950">100K</span>'),
        (999_950, '<span title="999,950">1.0M</span>'),  # not 1000K
        (2_500_000_000, '<span title="2,500,000,000">2.5B</span>'),
    ],
)
def test_large_counts_read_in_three_figures_with_the_exact_count_on_hover(value, shown):
    assert compact(value) == shown


@pytest.mark.parametrize(
    ("amount", "currency", "shown"),
    [
        (Decimal("9.70483930"), "USD", '<span title="9.70483930 USD">$9.70</span>'),
        (Decimal("9.70"), "USD", "$9.70"),
        (Decimal("1234567.5"), "EUR", "€1,234,567.50"),
        (Decimal("12"), "CHF", "12.00 CHF"),
        (Decimal("0.00012"), "USD", "$0.00012"),  # below a cent: never reads as nothing
        (Decimal("0.000123456"), "GBP", '<span title="0.000123456 GBP">£0.00012</span>'),
        (Decimal("-3.456"), "USD", '<span title="-3.456 USD">-$3.46</span>'),
        (0, "USD", "$0.00"),
        (None, "USD", "–"),
    ],
)
def test_amounts_read_in_their_currency(amount, currency, shown):
    assert money(amount, currency) == shown


def test_shares_have_one_decimal():
    assert percent(0.37931) == "37.9%"
    assert percent(7040, 18560) == "37.9%"
    assert percent(Decimal(1)) == "100.0%"
    assert percent(5, 0) == percent(5, None) == percent(None) == "–"


def test_numbers_keep_the_places_asked_for_and_the_exact_value_on_hover():
    assert number(Decimal("720.5"), 1) == "720.5"
    assert number(Decimal("1234.56"), 1) == '<span title="1,234.56">1,234.6</span>'
    assert number(30, 2) == "30.00"


def test_times_are_utc_for_the_browser_to_show_in_the_viewers_timezone():
    at = datetime(2026, 12, 4, 14, 12, 32, tzinfo=timezone(timedelta(hours=1)))
    assert when(at) == (
        '<time datetime="2026-12-04T13:12:32Z" title="2026-12-04 13:12:32 UTC" data-local="minutes">'
        "2026-12-04 13:12 UTC</time>"
    )
    assert ">2026-12-04 13:12:32 UTC</time>" in when(at.astimezone(UTC), "seconds")
    assert when(None) == ""
