"""Billing reports: usage and cost for any period, grouped by tenant, team, key, model, deployment, priority class
or day.

A report reads the daily roll-ups (UsageDaily) for whole UTC days and the ledger (UsageRecord) for the rest:
the partial days at either end of the period, and records the roll-up has not reached yet (ids above its
watermark). Both parts are one SQL statement (UNION ALL), so they come from one snapshot and a roll-up that
commits meanwhile can neither be missed nor counted twice. Totals therefore equal the ledger's sums exactly.

Money is Decimal throughout: PostgreSQL sums `numeric` exactly and Python adds the two parts exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import Context, Decimal

from django.db import connection, transaction
from django.db.models import Count, F, Q, QuerySet, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from .access import Access
from .models import (
    PRIORITY_RANK,
    ApiKey,
    PriorityClass,
    Team,
    Tenant,
    UsageDaily,
    UsageRecord,
    UsageRollupState,
    UsageStatus,
)
from .periods import period_bounds
from .pricing import COST_QUANTUM
from .usage_series import usage_series_add, usage_series_clear

GROUPS = ("tenant", "team", "key", "model", "deployment", "priority_class", "day")
PERIODS = ("day", "week", "month", "custom")
_EXACT = Context(prec=60)
# Records rolled up per transaction: keeps the table lock that makes the watermark safe short.
ROLLUP_BATCH = 1_000_000


@dataclass(frozen=True)
class Period:
    start: datetime
    end: datetime

    @property
    def label(self) -> str:
        last = self.end - timedelta(microseconds=1)
        if self.end - self.start == timedelta(days=1) and self.start.time() == time(0):
            return f"{self.start:%Y-%m-%d}"
        return f"{self.start:%Y-%m-%d %H:%M} to {self.end:%Y-%m-%d %H:%M} UTC ({last:%Y-%m-%d} inclusive)"


class PeriodError(ValueError):
    pass


def period_parse(
    *, period: str, at: date | None = None, since: datetime | None = None, until: datetime | None = None
) -> Period:
    """The [start, end) in UTC of a day, ISO week or calendar month holding `at` (default today), or a
    custom range from `since` to `until`."""
    if period == "custom":
        if since is None or until is None:
            raise PeriodError("A custom period needs both since and until.")
        start, end = _utc(since), _utc(until)
        if end <= start:
            raise PeriodError("until must be after since.")
        return Period(start, end)
    if period not in PERIODS:
        raise PeriodError(f"Unknown period {period!r}: use day, week, month or custom.")
    day = at or datetime.now(UTC).date()
    start, end = period_bounds(period, datetime.combine(day, time(0), tzinfo=UTC))
    return Period(start, end)


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


@dataclass
class ReportRow:
    key: object
    label: str
    currency: str
    requests: int = 0
    errors: int = 0
    input_tokens: int = 0  # all prompt tokens, cached ones included (as in the ledger)
    cached_input_tokens: int = 0
    output_tokens: int = 0
    cost: Decimal = field(default_factory=lambda: Decimal("0"))

    def add(self, requests, errors, input_tokens, cached, output_tokens, cost) -> None:
        self.requests += int(requests or 0)
        self.errors += int(errors or 0)
        self.input_tokens += int(input_tokens or 0)
        self.cached_input_tokens += int(cached or 0)
        self.output_tokens += int(output_tokens or 0)
        self.cost = _EXACT.add(self.cost, Decimal(cost or 0))


@dataclass
class Report:
    period: Period
    group_by: str
    rows: list[ReportRow]
    totals: list[ReportRow]  # one per currency

    @property
    def group_label(self) -> str:
        return group_label(self.group_by)


def group_label(group_by: str) -> str:
    """A grouping as people read it: "Team", "Priority class"."""
    return group_by.replace("_", " ").capitalize()


METRICS = ("requests", "errors", "input_tokens", "cached_input_tokens", "output_tokens", "cost")


def usage_report(
    *,
    access: Access,
    period: Period,
    group_by: str,
    tenant_id: int | None = None,
    team_id: int | None = None,
    api_key_id: int | None = None,
    model: str | None = None,
    priority_class: str | None = None,
) -> Report:
    """Usage and cost in `period` that `access` may see, one row per group and currency."""
    if group_by not in GROUPS:
        raise ValueError(f"Unknown grouping {group_by!r}: use one of {', '.join(GROUPS)}.")
    filters = {
        name: value
        for name, value in (
            ("tenant_id", tenant_id),
            ("team_id", team_id),
            ("api_key_id", api_key_id),
            ("model", model),
            ("priority_class", priority_class),
        )
        if value not in (None, "")
    }
    merged: dict[tuple, ReportRow] = {}
    for key, currency, *values in _read_consistently(access, period, filters, group_by):
        if isinstance(key, datetime):
            key = key.date()
        row = merged.setdefault((key, currency), ReportRow(key=key, label="", currency=currency))
        row.add(*values)
    rows = sorted(merged.values(), key=lambda r: (r.currency, _sort_key(r.key, group_by)))
    _label(rows, group_by)
    totals: dict[str, ReportRow] = {}
    for row in rows:
        total = totals.setdefault(row.currency, ReportRow(key=None, label="Total", currency=row.currency))
        total.add(*(getattr(row, m) for m in METRICS))
    return Report(period=period, group_by=group_by, rows=rows, totals=list(totals.values()))


def _sort_key(key, group_by: str) -> tuple:
    if group_by == "priority_class":  # in the order they are served, then requests metered before classes
        return (key not in PRIORITY_RANK, PRIORITY_RANK.get(key, 0))
    return (key is None, str(key) if not isinstance(key, int) else f"{key:020d}")


def _day_ceil(at: datetime) -> datetime:
    day = at.replace(hour=0, minute=0, second=0, microsecond=0)
    return day if day == at else day + timedelta(days=1)


def _rollup_version() -> tuple:
    return tuple(
        UsageRollupState.objects.filter(pk=1).values_list("last_record_id", "updated_at").first() or (0, None)
    )


def _read_consistently(access: Access, period: Period, filters: dict, group_by: str) -> list[tuple]:
    """Both parts in one statement, under a watermark no roll-up moved meanwhile.

    The watermark goes into the statement as a number, so PostgreSQL reads the records above it through the
    primary key instead of scanning the month. A roll-up commits its daily rows and its new watermark (and
    time) together, so if the state is the same before and after the statement, the statement saw daily rows
    that hold exactly the records up to that watermark. Otherwise it is read again.
    """
    while True:
        before = _rollup_version()
        daily, records = _parts(access, period, filters, group_by, watermark=before[0])
        rows = list(daily.union(*records, all=True))
        if _rollup_version() == before:
            return rows


def _parts(
    access: Access, period: Period, filters: dict, group_by: str, *, watermark: int
) -> tuple[QuerySet, list[QuerySet]]:
    """The roll-up part and the ledger parts of a report, each grouped by (group, currency)."""
    first_whole, end_whole = (
        _day_ceil(period.start),
        period.end.replace(hour=0, minute=0, second=0, microsecond=0),
    )
    records = access.usage_qs().order_by().filter(**filters)
    daily = access.usage_daily_qs().order_by().filter(**filters)
    if first_whole < end_whole:
        daily = daily.filter(day__gte=first_whole.date(), day__lt=end_whole.date())
        # Each part its own SELECT, so each can use its index: records the roll-up has not reached yet
        # (by primary key), and the partial days at either end (by time).
        ranges = [
            records.filter(id__gt=watermark, created_at__gte=first_whole, created_at__lt=end_whole),
            records.filter(created_at__gte=period.start, created_at__lt=first_whole),
            records.filter(created_at__gte=end_whole, created_at__lt=period.end),
        ]
    else:
        daily = daily.none()
        ranges = [records.filter(created_at__gte=period.start, created_at__lt=period.end)]
    daily = (
        daily.annotate(k=_group_expr(group_by, daily=True), cur=F("currency"))
        .values("k", "cur")
        .annotate(
            n=Sum("requests"),
            e=Sum("errors"),
            i=Sum("prompt_tokens"),
            c=Sum("cached_prompt_tokens"),
            o=Sum("output_tokens"),
            m=Sum("cost"),
        )
        .values_list("k", "cur", "n", "e", "i", "c", "o", "m")
    )
    return daily, [_ledger_sums(part, group_by) for part in ranges]


def _ledger_sums(records: QuerySet, group_by: str) -> QuerySet:
    return (
        records.annotate(k=_group_expr(group_by, daily=False), cur=F("currency"))
        .values("k", "cur")
        .annotate(
            n=Count("id"),
            e=Count("id", filter=~Q(status=UsageStatus.COMPLETED)),
            i=Sum("prompt_tokens"),
            c=Sum("cached_prompt_tokens"),
            o=Sum("output_tokens"),
            m=Sum("cost"),
        )
        .values_list("k", "cur", "n", "e", "i", "c", "o", "m")
    )


def _group_expr(group_by: str, *, daily: bool):
    if group_by == "day":
        return F("day") if daily else TruncDate("created_at", tzinfo=UTC)
    if group_by in ("model", "priority_class"):
        return F(group_by)
    column = {"tenant": "tenant_id", "team": "team_id", "key": "api_key_id", "deployment": "deployment_id"}
    return F(column[group_by])


def _label(rows: list[ReportRow], group_by: str) -> None:
    ids = [row.key for row in rows if row.key is not None]
    if group_by == "tenant":
        names = {t.id: t.slug for t in Tenant.objects.filter(id__in=ids)}
    elif group_by == "team":
        names = {t.id: str(t) for t in Team.objects.select_related("tenant").filter(id__in=ids)}
    elif group_by == "key":
        names = {
            k.id: f"{k.team} · {k.name} ({k.prefix})"
            for k in ApiKey.objects.filter(id__in=ids).select_related("team__tenant")
        }
    elif group_by == "deployment":
        from serving.models import ModelDeployment

        names = {d.id: d.name for d in ModelDeployment.objects.filter(id__in=ids)}
    elif group_by == "priority_class":
        names = {**dict(PriorityClass.choices), "": "(not recorded)"}
    else:
        names = {}
    for row in rows:
        if row.key is None:
            row.label = "(deleted deployment or none)" if group_by == "deployment" else "(none)"
        else:
            row.label = names.get(row.key, str(row.key))


def report_csv_rows(report: Report) -> Iterable[list[str]]:
    """The report as CSV rows: a header, one row per group and currency, then one total per currency."""
    yield ["period_start", "period_end", report.group_by, "label", "currency", *METRICS]
    start, end = report.period.start.isoformat(), report.period.end.isoformat()
    for row in [*report.rows, *report.totals]:
        key = (
            "TOTAL" if row.key is None and row.label == "Total" else ("" if row.key is None else str(row.key))
        )
        values = [str(getattr(row, m)) for m in METRICS[:-1]] + [money_text(row.cost)]
        yield [start, end, key, row.label, row.currency, *values]


def money_text(amount: Decimal) -> str:
    """An amount at the ledger's precision in plain notation: 0.00000001, never 1E-8."""
    return format(amount.quantize(COST_QUANTUM), "f")


