from celery import shared_task

from .load_scraper import endpoint_loads_scrape


@shared_task(ignore_result=True)
def scrape_engine_metrics() -> int:
    """Every second: the engines' queue depth and KV use, for least-loaded and load-aware routing."""
    return endpoint_loads_scrape()


@shared_task(ignore_result=True)
def restore_quota_counters() -> list[str]:
    """Every few seconds: budget counters Redis lost raised back to the ledger (routing/quota_restore.py)."""
    import redis
    from django.conf import settings

    from .quota_restore import quota_counters_restore

    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        return quota_counters_restore(client)
    finally:
        client.close()


@shared_task(ignore_result=True)
def drain_traffic_trace() -> int:
    """Every few seconds: the routers' sampled traffic trace from its Redis stream into the database."""
    import redis
    from django.conf import settings

    from .traffic_trace import traffic_trace_drain

    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        return traffic_trace_drain(client)
    finally:
        client.close()


@shared_task(ignore_result=True)
def prune_traffic_trace() -> int:
    """Hourly: traffic trace entries past ROUTER_TRAFFIC_TRACE_KEEP_DAYS deleted."""
    from .traffic_trace import traffic_trace_prune

    return traffic_trace_prune()
