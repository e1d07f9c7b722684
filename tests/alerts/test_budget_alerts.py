"""Budget alerts: percentages of a team's or tenant's token and spend budget, and the forecast, each told once per
crossing, through a real HTTP receiver and a real SMTP server."""

from __future__ import annotations

from datetime import UTC, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from alerts.delivery import delivery_attempt, signature_valid
from alerts.evaluate import rule_evaluate
from alerts.models import AlertKind, AlertState, BudgetScope, Destination, DestinationKind
from tests.conftest import make_usage

from .conftest import rule_with


@pytest.fixture(autouse=True)
def _local_receivers(settings):
    # The receivers run on this machine; tenants' webhooks are otherwise refused private addresses.
    settings.ALERT_WEBHOOK_ALLOW_PRIVATE = True


def _send(deliveries) -> None:
    for delivery in deliveries:
        assert delivery_attempt(delivery_id=delivery.pk).status == "sent"


def _spend_budget(world, amount: str) -> None:
    world.quota_a1.spend_budget = Decimal(amount)
    world.quota_a1.save()


def test_it_tells_each_percentage_once_as_it_is_crossed(world, receiver, webhook_to):
    _spend_budget(world, "1.00")
    destination = webhook_to(world.tenant_a)
    rule = rule_with(destination, kind=AlertKind.BUDGET, tenant=world.tenant_a, percentages=[50, 80, 100])

    assert rule_evaluate(rule_id=rule.pk) == []  # 0.00012 of 1.00 spent

    make_usage(world.key_a1, "spend-1", cost=Decimal("0.55"))
    _send(rule_evaluate(rule_id=rule.pk))
    assert len(receiver.requests) == 1
    sent = receiver.requests[0]
    assert "team acme/agents has used 55 % of its spend budget this month" in sent.json["text"].lower()
    assert sent.json["alert"]["details"]["percentage"] == 50
    assert sent.json["alert"]["event"] == "firing"
    assert signature_valid(
        destination.signing_secret,
        sent.headers["X-Platform-Timestamp"],
        sent.body,
        sent.headers["X-Platform-Signature"],
    )
    assert not signature_valid(
        "whsec_another", sent.headers["X-Platform-Timestamp"], sent.body, sent.headers["X-Platform-Signature"]
    )

    # Checked again with nothing new: nothing is sent.
    assert rule_evaluate(rule_id=rule.pk) == []

    # Past 80 and 100 % at once: only 100 % is told; 80 % is marked crossed, silently.
    make_usage(world.key_a1, "spend-2", cost=Decimal("0.50"))
    _send(rule_evaluate(rule_id=rule.pk))
    assert len(receiver.requests) == 2
    assert receiver.requests[1].json["alert"]["details"]["percentage"] == 100
    assert AlertState.objects.filter(rule=rule, firing=True).count() == 3
    assert rule_evaluate(rule_id=rule.pk) == []


def test_it_tells_again_when_a_raised_budget_is_crossed_again(world, receiver, webhook_to):
    _spend_budget(world, "0.10")
    rule = rule_with(
        webhook_to(world.tenant_a), kind=AlertKind.BUDGET, tenant=world.tenant_a, percentages=[80]
    )
    make_usage(world.key_a1, "spend-1", cost=Decimal("0.09"))
    _send(rule_evaluate(rule_id=rule.pk))
    _spend_budget(world, "1.00")  # raised: no longer past 80 %
    assert rule_evaluate(rule_id=rule.pk) == []
    make_usage(world.key_a1, "spend-2", cost=Decimal("0.90"))
    _send(rule_evaluate(rule_id=rule.pk))
    assert len(receiver.requests) == 2


def test_it_watches_token_budgets_and_only_its_own_team(world, receiver, webhook_to):
    world.quota_a1.token_budget = 2000
    world.quota_a1.save()
    rule = rule_with(
        webhook_to(world.tenant_a),
        kind=AlertKind.BUDGET,
        tenant=world.tenant_a,
        team=world.team_a2,
        percentages=[50],
    )
    make_usage(world.key_a1, "tokens-1", prompt_tokens=1000, cached_prompt_tokens=0, output_tokens=500)
    assert rule_evaluate(rule_id=rule.pk) == []  # team a1 is past 50 %, but the rule watches team a2

    rule.team = None
    rule.save()
    deliveries = rule_evaluate(rule_id=rule.pk)
    _send(deliveries)
    alert = receiver.requests[0].json["alert"]
    assert alert["details"]["budget"] == "token"
    assert alert["details"]["used"] == "2550"  # both records' input and output tokens


