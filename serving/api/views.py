from __future__ import annotations

from django.db.models import Prefetch
from rest_framework import permissions, viewsets

from inference_platform.api_base import AuditedModelViewSet, PeopleOnly

from .. import services
from ..models import AutoscalingPolicy, ModelDeployment, Pool, ScalingEvent
from .serializers import AutoscalingPolicySerializer, ModelDeploymentSerializer, ScalingEventSerializer

SOURCE = "api"


class ModelDeploymentViewSet(AuditedModelViewSet):
    """Model deployments with their pools. Everyone signed in can read them; operators change them.

    Writing `pools` replaces the deployment's set of pools, matched by name. Every write is a serving service,
    which audits it and has it reconciled once committed.
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
        return ModelDeployment.objects.prefetch_related(
            Prefetch("pools", queryset=Pool.objects.order_by("name"))
        )

    def perform_create(self, serializer) -> None:
        fields = dict(serializer.validated_data)
        pools = fields.pop("pools", [])
        serializer.instance = services.deployment_create(
            actor=self.request.user, source=SOURCE, fields=fields, pools=pools
        )

    def perform_update(self, serializer) -> None:
        fields = dict(serializer.validated_data)
        pools = fields.pop("pools", None)
        serializer.instance = services.deployment_update(
            actor=self.request.user, source=SOURCE, deployment=serializer.instance, fields=fields, pools=pools
        )

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
