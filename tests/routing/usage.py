"""Read the router's usage events back from the Redis stream."""

from __future__ import annotations

import time

import redis
from django.conf import settings

from tenants.usage_stream import FIELD, UsageEvent, stream_key


def usage_events(request_ids=None, *, wait_for: int = 0, timeout: float = 5.0) -> list[UsageEvent]:
    client = redis.Redis.from_url(settings.REDIS_URL)
    deadline = time.monotonic() + timeout
    while True:
        events = [UsageEvent.decode(fields[FIELD.encode()]) for _, fields in client.xrange(stream_key())]
        if request_ids is not None:
            events = [e for e in events if e.request_id in set(request_ids)]
        if len(events) >= wait_for or time.monotonic() > deadline:
            return events
        time.sleep(0.1)
