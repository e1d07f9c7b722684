"""The portal's history at the seed's rate: its size per month and the time a month's chart takes.

The fleet: 3,000 agents in 60 teams of 12 tenants (20 teams interactive, 30 standard, 10 batch), 4 deployments
with 6 pools, 7,600 requests a minute (each agent calls one deployment). It loads an hour of that traffic into
the ledger (456,000 records, one set-based INSERT), times the billing roll-up that adds it to the daily rows and
the minute and hour series, then copies that hour's series rows over the other 719 hours of 30 days (so that a
month holds what 30 days of the same traffic would), and samples the engines' series for every minute of the
month. It reports each table's size (heap, indexes and TOAST) per month beside the ledger's, and the median time
of the charts' reads (portal/charts.py) over 5 runs.

    .venv/bin/python -m bench.history [--docs docs/benchmarks.md]   (its own embedded PostgreSQL)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bench import harness as h
from bench.docs_section import write_section

ROOT = Path(__file__).resolve().parents[1]
AGENTS, TEAMS, TENANTS, RATE = 3_000, 60, 12, 7_600  # requests a minute
DEPLOYMENTS = (("coder-32b", ("prefill", "decode")), ("coder-7b", ("main",)), ("llama-70b", ("prefill", "decode")),
               ("embed", ("main",)))  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--docs", help="write the tables to this file's history section")
    args = parser.parse_args(argv)
    h.under_devstack("history", argv, ("DATABASE_URL",), state_dir=".local/bench-history")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    fleet = setup_fleet()
    rollup_s = load_hour(fleet, hour=now)
    copy_month(hour=now)
    sample_engines(fleet, hour=now)
    sizes = measure_sizes()
    reads = time_reads(fleet, now=now + timedelta(minutes=59), repeat=args.repeat)
    text = report(rollup_s, sizes, reads)
    print(text)
    if args.docs:
        write_section(Path(args.docs), "history", text, "Portal history", "bench/history.py")
    return 0


def setup_fleet() -> dict:
    from serving.models import Endpoint, ModelDeployment, Pool
    from tenants.keys import api_key_create
    from tenants.models import ApiKey, Team, Tenant

    deployments = []
    for name, pools in DEPLOYMENTS:
        deployment, _ = ModelDeployment.objects.get_or_create(
            name=name,
            defaults={"served_model_name": name, "model_source": f"models/{name}", "engine_kind": "sim"},
        )
        for pool_name in pools:
            role = pool_name if pool_name in ("prefill", "decode") else "both"
            pool, _ = Pool.objects.get_or_create(
                deployment=deployment,
                name=pool_name,
                defaults={
                    "replicas": 4,
                    "role": role,
                    "kv_connector": "" if role == "both" else "NixlConnector",
                },
            )
            for n in range(4):
                Endpoint.objects.get_or_create(
                    url=f"http://10.{deployment.pk % 250}.{pool.pk % 250}.{n + 1}:8000",
                    defaults={"pool": pool, "name": f"{name}-{pool_name}-{n}", "role": role},
                )
        deployments.append(deployment)
    keys = list(ApiKey.objects.filter(name="bench-history").select_related("team"))
    if len(keys) < TEAMS:
        classes = ["interactive"] * 20 + ["standard"] * 30 + ["batch"] * 10
        for t in range(TEAMS):
            tenant, _ = Tenant.objects.get_or_create(
                slug=f"hist-{t % TENANTS}", defaults={"name": f"History {t % TENANTS}"}
            )
            team, _ = Team.objects.get_or_create(
                tenant=tenant, slug=f"team-{t}", defaults={"name": f"Team {t}", "priority_class": classes[t]}
            )
            if not ApiKey.objects.filter(team=team, name="bench-history").exists():
                api_key_create(team=team, name="bench-history", scopes=["inference"], source="system")
        keys = list(ApiKey.objects.filter(name="bench-history").select_related("team"))
    return {"deployments": deployments, "keys": keys}


def load_hour(fleet: dict, *, hour: datetime) -> float:
    """An hour of the seed's traffic in the ledger, then the roll-up of it; returns the roll-up's seconds."""
    from django.db import connection

    from serving.models import Endpoint
    from tenants.billing import usage_rollup
    from tenants.models import UsageRecord, UsageRollupState
    from tenants.usage_series import SERIES_MODELS

    table = UsageRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {table}, {', '.join(m._meta.db_table for m in SERIES_MODELS)}")
        UsageRollupState.objects.update_or_create(pk=1, defaults={"last_record_id": 0})
        cursor.execute("DROP TABLE IF EXISTS bench_agents")
        cursor.execute("CREATE TEMP TABLE bench_agents (n int, key_id bigint, team_id bigint, tenant_id bigint,"
                       " deployment_id bigint, priority_class text, endpoint text)")  # fmt: skip
        deployments = [d.pk for d in fleet["deployments"]]
        # The engines that stream a deployment's answers, whose URL the ledger records: its decode or only pool's.
        streaming = Endpoint.objects.exclude(role="prefill").order_by("url")
        engines = {
            d: list(streaming.filter(pool__deployment_id=d).values_list("url", flat=True))
            for d in deployments
        }
        keys = fleet["keys"]
        cursor.executemany(
            "INSERT INTO bench_agents VALUES (%s, %s, %s, %s, %s, %s, %s)",
            [
                (
                    a,
                    k.id,
                    k.team_id,
                    k.team.tenant_id,
                    d,
                    k.team.priority_class,
                    engines[d][a % len(engines[d])],
                )
                for a in range(AGENTS)
                for k, d in [(keys[a % len(keys)], deployments[(a * 7) % len(deployments)])]
            ],
        )
        started = time.perf_counter()
        # Request g comes from agent g % AGENTS, spread evenly over the hour; TTFT, latency, tokens and queueing
        # vary with g (queued: one in ten, when its deployment was saturated).
        cursor.execute(
            f"""
            INSERT INTO {table} (request_id, tenant_id, team_id, api_key_id, deployment_id, model, endpoint,
                prompt_tokens, cached_prompt_tokens, output_tokens, cost, currency, ttft_ms, latency_ms, status,
                priority_class, queued_ms, created_at)
            SELECT 'hist-' || g, a.tenant_id, a.team_id, a.key_id, a.deployment_id, 'm', a.endpoint,
                20000 + g %% 180000, (20000 + g %% 180000) * (g %% 10) / 10, 50 + g %% 600,
                ((20000 + g %% 180000) * 0.0000005 + (50 + g %% 600) * 0.0000015)::numeric(16, 8), 'USD',
                150 + (g * 37) %% 4000, 2000 + (g * 53) %% 30000,
                CASE WHEN g %% 97 = 0 THEN 'failed' WHEN g %% 211 = 0 THEN 'cancelled' ELSE 'completed' END,
                a.priority_class, CASE WHEN g %% 10 = 0 THEN (g * 13) %% 5000 END,
                %s::timestamptz + interval '1 hour' * (g::float8 / %s)
            FROM generate_series(0, %s - 1) AS g JOIN bench_agents a ON a.n = g %% {AGENTS}
            """,
            [hour, RATE * 60, RATE * 60],
        )
        print(f"ledger: {RATE * 60:,} records in {time.perf_counter() - started:.0f} s", flush=True)
        cursor.execute(f"ANALYZE {table}")
    started = time.perf_counter()
    usage_rollup()
    return time.perf_counter() - started


def copy_month(*, hour: datetime) -> None:
    """The hour's series rows copied to each of the 719 hours before it: 30 days of the same traffic."""
    from django.db import connection

    from tenants.usage_series import SERIES_MODELS

    started = time.perf_counter()
    with connection.cursor() as cursor:
        for model in SERIES_MODELS:
            table = model._meta.db_table
            columns = [f.column for f in model._meta.concrete_fields if f.column not in ("id", "start")]
            cursor.execute(
                f"""INSERT INTO {table} (start, {", ".join(columns)})
                SELECT start - interval '1 hour' * k, {", ".join(columns)}
                FROM {table}, generate_series(1, 719) AS k WHERE start >= %s""",
                [hour],
            )
            cursor.execute(f"VACUUM ANALYZE {table}")
    print(f"series: 30 days written in {time.perf_counter() - started:.0f} s", flush=True)


