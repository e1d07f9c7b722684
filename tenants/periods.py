"""Budget and billing periods, in UTC."""

from datetime import UTC, datetime, timedelta


def period_bounds(period: str, at: datetime) -> tuple[datetime, datetime]:
    """The [start, end) of the day, ISO week (from Monday) or calendar month that holds `at`."""
    at = at.astimezone(UTC)
    day = at.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day, day + timedelta(days=1)
    if period == "week":
        start = day - timedelta(days=day.weekday())
        return start, start + timedelta(days=7)
    if period == "month":
        start = day.replace(day=1)
        end = (
            start.replace(year=start.year + 1, month=1)
            if start.month == 12
            else start.replace(month=start.month + 1)
        )
        return start, end
    raise ValueError(f"unknown period {period!r}: use day, week or month")
