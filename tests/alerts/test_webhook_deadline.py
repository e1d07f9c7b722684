"""A tenant's webhook cannot hold a worker: one deadline for the whole attempt, only the first bytes of the answer
read, no second attempt while one still runs, and deliveries on a queue (and workers) of their own."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from django.conf import settings as django_settings
from django.db import connection

from alerts import delivery as delivery_module
from alerts import tasks
from alerts.delivery import delivery_attempt
from alerts.evaluate import rule_evaluate
from alerts.models import AlertKind, Delivery, Destination, DestinationKind
from inference_platform import devstack
from serving.models import ObservedStatus

from .conftest import rule_with


@pytest.fixture
def failing(world):
    world.deployment.observed_status = ObservedStatus.FAILED
    world.deployment.save()
    return world


def _delivery_to(url: str) -> Delivery:
    destination = Destination.objects.create(name="hostile", kind=DestinationKind.WEBHOOK, url=url)
    (delivery,) = rule_evaluate(rule_id=rule_with(destination, kind=AlertKind.DEPLOYMENT_HEALTH).pk)
    return delivery


def _timed_attempt(delivery: Delivery) -> tuple[Delivery, float]:
    started = time.monotonic()
    delivery = delivery_attempt(delivery_id=delivery.pk)
    return delivery, time.monotonic() - started


def test_a_receiver_that_drips_its_answer_is_cut_off_at_the_deadline(failing, hostile, settings):
    # A byte every 0.1 s: each read waits far less than the timeout, but the whole answer never comes.
    settings.ALERT_WEBHOOK_TIMEOUT_S = 1
    delivery, took = _timed_attempt(_delivery_to(f"{hostile.base}/drip"))
    assert took < 3, f"the attempt took {took:.1f} s"
    assert (delivery.status, delivery.attempts) == ("pending", 1)  # retried later, like any timeout
    assert delivery.last_error == "No complete answer within 1 s."


@pytest.mark.parametrize("status", [500, 200])
def test_only_the_first_bytes_of_an_endless_answer_are_read(failing, hostile, settings, status):
    settings.ALERT_WEBHOOK_TIMEOUT_S = 5
    delivery, took = _timed_attempt(_delivery_to(f"{hostile.base}/endless/{status}"))
    assert took < 2, f"the attempt took {took:.1f} s"
    if status == 200:
        assert delivery.status == "sent"
    else:
        assert delivery.response_status == 500
        assert delivery.last_error == "The receiver answered 500: " + "x" * 300


def test_no_second_attempt_starts_while_one_still_runs(
    failing, hostile, settings, monkeypatch, transactional_db
):
    """Were an attempt to outlive its claim, the sweep would claim the delivery again and start another beside it
    (and another, claim after claim). The deadline stays well inside the claim, whatever the setting says."""
    monkeypatch.setattr(delivery_module, "CLAIM_S", 2)
    settings.ALERT_WEBHOOK_TIMEOUT_S = 60
    delivery = _delivery_to(f"{hostile.base}/drip")

    def first() -> None:
        try:
            delivery_attempt(delivery_id=delivery.pk)
        finally:
            connection.close()

    running = threading.Thread(target=first)
    running.start()
    try:
        while not hostile.requests:  # the first attempt has its claim and is waiting on the receiver
            assert running.is_alive()
            time.sleep(0.01)
        until = time.monotonic() + 3  # past the claim
        while time.monotonic() < until:
            assert delivery_attempt(delivery_id=delivery.pk) is None
            time.sleep(0.1)
    finally:
        running.join(timeout=hostile.GIVE_UP_S + 5)
    assert hostile.requests == ["/drip"]
    delivery.refresh_from_db()
    assert delivery.attempts == 1 and delivery.last_error == "No complete answer within 1 s."


def test_deliveries_go_to_their_own_queue(db):
    broker = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    broker.delete("alerts")
    before = broker.llen("celery")
    try:
        tasks.deliver.delay(0)
        tasks.deliver_due.delay()
        assert broker.llen("alerts") == 2
        assert broker.llen("celery") == before
    finally:
        broker.delete("alerts")


def test_make_run_serves_each_queue_with_workers_of_its_own():
    """The default worker's threads (reconcile, autoscaling, usage ingestion, quota restore) take no delivery and
    no what-if run; each routed queue has a worker."""
    workers = devstack.celery_workers(["celery"])
    queues = {name: command[command.index("--queues") + 1].split(",") for name, command in workers.items()}
    assert queues.pop("worker") == ["celery"]
    routed = {route["queue"] for route in django_settings.CELERY_TASK_ROUTES.values()}
    assert routed >= {"alerts", "whatif"}
    assert sorted(queue for names in queues.values() for queue in names) == sorted(routed)
