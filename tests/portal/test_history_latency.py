"""TTFT and ITL p50/p90 over time per team and per pool: the roll-up's histograms read back through the history
API agree with the percentiles of the records themselves, per minute and per hour, and only whoever may see the
team's page (a team) or the deployments (its pools) gets them. A pool's requests, errors, tokens and cost are the
sums of its engines' records, in its rows and on its deployment's charts."""

from __future__ import annotations

import math
import random
from collections import Counter
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.test import Client

from serving.models import AutoscalingPolicy, Endpoint, Health, Pool
from tenants.billing import usage_rollup, usage_rollup_rebuild
from tenants.models import PoolUsageSeries, TeamUsageSeries, UsageRecord
from tenants.usage_series import bucket_bounds

from ..conftest import make_usage

TEAM_CHARTS = {"ttft": "ttft", "itl": "itl"}


def bucket_of(ms: float) -> int:
    """history_bucket (migration 0011) as Python writes it, with the same logarithms."""
    return 0 if ms < 1 else min(1 + math.floor(3 * math.log(ms) / math.log(2)), 63)


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(q * len(ordered)) - 1]


def assert_quantile(read: float | None, values: list[float], q: float) -> None:
    """The series reads the q-quantile of the values to within its bucket: inside the bucket of the record that
    holds the rank (the histograms keep no more than that), give or take the 0.05 ms of the answer's rounding."""
    low, high = bucket_bounds(bucket_of(nearest_rank(values, q)))
    assert read is not None and low - 0.051 <= read <= high + 0.051, (read, q, nearest_rank(values, q))


@pytest.fixture
def hour_start():
    """Two minutes early in the hour now under way, so that both minutes and their hour are in every period."""
    now = datetime.now(UTC)
    if now.minute < 2:
        now -= timedelta(minutes=2)  # the minutes are in the hour before; the week's hours still hold it
    return now.replace(minute=0, second=0, microsecond=0)


def _get(user, scope: str, ident: int, period: str) -> dict:
    client = Client()
    client.force_login(user)
    response = client.get("/portal/history/", {"scope": scope, "id": ident, "period": period})
    assert response.status_code == 200, response.content
    return response.json()


def _at(data: dict, chart: str, key: str, at: datetime):
    series = {s["key"]: s for c in data["charts"] if c["id"] == chart for s in c["series"]}
    return series[key]["values"][data["t"].index(int(at.timestamp()))]


def _traffic(world, hour_start: datetime) -> dict:
    """Two minutes of requests from two teams over two pools (and an engine already gone, and a request that
    reached no engine); returns the TTFT and ITL of the completed ones per (team or pool, minute)."""
    rng = random.Random(33)
    main = world.deployment.pools.get(name="main")
    decode = Pool.objects.create(deployment=world.deployment, name="decode", replicas=1)
    urls = {
        main: "http://127.0.0.1:19101",
        decode: "http://127.0.0.1:19102",
    }
    for pool, url in urls.items():
        Endpoint.objects.create(pool=pool, name=f"e-{pool.name}", url=url, role="both", health=Health.HEALTHY)
    AutoscalingPolicy.objects.create(
        pool=decode, enabled=True, max_replicas=2, ttft_p90_s=1.5, itl_p90_s=0.04
    )
    # Each team and pool has its own spread, so that a value mixed up between them shows.
    engines = [(main, urls[main], 1.0), (decode, urls[decode], 3.0), (None, "http://127.0.0.1:19199", 1.0)]
    seen: dict = {}
    n = 0
    for minute in (hour_start, hour_start + timedelta(minutes=1)):
        for key, team, slow in ((world.key_a1, world.team_a1, 1.0), (world.key_a2, world.team_a2, 4.0)):
            for _ in range(120):
                pool, url, pool_slow = rng.choice(engines)
                ttft = rng.randint(20, 400) * slow * pool_slow + rng.random()
                output = rng.randint(2, 300)
                latency = ttft + (output - 1) * rng.uniform(5, 60) * pool_slow
                status = rng.choices(("completed", "failed", "cancelled"), (90, 5, 5))[0]
                prompt = rng.randint(10, 5000)
                n += 1
                make_usage(
                    key,
                    f"lat-{n}",
                    created_at=minute + timedelta(seconds=rng.randint(0, 59)),
                    deployment=world.deployment,
                    endpoint=url,
                    prompt_tokens=prompt,
                    cached_prompt_tokens=rng.randint(0, prompt),
                    output_tokens=output,
                    cost=Decimal(rng.randint(1, 10**6)) / 10**8,
                    currency=rng.choice(("USD", "USD", "EUR")),
                    ttft_ms=round(ttft),
                    latency_ms=round(latency),
                    status=status,
                )
                if status != "completed":
                    continue
                itl = (round(latency) - round(ttft)) / (output - 1)
                for owner in (team, pool):
                    if owner is not None:
                        entry = seen.setdefault((owner, minute), {"ttft": [], "itl": []})
                        entry["ttft"].append(round(ttft))
                        entry["itl"].append(itl)
    make_usage(
        world.key_a1, "lat-no-engine", created_at=hour_start, deployment=world.deployment, status="rejected"
    )
    return seen


