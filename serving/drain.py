"""Scale-down that drops nothing: choose the replica whose loss costs least, drain it, then stop it.

1. Choose (`choose_victims`): the endpoint whose cached prefixes are least held elsewhere (from the precise
   prefix index: blocks of its that no other engine of the deployment holds), then the least loaded (requests in
   flight from every router replica, and the engine's own running and waiting sequences).
2. Drain (`start_draining`): `Endpoint.draining_since` is set and the routers' configuration version bumped, so
   every router replica drops it from its snapshot within its poll interval and sends it nothing new.
3. Stop (`drained`): once nothing is in flight there (and the routers have had time to see the change), or after
   `ENGINE_DRAIN_TIMEOUT_S`, whichever comes first, the orchestrator stops the engine.

The local and the Kubernetes orchestrators share these steps.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import httpx
from django.conf import settings
from django.utils import timezone

from inference_platform.config_version import bump_config_version_on_commit

from .models import Endpoint, EndpointLifetime

# Index entries of an endpoint sampled to estimate how much of its cache is held nowhere else.
SOLE_BLOCK_SAMPLE = 2000
ENGINE_METRICS_TIMEOUT_S = 1.0


def in_flight(redis, endpoint: Endpoint) -> float:
    """Requests at an endpoint now: every router replica's in flight there (published every load-share
    interval), or the engine's own running and waiting sequences, read from its /metrics now (else as last
    scraped), whichever is more."""
    from routing.contracts import LOAD_KEY, REPLICA_LOAD_KEY, others_load

    with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(REPLICA_LOAD_KEY.format(endpoint.pk))
        pipe.hgetall(LOAD_KEY.format(endpoint.pk))
        routers, scraped = pipe.execute()
    routed = others_load(routers, "", time.time()).active
    engine_side = engine_busy(endpoint.url)
    if engine_side is None:
        engine_side = float(scraped.get(b"running", 0)) + float(scraped.get(b"waiting", 0))
    return max(float(routed), engine_side)


@functools.cache
def _metrics_client() -> httpx.Client:
    """One client for every engine this process asks: each `httpx.get` builds its own TLS context, some 40 ms of CPU,
    which a scale-down of 68 engines paid 68 times (bench/kube_scale.py)."""
    return httpx.Client(timeout=ENGINE_METRICS_TIMEOUT_S)


def engine_busy(url: str) -> float | None:
    """The engine's running and waiting requests from its /metrics now; None when it does not answer."""
    from routing.scheduling.load_scraper import parse_load

    try:
        response = _metrics_client().get(f"{url.rstrip('/')}/metrics")
        response.raise_for_status()
        engine = parse_load(response.text)
    except (httpx.HTTPError, ValueError):
        return None
    return engine.get("running", 0.0) + engine.get("waiting", 0.0)


def orphan_drained(redis, mark: str, url: str | None) -> bool:
    """Whether an engine whose deployment is gone (no Endpoint row, so no router sends it anything) may be
    stopped: once it runs nothing, or after the drain timeout from when it was first found orphaned."""
    key = f"drain:orphan:{mark}"
    redis.set(key, time.time(), nx=True, ex=settings.ENGINE_DRAIN_TIMEOUT_S + 3600)
    waited = time.time() - float(redis.get(key) or 0)
    if waited < settings.ENGINE_DRAIN_TIMEOUT_S and (
        waited < router_settle_s() or (url and engine_busy(url))
    ):
        return False
    redis.delete(key)
    return True


def sole_blocks(redis, endpoint_id: int) -> int:
    """About how many cached blocks of this endpoint no other engine holds (GPU or CPU tier), from a sample of
    its entries in the precise prefix index; 0 when the index knows nothing of it."""
    from routing.contracts import block_hash_key, endpoint_map_key

    key = endpoint_map_key(endpoint_id)
    total = redis.hlen(key)
    if not total:
        return 0
    sample = []
    for _, value in redis.hscan_iter(key, count=500):
        sample.append(value.decode())
        if len(sample) >= SOLE_BLOCK_SAMPLE:
            break
    with redis.pipeline(transaction=False) as pipe:
        for entry in sample:
            deployment, block = entry.split(":", 1)
            pipe.hlen(block_hash_key(int(deployment), block))
        holders = pipe.execute()
    alone = sum(1 for count in holders if count <= 1)
    return round(total * alone / len(sample))


def choose_victims(redis, endpoints: Sequence[Endpoint], count: int) -> list[Endpoint]:
    """The `count` endpoints whose removal loses least: fewest sole cached blocks, then least in flight, then
    the youngest; an endpoint not yet healthy goes first (it serves nothing)."""
    if count <= 0:
        return []

    def cost(endpoint: Endpoint) -> tuple:
        age = -endpoint.started_at.timestamp() if endpoint.started_at else 0.0
        if endpoint.health != "healthy":
            return (0, 0, 0.0, age)
        return (1, sole_blocks(redis, endpoint.pk), in_flight(redis, endpoint), age)

    return sorted(endpoints, key=cost)[:count]


def start_draining(endpoints: Sequence[Endpoint]) -> None:
    now = timezone.now()
    for endpoint in endpoints:
        endpoint.draining_since = now
        Endpoint.objects.filter(pk=endpoint.pk).update(draining_since=now)
        if endpoint.lifetime_id:
            EndpointLifetime.objects.filter(pk=endpoint.lifetime_id, draining_at__isnull=True).update(
                draining_at=now
            )
    if endpoints:
        bump_config_version_on_commit()  # routers drop them from their snapshots


def stop_draining(endpoints: Sequence[Endpoint]) -> None:
    """Demand came back before they stopped: they serve again (warm, rather than a cold start elsewhere)."""
    for endpoint in endpoints:
        endpoint.draining_since = None
        Endpoint.objects.filter(pk=endpoint.pk).update(draining_since=None)
        if endpoint.lifetime_id:
            EndpointLifetime.objects.filter(pk=endpoint.lifetime_id).update(draining_at=None)
    if endpoints:
        bump_config_version_on_commit()


def drained(redis, endpoint: Endpoint) -> bool:
    """Whether a draining endpoint may be stopped now."""
    waited = (timezone.now() - endpoint.draining_since).total_seconds()
    if waited >= settings.ENGINE_DRAIN_TIMEOUT_S:
        return True
    return waited >= router_settle_s() and in_flight(redis, endpoint) == 0


def router_settle_s() -> float:
    """Routers poll their configuration every ROUTER_CONFIG_POLL_SECONDS and publish loads every
    ROUTER_LOAD_SHARE_SECONDS: until both have passed, a request may still be on its way to an engine."""
    return settings.ROUTER_CONFIG_POLL_SECONDS + 2 * settings.ROUTER_LOAD_SHARE_SECONDS + 0.5