def test_it_forecasts_a_budget_that_runs_out_before_the_period_ends(world, receiver, webhook_to):
    world.quota_a1.budget_period = "day"
    world.quota_a1.token_budget = 3000
    world.quota_a1.save()
    rule = rule_with(webhook_to(world.tenant_a), kind=AlertKind.BUDGET_FORECAST, tenant=world.tenant_a)
    yesterday = (
        (timezone.now() - timedelta(days=1))
        .astimezone(UTC)
        .replace(hour=0, minute=0, second=0, microsecond=0)
    )
    make_usage(
        world.key_a1,
        "early",
        prompt_tokens=1000,
        cached_prompt_tokens=0,
        output_tokens=0,
        created_at=yesterday + timedelta(hours=1),
    )
    # At 06:00, 1000 of 3000 tokens used: 4000 forecast for the day.
    _send(rule_evaluate(rule_id=rule.pk, now=yesterday + timedelta(hours=6)))
    assert len(receiver.requests) == 1
    alert = receiver.requests[0].json["alert"]
    assert alert["kind"] == "budget_forecast"
    assert alert["details"]["forecast"] == "4000.0000"
    assert "runs out around" in alert["summary"]
    assert alert["summary"].startswith("At this day's rate, team acme/agents's token budget")

    # Told once while the forecast holds; at 18:00 the same usage forecasts 1333: cleared, silently.
    assert rule_evaluate(rule_id=rule.pk, now=yesterday + timedelta(hours=7)) == []
    assert rule_evaluate(rule_id=rule.pk, now=yesterday + timedelta(hours=18)) == []
    state = AlertState.objects.get(rule=rule)
    assert not state.firing and state.resolved_at is not None


def test_it_makes_no_forecast_early_in_the_period(world, webhook_to):
    world.quota_a1.budget_period = "day"
    world.quota_a1.token_budget = 10
    world.quota_a1.save()
    rule = rule_with(webhook_to(world.tenant_a), kind=AlertKind.BUDGET_FORECAST, tenant=world.tenant_a)
    start = (
        (timezone.now() - timedelta(days=1))
        .astimezone(UTC)
        .replace(hour=0, minute=0, second=0, microsecond=0)
    )
    make_usage(world.key_a1, "first-minute", created_at=start + timedelta(seconds=30))
    assert rule_evaluate(rule_id=rule.pk, now=start + timedelta(minutes=1)) == []


def test_it_watches_every_tenants_ceiling_for_the_operators(world, receiver, webhook_to):
    world.tenant_a.max_spend_budget = Decimal("0.001")
    world.tenant_a.save()
    rule = rule_with(
        webhook_to(None), kind=AlertKind.BUDGET, budget_scope=BudgetScope.TENANT, percentages=[100]
    )
    make_usage(world.key_a2, "spend-a2", cost=Decimal("0.0009"))
    _send(rule_evaluate(rule_id=rule.pk))
    assert len(receiver.requests) == 1
    alert = receiver.requests[0].json["alert"]
    assert alert["details"]["scope"] == "tenant" and alert["details"]["id"] == world.tenant_a.pk
    assert "Tenant acme has used 102 %" in alert["summary"]
    assert AlertState.objects.get(rule=rule).tenant_id == world.tenant_a.pk


def test_it_sends_budget_alerts_by_email(world, smtp):
    _spend_budget(world, "0.0001")
    destination = Destination.objects.create(
        tenant=world.tenant_a, name="finance", kind=DestinationKind.EMAIL, emails=["finance@acme.example"]
    )
    rule = rule_with(destination, kind=AlertKind.BUDGET, tenant=world.tenant_a, percentages=[100])
    _send(rule_evaluate(rule_id=rule.pk))
    assert len(smtp.messages) == 1
    recipients, message = smtp.messages[0]
    assert recipients == ["finance@acme.example"]
    assert message["Subject"].startswith("[FIRING] Budget used: Team acme/agents has used 120 %")
    assert "Condition: team:" in message.get_payload()
