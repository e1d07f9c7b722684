from celery import shared_task

from routing.scheduling.load_scraper import endpoint_loads_scrape


def _with_redis(work):
    """`work(client)` with a Redis client of its own, closed after."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        return work(client)
    finally:
        client.close()


@shared_task(ignore_result=True)
def scrape_engine_metrics() -> int:
    """Every second: the engines' queue depth and KV use, for least-loaded and load-aware routing."""
    return endpoint_loads_scrape()


@shared_task(ignore_result=True)
def restore_quota_counters() -> list[str]:
    """Every few seconds: budget counters Redis lost raised back to the ledger (routing/metering/quota_restore.py)."""
    from routing.metering.quota_restore import quota_counters_restore

    return _with_redis(quota_counters_restore)


@shared_task(ignore_result=True)
def drain_traffic_trace() -> int:
    """Every few seconds: the routers' sampled traffic trace from its Redis stream into the database."""
    from routing.metering.traffic_trace import traffic_trace_drain

    return _with_redis(traffic_trace_drain)


@shared_task(ignore_result=True)
def prune_traffic_trace() -> int:
    """Hourly: traffic trace entries past ROUTER_TRAFFIC_TRACE_KEEP_DAYS deleted."""
    from routing.metering.traffic_trace import traffic_trace_prune

    return traffic_trace_prune()
