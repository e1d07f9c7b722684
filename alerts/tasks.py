"""Celery tasks for alerts: beat evaluates every rule and sweeps due deliveries; each new delivery is also sent
at once by its own task."""

from __future__ import annotations

import logging

from celery import shared_task

from .delivery import delivery_attempt, due_deliveries
from .evaluate import rule_evaluate
from .models import AlertRule

log = logging.getLogger(__name__)


@shared_task(acks_late=True, ignore_result=True)
def evaluate_alerts() -> int:
    """Check every active rule; return how many deliveries the crossings created. One rule's error does not stop
    the others."""
    created = 0
    for rule_id in AlertRule.objects.filter(is_active=True).values_list("pk", flat=True):
        try:
            created += len(rule_evaluate(rule_id=rule_id))
        except Exception:
            log.exception("alerts: rule %s could not be evaluated", rule_id)
    return created


@shared_task(acks_late=True, ignore_result=True)
def deliver(delivery_id: int) -> None:
    delivery_attempt(delivery_id=delivery_id)


@shared_task(acks_late=True, ignore_result=True)
def deliver_due() -> int:
    """Send what is due: retries whose backoff has passed, and deliveries whose own task was lost."""
    sent = 0
    for delivery_id in due_deliveries():
        sent += delivery_attempt(delivery_id=delivery_id) is not None
    return sent
