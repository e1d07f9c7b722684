"""What every provisioning API view shares: the caller's access scope, write checks and the audit trail."""

from __future__ import annotations

from django.db import transaction
from rest_framework import permissions, viewsets

from tenants.access import Access
from tenants.audit import audit_record, changes, snapshot


def access_of(request) -> Access:
    cached = getattr(request, "_platform_access", None)
    if cached is None:
        user = request.user
        cached = user.access if hasattr(user, "access") else Access.for_user(user)
        request._platform_access = cached
    return cached


class PeopleOnly(permissions.BasePermission):
    """API keys may read usage only; everything else needs a person's credentials."""

    message = "API keys can only read usage; sign in or use a personal token for this."

    def has_permission(self, request, view) -> bool:
        return not hasattr(request.user, "api_key") or getattr(view, "allow_api_keys", False)


class ScopedWrite(permissions.BasePermission):
    """Reads follow the view's scoped queryset; writes ask the view."""

    message = "You do not have permission to change this."

    def has_permission(self, request, view) -> bool:
        if request.method in permissions.SAFE_METHODS or view.action not in ("create",):
            return True
        return view.can_create(access_of(request))

    def has_object_permission(self, request, view, obj) -> bool:
        if request.method in permissions.SAFE_METHODS:
            return True
        return view.can_change(access_of(request), obj)


class AuditedModelViewSet(viewsets.ModelViewSet):
    """A model viewset whose queryset is the caller's scope and whose every change is audited."""

    permission_classes = [permissions.IsAuthenticated, PeopleOnly, ScopedWrite]
    audit_name: str = ""

    @property
    def access(self) -> Access:
        return access_of(self.request)

    def can_create(self, access: Access) -> bool:
        return access.is_operator

    def can_change(self, access: Access, obj) -> bool:
        return access.is_operator

    def get_serializer_context(self):
        return {**super().get_serializer_context(), "access": self.access}

    def _audit(self, action: str, instance, details: dict) -> None:
        audit_record(
            actor=self.request.user,
            action=f"{self.audit_name}.{action}",
            instance=instance,
            source="api",
            details=details,
        )

    def perform_create(self, serializer) -> None:
        with transaction.atomic():
            instance = serializer.save()
            self._audit("create", instance, {"after": self.audit_snapshot(instance)})

    def perform_update(self, serializer) -> None:
        with transaction.atomic():
            before = self.audit_snapshot(serializer.instance)
            instance = serializer.save()
            diff = changes(before, self.audit_snapshot(instance))
            if diff:
                self._audit("update", instance, {"changes": diff})

    def perform_destroy(self, instance) -> None:
        with transaction.atomic():
            self._audit("delete", instance, {"before": self.audit_snapshot(instance)})
            instance.delete()

    def audit_snapshot(self, instance) -> dict:
        return snapshot(instance)
