"""`python manage.py run_kv_ingester`: keep the prefix-cache index in Redis from the engines' KV events."""

from __future__ import annotations

import os
import signal
import threading

import redis
from django.conf import settings
from django.core.management.base import BaseCommand

from routing.kvindex.kv_ingest_stream import KVIngester


class Command(BaseCommand):
    help = "Subscribe to every engine's KV-cache events and maintain the prefix-cache index in Redis."

    def add_arguments(self, parser):
        parser.add_argument(
            "--bind",
            default=getattr(settings, "KV_EVENTS_BIND", None) or os.environ.get("KV_EVENTS_BIND") or None,
            help="Also bind a SUB socket here for engines that connect to a central collector "
            "(e.g. tcp://127.0.0.1:5557). Default: the KV_EVENTS_BIND setting.",
        )
        parser.add_argument(
            "--refresh-seconds",
            type=float,
            default=float(getattr(settings, "KV_INGEST_REFRESH_SECONDS", 2.0)),
            help="How often to re-read the endpoints (also at once when the config version changes).",
        )

    def handle(self, *args, bind=None, refresh_seconds=2.0, **options):
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        ingester = KVIngester(redis.Redis.from_url(settings.REDIS_URL), bind=bind, refresh_s=refresh_seconds)
        ingester.run(stop)
        self.stdout.write(f"kv ingester stopped: {ingester.stats}")
