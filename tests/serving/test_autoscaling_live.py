"""The autoscaler on real processes: simulator engines under the local orchestrator, a router process in front,
streams through it; the autoscaler's passes run here as Celery beat runs them (scrape, autoscale, reconcile)."""

from __future__ import annotations

import threading
import time

from django.db.models import F

from routing.scheduling.load_scraper import endpoint_loads_scrape
from serving.autoscaling import autoscale_all
from serving.models import (
    AutoscalingPolicy,
    Endpoint,
    Health,
    ModelDeployment,
    Pool,
    ScalingEvent,
)
from tests.serving.test_drain import MODEL, reconcile, served_through_a_router, stream


def healthy(deployment: ModelDeployment) -> int:
    return Endpoint.objects.filter(
        pool__deployment=deployment, health=Health.HEALTHY, draining_since__isnull=True
    ).count()


def autoscaler_pass(deployment: ModelDeployment) -> Pool:
    endpoint_loads_scrape()
    autoscale_all()
    reconcile(deployment)
    return Pool.objects.get(deployment=deployment)


def test_it_scales_up_under_load_and_down_when_idle(live_engines):
    deployment = ModelDeployment.objects.create(
        name="live",
        served_model_name=MODEL,
        model_source="models/tiny-qwen",
        engine_kind="sim",
        max_model_len=2048,
    )
    pool = Pool.objects.create(
        # Streams of 24 s (120 tokens at 0.2 s): long enough to outlast two engines' start-up on a slow,
        # busy machine (at 0.05 s a token they once ended first, and the pool never reached three).
        deployment=deployment,
        name="main",
        replicas=1,
        extra_engine_args=["--decode-time", "0.2"],
    )
    AutoscalingPolicy.objects.create(
        pool=pool,
        enabled=True,
        min_replicas=1,
        max_replicas=3,
        running_requests_per_replica=2,
        scale_up_window_s=0,
        scale_down_window_s=0,
        max_scale_up_step=2,
    )
    with served_through_a_router(deployment) as (router, key):
        # Under load: six long streams on one engine, two per replica wanted: three replicas, all serving.
        results: list = [None] * 6
        threads = [
            threading.Thread(target=stream, args=(router.url, key.secret, results, i, 120)) for i in range(6)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while (autoscaler_pass(deployment).replicas, healthy(deployment)) != (3, 3):
            assert time.monotonic() < deadline, deployment.status_message
            time.sleep(0.5)
        # One step of two, or two of one when the streams reach the engine over more than one pass.
        ups = list(ScalingEvent.objects.filter(pool=pool).order_by("at"))
        assert [e.actor for e in ups] == ["autoscaler"] * len(ups)
        path = [ups[0].from_replicas] + [e.to_replicas for e in ups]
        assert path[0] == 1 and path[-1] == 3 and path == sorted(set(path)), path
        assert ups[-1].signals["running_requests"] >= 5 and "running_requests_per_replica" in ups[-1].reason
        for thread in threads:
            thread.join(timeout=90)
        assert results == [(200, 120, True)] * 6

        # Idle: back to one replica, one step at a time, each drained before it stops.
        deadline = time.monotonic() + 60
        while (autoscaler_pass(deployment).replicas, Endpoint.objects.filter(pool=pool).count()) != (1, 1):
            assert time.monotonic() < deadline, deployment.status_message
            time.sleep(0.5)
        downs = list(
            ScalingEvent.objects.filter(pool=pool, to_replicas__lt=F("from_replicas")).order_by("at")
        )
        assert [(e.from_replicas, e.to_replicas) for e in downs] == [(3, 2), (2, 1)]
        assert all(e.reason.startswith("no demand") for e in downs)
        assert AutoscalingPolicy.objects.get(pool=pool).enabled  # its own changes pause nothing
