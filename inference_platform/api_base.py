"""What every provisioning API view shares: the caller's access scope, write checks and the audit trail."""

from __future__ import annotations

from rest_framework import permissions, viewsets

from tenants.access import Access
from tenants.audit import audited, snapshot


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

    def _audited(self, instance=None, *, delete: bool = False):
        return audited(
            self.audit_name,
            instance,
            actor=self.request.user,
            source="api",
            snapshot_of=self.audit_snapshot,
            delete=delete,
        )

    def perform_create(self, serializer) -> None:
        with self._audited() as change:
            change.instance = serializer.save()

    def perform_update(self, serializer) -> None:
        with self._audited(serializer.instance) as change:
            change.instance = serializer.save()

    def perform_destroy(self, instance) -> None:
        with self._audited(instance, delete=True):
            instance.delete()

    def audit_snapshot(self, instance) -> dict:
        return snapshot(instance)