# Roll-ups ---------------------------------------------------------------------------------------------

_ROLLUP_SQL = f"""
INSERT INTO {UsageDaily._meta.db_table} (day, tenant_id, team_id, api_key_id, deployment_id, model, priority_class,
                     currency, requests, errors, prompt_tokens, cached_prompt_tokens, output_tokens, cost)
SELECT (created_at AT TIME ZONE 'UTC')::date, tenant_id, team_id, api_key_id, deployment_id, model, priority_class,
       currency, count(*), count(*) FILTER (WHERE status <> %s), sum(prompt_tokens), sum(cached_prompt_tokens),
       sum(output_tokens), sum(cost)
FROM {UsageRecord._meta.db_table}
WHERE id > %s AND id <= %s
GROUP BY 1, 2, 3, 4, 5, 6, 7, 8
ON CONFLICT ON CONSTRAINT usage_daily_one_row_per_group DO UPDATE SET
    requests = {UsageDaily._meta.db_table}.requests + EXCLUDED.requests,
    errors = {UsageDaily._meta.db_table}.errors + EXCLUDED.errors,
    prompt_tokens = {UsageDaily._meta.db_table}.prompt_tokens + EXCLUDED.prompt_tokens,
    cached_prompt_tokens = {UsageDaily._meta.db_table}.cached_prompt_tokens + EXCLUDED.cached_prompt_tokens,
    output_tokens = {UsageDaily._meta.db_table}.output_tokens + EXCLUDED.output_tokens,
    cost = {UsageDaily._meta.db_table}.cost + EXCLUDED.cost
"""


