"""Commercial list prices from a file (JSON or CSV): read, check every row, then write them all or none.

A file holds one price per row, with the model's columns: name, input_per_mtok, cached_input_per_mtok,
output_per_mtok, currency (default USD) and as_of (the day the price was read; `--as-of` gives it to rows without
one). A name already known updates that price; a new name adds one; prices not in the file are left as they are.
JSON is a list of objects; CSV has a header row. Amounts keep every digit written (JSON numbers are read as
decimals, not floats).
"""

from __future__ import annotations

import copy
import csv
import json
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from pathlib import Path

from django import forms
from django.db import transaction

from tenants.audit import audited
from tenants.models import currency_validator

from .models import CommercialPrice

COLUMNS = ("name", "input_per_mtok", "cached_input_per_mtok", "output_per_mtok", "currency", "as_of")
# The audit trail's name for who changed the prices.
ACTOR = "update_commercial_prices"


class PriceFileError(ValueError):
    """The file cannot be used; the message says every problem found, by row."""


class CommercialPriceForm(forms.ModelForm):
    currency = forms.CharField(max_length=3, validators=[currency_validator])

    class Meta:
        model = CommercialPrice
        fields = list(COLUMNS)


@dataclass
class Loaded:
    added: list[str]
    updated: list[str]
    unchanged: list[str]


def price_rows_read(path: Path) -> list[dict]:
    """The file's rows as dicts of text (CSV) or JSON values, by its extension (.json or .csv)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise PriceFileError(f"Cannot read {path}: {exc}") from None
    if path.suffix.lower() == ".json":
        try:
            rows = json.loads(text, parse_float=Decimal)
        except json.JSONDecodeError as exc:
            raise PriceFileError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise PriceFileError(f"{path} must hold a JSON list of objects, one per price.")
        return rows
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(text.splitlines())
        rows = list(reader)
        if any(None in row for row in rows):  # a line with more cells than the header has names
            raise PriceFileError(f"{path}: a row has more cells than the header has columns.")
        return rows
    raise PriceFileError(f"{path}: give a .json or a .csv file.")


def _row_errors(row: dict, form: CommercialPriceForm) -> list[str]:
    unknown = sorted(set(row) - set(COLUMNS))
    errors = [f"unknown column {name!r} (the columns are {', '.join(COLUMNS)})" for name in unknown]
    if not form.is_valid():
        errors += [f"{field}: {' '.join(messages)}" for field, messages in form.errors.items()]
    return errors


def commercial_prices_load(*, rows: list[dict], as_of: date | None = None) -> Loaded:
    """Check every row, then add or update them all in one transaction (each change audited), or raise
    PriceFileError naming every bad row and change nothing."""
    if not rows:
        raise PriceFileError("The file holds no prices.")
    known = {price.name: price for price in CommercialPrice.objects.all()}
    checked, problems, seen = [], [], set()
    for number, row in enumerate(rows, start=1):
        data = {name: "" if value is None else str(value) for name, value in row.items()}
        data["currency"] = data.get("currency") or "USD"
        if not data.get("as_of") and as_of is not None:
            data["as_of"] = as_of.isoformat()
        name = data.get("name", "").strip()
        # A copy: the form writes the new values into its instance, and the audit compares them with the old.
        form = CommercialPriceForm(data=data, instance=copy.copy(known[name]) if name in known else None)
        errors = _row_errors(row, form)
        if name in seen:
            errors.append(f"{name!r} is given twice")
        seen.add(name)
        if errors:
            problems.append(f"row {number}{f' ({name})' if name else ''}: " + "; ".join(errors))
        checked.append(form)
    if problems:
        raise PriceFileError("Nothing was changed:\n" + "\n".join(problems))
    loaded = Loaded([], [], [])
    with transaction.atomic():
        for form in checked:
            name = form.cleaned_data["name"]
            if name in known and not form.has_changed():
                loaded.unchanged.append(name)
                continue
            with audited("commercial_price", known.get(name), actor=ACTOR, source="system") as change:
                change.instance = form.save()
            (loaded.updated if name in known else loaded.added).append(name)
    return loaded
