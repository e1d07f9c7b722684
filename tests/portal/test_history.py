"""The history: the ledger's per-minute and per-hour series (built by the billing roll-up), the engines' series
(sampled from what the worker scrapes into Redis), pruning, and the charts' JSON, scoped like the pages."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import redis
from django.conf import settings
from django.db.models import Sum

from portal.charts import window_for
from portal.history import history_prune, history_sample
from portal.models import PoolSeries, PrefixSeries
from routing.contracts import LOAD_KEY
from routing.contracts import PREFIX_HEALTH_KEY as PREFIX_KEY
from serving.models import AutoscalingPolicy, Endpoint, Health
from tenants.billing import usage_rollup, usage_rollup_rebuild
from tenants.models import DeploymentUsageSeries, TeamUsageSeries, UsageRecord
from tenants.usage_series import bucket_bounds, histogram_quantile

from ..conftest import make_usage


@pytest.fixture(autouse=True)
def _now():
    """This minute (each test's own), and the time within it the traffic is dated."""
    global NOW, MINUTE
    NOW = datetime.now(UTC).replace(second=30, microsecond=0)
    MINUTE = NOW.replace(second=0)


def point(data: dict, series: dict, at: datetime | None = None):
    """The series' value at the step holding `at` (default: the traffic's minute or hour)."""
    at = at or NOW
    return series["values"][data["t"].index(int(at.timestamp()) // data["step_s"] * data["step_s"])]


def traffic(world, n: int = 100, *, at: datetime | None = None, prefix: str = "t") -> None:
    """n requests of team acme/agents on the deployment: TTFT 1..n * 10 ms, 11 output tokens at 20 ms apart,
    every tenth failed, the interactive ones queued 0..n ms."""
    at = at or NOW
    for i in range(n):
        make_usage(
            world.key_a1,
            f"{prefix}-{i}",
            created_at=at,
            deployment=world.deployment,
            prompt_tokens=1000,
            cached_prompt_tokens=800,
            output_tokens=11,
            cost=Decimal("0.001"),
            ttft_ms=10 * (i + 1),
            latency_ms=10 * (i + 1) + 200,
            status="failed" if i % 10 == 9 else "completed",
            priority_class="interactive" if i % 2 else "batch",
            queued_ms=i if i % 2 else None,
        )


def test_it_buckets_and_reads_percentiles():
    assert bucket_bounds(0) == (0.0, 1.0)
    assert bucket_bounds(4) == pytest.approx((2.0, 2 ** (4 / 3)))
    assert histogram_quantile(None, 0.9) is None and histogram_quantile([0, 0], 0.5) is None
    # 10 values in the bucket [8, 10.08) ms: the median is inside it.
    assert 8 <= histogram_quantile([0] * 10 + [10], 0.5) < 10.08


def test_the_roll_up_adds_each_record_once_to_the_minutes_and_hours(world):
    traffic(world)
    usage_rollup()
    usage_rollup()  # nothing new: nothing added twice
    traffic(world, 10, at=NOW - timedelta(hours=2), prefix="earlier")
    usage_rollup()
    minute = DeploymentUsageSeries.objects.filter(step_s=60, start=MINUTE, deployment_id=world.deployment.pk)
    assert minute.aggregate(n=Sum("requests"), f=Sum("failed"), p=Sum("prompt_tokens"))["n"] == 100
    assert minute.aggregate(f=Sum("failed"))["f"] == 10
    hours = DeploymentUsageSeries.objects.filter(step_s=3600, deployment_id=world.deployment.pk)
    assert sorted(set(hours.values_list("start", flat=True))) == [
        (NOW - timedelta(hours=2)).replace(minute=0, second=0),
        NOW.replace(minute=0, second=0),
    ]
    team = TeamUsageSeries.objects.filter(team=world.team_a1)
    # 110 and the fixture's own record of the team.
    assert team.filter(step_s=60).aggregate(n=Sum("requests"))["n"] == 111
    assert team.filter(step_s=3600).aggregate(n=Sum("requests"))["n"] == 111
    # Every record of the ledger is in the series, once (the fixture's records too).
    assert TeamUsageSeries.objects.filter(step_s=3600).aggregate(n=Sum("requests"))["n"] == (
        UsageRecord.objects.count()
    )
    # TTFT of the 90 completed requests (10..1000 ms less the failed): p90 about 900 ms, within a bucket (26 %).
    row = minute.get(priority_class="batch")
    assert histogram_quantile(row.ttft_ms, 0.5) == pytest.approx(510, rel=0.26)
    # Inter-token latency: 200 ms over 10 gaps.
    assert histogram_quantile(row.itl_ms, 0.9) == pytest.approx(20, rel=0.26)
    assert row.queued_ms is None  # no batch request waited in a queue
    interactive = minute.get(priority_class="interactive")
    assert histogram_quantile(interactive.queued_ms, 0.9) == pytest.approx(89, rel=0.26)
    # A rebuild adds the whole ledger up again, to the same sums.
    before = list(DeploymentUsageSeries.objects.order_by("step_s", "start", "priority_class").values())
    usage_rollup_rebuild()
    after = list(DeploymentUsageSeries.objects.order_by("step_s", "start", "priority_class").values())
    assert [{**r, "id": 0} for r in before] == [{**r, "id": 0} for r in after]


def test_the_worker_samples_the_engines_and_the_prefix_counters(world):
    pool = world.deployment.pools.get()
    policy = AutoscalingPolicy.objects.create(
        pool=pool, enabled=True, max_replicas=4, kv_cache_utilization=0.8
    )
    endpoints = [
        Endpoint.objects.create(pool=pool, name=f"e{n}", url=f"http://127.0.0.1:{19000 + n}", role="both",
                                health=Health.HEALTHY)
        for n in range(2)
    ]  # fmt: skip
    client = redis.Redis.from_url(settings.REDIS_URL)
    now = NOW.timestamp()
    prefix_key = PREFIX_KEY.format(world.deployment.pk, int(now // 60))
    try:
        for endpoint, (running, waiting, kv) in zip(endpoints, [(3, 1, 0.5), (5, 3, 0.7)], strict=True):
            client.hset(LOAD_KEY.format(endpoint.pk), mapping={"running": running, "waiting": waiting,
                                                               "kv_usage": kv, "ts": time.time()})  # fmt: skip
        client.hset(prefix_key, mapping={"predicted": 700, "reported": 1000})
        assert history_sample(client=client, now=now) == 1
        assert history_sample(client=client, now=now + 10) == 1
    finally:
        client.delete(prefix_key, *(LOAD_KEY.format(e.pk) for e in endpoints))
    row = PoolSeries.objects.get(step_s=60, pool_id=pool.pk)
    assert (row.samples, row.replicas, row.ready, row.running, row.waiting) == (2, 4, 4, 16, 8)
    assert row.kv_sum / row.kv_samples == pytest.approx(0.6) and row.kv_max == 0.7
    hour = PoolSeries.objects.get(step_s=3600, pool_id=pool.pk)
    assert (hour.samples, hour.ready, hour.kv_samples) == (2, 4, 4)
    prefix = PrefixSeries.objects.get(step_s=60, deployment_id=world.deployment.pk)
    assert (prefix.predicted, prefix.reported) == (700, 1000)  # copied, not added twice
    assert PrefixSeries.objects.get(step_s=3600).reported == 1000

    # The deployment's chart shows them: per pool the replicas and signals, with the policy's KV target.
    traffic(world)
    usage_rollup()
    data = _get(world.operator, "deployment", world.deployment.pk, "hour")
    charts = {c["id"]: c for c in data["charts"]}
    pool_chart = {s["key"]: point(data, s) for s in charts[f"pool_{pool.name}"]["series"]}
    assert pool_chart == {
        "replicas": 2.0,
        "ready": 2.0,
        "running": 8.0,
        "waiting": 4.0,
        "kv": 0.6,
        "kv_target": policy.kv_cache_utilization,
    }
    cache = {s["key"]: point(data, s) for s in charts["cache"]["series"]}
    assert cache == {"prefix_hit_rate": 0.8, "predicted_reported": 0.7}


def _get(user, scope: str, ident: int | None, period: str):
    from django.test import Client

    client = Client()
    client.force_login(user)
    query = {"scope": scope, "period": period, **({"id": ident} if ident else {})}
    response = client.get("/portal/history/", query)
    assert response.status_code == 200, response.content
    return response.json()


@pytest.mark.parametrize(
    ("period", "points", "step"),
    [("hour", 60, 60), ("day", 1440, 60), ("week", 168, 3600), ("month", 720, 3600)],
)
def test_each_period_has_a_point_per_step_ending_now(world, period, points, step):
    traffic(world)
    usage_rollup()
    data = _get(world.operator, "deployment", world.deployment.pk, period)
    assert (len(data["t"]), data["step_s"]) == (points, step)
    assert data["t"][-1] <= time.time() < data["t"][-1] + step
    charts = {c["id"]: c for c in data["charts"]}
    assert list(charts) == [
        "traffic", "tokens", "ttft", "itl", "cache", "queueing", "pool_main", "pool_main_traffic",
        "pool_main_latency", "spend",
    ]  # fmt: skip
    for chart in charts.values():
        assert all(len(s["values"]) == points for s in chart["series"])
    requests = charts["traffic"]["series"][0]["values"]
    # Per minute: 100 requests in one minute; 100 over an hour's step reads as 100/60 a minute.
    assert sum(requests) * step / 60 == pytest.approx(100, rel=1e-3)
    assert charts["spend"]["series"][0]["values"][-1] == pytest.approx(0.1)
    ttft = {s["key"]: s for s in charts["ttft"]["series"]}
    assert point(data, ttft["ttft_p90"]) == pytest.approx(900, rel=0.26)
    queue = [s["label"] for s in charts["queueing"]["series"]]
    assert queue == ["Queue wait p90: Interactive", "Routers' prefill backlog"]


def test_who_sees_which_history(world):
    traffic(world)
    usage_rollup()
    from django.test import Client

    def status(user, **query) -> int:
        client = Client()
        client.force_login(user)
        return client.get("/portal/history/", {"period": "hour", **query}).status_code

    assert status(world.operator, scope="fleet") == 200
    assert status(world.admin_a, scope="fleet") == 403
    assert status(world.team_admin_a1, scope="deployment", id=world.deployment.pk) == 403
    assert status(world.team_admin_a1, scope="team", id=world.team_a1.pk) == 200
    assert status(world.member_a1, scope="team", id=world.team_a1.pk) == 200
    assert status(world.team_admin_a1, scope="team", id=world.team_a2.pk) == 404  # not their team
    assert status(world.admin_b, scope="team", id=world.team_a1.pk) == 404  # another tenant's
    assert status(world.admin_a, scope="tenant", id=world.tenant_a.pk) == 200
    assert status(world.team_admin_a1, scope="tenant", id=world.tenant_a.pk) == 403
    assert status(world.admin_b, scope="tenant", id=world.tenant_a.pk) == 404
    assert status(world.operator, scope="team") == 400  # no id
    assert status(world.operator, scope="fleet", period="year") == 400
    assert Client().get("/portal/history/", {"scope": "fleet"}).status_code in (401, 403)


def test_a_teams_history_reads_against_its_quota_and_budget(world):
    world.quota_a1.input_tokens_per_minute = 500_000
    world.quota_a1.spend_budget = Decimal("25")
    world.quota_a1.save()
    earlier = NOW - timedelta(minutes=10)  # apart from the fixture's own record of the team
    traffic(world, at=earlier)
    usage_rollup()
    data = _get(world.team_admin_a1, "team", world.team_a1.pk, "day")
    charts = {c["id"]: {s["key"]: s for s in c["series"]} for c in data["charts"]}
    assert point(data, charts["traffic"]["requests"], earlier) == 100
    assert charts["traffic"]["requests_per_minute"]["values"] == [60] * 1440
    assert point(data, charts["tokens"]["input"], earlier) == 100 * 200
    assert charts["tokens"]["input_tokens_per_minute"]["dash"] is True
    assert charts["spend"]["spend_budget"]["values"][0] == 25.0


def test_old_minutes_and_hours_are_pruned(world, settings):
    settings.HISTORY_MINUTES_KEEP_DAYS, settings.HISTORY_HOURS_KEEP_DAYS = 35, 400
    traffic(world, 2, at=NOW - timedelta(days=40), prefix="old")
    traffic(world, 2, at=NOW - timedelta(days=500), prefix="older")
    usage_rollup()
    assert history_prune() > 0
    team = TeamUsageSeries.objects.filter(team=world.team_a1)
    starts = {(r.step_s, r.start.date()) for r in team}
    assert (60, (NOW - timedelta(days=40)).date()) not in starts
    assert (3600, (NOW - timedelta(days=40)).date()) in starts
    assert all(day > (NOW - timedelta(days=401)).date() for _, day in starts)


def test_the_window_ends_with_the_step_under_way():
    window = window_for("week", datetime(2026, 3, 4, 10, 17, tzinfo=UTC))
    assert window.starts[-1] == datetime(2026, 3, 4, 10, tzinfo=UTC)
    assert window.starts[0] == datetime(2026, 2, 25, 11, tzinfo=UTC) and len(window.starts) == 168


def test_the_json_is_plain(world):
    data = _get(world.operator, "fleet", None, "hour")
    assert json.loads(json.dumps(data)) == data
    assert [c["id"] for c in data["charts"]] == ["traffic", "tokens", "ttft", "cache", "engines", "spend"]
