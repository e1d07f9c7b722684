"""`python manage.py export_trace --deployment NAME --since T [--until T] [--out FILE]`: a period of the recorded
traffic trace (routing/metering/traffic_trace.py) as Mooncake-style JSON lines, which `python -m planner --trace FILE`
replays. See docs/planner.md#traces-of-our-own-traffic."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime

from django.core.management.base import BaseCommand, CommandError
from django.utils.dateparse import parse_date, parse_datetime

from routing.metering.traffic_trace import export_rows
from serving.models import ModelDeployment


def moment(text: str) -> datetime:
    """An ISO 8601 time (UTC unless it says otherwise) or a date (its midnight, UTC)."""
    at = parse_datetime(text)
    if at is None:
        day = parse_date(text)
        if day is None:
            raise CommandError(f"not an ISO 8601 time or date: {text!r}")
        at = datetime(day.year, day.month, day.day)
    return at if at.tzinfo else at.replace(tzinfo=UTC)


class Command(BaseCommand):
    help = "Write a period of the recorded traffic trace as Mooncake-style JSON lines."

    def add_arguments(self, parser):
        parser.add_argument("--deployment", required=True, help="the deployment's name (or id)")
        parser.add_argument("--since", required=True, type=moment, help="ISO 8601 time or date, inclusive")
        parser.add_argument("--until", type=moment, help="ISO 8601 time or date, exclusive (default: now)")
        parser.add_argument("--out", help="the file to write (default: standard output)")
        parser.add_argument(
            "--block-tokens",
            type=int,
            default=512,
            help="prompt tokens per hash id (default 512, the planner's); a multiple of the deployment's block size",
        )

    def handle(self, *args, deployment, since, until, out, block_tokens, **options):
        found = ModelDeployment.objects.filter(name=deployment).values_list("id", flat=True).first()
        if found is None and deployment.isdigit():
            found = int(deployment)  # a deployment since deleted: its entries are kept by id
        if found is None:
            raise CommandError(f"no deployment named {deployment!r}")
        until = until or datetime.now(UTC)
        if block_tokens < 1:
            raise CommandError("--block-tokens must be at least 1")
        target = open(out, "w", encoding="utf-8") if out else sys.stdout
        count = 0
        try:
            for row in export_rows(deployment_id=found, since=since, until=until, block_tokens=block_tokens):
                target.write(json.dumps(row, separators=(",", ":")) + "\n")
                count += 1
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        finally:
            if out:
                target.close()
        self.stderr.write(f"{count} requests from {since.isoformat()} to {until.isoformat()}")
