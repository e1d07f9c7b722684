"""Every page of the portal in headless Chromium after a generated day of traffic: the charts are drawn (uPlot,
static/vendor/) with the series and the points the history holds, the period buttons redraw them, nothing is
loaded from outside the platform; screenshots go to test-output/."""

from __future__ import annotations

import math
import random
import time
from datetime import timedelta
from decimal import Decimal

import pytest
import redis
from django.conf import settings
from django.db import connection
from django.utils import timezone

from portal.charts import window_for
from portal.history import history_sample
from routing.contracts import LOAD_KEY
from routing.contracts import PREFIX_HEALTH_KEY as PREFIX_KEY
from serving.models import AutoscalingPolicy, Endpoint
from tenants.billing import usage_rollup
from tenants.models import UsageRecord

from .test_browser import OUTPUT, page, running_fleet, server, sign_in  # noqa: F401  (fixtures)

pytestmark = pytest.mark.browser

# What each page's charts must show: chart id -> the series' labels.
TRAFFIC = ["Requests", "Failed", "Cancelled", "Rejected (queue)"]
TOKENS = ["Input (fresh)", "Input (cached)", "Output"]
CHARTS_JS = """() => Object.fromEntries(Object.entries(window.portalCharts).map(([key, u]) => [key, {
    series: u.series.slice(1).map(s => s.label),
    points: u.data[0].length,
    filled: u.data.slice(1).map(values => values.filter(v => v !== null && v !== 0).length),
}]))"""


