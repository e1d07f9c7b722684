from celery import shared_task

from .load_scraper import endpoint_loads_scrape


@shared_task(ignore_result=True)
def scrape_engine_metrics() -> int:
    """Every second: the engines' queue depth and KV use, for least-loaded and load-aware routing."""
    return endpoint_loads_scrape()
