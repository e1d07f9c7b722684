"""Billing roll-ups: a month's report over 10 million usage records, with and without the daily rows.

Fills a month (March 2025) with N records in one set-based INSERT per million (indexes built afterwards, as a
bulk load would), rolls them up, adds fresh records the roll-up has not reached yet, then times
`usage_report` for the month by tenant, team, key, model and day, and compares with the ledger scanned
directly. Every report's totals are checked against the ledger's sums.

    .venv/bin/python -m bench.rollups [--records 10000000]   (runs under its own embedded PostgreSQL)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import UTC, date, datetime

from bench import harness as h

MONTH = date(2025, 3, 1)
FRESH = 20_000  # records newer than the last roll-up, read from the ledger
CHUNK = 1_000_000


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    h.under_devstack("rollups", argv, ("DATABASE_URL",), state_dir=".local/bench-rollups")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    keys = setup_tenants()
    load(args.records, keys)
    run(args.repeat)


def setup_tenants() -> list:
    from tenants.keys import api_key_create
    from tenants.models import ApiKey, Team, Tenant

    if ApiKey.objects.filter(name__startswith="bench-").count() >= 100:
        return list(ApiKey.objects.filter(name__startswith="bench-").select_related("team"))
    keys = []
    for t in range(4):
        tenant, _ = Tenant.objects.get_or_create(slug=f"bench-{t}", defaults={"name": f"Bench {t}"})
        for m in range(5):
            team, _ = Team.objects.get_or_create(
                tenant=tenant, slug=f"team-{m}", defaults={"name": f"Team {m}"}
            )
            for k in range(5):
                keys.append(
                    api_key_create(
                        team=team, name=f"bench-{k}", scopes=["inference"], source="system"
                    ).api_key
                )
    return keys


def load(n: int, keys: list) -> None:
    from django.db import connection

    from tenants.billing import usage_rollup, usage_rollup_rebuild
    from tenants.models import UsageRecord

    have = UsageRecord.objects.filter(request_id__startswith="bench-").count()
    if have == n + 2 * FRESH:
        print(f"{n:,} records already loaded")
        return
    table = UsageRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {table} RESTART IDENTITY CASCADE")
        cursor.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s AND indexname NOT LIKE '%%pkey'",
            [table],
        )
        indexes = cursor.fetchall()
        cursor.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'u'", [table]
        )
        constraints = [name for (name,) in cursor.fetchall()]
        for constraint in constraints:
            cursor.execute(f"ALTER TABLE {table} DROP CONSTRAINT {constraint}")
        for name, _ in indexes:
            cursor.execute(f"DROP INDEX IF EXISTS {name}")
        cursor.execute(
            "CREATE TEMP TABLE bench_keys (n int, key_id bigint, team_id bigint, tenant_id bigint)"
        )
        cursor.executemany(
            "INSERT INTO bench_keys VALUES (%s, %s, %s, %s)",
            [(i, k.id, k.team_id, k.team.tenant_id) for i, k in enumerate(keys)],
        )
        started = time.perf_counter()
        for first in range(1, n + 1, CHUNK):
            last = min(n, first + CHUNK - 1)
            cursor.execute(_insert_sql(table), [1, n, first, last, len(keys)])
            print(f"  inserted {last:,} records ({time.perf_counter() - started:.0f} s)", flush=True)
        for _name, definition in indexes:
            cursor.execute(definition)
        for constraint in constraints:  # its unique index was among those just rebuilt
            cursor.execute(f"ALTER TABLE {table} ADD CONSTRAINT {constraint} UNIQUE USING INDEX {constraint}")
        cursor.execute(f"VACUUM ANALYZE {table}")
        print(f"loaded {n:,} records with indexes in {time.perf_counter() - started:.0f} s")
    started = time.perf_counter()
    rolled = usage_rollup_rebuild()
    print(
        f"rolled up {rolled:,} records in {time.perf_counter() - started:.1f} s (first roll-up of the month)"
    )
    with connection.cursor() as cursor:  # fresh records on the month's last day, after that roll-up
        cursor.execute(_insert_sql(table, fresh=True), _params(len(keys), n + 1, FRESH))
    started = time.perf_counter()
    usage_rollup()
    print(f"incremental roll-up of {FRESH:,} new records: {time.perf_counter() - started:.2f} s")
    with connection.cursor() as cursor:  # and as many again that no roll-up has reached yet
        cursor.execute(_insert_sql(table, fresh=True), _params(len(keys), n + FRESH + 1, FRESH))
        cursor.execute(f"ANALYZE {table}")


def _params(keys: int, first: int, count: int) -> list[int]:
    return [first, count, first, first + count - 1, keys]


def _insert_sql(table: str, fresh: bool = False) -> str:
    # Records spread evenly over the month (fresh ones over its last day); tokens and cost vary with g.
    spread, start = ("1 day", "2025-03-31") if fresh else ("31 days", "2025-03-01")
    return f"""
    INSERT INTO {table} (request_id, tenant_id, team_id, api_key_id, deployment_id, model, endpoint,
        prompt_tokens, cached_prompt_tokens, output_tokens, cost, currency, ttft_ms, latency_ms, status,
        created_at)
    SELECT 'bench-' || g, k.tenant_id, k.team_id, k.key_id, NULL,
        (ARRAY['qwen-coder-32b', 'qwen-coder-7b', 'llama-70b'])[1 + g %% 3], '10.0.0.1:8000',
        1000 + g %% 200000, (1000 + g %% 200000) * (g %% 10) / 10, 10 + g %% 500,
        ((1000 + g %% 200000) * 0.0000005 + (10 + g %% 500) * 0.0000015)::numeric(16, 8), 'USD',
        100 + g %% 900, 1000 + g %% 9000, CASE WHEN g %% 97 = 0 THEN 'failed' ELSE 'completed' END,
        timestamptz '{start} 00:00:00+00' + interval '{spread}' * ((g - %s) / %s::float8)
    FROM generate_series(%s::bigint, %s::bigint) AS g
    JOIN bench_keys k ON k.n = g %% %s
    """


def run(repeat: int) -> None:
    from django.contrib.auth import get_user_model
    from django.db.models import Count, Sum

    from tenants.access import Access
    from tenants.billing import period_parse, usage_report
    from tenants.models import UsageDaily, UsageRecord

    operator, _ = get_user_model().objects.get_or_create(
        username="bench-operator", defaults={"is_superuser": True}
    )
    access = Access.for_user(operator)
    period = period_parse(period="month", at=MONTH)
    started = time.perf_counter()
    ledger = UsageRecord.objects.filter(created_at__gte=period.start, created_at__lt=period.end).aggregate(
        n=Count("id"), cost=Sum("cost"), tokens=Sum("prompt_tokens")
    )
    scan_s = time.perf_counter() - started
    print(f"\nrecords in the month: {ledger['n']:,}; daily rows: {UsageDaily.objects.count():,}")
    print(f"ledger scanned directly (one aggregate, no grouping): {scan_s:.2f} s")
    print(f"\n{'report':<34} {'median ms':>10} {'max ms':>8} {'rows':>6}  totals equal the ledger")
    custom = period_parse(
        period="custom",
        since=datetime(2025, 3, 3, 12, tzinfo=UTC),
        until=datetime(2025, 3, 28, 6, tzinfo=UTC),
    )
    cases = [(f"month by {g}", period, g) for g in ("tenant", "team", "key", "model", "day")]
    cases.append(("3 Mar 12:00-28 Mar 06:00 by team", custom, "team"))
    for label, when, group_by in cases:
        expected = ledger
        if when is custom:
            expected = UsageRecord.objects.filter(
                created_at__gte=when.start, created_at__lt=when.end
            ).aggregate(n=Count("id"), cost=Sum("cost"), tokens=Sum("prompt_tokens"))
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            report = usage_report(access=access, period=when, group_by=group_by)
            times.append((time.perf_counter() - t0) * 1000)
        (total,) = report.totals
        ok = (total.requests, total.cost, total.input_tokens) == (
            expected["n"],
            expected["cost"],
            expected["tokens"],
        )
        print(f"{label:<34} {statistics.median(times):>10.1f} {max(times):>8.1f} {len(report.rows):>6}  {ok}")
        if not ok:
            raise SystemExit(f"totals differ: {total} vs {expected}")


if __name__ == "__main__":
    main(sys.argv[1:])
