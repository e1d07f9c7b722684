"""The audit trail: one AuditLog row per state change, in the caller's transaction, never with a secret."""

from __future__ import annotations

import datetime
import uuid
from decimal import Decimal
from typing import Any

from django.db import models, transaction

from .models import AuditLog

# Columns whose values never enter the audit trail.
SECRET_FIELDS = frozenset({"secret_hmac", "password", "key"})


def _plain(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, datetime.datetime | datetime.date):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def snapshot(instance: models.Model) -> dict[str, Any]:
    """The instance's own columns as JSON-ready values, secrets left out."""
    data = {}
    for field in instance._meta.concrete_fields:
        if field.name in SECRET_FIELDS:
            continue
        data[field.attname] = _plain(getattr(instance, field.attname))
    return data


def changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    return {name: [before.get(name), value] for name, value in after.items() if before.get(name) != value}


def tenant_id_of(instance: models.Model) -> int | None:
    from .models import Tenant

    if isinstance(instance, Tenant):
        return instance.pk
    for path in ("tenant_id", "team.tenant_id", "api_key.team.tenant_id"):
        obj: Any = instance
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    return None


def audit_record(
    *,
    actor,
    action: str,
    instance: models.Model,
    source: str,
    details: dict[str, Any] | None = None,
    tenant_id: int | None = None,
) -> AuditLog:
    """Write one audit row. Must run inside the transaction that made the change. `actor`: a user, None (the
    system), or the name of a process acting on its own (e.g. "autoscaler")."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("audit_record must be called inside the transaction that changes the data")
    if isinstance(actor, str):
        actor_label, actor = actor, None
    else:
        actor_label = getattr(actor, "get_username", lambda: "system")() if actor is not None else "system"
    return AuditLog.objects.create(
        actor=actor if getattr(actor, "pk", None) else None,
        actor_label=actor_label,
        tenant_id=tenant_id if tenant_id is not None else tenant_id_of(instance),
        action=action,
        target_type=instance._meta.label_lower,
        target_id=str(instance.pk),
        target_repr=str(instance)[:255],
        details=details or {},
        source=source,
    )
