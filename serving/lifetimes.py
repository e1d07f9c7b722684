"""Each engine's lifetime (started, ready, draining, stopped), recorded by the orchestrators as they see it.

Cost to serve sums the GPU-hours these cover, and the autoscaler reads a pool's start-up time from them."""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone

from .models import Endpoint, EndpointLifetime, ModelDeployment, Pool


def lifetime_open(
    endpoint: Endpoint, deployment: ModelDeployment, pool: Pool, started_at: datetime | None = None
) -> None:
    """Start a new lifetime for an engine just started (closing the one before, if any); the caller saves
    `endpoint`."""
    now = started_at or timezone.now()
    lifetime_close(endpoint, now)
    endpoint.lifetime = EndpointLifetime.objects.create(
        pool=pool,
        deployment_name=deployment.name,
        pool_name=pool.name,
        endpoint_name=endpoint.name,
        accelerator=pool.accelerator,
        gpus=pool.gpus_per_replica * pool.nodes_per_replica,
        started_at=now,
    )


def lifetime_ready(endpoint: Endpoint, at: datetime | None = None) -> None:
    if endpoint.lifetime_id:
        EndpointLifetime.objects.filter(pk=endpoint.lifetime_id, ready_at__isnull=True).update(
            ready_at=at or timezone.now()
        )


def lifetime_close(endpoint: Endpoint, at: datetime | None = None) -> None:
    if endpoint.lifetime_id:
        EndpointLifetime.objects.filter(pk=endpoint.lifetime_id, stopped_at__isnull=True).update(
            stopped_at=at or timezone.now()
        )