def sample_engines(fleet: dict, *, hour: datetime) -> None:
    """The engines' series for every minute of the 30 days, as the sampler leaves them (6 samples a minute)."""
    from django.db import connection

    from portal.models import PoolSeries, PrefixSeries
    from serving.models import Pool

    pools = list(Pool.objects.filter(deployment__in=fleet["deployments"]).values_list("id", "deployment_id"))
    first = hour - timedelta(hours=719)
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {PoolSeries._meta.db_table}, {PrefixSeries._meta.db_table}")
        for step_s, count in ((60, 720 * 60), (3600, 720)):
            per = step_s // 10  # samples in a step
            for pool_id, deployment_id in pools:
                cursor.execute(
                    f"""INSERT INTO {PoolSeries._meta.db_table} (step_s, start, pool_id, deployment_id, samples,
                        replicas, ready, running, waiting, queued_prompt_tokens, kv_samples, kv_sum, kv_max)
                    SELECT %s, %s::timestamptz + make_interval(secs => %s * k), %s, %s, %s, 4 * %s, 4 * %s,
                        30.0 * %s, 3.0 * %s, 50000.0 * %s, 4 * %s, 2.4 * %s, 0.8
                    FROM generate_series(0, %s - 1) AS k""",
                    [
                        step_s,
                        first,
                        step_s,
                        pool_id,
                        deployment_id,
                        per,
                        per,
                        per,
                        per,
                        per,
                        per,
                        per,
                        per,
                        count,
                    ],
                )
            for deployment in fleet["deployments"]:
                cursor.execute(
                    f"""INSERT INTO {PrefixSeries._meta.db_table} (step_s, start, deployment_id, predicted, reported)
                    SELECT %s, %s::timestamptz + make_interval(secs => %s * k), %s, 900000, 1000000
                    FROM generate_series(0, %s - 1) AS k""",
                    [step_s, first, step_s, deployment.pk, count],
                )
        cursor.execute(f"VACUUM ANALYZE {PoolSeries._meta.db_table}")
        cursor.execute(f"VACUUM ANALYZE {PrefixSeries._meta.db_table}")


