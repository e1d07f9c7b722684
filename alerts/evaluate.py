"""Evaluating rules: each check's observations move each condition's state, and a crossing creates deliveries.

A condition is told once when it starts to hold (after `for_minutes`, for health rules) and, for health rules, once
when it clears; a check that finds it still holding sends nothing. A rule is evaluated under a row lock taken with
SKIP LOCKED, so two workers never evaluate (and send) the same rule at once.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from .budgets import budget_observations
from .health import health_observations
from .messages import alert_payload
from .models import AlertRule, AlertState, Delivery, DeliveryEvent
from .observations import Observation

log = logging.getLogger(__name__)


def observations_of(rule: AlertRule, now: datetime, previous: dict[str, AlertState]) -> list[Observation]:
    if rule.is_budget:
        return list(budget_observations(rule, now))
    return list(health_observations(rule, now, previous))


def rule_evaluate(*, rule_id: int, now: datetime | None = None) -> list[Delivery]:
    """Check one rule now; return the deliveries its crossings created (committed, not yet sent)."""
    now = now or timezone.now()
    with transaction.atomic():
        rule = (
            AlertRule.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(pk=rule_id, is_active=True)
            .first()
        )
        if rule is None:
            return []
        states = AlertState.objects.filter(rule=rule)
        # A health rule has few conditions, and a check may read its own history (the crash loop's restart
        # counts); a budget rule's pile up period after period, so only those that still hold are read first.
        if rule.is_budget:
            states = states.filter(Q(holding=True) | Q(firing=True))
        previous = {state.key: state for state in states}
        observations = observations_of(rule, now, previous)
        keys = [obs.key for obs in observations if obs.key not in previous]
        previous.update({state.key: state for state in AlertState.objects.filter(rule=rule, key__in=keys)})
        deliveries: list[Delivery] = []
        for obs in observations:
            state = previous.pop(obs.key, None) or AlertState(rule=rule, key=obs.key, tenant_id=obs.tenant_id)
            deliveries += _apply(rule, state, obs, now)
        # Conditions no check reported any more (a deployment removed, a budget taken away) have cleared.
        for state in previous.values():
            if state.holding or state.firing:
                deliveries += _apply(rule, state, Observation(key=state.key, holding=False), now)
    return deliveries


def _apply(rule: AlertRule, state: AlertState, obs: Observation, now: datetime) -> list[Delivery]:
    state.checked_at = now
    if obs.summary:
        state.summary = obs.summary[:500]
    if obs.details:
        state.details = obs.details
    event = None
    if obs.holding:
        if not state.holding:
            state.holding, state.holding_since = True, now
        sustained = now - state.holding_since >= timedelta(minutes=rule.for_minutes)
        if not state.firing and sustained:
            state.firing, state.fired_at, state.resolved_at = True, now, None
            event = None if obs.quiet else DeliveryEvent.FIRING
    elif obs.holding is False:
        state.holding, state.holding_since = False, None
        if state.firing:
            state.firing, state.resolved_at = False, now
            # A budget crossed stays crossed for its period; only health conditions are told they cleared.
            event = None if rule.is_budget or not obs.summary else DeliveryEvent.RESOLVED
    state.save()
    return _deliveries(rule, state, event) if event else []


def _deliveries(rule: AlertRule, state: AlertState, event: str) -> list[Delivery]:
    payload = alert_payload(rule=rule, state=state, event=event)
    deliveries = [
        Delivery.objects.create(
            state=state, destination=destination, tenant_id=rule.tenant_id, event=event, payload=payload
        )
        for destination in rule.destinations.filter(is_active=True)
    ]
    if deliveries:
        log.info("alert %s %s: %s", event, state.key, state.summary)
        for delivery in deliveries:
            transaction.on_commit(lambda pk=delivery.pk: _enqueue(pk))
    return deliveries


def _enqueue(delivery_id: int) -> None:
    """Send at once; if the broker cannot take the task, the periodic sweep of due deliveries sends it."""
    from .tasks import deliver

    try:
        deliver.delay(delivery_id)
    except Exception as exc:  # noqa: BLE001 - any broker error: the sweep retries
        log.warning("alerts: delivery %s left to the sweep: %s", delivery_id, exc)
