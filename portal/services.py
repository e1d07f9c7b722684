"""What the portal changes: deployments (create, scale, delete), each audited and followed by a reconcile."""

from __future__ import annotations

from django.db import transaction

from serving import services as serving
from serving.models import EngineKind, ModelDeployment, Pool
from tenants.audit import audit_record

SOURCE = "portal"


def deployment_create(
    *,
    actor,
    name: str,
    served_model_name: str,
    model_source: str,
    engine_kind: str = EngineKind.SIM,
    replicas: int = 1,
) -> ModelDeployment:
    """A deployment with one pool serving both prefill and decode; its engines start on the next reconcile."""
    with transaction.atomic():
        deployment = ModelDeployment(
            name=name, served_model_name=served_model_name, model_source=model_source, engine_kind=engine_kind
        )
        deployment.full_clean()
        deployment.save()
        pool = Pool(deployment=deployment, name="main", replicas=replicas)
        pool.full_clean()
        pool.save()
        audit_record(
            actor=actor,
            action="deployment.create",
            instance=deployment,
            source=SOURCE,
            details={"after": serving.deployment_snapshot(deployment)},
        )
        serving.deployment_changed(deployment_id=deployment.pk)
    return deployment


def pool_scale(*, actor, pool: Pool, replicas: int) -> bool:
    """Set a pool's replicas; returns False when it already had that many."""
    with transaction.atomic():
        pool = Pool.objects.select_for_update().get(pk=pool.pk)
        if pool.replicas == replicas:
            return False
        before = pool.replicas
        pool.replicas = replicas
        pool.full_clean()
        pool.save(update_fields=["replicas"])
        audit_record(
            actor=actor,
            action="deployment.scale",
            instance=pool.deployment,
            source=SOURCE,
            details={"changes": {f"pools.{pool.name}.replicas": [before, replicas]}},
        )
        serving.deployment_changed(deployment_id=pool.deployment_id)
    return True


def deployment_delete(*, actor, deployment: ModelDeployment) -> None:
    with transaction.atomic():
        audit_record(
            actor=actor,
            action="deployment.delete",
            instance=deployment,
            source=SOURCE,
            details={"before": serving.deployment_snapshot(deployment)},
        )
        deployment.delete()
        serving.deployment_deleted()
