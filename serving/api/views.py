from __future__ import annotations

from django.db import transaction
from django.db.models import Prefetch
from drf_spectacular.utils import PolymorphicProxySerializer, extend_schema, extend_schema_view
from rest_framework import permissions, viewsets

from inference_platform.api_base import AuditedModelViewSet, PeopleOnly
from tenants.entitlements import deployment_tenants_set

from .. import services
from ..models import AutoscalingPolicy, ModelDeployment, Pool, ScalingEvent
from .serializers import (
    AutoscalingPolicySerializer,
    DeploymentForCallersSerializer,
    ModelDeploymentSerializer,
    ScalingEventSerializer,
)

SOURCE = "api"

# Operators read the whole deployment; everyone else what a caller needs.
_AS_SEEN = PolymorphicProxySerializer(
    component_name="DeploymentAsSeen",
    serializers=[ModelDeploymentSerializer, DeploymentForCallersSerializer],
    resource_type_field_name=None,
)


@extend_schema_view(list=extend_schema(responses=_AS_SEEN), retrieve=extend_schema(responses=_AS_SEEN))
class ModelDeploymentViewSet(AuditedModelViewSet):
    """Model deployments with their pools. Operators read and change all of it. Everyone else reads only the
    deployments they may call (a tenant admin: those open to the tenant), and of each only what a caller needs:
    its names, context length, status and whether it takes tools and reasons.

    Writing `pools` replaces the deployment's set of pools, matched by name; writing `tenants` limits it to those
    tenants (empty: every tenant). Every write is a serving service, which audits it and has it reconciled once
    committed.
    """

    serializer_class = ModelDeploymentSerializer
    filterset_fields = [
        "served_model_name",
        "engine_kind",
        "orchestrator",
        "desired_status",
        "observed_status",
    ]

    def get_queryset(self):
        if not self.access.is_operator:
            return self.access.deployments_qs()
        return ModelDeployment.objects.prefetch_related(
            Prefetch("pools", queryset=Pool.objects.order_by("name")), "tenants"
        )

    def get_serializer_class(self):
        # Before authentication (the schema, an anonymous 401) the operators' serializer describes the writes.
        user = getattr(self.request, "user", None)
        if user is not None and user.is_authenticated and not self.access.is_operator:
            return DeploymentForCallersSerializer
        return ModelDeploymentSerializer

    def perform_create(self, serializer) -> None:
        fields = dict(serializer.validated_data)
        pools = fields.pop("pools", [])
        tenants = fields.pop("tenants", None)
        with transaction.atomic():
            deployment = services.deployment_create(
                actor=self.request.user, source=SOURCE, fields=fields, pools=pools
            )
            if tenants:
                deployment_tenants_set(
                    deployment=deployment, tenants=tenants, actor=self.request.user, source=SOURCE
                )
        serializer.instance = deployment

    def perform_update(self, serializer) -> None:
        fields = dict(serializer.validated_data)
        pools = fields.pop("pools", None)
        tenants = fields.pop("tenants", None)
        with transaction.atomic():
            deployment = services.deployment_update(
                actor=self.request.user,
                source=SOURCE,
                deployment=serializer.instance,
                fields=fields,
                pools=pools,
            )
            if tenants is not None:
                deployment_tenants_set(
                    deployment=deployment, tenants=tenants, actor=self.request.user, source=SOURCE
                )
        serializer.instance = deployment

    def perform_destroy(self, instance) -> None:
        services.deployment_delete(actor=self.request.user, source=SOURCE, deployment=instance)


class AutoscalingPolicyViewSet(AuditedModelViewSet):
    """Each pool's autoscaling policy (serving/autoscaling.py). Everyone signed in can read them; operators
    change them. A manual change of a pool's replicas turns its policy off (`paused_reason` says who and when);
    setting `enabled` again turns it back on."""

    serializer_class = AutoscalingPolicySerializer
    audit_name = "autoscaling_policy"
    filterset_fields = ["pool", "pool__deployment", "enabled"]

    def get_queryset(self):
        return AutoscalingPolicy.objects.select_related("pool").order_by("pool_id")


class ScalingEventViewSet(viewsets.ReadOnlyModelViewSet):
    """What changed each pool's replicas, newest first: the autoscaler's decisions with the signals they read,
    and the manual edits that paused it."""

    serializer_class = ScalingEventSerializer
    permission_classes = [permissions.IsAuthenticated, PeopleOnly]
    filterset_fields = ["pool", "pool__deployment", "actor"]

    def get_queryset(self):
        return ScalingEvent.objects.order_by("-at", "-id")
