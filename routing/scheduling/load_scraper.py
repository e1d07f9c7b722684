"""Scrape every healthy engine's /metrics into Redis, where each router replica reads the load it routes by."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import redis
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from routing.contracts import LOAD_KEY, LOAD_TTL_S
from serving.models import Endpoint, Health

log = logging.getLogger(__name__)

# vLLM metric name (as the parser reports the family) -> field in the Redis hash
FIELDS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:prefix_cache_queries": "prefix_queries",
}


def parse_load(text: str) -> dict[str, float]:
    """The load figures of one engine from its Prometheus text, summed over label sets."""
    load: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        field = FIELDS.get(family.name)
        if field is None:
            continue
        load[field] = sum(s.value for s in family.samples if not s.name.endswith("_created"))
    return load


async def _scrape(endpoints: list[tuple[int, str]], timeout: float) -> dict[int, dict[str, float]]:
    async with httpx.AsyncClient(timeout=timeout) as client:

        async def one(endpoint_id: int, url: str):
            try:
                response = await client.get(f"{url.rstrip('/')}/metrics")
                response.raise_for_status()
                return endpoint_id, parse_load(response.text)
            except (httpx.HTTPError, ValueError) as exc:
                log.info("could not scrape %s: %s", url, exc)
                return endpoint_id, None

        results = await asyncio.gather(*(one(i, u) for i, u in endpoints))
    return {endpoint_id: load for endpoint_id, load in results if load is not None}


def endpoint_loads_scrape(timeout: float = 0.8) -> int:
    """Scrape all healthy endpoints once; returns how many answered."""
    endpoints = list(Endpoint.objects.filter(health=Health.HEALTHY).values_list("id", "url"))
    if not endpoints:
        return 0
    loads = asyncio.run(_scrape(endpoints, timeout))
    client = redis.Redis.from_url(settings.REDIS_URL)
    with client.pipeline(transaction=False) as pipe:
        for endpoint_id, load in loads.items():
            key = LOAD_KEY.format(endpoint_id)
            pipe.hset(key, mapping={**load, "ts": time.time()})
            pipe.expire(key, LOAD_TTL_S)
        pipe.execute()
    return len(loads)
