"""Update the commercial list prices shown beside cost to serve from a JSON or CSV file (portal/prices.py)."""

from __future__ import annotations

from datetime import date
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.prices import COLUMNS, PriceFileError, commercial_prices_load, price_rows_read


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise CommandError(f"--as-of {text!r}: give a day as YYYY-MM-DD.") from None


class Command(BaseCommand):
    help = (
        "Add or update commercial list prices (per million tokens) from a .json file (a list of objects) or a .csv "
        f"file (a header row), with the columns {', '.join(COLUMNS)}. Every row is checked first: one bad row "
        "and nothing is changed."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", type=Path)
        parser.add_argument(
            "--as-of", help="The day the prices were read (YYYY-MM-DD), for rows without as_of."
        )

    def handle(self, *args, file: Path, as_of: str | None, **options) -> None:
        try:
            rows = price_rows_read(file)
            loaded = commercial_prices_load(rows=rows, as_of=_day(as_of) if as_of else None)
        except PriceFileError as exc:
            raise CommandError(str(exc)) from None
        for verb, names in (
            ("Added", loaded.added),
            ("Updated", loaded.updated),
            ("Unchanged", loaded.unchanged),
        ):
            if names:
                self.stdout.write(f"{verb}: {', '.join(names)}")
