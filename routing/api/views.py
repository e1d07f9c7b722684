from rest_framework import permissions

from inference_platform.api_base import AuditedModelViewSet, access_of
from routing.api.serializers import RoutingPolicySerializer
from routing.models import RoutingPolicy


class OperatorsOnly(permissions.BasePermission):
    message = "Routing policies are managed by platform operators."

    def has_permission(self, request, view) -> bool:
        return access_of(request).is_operator


class RoutingPolicyViewSet(AuditedModelViewSet):
    """Per-deployment routing: mode, scorer weights and thresholds. Changes apply live."""

    serializer_class = RoutingPolicySerializer
    audit_name = "routing_policy"
    filterset_fields = ["deployment", "mode"]

    def get_permissions(self):
        return [*super().get_permissions(), OperatorsOnly()]

    def get_queryset(self):
        return RoutingPolicy.objects.select_related("deployment")
