"""The audit trail: one AuditLog row per state change, in the caller's transaction, never with a secret.
`audited` makes a change to one row and writes its audit row, in one transaction: the services and the API views
change rows through it, and the admin deletes through it (its add and change views audit in their own transaction,
tenants/admin_audit.py)."""

from __future__ import annotations

import contextlib
import datetime
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


@dataclass
class Change:
    """The row an `audited` block changes: set `instance` to the row the block creates (or to the one it saved,
    when that is another object than the one it was given)."""

    instance: models.Model | None


@contextlib.contextmanager
def audited(
    name: str,
    instance: models.Model | None = None,
    *,
    actor,
    source: str,
    snapshot_of: Callable[[models.Model], dict[str, Any]] = snapshot,
    delete: bool = False,
    verb: str = "update",
) -> Iterator[Change]:
    """Change one row in the block, in one transaction with its audit row `<name>.<verb>`, the row's
    `snapshot_of` in its details:

    - no `instance`: the block creates the row and sets `change.instance`: `create`, with what it is;
    - `delete`: the block deletes `instance`: `delete`, with what it was, written first (while the row has its id);
    - otherwise the block changes `instance`: `update` (or `verb`: `revoke`), with the fields that changed; no
      row when none did.

    An error in the block rolls back the change and its audit row together."""

    def record(action: str, row: models.Model, details: dict[str, Any]) -> None:
        audit_record(actor=actor, action=f"{name}.{action}", instance=row, source=source, details=details)

    with transaction.atomic():
        change = Change(instance)
        before = snapshot_of(instance) if instance is not None else None
        if delete:
            record("delete", instance, {"before": before})
            yield change
            return
        yield change
        after = snapshot_of(change.instance)
        if before is None:
            record("create", change.instance, {"after": after})
        elif diff := changes(before, after):
            record(verb, change.instance, {"changes": diff})