def measure_sizes() -> list[tuple[str, int, int]]:
    """(table, rows, bytes with indexes and TOAST) of each series table, and of the ledger's hour x 720."""
    from django.db import connection

    from portal.models import PoolSeries, PrefixSeries
    from tenants.models import UsageRecord
    from tenants.usage_series import SERIES_MODELS

    out = []
    with connection.cursor() as cursor:
        for model in (*SERIES_MODELS, PoolSeries, PrefixSeries, UsageRecord):
            table = model._meta.db_table
            cursor.execute(f"SELECT count(*), pg_total_relation_size(%s) FROM {table}", [table])
            out.append((table, *cursor.fetchone()))
    return out


def time_reads(fleet: dict, *, now: datetime, repeat: int) -> list[tuple[str, float, float, int]]:
    """(chart, median ms, max ms, points) of the charts' reads for a month, a week and a day."""
    from portal.charts import deployment_history, fleet_history, team_history, tenant_history

    deployment = fleet["deployments"][0]
    team = fleet["keys"][0].team
    cases = []
    for period in ("month", "week", "day"):
        cases += [
            (f"fleet, {period}", lambda p=period: fleet_history(period=p, now=now)),
            (
                f"deployment, {period}",
                lambda p=period: deployment_history(deployment=deployment, period=p, now=now),
            ),
            (f"team, {period}", lambda p=period: team_history(team=team, period=p, now=now)),
        ]
    cases.append(("tenant, month", lambda: tenant_history(tenant=team.tenant, period="month", now=now)))
    out = []
    for label, read in cases:
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            data = read()
            times.append((time.perf_counter() - started) * 1000)
        requests = sum(data["charts"][0]["series"][0]["values"]) * data["step_s"] / 60
        if not requests:
            raise SystemExit(f"{label}: no requests read")
        out.append((label, statistics.median(times), max(times), len(data["t"])))
    return out


def report(rollup_s: float, sizes: list, reads: list) -> str:
    ledger_rows, ledger_bytes = sizes[-1][1], sizes[-1][2]
    lines = [
        f"An hour at {RATE:,} requests a minute ({ledger_rows:,} records, {AGENTS:,} agents, {TEAMS} teams, "
        f"{len(DEPLOYMENTS)} deployments) rolled up into the daily rows and the minute and hour series in "
        f"{rollup_s:.1f} s (one roll-up; the worker's run every 15 s adds about 1,900 records).",
        "",
        "| table, 30 days | rows | size (MB) | bytes a row |",
        "| --- | ---: | ---: | ---: |",
    ]
    total = 0
    for table, rows, size in sizes[:-1]:
        total += size
        lines.append(f"| {table} | {rows:,} | {size / 2**20:,.1f} | {size // max(rows, 1):,} |")
    lines.append(f"| all the history | | {total / 2**20:,.1f} | |")
    month_ledger = ledger_bytes * 720
    lines.append(
        f"| the ledger for comparison ({ledger_rows:,} records an hour x 720) | {ledger_rows * 720:,} | "
        f"{month_ledger / 2**20:,.0f} | {ledger_bytes // max(ledger_rows, 1):,} |"
    )
    lines += [
        "",
        "| chart read (portal/charts.py) | median ms | max ms | points |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {label} | {median:.1f} | {top:.1f} | {points:,} |" for label, median, top, points in reads]
    return "\n".join(lines)


if __name__ == "__main__":
    h.run(main)