def a_day_of_traffic(world) -> None:
    """Requests every minute of the last 24 hours from three keys, busier by day than by night, a few failed
    and some queued; the engines sampled every ten minutes, their load following the traffic."""
    rng = random.Random(7)
    now = timezone.now()
    pool = world.deployment.pools.get()
    AutoscalingPolicy.objects.create(pool=pool, enabled=True, max_replicas=4, ttft_p90_s=2.0, itl_p90_s=0.05)
    urls = list(Endpoint.objects.filter(pool=pool).values_list("url", flat=True))
    records = []
    for step in range(1440):
        at = now - timedelta(minutes=step)
        busy = 1 + 0.8 * math.sin(2 * math.pi * step / 1440)
        for key, scale in ((world.key_a1, 3), (world.key_a2, 1), (world.key_b1, 2)):
            for n in range(max(1, round(busy * scale))):
                prompt = rng.randint(20_000, 200_000)
                records.append(
                    UsageRecord(
                        request_id=f"day-{step}-{key.api_key.pk}-{n}",
                        tenant_id=key.api_key.team.tenant_id,
                        team_id=key.api_key.team_id,
                        api_key=key.api_key,
                        deployment=world.deployment,
                        model="tiny-qwen",
                        endpoint=urls[(step + n) % len(urls)],
                        prompt_tokens=prompt,
                        cached_prompt_tokens=int(prompt * rng.uniform(0.6, 0.98)),
                        output_tokens=rng.randint(50, 800),
                        cost=Decimal("0.00001") * rng.randint(100, 5000),
                        ttft_ms=rng.randint(200, 2500),
                        latency_ms=rng.randint(3000, 20000),
                        status="failed" if rng.random() < 0.02 else "completed",
                        priority_class=key.api_key.team.priority_class,
                        queued_ms=rng.randint(0, 3000) if busy > 1.5 else None,
                        created_at=at,
                    )
                )
    UsageRecord.objects.bulk_create(records)
    usage_rollup()
    client = redis.Redis.from_url(settings.REDIS_URL)
    endpoints = list(Endpoint.objects.filter(pool=pool))
    for step in range(144):
        at = now.timestamp() - 600 * step
        busy = 1.5 + math.sin(2 * math.pi * step / 144)
        for endpoint in endpoints:
            client.hset(
                LOAD_KEY.format(endpoint.pk),
                mapping={
                    "running": round(4 * busy),
                    "waiting": round(busy),
                    "kv_usage": 0.3 * busy,
                    "ts": time.time(),
                },
            )
        prefix = PREFIX_KEY.format(world.deployment.pk, int(at // 60))
        client.hset(prefix, mapping={"predicted": 9000, "reported": 10_000})
        history_sample(client=client, now=at)
        client.delete(prefix)
    client.delete(*(LOAD_KEY.format(e.pk) for e in endpoints))


def minutes_completed(team) -> int:
    """How many of the last 1,440 minutes (a day's chart) hold a completed request of the team."""
    first = window_for("day", timezone.now()).first
    records = UsageRecord.objects.filter(team=team, status="completed", created_at__gte=first)
    return len({at.replace(second=0, microsecond=0) for at in records.values_list("created_at", flat=True)})


def charts_on(tab, box: str = "history") -> dict:
    tab.wait_for_function(f"Number(document.getElementById('{box}').dataset.drawn) > 0")
    return {
        key.split(":", 1)[1]: value
        for key, value in tab.evaluate(CHARTS_JS).items()
        if key.startswith(box + ":")
    }


def pick(tab, period: str) -> dict:
    drawn = int(tab.get_attribute("#history", "data-drawn"))
    tab.click(f"#history button[data-period={period}]")
    tab.wait_for_function(f"Number(document.getElementById('history').dataset.drawn) > {drawn}")
    return charts_on(tab)


def test_every_page_charts_a_day_of_traffic(world, server, page):  # noqa: F811
    # A browser test before this one may have ended its server's connections, this thread's among them.
    connection.close()
    running_fleet(world)
    a_day_of_traffic(world)
    outside = []
    page.on("request", lambda r: None if r.url.startswith(server) else outside.append(r.url))
    sign_in(page, server, "olive")

    # The fleet: a day per minute by default, then each period.
    charts = charts_on(page)
    assert list(charts) == ["traffic", "tokens", "ttft", "cache", "engines", "spend"]
    assert charts["traffic"]["series"] == TRAFFIC and charts["tokens"]["series"] == TOKENS
    assert charts["ttft"]["series"] == ["tiny TTFT p90"]
    assert {c["points"] for c in charts.values()} == {1440}
    # Requests in every minute (the oldest one may have left the window if a minute began since they were made).
    assert charts["traffic"]["filled"][0] >= 1439
    assert charts["engines"]["filled"][0] >= 140  # sampled every ten minutes
    page.screenshot(path=OUTPUT / "charts-fleet-day.png", full_page=True)
    for period, points in (("hour", 60), ("week", 168), ("month", 720)):
        charts = pick(page, period)
        assert {c["points"] for c in charts.values()} == {points}, period
        assert page.locator(f"#history button[data-period={period}].active").count() == 1
    # The month: the day's 24 or 25 hours, and an hour of each of the nine days before (running_fleet's).
    assert 33 <= charts["traffic"]["filled"][0] <= 34

    # A deployment: traffic, latency against its objectives, cache, queueing, its pool against the signals.
    page.goto(f"{server}/portal/deployments/{world.deployment.pk}/")
    charts = charts_on(page)
    assert list(charts) == [
        "traffic", "tokens", "ttft", "itl", "cache", "queueing", "pool_main", "pool_main_traffic",
        "pool_main_latency", "spend",
    ]  # fmt: skip
    assert charts["ttft"]["series"] == [
        "Time to first token p50",
        "Time to first token p90",
        "Objective (p90)",
    ]
    assert charts["itl"]["series"][-1] == "Objective (p90)"
    assert charts["cache"]["series"] == [
        "Prefix-hit rate (cached / input)",
        "Cached tokens predicted / reported",
    ]
    assert charts["cache"]["filled"][1] >= 140
    assert charts["queueing"]["series"][0].startswith("Queue wait p90")
    assert charts["pool_main"]["series"] == [
        "Replicas wanted", "Engines ready", "Requests running", "Requests waiting", "KV-cache use (mean)",
    ]  # fmt: skip
    # The pool's own requests and tokens: its engines served every request, so the deployment's counts.
    assert charts["pool_main_traffic"]["series"] == [
        "Requests", "Failed", "Cancelled", "Input (fresh)", "Input (cached)", "Output",
    ]  # fmt: skip
    assert charts["pool_main_traffic"]["filled"][0] == charts["traffic"]["filled"][0]
    assert charts["spend"]["series"] == ["Spend (USD)", "Pool main (USD)"]
    # The pool's own TTFT and ITL (its engines served every request), against its policy's objectives.
    assert charts["pool_main_latency"]["series"] == [
        "TTFT p50", "TTFT p90", "ITL p50", "ITL p90", "TTFT objective (p90)", "ITL objective (p90)",
    ]  # fmt: skip
    assert all(n >= 1439 for n in charts["pool_main_latency"]["filled"][:4])
    assert {c["points"] for c in charts.values()} == {1440}
    page.screenshot(path=OUTPUT / "portal-deployment-day.png", full_page=True)
    charts = pick(page, "week")
    assert charts["ttft"]["points"] == 168 and 24 <= charts["ttft"]["filled"][1] <= 25
    assert 24 <= charts["pool_main_latency"]["filled"][1] <= 25

    # A team, seen by its admin: usage against its quota.
    page.context.clear_cookies()
    sign_in_team_admin(page, server)
    page.goto(f"{server}/portal/teams/{world.team_a1.pk}/")
    charts = charts_on(page)
    assert list(charts) == ["traffic", "tokens", "ttft", "itl", "spend"]
    assert charts["traffic"]["series"] == [*TRAFFIC, "Quota: requests/min"]
    # The team's own latency: p50 and p90 in every minute it had a completed request (a few had only failures).
    assert charts["ttft"]["series"] == ["Time to first token p50", "Time to first token p90"]
    assert charts["itl"]["series"] == ["Inter-token latency p50", "Inter-token latency p90"]
    completed = minutes_completed(world.team_a1)
    assert all(completed - 1 <= n <= completed for n in charts["ttft"]["filled"] + charts["itl"]["filled"])
    assert charts["spend"]["series"] == ["Spend (USD)"]
    assert charts["traffic"]["points"] == 1440
    page.screenshot(path=OUTPUT / "charts-team-day.png", full_page=True)
    page.context.clear_cookies()

    # The live page: the last hour, redrawn as it goes.
    sign_in(page, server, "olive")
    page.goto(f"{server}/portal/live/")
    charts = charts_on(page)
    assert charts["traffic"]["points"] == 60 and page.locator("#history button.period").count() == 0
    page.screenshot(path=OUTPUT / "charts-live.png", full_page=True)

    # The report: tables and CSV as before, charts per day of the month instead of hand-drawn bars.
    page.goto(f"{server}/portal/reports/?period=month&group_by=team")
    charts = charts_on(page, "report-days")
    days = int(
        page.evaluate("new Date(new Date().getUTCFullYear(), new Date().getUTCMonth() + 1, 0).getDate()")
    )
    assert charts["cost_per_day"]["series"] == ["Cost (USD)"] and charts["cost_per_day"]["points"] == days
    assert charts["tokens_per_day"]["series"] == TOKENS
    assert page.locator("svg.chart").count() == 0 and page.locator("#report tr.total").count() == 1
    page.screenshot(path=OUTPUT / "charts-report.png", full_page=True)

    # The other pages load too, and nothing anywhere came from outside.
    for path in (
        "/portal/teams/",
        f"/portal/deployments/{world.deployment.pk}/cost/",
        "/portal/deployments/new/",
    ):
        response = page.goto(server + path)
        assert response.status == 200, path
    assert outside == []


def sign_in_team_admin(tab, base: str) -> None:
    tab.goto(f"{base}/portal/login/")
    tab.fill("input[name=username]", "tom")
    tab.fill("input[name=password]", "pw-tom-long-enough")
    tab.click("button[type=submit]")
    tab.wait_for_url(f"{base}/portal/teams/")
