"""Celery tasks for alerts: beat evaluates every rule and sweeps due deliveries; each new delivery is also sent
at once by its own task. Deliveries run on the queue "alerts" (settings.CELERY_TASK_ROUTES), served by workers of
their own: a receiver that is slow to answer takes none of the threads the platform's own tasks run on."""

from __future__ import annotations

import logging

from celery import shared_task
from django.utils import timezone

from .budgets import BudgetReader
from .delivery import delivery_attempt, due_deliveries
from .evaluate import rule_evaluate
from .models import AlertRule

log = logging.getLogger(__name__)


@shared_task(acks_late=True, ignore_result=True)
def evaluate_alerts() -> int:
    """Check every active rule; return how many deliveries the crossings created. One rule's error does not stop
    the others. The rules share one reader, so budgets and usage are read once for the whole pass."""
    created, now, reader = 0, timezone.now(), BudgetReader()
    for rule_id in AlertRule.objects.filter(is_active=True).values_list("pk", flat=True):
        try:
            created += len(rule_evaluate(rule_id=rule_id, now=now, reader=reader))
        except Exception:
            log.exception("alerts: rule %s could not be evaluated", rule_id)
    return created


@shared_task(acks_late=True, ignore_result=True)
def deliver(delivery_id: int) -> None:
    delivery_attempt(delivery_id=delivery_id)


@shared_task(acks_late=True, ignore_result=True)
def deliver_due() -> int:
    """Send what is due: retries whose backoff has passed, and deliveries whose own task was lost. One delivery's
    error (its attempt is counted all the same) does not hold up those behind it."""
    sent = 0
    for delivery_id in due_deliveries():
        try:
            sent += delivery_attempt(delivery_id=delivery_id) is not None
        except Exception:
            log.exception("alerts: delivery %s could not be attempted", delivery_id)
    return sent