def usage_rollup(*, batch: int = ROLLUP_BATCH) -> int:
    """Add every ledger record above the watermark to the daily rows, exactly once; return how many.

    The ledger's ids come from a sequence, so a record with a smaller id can commit after one with a larger
    id. A SHARE lock on the ledger waits for every writer in flight and holds new ones back until the batch
    commits, so every id up to the maximum read under it is committed and none can appear later.
    """
    total = 0
    while True:
        with transaction.atomic():
            state = UsageRollupState.objects.select_for_update().filter(pk=1).first()
            if state is None:
                state = UsageRollupState.objects.create(pk=1)
            with connection.cursor() as cursor:
                cursor.execute(f"LOCK TABLE {UsageRecord._meta.db_table} IN SHARE MODE")
                cursor.execute(
                    f"SELECT coalesce(max(id), 0) FROM {UsageRecord._meta.db_table} WHERE id > %s",
                    [state.last_record_id],
                )
                newest = cursor.fetchone()[0]
                if newest <= state.last_record_id:
                    return total
                upto = min(newest, state.last_record_id + batch)
                cursor.execute(_ROLLUP_SQL, [UsageStatus.COMPLETED, state.last_record_id, upto])
                # The same records to the minute and hour series the portal charts, under the same watermark.
                usage_series_add(cursor, after_id=state.last_record_id, upto_id=upto)
                cursor.execute(
                    f"SELECT count(*) FROM {UsageRecord._meta.db_table} WHERE id > %s AND id <= %s",
                    [state.last_record_id, upto],
                )
                total += cursor.fetchone()[0]
            # The time as well: reports compare (watermark, time) to see that no roll-up ran under them.
            UsageRollupState.objects.filter(pk=1).update(last_record_id=upto, updated_at=timezone.now())
        if upto == newest:
            return total


def usage_rollup_rebuild() -> int:
    """Throw the daily rows and the series away and roll the whole ledger up again (after a manual correction)."""
    with transaction.atomic():
        UsageDaily.objects.all().delete()
        usage_series_clear()
        UsageRollupState.objects.update_or_create(
            pk=1, defaults={"last_record_id": 0, "updated_at": timezone.now()}
        )
    return usage_rollup()


__all__ = [
    "GROUPS",
    "METRICS",
    "PERIODS",
    "Period",
    "PeriodError",
    "Report",
    "ReportRow",
    "group_label",
    "period_parse",
    "money_text",
    "report_csv_rows",
    "usage_report",
    "usage_rollup",
    "usage_rollup_rebuild",
]
