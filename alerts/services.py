"""Changes to destinations and rules, each in one transaction with its audit row (tenants/audit.py)."""

from __future__ import annotations

from django.db import models, transaction

from tenants.audit import audit_record, audited, snapshot

from .models import AlertRule, Destination, new_signing_secret


def alert_snapshot(instance: models.Model) -> dict:
    """What the audit trail keeps of a destination or rule: never the signing secret."""
    data = snapshot(instance)
    data.pop("signing_secret", None)
    if isinstance(instance, AlertRule) and instance.pk:
        data["destinations"] = sorted(instance.destinations.values_list("pk", flat=True))
    return data


def _name(instance: models.Model) -> str:
    return "alert_destination" if isinstance(instance, Destination) else "alert_rule"


def destination_create(*, actor, source: str, **fields) -> Destination:
    destination = Destination(**fields)
    destination.full_clean()
    with audited("alert_destination", actor=actor, source=source, snapshot_of=alert_snapshot) as change:
        destination.save()
        change.instance = destination
    return destination


def destination_rotate_secret(*, destination: Destination, actor, source: str) -> Destination:
    """A new signing secret; receivers must be given it (the old one stops verifying at once)."""
    with transaction.atomic():
        destination.signing_secret = new_signing_secret()
        destination.save(update_fields=["signing_secret"])
        audit_record(
            actor=actor, action="alert_destination.rotate_secret", instance=destination, source=source
        )
    return destination


def rule_create(*, actor, source: str, destinations: list[Destination], **fields) -> AlertRule:
    rule = AlertRule(**fields)
    rule.full_clean()
    with audited("alert_rule", actor=actor, source=source, snapshot_of=alert_snapshot) as change:
        rule.save()
        rule.destinations.set(destinations)
        change.instance = rule
    return rule


def alert_object_delete(*, instance: Destination | AlertRule, actor, source: str) -> None:
    with audited(
        _name(instance), instance, actor=actor, source=source, snapshot_of=alert_snapshot, delete=True
    ):
        instance.delete()
