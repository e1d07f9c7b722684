from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import permissions, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from inference_platform.api_base import AuditedModelViewSet, PeopleOnly, access_of

from .. import scopes
from ..services import alert_snapshot, destination_rotate_secret
from . import serializers as s


class DestinationViewSet(AuditedModelViewSet):
    """Where alerts go: a webhook (Slack-compatible JSON, signed with `signing_secret`) or e-mail addresses.
    A tenant's admins manage their tenant's; operators every one, and the platform's own (no tenant)."""

    serializer_class = s.DestinationSerializer
    audit_name = "alert_destination"
    filterset_fields = ["tenant", "kind", "is_active"]

    def get_queryset(self):
        return scopes.destinations_qs(self.access)

    def can_create(self, access):
        return access.is_operator or bool(access.admin_tenants)

    def can_change(self, access, obj):
        return scopes.can_manage(access, obj.tenant_id)

    def audit_snapshot(self, instance):
        return alert_snapshot(instance)

    @extend_schema(request=None, responses={200: s.DestinationSerializer})
    @action(detail=True, methods=["post"], url_path="rotate-secret")
    def rotate_secret(self, request, pk=None):
        """A new signing secret, at once: give it to the receiver."""
        destination = self.get_object()
        self.check_object_permissions(request, destination)
        destination_rotate_secret(destination=destination, actor=request.user, source="api")
        return Response(self.get_serializer(destination).data)


class AlertRuleViewSet(AuditedModelViewSet):
    """What raises alerts. Budget rules (`budget`: percentages crossed; `budget_forecast`: the period's budget
    forecast to run out before it ends) belong to a tenant's admins or, without a tenant, to the operators;
    health rules are the operators'."""

    serializer_class = s.AlertRuleSerializer
    audit_name = "alert_rule"
    filterset_fields = ["tenant", "kind", "is_active"]

    def get_queryset(self):
        return scopes.rules_qs(self.access)

    def can_create(self, access):
        return access.is_operator or bool(access.admin_tenants)

    def can_change(self, access, obj):
        return scopes.can_manage(access, obj.tenant_id)

    def audit_snapshot(self, instance):
        return alert_snapshot(instance)


class AlertViewSet(viewsets.ReadOnlyModelViewSet):
    """Each condition a rule has seen: whether it holds, and when it was sent and cleared."""

    serializer_class = s.AlertStateSerializer
    permission_classes = [permissions.IsAuthenticated, PeopleOnly]
    filterset_fields = ["rule", "firing", "holding"]

    def get_queryset(self):
        return scopes.alert_states_qs(access_of(self.request))


class DeliveryViewSet(viewsets.ReadOnlyModelViewSet):
    """Every alert sent to every destination: attempts, the receiver's answer, the last error."""

    serializer_class = s.DeliverySerializer
    permission_classes = [permissions.IsAuthenticated, PeopleOnly]
    filterset_fields = ["state", "destination", "status", "event"]

    def get_queryset(self):
        return scopes.deliveries_qs(access_of(self.request))
