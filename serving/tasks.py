"""Celery tasks: another interface onto the serving services. They take ids and call one service each."""

from __future__ import annotations

from celery import shared_task

from . import services

# While engines are starting or waiting to restart, look again this soon rather than at the next beat.
FOLLOW_UP_S = 2
FOLLOW_UPS = 30


@shared_task(
    autoretry_for=(Exception,), retry_backoff=True, retry_backoff_max=60, max_retries=5, acks_late=True
)
def reconcile_deployment(deployment_id: int, follow_ups: int = FOLLOW_UPS) -> str:
    result = services.deployment_reconcile(deployment_id=deployment_id)
    if result is None:
        return "skipped"
    if result.settling and follow_ups > 0:
        reconcile_deployment.apply_async((deployment_id, follow_ups - 1), countdown=FOLLOW_UP_S)
    return result.status


@shared_task(acks_late=True)
def reconcile_all() -> dict[int, str]:
    return services.deployments_reconcile_all()


@shared_task(autoretry_for=(Exception,), retry_backoff=True, retry_backoff_max=60, max_retries=5)
def sweep_engines(follow_ups: int = FOLLOW_UPS) -> list[str]:
    result = services.engines_sweep()
    if result.draining and follow_ups > 0:
        sweep_engines.apply_async((follow_ups - 1,), countdown=FOLLOW_UP_S)  # until they are drained
    return result.gone


@shared_task(acks_late=True)
def autoscale() -> list[str]:
    """One autoscaler pass (serving/autoscaling.py); returns the scaling events it made, as text."""
    from .autoscaling import autoscale_all

    return [str(event) for event in autoscale_all()]
