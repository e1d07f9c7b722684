"""Make every change made in the Django admin write exactly one AuditLog row, inside the admin's transaction."""

from __future__ import annotations

from django.contrib import admin
from django.db import transaction

from .audit import audit_record, changes, snapshot


class AuditedAdmin(admin.ModelAdmin):
    audit_name: str = ""

    def _action(self, verb: str) -> str:
        return f"{self.audit_name or self.model._meta.model_name}.{verb}"

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
        with transaction.atomic():
            audit_record(
                actor=request.user,
                action=self._action("delete"),
                instance=obj,
                source="admin",
                details={"before": self.audit_snapshot(obj)},
            )
            super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        with transaction.atomic():
            for obj in queryset:
                audit_record(
                    actor=request.user,
                    action=self._action("delete"),
                    instance=obj,
                    source="admin",
                    details={"before": self.audit_snapshot(obj)},
                )
            super().delete_queryset(request, queryset)