def _check(data: dict, at: datetime, chart: dict, seen: dict, owner, minutes: list[datetime]) -> None:
    """The chart's p50 and p90 of TTFT and ITL at `at` against the records of `owner` in those minutes."""
    for name in ("ttft", "itl"):
        values = [v for m in minutes for v in seen[(owner, m)][name]]
        for q, suffix in ((0.5, "p50"), (0.9, "p90")):
            assert_quantile(_at(data, chart[name], f"{name}_{suffix}", at), values, q)


def test_team_and_pool_latency_percentiles_match_the_records(world, hour_start):
    seen = _traffic(world, hour_start)
    usage_rollup()
    minutes = [hour_start, hour_start + timedelta(minutes=1)]
    pools = {p.name: p for p in world.deployment.pools.all()}

    # Each team, per minute (a day's chart) and per hour (a week's), as its own admin reads it.
    for team, user in ((world.team_a1, world.team_admin_a1), (world.team_a2, world.admin_a)):
        by_minute = _get(user, "team", team.pk, "day")
        charts = [c["id"] for c in by_minute["charts"]]
        assert charts == ["traffic", "tokens", "ttft", "itl", "spend"]
        for minute in minutes:
            _check(by_minute, minute, TEAM_CHARTS, seen, team, [minute])
        by_hour = _get(user, "team", team.pk, "week")
        _check(by_hour, hour_start, TEAM_CHARTS, seen, team, minutes)

    # Each pool, on its deployment's page: only its engines' requests; the policy's objectives beside them.
    for period, step in (("day", None), ("week", hour_start)):
        data = _get(world.operator, "deployment", world.deployment.pk, period)
        ids = [c["id"] for c in data["charts"]]
        assert ids[-7:] == [
            "pool_decode", "pool_decode_traffic", "pool_decode_latency",
            "pool_main", "pool_main_traffic", "pool_main_latency", "spend",
        ]  # fmt: skip
        for name, pool in pools.items():
            chart = dict.fromkeys(("ttft", "itl"), f"pool_{name}_latency")
            for at, group in [(step, minutes)] if step else [(m, [m]) for m in minutes]:
                _check(data, at, chart, seen, pool, group)
        decode = {
            s["key"]: s for c in data["charts"] if c["id"] == "pool_decode_latency" for s in c["series"]
        }
        assert decode["ttft_objective"]["values"][0] == 1500 and decode["itl_objective"]["dash"] is True
        assert "ttft_objective" not in {
            s["key"] for c in data["charts"] if c["id"] == "pool_main_latency" for s in c["series"]
        }

    # The pools' rows count only the records of their engines; the gone engine's are in the teams' rows.
    served = {r.pool_id: r.requests for r in PoolUsageSeries.objects.filter(step_s=3600)}
    assert set(served) == {pools["main"].pk, pools["decode"].pk}
    assert sum(served.values()) < sum(
        TeamUsageSeries.objects.filter(step_s=3600, start=hour_start).values_list("requests", flat=True)
    )

    # A rebuild adds the ledger up again to the same rows.
    def rows() -> list:
        team = TeamUsageSeries.objects.order_by("step_s", "start", "team_id", "currency").values()
        pool = PoolUsageSeries.objects.order_by("step_s", "start", "pool_id", "currency").values()
        return [{**r, "id": 0} for r in [*team, *pool]]

    before = rows()
    usage_rollup_rebuild()
    assert rows() == before


COUNTS = (
    "requests",
    "failed",
    "cancelled",
    "rejected",
    "prompt_tokens",
    "cached_prompt_tokens",
    "output_tokens",
)


