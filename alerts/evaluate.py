"""Evaluating rules: each check's observations move each condition's state, and a crossing creates deliveries.

A condition is told once when it starts to hold (after `for_minutes`, for health rules) and, for health rules, once
when it clears; a check that finds it still holding sends nothing. A rule is evaluated under a row lock taken with
SKIP LOCKED, so two workers never evaluate (and send) the same rule at once.

A rule costs a few queries whatever its conditions (its states are read and written in bulk), and the rules of one
pass share a BudgetReader, so the ledger is read once per tenant and period, not once per rule.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from .budgets import BudgetReader, budget_observations
from .health import health_observations
from .messages import alert_payload
from .models import AlertRule, AlertState, Delivery, DeliveryEvent
from .observations import Observation

log = logging.getLogger(__name__)


def observations_of(
    rule: AlertRule, now: datetime, previous: dict[str, AlertState], reader: BudgetReader | None = None
) -> list[Observation]:
    if rule.is_budget:
        return list(budget_observations(rule, now, reader))
    return list(health_observations(rule, now, previous))


def rule_evaluate(
    *, rule_id: int, now: datetime | None = None, reader: BudgetReader | None = None
) -> list[Delivery]:
    """Check one rule now; return the deliveries its crossings created (committed, not yet sent). A pass over
    many rules gives them one `reader`, so that they share what they read of budgets and usage."""
    now = now or timezone.now()
    with transaction.atomic():
        rule = (
            AlertRule.objects.select_for_update(skip_locked=True, of=("self",))
            .select_related("tenant")
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
        observations = observations_of(rule, now, previous, reader)
        keys = [obs.key for obs in observations if obs.key not in previous]
        if keys:
            previous.update(
                {state.key: state for state in AlertState.objects.filter(rule=rule, key__in=keys)}
            )
        checked: list[tuple[AlertState, str | None]] = []
        for obs in observations:
            state = previous.pop(obs.key, None) or AlertState(rule=rule, key=obs.key, tenant_id=obs.tenant_id)
            checked.append((state, _apply(rule, state, obs, now)))
        # Conditions no check reported any more (a deployment removed, a budget taken away) have cleared.
        for state in previous.values():
            if state.holding or state.firing:
                checked.append((state, _apply(rule, state, Observation(key=state.key, holding=False), now)))
        _save_states([state for state, _ in checked])
        return _deliveries(rule, [(state, event) for state, event in checked if event])


STATE_FIELDS = [
    "holding",
    "firing",
    "holding_since",
    "fired_at",
    "resolved_at",
    "checked_at",
    "summary",
    "details",
]


def _save_states(states: list[AlertState]) -> None:
    """Every state of the rule in two statements at most: the new ones, and the changes to the others."""
    AlertState.objects.bulk_create([state for state in states if state.pk is None])
    AlertState.objects.bulk_update([state for state in states if state.pk is not None], STATE_FIELDS)


def _apply(rule: AlertRule, state: AlertState, obs: Observation, now: datetime) -> str | None:
    """Move the state by what the check observed; the event to send, if any. The caller saves the state."""
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
    return event


def _deliveries(rule: AlertRule, events: list[tuple[AlertState, str]]) -> list[Delivery]:
    if not events:
        return []
    destinations = list(rule.destinations.filter(is_active=True))
    deliveries = []
    for state, event in events:
        payload = alert_payload(rule=rule, state=state, event=event)
        deliveries += [
            Delivery(
                state=state, destination=destination, tenant_id=rule.tenant_id, event=event, payload=payload
            )
            for destination in destinations
        ]
        if destinations:
            log.info("alert %s %s: %s", event, state.key, state.summary)
    Delivery.objects.bulk_create(deliveries)
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
