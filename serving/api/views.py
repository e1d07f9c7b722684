from __future__ import annotations

from django.db import transaction
from django.db.models import Prefetch

from inference_platform.api_base import AuditedModelViewSet

from .. import services
from ..models import ModelDeployment, Pool
from .serializers import ModelDeploymentSerializer


class ModelDeploymentViewSet(AuditedModelViewSet):
    """Model deployments with their pools. Everyone signed in can read them; operators change them.

    Writing `pools` replaces the deployment's set of pools, matched by name.
    """

    serializer_class = ModelDeploymentSerializer
    audit_name = "deployment"
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

    def audit_snapshot(self, instance) -> dict:
        return services.deployment_snapshot(instance)

    # Every change is followed, once committed, by a reconcile of what runs.
    def perform_create(self, serializer) -> None:
        with transaction.atomic():
            super().perform_create(serializer)
            services.deployment_changed(deployment_id=serializer.instance.pk)

    def perform_update(self, serializer) -> None:
        with transaction.atomic():
            super().perform_update(serializer)
            services.deployment_changed(deployment_id=serializer.instance.pk)

    def perform_destroy(self, instance) -> None:
        with transaction.atomic():
            super().perform_destroy(instance)
            services.deployment_deleted()