def _pool_sums_from_the_ledger() -> dict:
    """Per (step, start, pool, currency), the counts and cost of the records whose engine is one of the pool's,
    added up in Python from the records themselves."""
    pool_of = dict(Endpoint.objects.values_list("url", "pool_id"))
    sums: dict = {}
    for r in UsageRecord.objects.all():
        if r.endpoint not in pool_of:
            continue
        for step_s in (60, 3600):
            start = datetime.fromtimestamp(int(r.created_at.timestamp()) // step_s * step_s, UTC)
            row = sums.setdefault((step_s, start, pool_of[r.endpoint], r.currency), Counter(cost=Decimal(0)))
            row.update(
                requests=1,
                **{r.status: 1},
                prompt_tokens=r.prompt_tokens,
                cached_prompt_tokens=r.cached_prompt_tokens,
                output_tokens=r.output_tokens,
            )
            row["cost"] += r.cost
    return sums


def test_pool_counts_and_cost_match_the_records(world, hour_start):
    _traffic(world, hour_start)
    usage_rollup()
    expected = _pool_sums_from_the_ledger()
    assert {k[3] for k in expected} == {"USD", "EUR"} and len({k[2] for k in expected}) == 2

    # Each row of the pool series, minute and hour, is its records' sums: no record of the gone engine or of
    # none, no rejected one, every status counted as itself.
    rows = {
        (r["step_s"], r["start"], r["pool_id"], r["currency"]): {name: r[name] for name in (*COUNTS, "cost")}
        for r in PoolUsageSeries.objects.values()
    }
    assert rows == {k: {name: v[name] for name in (*COUNTS, "cost")} for k, v in expected.items()}
    assert sum(v["failed"] for v in expected.values()) and sum(v["cancelled"] for v in expected.values())

    # The deployment's page charts them per pool, all currencies together, per minute (a day) and per hour (a
    # week, divided by 60); each pool's spend is in the spend chart per currency, from the period's start.
    pools = {p.name: p.pk for p in world.deployment.pools.all()}
    for period, step_s in (("day", 60), ("week", 3600)):
        data = _get(world.operator, "deployment", world.deployment.pk, period)
        for name, pool_id in pools.items():
            chart = f"pool_{name}_traffic"
            keys = [s["key"] for c in data["charts"] if c["id"] == chart for s in c["series"]]
            assert keys == ["requests", "failed", "cancelled", "input", "cached", "output"]
            starts = sorted({k[1] for k in expected if k[0] == step_s and k[2] == pool_id})
            for at in starts:
                total = Counter()
                for k, v in expected.items():
                    if k[:3] == (step_s, at, pool_id):
                        total.update({name: v[name] for name in COUNTS})
                per_min = 60 / step_s
                for key, value in (
                    ("requests", total["requests"]),
                    ("failed", total["failed"]),
                    ("cancelled", total["cancelled"]),
                    ("input", total["prompt_tokens"] - total["cached_prompt_tokens"]),
                    ("cached", total["cached_prompt_tokens"]),
                    ("output", total["output_tokens"]),
                ):
                    assert _at(data, chart, key, at) == pytest.approx(value * per_min, abs=0.002), (key, at)
            spend = {
                s["key"]: s["values"][-1] for c in data["charts"] if c["id"] == "spend" for s in c["series"]
            }
            for currency in ("USD", "EUR"):
                mine = [
                    v["cost"] for k, v in expected.items() if k[0] == step_s and k[2:] == (pool_id, currency)
                ]
                assert spend[f"spend_pool_{name}_{currency}"] == pytest.approx(float(sum(mine)), abs=1e-6)


def test_who_sees_team_and_pool_latency(world, hour_start):
    _traffic(world, hour_start)
    usage_rollup()

    def status(user, scope: str, ident: int) -> int:
        client = Client()
        client.force_login(user)
        return client.get("/portal/history/", {"scope": scope, "id": ident, "period": "hour"}).status_code

    # A team's member sees their team's latency, and no other team's; pools are the operators'.
    mine = _get(world.member_a1, "team", world.team_a1.pk, "hour")
    assert {"ttft", "itl"} <= {c["id"] for c in mine["charts"]}
    assert status(world.member_a1, "team", world.team_a2.pk) == 404
    assert status(world.member_a1, "deployment", world.deployment.pk) == 403
    assert status(world.team_admin_a1, "deployment", world.deployment.pk) == 403
    assert status(world.admin_a, "deployment", world.deployment.pk) == 403
    assert status(world.admin_b, "team", world.team_a1.pk) == 404
    assert status(world.operator, "deployment", world.deployment.pk) == 200
    # The tenant's view adds its teams' counts only: no team's latency leaks through it.
    tenant = _get(world.admin_a, "tenant", world.tenant_a.pk, "hour")
    assert [c["id"] for c in tenant["charts"]] == ["traffic", "tokens", "spend"]
