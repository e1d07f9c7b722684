"""Admission under concurrency: N requests at once never exceed a limit or a budget, across replicas."""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal

import httpx
from django.utils import timezone

from tenants.keys import api_key_create
from tenants.models import PriceSheet, Quota, Scope, Team, Tenant

from ..serving.engines import MODEL_NAME
from .conftest import set_quota
from .usage import usage_events


async def fire(urls: list[str], key: str, n: int, **body) -> list[httpx.Response]:
    payload = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
        **body,
    }
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(
            *[
                client.post(
                    f"{urls[i % len(urls)]}/v1/chat/completions",
                    json=payload,
                    headers={"authorization": f"Bearer {key}"},
                )
                for i in range(n)
            ]
        )


def clear_of_the_minutes_turn(margin_s: float = 20.0) -> None:
    """Wait for the next minute when this one has less than `margin_s` left: a per-minute count starts afresh at
    the turn, and a burst on a loaded host can take seconds."""
    left = 60.0 - time.time() % 60
    if left < margin_s:
        time.sleep(left + 0.1)


def test_it_admits_exactly_the_requests_per_minute_allowed(fleet):
    set_quota(fleet, requests_per_minute=7)
    clear_of_the_minutes_turn()
    responses = asyncio.run(fire([fleet.router.url], fleet.key.secret, 25))
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == 7 and statuses.count(429) == 18
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-limit-requests"] == "7"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "requests per minute" in refused.json()["error"]["message"]


def test_it_caps_concurrent_requests_and_frees_slots_when_they_end(fleet):
    set_quota(fleet, max_concurrent_requests=3)
    responses = asyncio.run(fire([fleet.router.url], fleet.key.secret, 12, max_tokens=60))
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == 3 and statuses.count(429) == 9
    later = asyncio.run(fire([fleet.router.url], fleet.key.secret, 3))  # the slots came back
    assert [r.status_code for r in later] == [200, 200, 200]


def test_concurrent_requests_never_overshoot_a_token_budget(fleet):
    budget = 400
    set_quota(fleet, token_budget=budget, budget_period="day")
    responses = asyncio.run(fire([fleet.router.url], fleet.key.secret, 30, max_tokens=20))
    ok = [r for r in responses if r.status_code == 200]
    assert ok and len(ok) < 30
    used = sum(r.json()["usage"]["total_tokens"] for r in ok)
    assert used <= budget
    refused = next(r for r in responses if r.status_code == 429)
    assert "token budget" in refused.json()["error"]["message"]


def test_concurrent_requests_never_overshoot_a_spend_budget_on_two_replicas(fleet):
    from .conftest import start_router

    PriceSheet.objects.create(
        served_model_name=MODEL_NAME,
        effective_from=timezone.now() - timezone.timedelta(days=1),
        input_per_mtok=Decimal("1000"),
        cached_input_per_mtok=Decimal("100"),
        output_per_mtok=Decimal("4000"),
    )
    set_quota(fleet, spend_budget=Decimal("0.5"), budget_period="month")
    second = start_router()
    try:
        responses = asyncio.run(fire([fleet.router.url, second.url], fleet.key.secret, 40, max_tokens=10))
    finally:
        second.stop()
    ok = [r for r in responses if r.status_code == 200]
    assert ok and len(ok) < 40, [(r.status_code, r.text[:200]) for r in responses[:3]]
    spent = sum(
        (
            Decimal(r.json()["usage"]["prompt_tokens"]) * 1000
            + Decimal(r.json()["usage"]["completion_tokens"]) * 4000
        )
        / 1_000_000
        for r in ok
    )
    assert spent <= Decimal("0.5")


def test_every_request_emits_exactly_one_usage_event(fleet):
    responses = asyncio.run(fire([fleet.router.url], fleet.key.secret, 10, max_tokens=3))
    ids = [r.headers["x-request-id"] for r in responses]
    events = usage_events(ids, wait_for=10)
    assert sorted(e.request_id for e in events) == sorted(ids)
    for event in events:
        assert event.status == "completed" and event.output_tokens == 3 and event.prompt_tokens > 0
        assert event.team_id == fleet.team.id and event.api_key_id == fleet.key.api_key.id
        assert event.deployment_id == fleet.deployment.id and event.model == MODEL_NAME
        assert event.endpoint in {e.url for e in fleet.engines}
        assert event.ttft_ms is not None and event.latency_ms >= event.ttft_ms


def test_a_tenants_ceilings_hold_for_all_its_teams_together(fleet):
    """An operator's ceiling is a credit limit: a tenant admin who adds teams and keys, each with a quota within
    the ceiling, gets no more than the ceiling in all."""
    tenant = fleet.team.tenant
    second_team = Team.objects.create(tenant=tenant, name="More agents", slug="more-agents")
    second_key = api_key_create(team=second_team, name="agent", scopes=[Scope.INFERENCE])
    for team in (fleet.team, second_team):
        Quota.objects.create(team=team, requests_per_minute=6, token_budget=10_000, budget_period="month")
    Tenant.objects.filter(pk=tenant.pk).update(max_requests_per_minute=8)
    fleet.sync()
    clear_of_the_minutes_turn()

    async def both() -> list[httpx.Response]:
        first, second = await asyncio.gather(
            fire([fleet.router.url], fleet.key.secret, 6), fire([fleet.router.url], second_key.secret, 6)
        )
        return first + second

    statuses = [r.status_code for r in asyncio.run(both())]
    assert statuses.count(200) == 8 and statuses.count(429) == 4, statuses
    (refused,) = asyncio.run(fire([fleet.router.url], fleet.key.secret, 1))
    assert refused.status_code == 429
    assert refused.json()["error"]["message"] == "Rate limit reached for this tenant: requests per minute."
    assert refused.headers["x-ratelimit-limit-requests"] == "8"
    # Another tenant's teams are not counted against it.
    other_tenant = Tenant.objects.create(name="Other", slug="other")
    other_team = Team.objects.create(tenant=other_tenant, name="Bots", slug="bots")
    other_key = api_key_create(team=other_team, name="bot", scopes=[Scope.INFERENCE])
    fleet.sync()
    assert [r.status_code for r in asyncio.run(fire([fleet.router.url], other_key.secret, 3))] == [200] * 3
