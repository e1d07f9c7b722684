"""Make every change made in the Django admin write exactly one AuditLog row, inside the admin's transaction; and
show what the platform writes itself (the ledger, the audit trail, the engines found running, scaling events)
without letting anyone edit it."""

from __future__ import annotations

from django.contrib import admin
from django.db import transaction

from .audit import audit_record, audited, changes, snapshot


class AuditedAdmin(admin.ModelAdmin):
    audit_name: str = ""

    def _action(self, verb: str) -> str:
        return f"{self._audit_name()}.{verb}"

    def _audit_name(self) -> str:
        return self.audit_name or self.model._meta.model_name

    def audit_snapshot(self, obj) -> dict:
        return snapshot(obj)

    def save_model(self, request, obj, form, change):
        if change:
            obj._audit_before = self.audit_snapshot(type(obj).objects.get(pk=obj.pk))
        super().save_model(request, obj, form, change)

    # The admin calls these inside the transaction of the add or change view.
    def log_addition(self, request, obj, message):
        audit_record(
            actor=request.user,
            action=self._action("create"),
            instance=obj,
            source="admin",
            details={"after": self.audit_snapshot(obj)},
        )
        return super().log_addition(request, obj, message)

    def log_change(self, request, obj, message):
        diff = changes(getattr(obj, "_audit_before", {}), self.audit_snapshot(obj))
        if diff or message:
            audit_record(
                actor=request.user,
                action=self._action("update"),
                instance=obj,
                source="admin",
                details={
                    "changes": diff,
                    "admin_message": message if isinstance(message, list) else str(message),
                },
            )
        return super().log_change(request, obj, message)

    def delete_model(self, request, obj):
        with audited(
            self._audit_name(),
            obj,
            actor=request.user,
            source="admin",
            snapshot_of=self.audit_snapshot,
            delete=True,
        ):
            super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        # One by one, so each deletion is audited as delete_model audits it; all or none.
        with transaction.atomic():
            for obj in queryset:
                self.delete_model(request, obj)


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows the platform writes, never added, changed or deleted by hand."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
