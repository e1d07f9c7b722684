"""Figures as people read them on the portal's pages: thousands separators, units (45.6M tokens, $9.70),
percentages with one decimal, times in the viewer's timezone with UTC on hover. What scripts draw (the live page's
figures, durations such as 1.2 s) is written the same way by static/portal/figures.js.

Pages only: CSV exports and the API keep exact values. Where a page rounds a figure, the exact one is on hover (a
title). The browser turns each `<time data-local>` into the viewer's own time (static/portal/figures.js); without
script it stays in UTC, as its text says.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

from django import template
from django.utils.html import format_html

register = template.Library()

NONE = "–"
# Amounts in these currencies are written with the symbol before them; any other with its code after them.
SYMBOLS = {"USD": "$", "EUR": "€", "GBP": "£"}
SUFFIXES = (
    (Decimal(10) ** 12, "T"),
    (Decimal(10) ** 9, "B"),
    (Decimal(10) ** 6, "M"),
    (Decimal(10) ** 3, "K"),
)
CENT = Decimal("0.01")


def _decimal(value) -> Decimal | None:
    if value is None or value == "" or isinstance(value, bool):
        return None
    try:
        number = Decimal(str(value))
    except (InvalidOperation, ValueError, TypeError):
        return None
    return number if number.is_finite() else None


def _exact(number: Decimal) -> str:
    """Every digit, with separators and no exponent: 45,602,087 or 9.70483930."""
    return f"{number:,f}"


def _rounded(shown: str, exact: str):
    """`shown`, with the exact figure on hover."""
    return format_html('<span title="{}">{}</span>', exact, shown)


@register.filter
def count(value) -> str:
    """A whole number with thousands separators: 45602087 -> 45,602,087."""
    number = _decimal(value)
    return NONE if number is None else f"{number.to_integral_value(ROUND_HALF_UP):,f}"


@register.filter
def number(value, places: int = 1) -> str:
    """A number with separators and `places` decimals: 1234.5678 -> 1,234.6; the exact one on hover."""
    number = _decimal(value)
    if number is None:
        return NONE
    shown = number.quantize(Decimal(1).scaleb(-int(places)), ROUND_HALF_UP)
    return f"{shown:,f}" if shown == number else _rounded(f"{shown:,f}", _exact(number))


def _three_figures(number: Decimal) -> Decimal:
    tenths = number.quantize(Decimal("0.1"), ROUND_HALF_UP)
    return tenths if abs(tenths) < 100 else number.quantize(Decimal(1), ROUND_HALF_UP)


@register.filter
def compact(value) -> str:
    """A large count in three figures or so, with K, M, B or T: 45602087 -> 45.6M; below 10,000 in full. The
    exact count on hover."""
    number = _decimal(value)
    if number is None:
        return NONE
    exact = count(number)
    if abs(number) < 10_000:
        return exact
    for i, (size, suffix) in enumerate(SUFFIXES):
        if abs(number) >= size:
            scaled = _three_figures(number / size)
            if abs(scaled) >= 1000 and i > 0:  # 999,950 reads 1.0M, not 1000K
                size, suffix = SUFFIXES[i - 1]
                scaled = _three_figures(number / size)
            return _rounded(f"{scaled:f}{suffix}", exact)
    return exact


@register.filter
def money(value, currency: str = "USD") -> str:
    """An amount in its currency: $9.70, €0.40, 12.00 CHF; below a cent, two significant digits ($0.00012), so
    that nothing spent reads as zero. The exact amount on hover."""
    amount = _decimal(value)
    if amount is None:
        return NONE
    currency = (currency or "").upper()
    if amount == 0 or abs(amount) >= CENT:
        shown = amount.quantize(CENT, ROUND_HALF_UP)
    else:
        shown = amount.quantize(Decimal(1).scaleb(amount.adjusted() - 1), ROUND_HALF_UP)
    digits = f"{abs(shown):,f}"
    sign = "-" if shown < 0 else ""
    symbol = SYMBOLS.get(currency)
    text = f"{sign}{symbol}{digits}" if symbol else f"{sign}{digits} {currency}".rstrip()
    return _rounded(text, f"{_exact(amount)} {currency}".rstrip()) if shown != amount else text


_FRACTION = object()  # `percent` given no whole: the value is a fraction already


@register.filter
def percent(value, whole=_FRACTION) -> str:
    """A share with one decimal: 0.379 -> 37.9%; or `value` as a share of `whole`: 7040|percent:18560 -> 37.9%."""
    part = _decimal(value)
    if part is None:
        return NONE
    if whole is not _FRACTION:
        total = _decimal(whole)
        if not total:
            return NONE
        part = part / total
    return f"{(part * 100).quantize(Decimal('0.1'), ROUND_HALF_UP):,f}%"


@register.filter
def when(value, precision: str = "minutes") -> str:
    """An instant for the viewer's timezone: a <time> in UTC (with seconds on hover) that the browser rewrites
    in local time. `precision`: minutes or seconds."""
    if not isinstance(value, datetime):
        return ""
    at = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    shown = "%Y-%m-%d %H:%M:%S" if precision == "seconds" else "%Y-%m-%d %H:%M"
    return format_html(
        '<time datetime="{}" title="{} UTC" data-local="{}">{} UTC</time>',
        at.isoformat().replace("+00:00", "Z"),
        at.strftime("%Y-%m-%d %H:%M:%S"),
        precision,
        at.strftime(shown),
    )
