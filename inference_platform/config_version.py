"""A shared counter in Redis that every router replica polls: bumping it makes them reload their caches."""

from __future__ import annotations

import functools
import logging

from django.conf import settings
from django.db import transaction

from routing.contracts import CONFIG_VERSION_KEY

log = logging.getLogger(__name__)


def _redis():
    """A client of the Redis the settings name now (one per URL: a settings change, as tests make, is followed)."""
    return _client(settings.REDIS_URL)


@functools.cache
def _client(url: str):
    import redis

    return redis.Redis.from_url(url)


def bump_config_version() -> int | None:
    """Returns the new version (None if Redis could not be reached)."""
    import redis

    try:
        return int(_redis().incr(CONFIG_VERSION_KEY))
    except redis.RedisError:
        # The change is committed; routers still pick it up at their next periodic reload.
        log.warning("could not bump the router config version; routers reload within their max snapshot age")
        return None


def bump_config_version_on_commit() -> None:
    """Bump once the current transaction commits (at once outside a transaction)."""
    transaction.on_commit(bump_config_version)
