from __future__ import annotations

from datetime import UTC

import django_filters
from django.core.exceptions import ValidationError
from django_filters.fields import IsoDateTimeField
from drf_spectacular.utils import extend_schema
from rest_framework import permissions, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from inference_platform.api_base import AuditedModelViewSet, PeopleOnly, access_of
from inference_platform.api_query import IdFilter, StrictFilterSet

from ..entitlements import TEAM_ADMIN_FIELDS, entitlement_snapshot
from ..keys import api_key_create, api_key_revoke
from ..models import TEAM_ROLES, BudgetPeriod, PriorityClass, UsageRecord, UsageStatus
from ..periods import period_bounds
from . import serializers as s


class TenantViewSet(AuditedModelViewSet):
    serializer_class = s.TenantSerializer
    audit_name = "tenant"
    filterset_fields = ["slug", "is_active"]

    def get_queryset(self):
        return self.access.tenants_qs()


class TeamViewSet(AuditedModelViewSet):
    """Teams. Tenant admins change everything of their tenant's teams; a team's admins change only its priority
    class (PATCH), within the tenant's highest."""

    serializer_class = s.TeamSerializer
    audit_name = "team"
    filterset_fields = ["tenant", "slug", "priority_class", "restrict_models"]

    def get_queryset(self):
        return self.access.teams_qs().prefetch_related("deployments")

    def can_create(self, access):
        return access.is_operator or bool(access.admin_tenants)

    def can_change(self, access, obj):
        if access.can_admin_tenant(obj.tenant_id):
            return True
        if obj.id not in access.admin_teams:
            return False
        sent = set(self.request.data) if isinstance(self.request.data, dict) else set()
        if self.action == "partial_update" and sent <= TEAM_ADMIN_FIELDS:
            return True
        raise PermissionDenied("A team's admins may change only its priority_class (with PATCH).")

    def audit_snapshot(self, instance):
        return entitlement_snapshot(instance)


class MembershipViewSet(AuditedModelViewSet):
    serializer_class = s.MembershipSerializer
    audit_name = "membership"
    filterset_fields = ["tenant", "team", "role"]

    def get_queryset(self):
        return self.access.memberships_qs()

    def can_create(self, access):
        return access.administers_anything

    def can_change(self, access, obj):
        if access.can_admin_tenant(obj.tenant_id):
            return True
        return obj.role in TEAM_ROLES and obj.team_id in access.admin_teams


class ApiKeyViewSet(AuditedModelViewSet):
    """API keys. Creating one returns its secret in `key`, this once; keys are revoked, not deleted."""

    serializer_class = s.ApiKeySerializer
    audit_name = "api_key"
    filterset_fields = ["team", "team__tenant"]
    http_method_names = ["get", "post", "put", "patch", "head", "options"]

    def get_queryset(self):
        return self.access.api_keys_qs()

    def can_create(self, access):
        return access.administers_anything

    def can_change(self, access, obj):
        return access.can_manage_team(obj.team)

    def audit_snapshot(self, instance):
        return entitlement_snapshot(instance)

    @extend_schema(responses={201: s.IssuedApiKeySerializer})
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        issued = api_key_create(actor=request.user, source="api", **serializer.validated_data)
        body = s.IssuedApiKeySerializer(issued.api_key, context=self.get_serializer_context()).data
        body["key"] = issued.secret
        return Response(body, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})

    @extend_schema(request=None, responses={200: s.ApiKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        """Revoke the key at once; it stops working on every router within seconds."""
        api_key = self.get_object()
        api_key_revoke(api_key=api_key, actor=request.user, source="api")
        api_key.refresh_from_db()
        return Response(self.get_serializer(api_key).data)


class QuotaViewSet(AuditedModelViewSet):
    serializer_class = s.QuotaSerializer
    audit_name = "quota"
    filterset_fields = ["team", "api_key"]

    def get_queryset(self):
        return self.access.quotas_qs()

    def can_create(self, access):
        return access.is_operator or bool(access.admin_tenants)

    def can_change(self, access, obj):
        return access.can_admin_tenant(obj.team.tenant_id)


class ModelAliasViewSet(AuditedModelViewSet):
    """A tenant's names for deployments: its agents call the alias, and moving it moves them all. Everyone in
    the tenant reads them; its admins change them."""

    serializer_class = s.ModelAliasSerializer
    audit_name = "model_alias"
    filterset_fields = ["tenant", "name", "deployment"]

    def get_queryset(self):
        return self.access.model_aliases_qs()

    def can_create(self, access):
        return access.is_operator or bool(access.admin_tenants)

    def can_change(self, access, obj):
        return access.can_admin_tenant(obj.tenant_id)


class PriceSheetViewSet(AuditedModelViewSet):
    serializer_class = s.PriceSheetSerializer
    audit_name = "price_sheet"
    filterset_fields = ["served_model_name", "tenant", "currency"]

    def get_queryset(self):
        return self.access.price_sheets_qs()


class UtcDateTimeField(IsoDateTimeField):
    """An ISO 8601 time, handed on in UTC. PostgreSQL refuses offsets beyond 15:59 that Python accepts (up to
    23:59), and a time near the calendar's ends may not exist in UTC: both are the client's to fix, not 500s."""

    def to_python(self, value):
        parsed = super().to_python(value)
        if parsed is None:
            return None
        try:
            return parsed.astimezone(UTC)
        except OverflowError:
            raise ValidationError(
                "This time is out of range once converted to UTC; give one between years 1 and 9999.",
                code="out_of_range",
            ) from None


class UtcDateTimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UtcDateTimeField


class UsageFilter(StrictFilterSet):
    tenant = IdFilter()
    team = IdFilter()
    key = IdFilter(field_name="api_key")
    model = django_filters.CharFilter()
    status = django_filters.ChoiceFilter(choices=UsageStatus.choices)
    priority_class = django_filters.ChoiceFilter(choices=PriorityClass.choices)
    since = UtcDateTimeFilter(field_name="created_at", lookup_expr="gte")
    until = UtcDateTimeFilter(field_name="created_at", lookup_expr="lt")
    period = django_filters.ChoiceFilter(
        choices=BudgetPeriod.choices, method="filter_period", label="The current day, week or month (UTC)."
    )

    class Meta:
        model = UsageRecord
        fields = ["tenant", "team", "key", "model", "status", "priority_class", "since", "until", "period"]

    def filter_period(self, queryset, name, value):
        from django.utils import timezone

        start, end = period_bounds(value, timezone.now())
        return queryset.filter(created_at__gte=start, created_at__lt=end)


class UsageViewSet(viewsets.ReadOnlyModelViewSet):
    """Metered requests, newest first. API keys with the read-usage scope see their own team's."""

    serializer_class = s.UsageRecordSerializer
    permission_classes = [permissions.IsAuthenticated, PeopleOnly]
    filterset_class = UsageFilter
    lookup_field = "request_id"
    allow_api_keys = True

    def get_queryset(self):
        return access_of(self.request).usage_qs()


class AuditLogViewSet(viewsets.ReadOnlyModelViewSet):
    """The audit trail: operators see all of it, tenant admins their tenant's."""

    serializer_class = s.AuditLogSerializer
    permission_classes = [permissions.IsAuthenticated, PeopleOnly]
    filterset_fields = ["tenant", "action", "target_type", "source"]

    def get_queryset(self):
        return access_of(self.request).audit_qs()
