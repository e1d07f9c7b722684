"""Delivering alerts: retried with backoff, every attempt recorded on the delivery, never sent twice at once, and a
tenant's webhook kept off private addresses."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from alerts import tasks
from alerts.delivery import delivery_attempt
from alerts.evaluate import rule_evaluate
from alerts.models import AlertKind, Delivery, DeliveryStatus, Destination, DestinationKind
from serving.models import ObservedStatus

from .conftest import rule_with


@pytest.fixture
def failing(world):
    world.deployment.observed_status = ObservedStatus.FAILED
    world.deployment.save()
    return world


def _one_delivery(destination) -> Delivery:
    rule = rule_with(destination, kind=AlertKind.DEPLOYMENT_HEALTH)
    (delivery,) = rule_evaluate(rule_id=rule.pk)
    return delivery


def _due_now(delivery: Delivery) -> None:
    Delivery.objects.filter(pk=delivery.pk).update(next_attempt_at=timezone.now())


def test_it_retries_with_backoff_until_the_receiver_takes_it(failing, receiver, webhook_to, settings):
    settings.ALERT_DELIVERY_BACKOFF_S = 30
    receiver.answers = [503, 500]
    delivery = _one_delivery(webhook_to())

    before = timezone.now()
    delivery = delivery_attempt(delivery_id=delivery.pk)
    assert (delivery.status, delivery.attempts, delivery.response_status) == ("pending", 1, 503)
    assert delivery.last_error.startswith("The receiver answered 503")
    assert timedelta(seconds=29) < delivery.next_attempt_at - before < timedelta(seconds=32)
    assert delivery_attempt(delivery_id=delivery.pk) is None  # not due yet

    _due_now(delivery)
    delivery = delivery_attempt(delivery_id=delivery.pk)
    assert delivery.attempts == 2
    assert (
        timedelta(seconds=59) < delivery.next_attempt_at - timezone.now() < timedelta(seconds=62)
    )  # doubled

    _due_now(delivery)
    assert tasks.deliver_due() == 1
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.response_status, delivery.last_error) == (
        "sent",
        3,
        200,
        "",
    )
    assert (
        len({r.headers["X-Platform-Delivery"] for r in receiver.requests}) == 1
    )  # one id, so receivers can dedupe
    assert len(receiver.requests) == 3
    assert tasks.deliver_due() == 0


def test_it_gives_up_after_its_attempts(failing, receiver, webhook_to, settings):
    settings.ALERT_DELIVERY_ATTEMPTS = 2
    receiver.answers = [500, 500, 500]
    delivery = _one_delivery(webhook_to())
    delivery_attempt(delivery_id=delivery.pk)
    _due_now(delivery)
    delivery = delivery_attempt(delivery_id=delivery.pk)
    assert (delivery.status, delivery.attempts) == ("failed", 2)
    _due_now(delivery)
    assert delivery_attempt(delivery_id=delivery.pk) is None


def test_a_refusal_of_the_receiver_fails_at_once(failing, receiver, webhook_to):
    receiver.answers = [404]
    delivery = delivery_attempt(delivery_id=_one_delivery(webhook_to()).pk)
    assert (delivery.status, delivery.response_status) == ("failed", 404)


def test_a_receiver_that_is_not_there_is_retried(failing, webhook_to):
    destination = Destination.objects.create(
        name="gone", kind=DestinationKind.WEBHOOK, url="http://127.0.0.1:1/x"
    )
    delivery = delivery_attempt(delivery_id=_one_delivery(destination).pk)
    assert delivery.status == "pending" and delivery.response_status is None
    assert delivery.last_error.startswith("ConnectError")


def test_a_tenants_webhook_may_not_reach_a_private_address(world, receiver, webhook_to, settings):
    settings.ALERT_WEBHOOK_ALLOW_PRIVATE = False
    world.quota_a1.spend_budget = 0
    world.quota_a1.save()
    rule = rule_with(
        webhook_to(world.tenant_a), kind=AlertKind.BUDGET, tenant=world.tenant_a, percentages=[100]
    )
    (delivery,) = rule_evaluate(rule_id=rule.pk)
    delivery = delivery_attempt(delivery_id=delivery.pk)
    assert delivery.status == DeliveryStatus.FAILED
    assert "127.0.0.1 does not resolve to a public address" in delivery.last_error
    assert receiver.requests == []


def test_a_switched_off_destination_gets_nothing_new(failing, receiver, webhook_to):
    destination = webhook_to()
    destination.is_active = False
    destination.save()
    rule = rule_with(destination, kind=AlertKind.DEPLOYMENT_HEALTH)
    assert rule_evaluate(rule_id=rule.pk) == []


def test_the_beat_task_evaluates_every_active_rule(failing, receiver, webhook_to):
    rule_with(webhook_to(name="a"), kind=AlertKind.DEPLOYMENT_HEALTH)
    rule_with(webhook_to(name="b"), kind=AlertKind.DEPLOYMENT_HEALTH, is_active=False)
    assert tasks.evaluate_alerts() == 1
    assert tasks.evaluate_alerts() == 0
