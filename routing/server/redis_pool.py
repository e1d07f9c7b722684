"""The router's Redis client: a bounded blocking pool whose connections pack commands with hiredis.

redis-py's synchronous connections pack commands with hiredis' C packer when hiredis is installed; its asyncio
connections always use the pure-Python packer, which was about a tenth of the router's CPU per request under a
quota (the admission script's keys and arguments, the settlement, the usage event). The connection class here
is redis-py's own asyncio connection with the synchronous side's packer.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.connection import HiredisRespSerializer  # needs hiredis, a locked dependency


class HiredisPackingConnection(aioredis.Connection):
    _packer = HiredisRespSerializer()

    def pack_command(self, *args):
        return self._packer.pack(*args)


def router_redis(url: str, max_connections: int) -> aioredis.Redis:
    """Requests wait for a connection under load rather than fail."""
    options = {}
    if urlsplit(url).scheme == "redis":  # TLS and unix-socket URLs keep redis-py's own connection classes
        options["connection_class"] = HiredisPackingConnection
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=10, **options
    )
    return aioredis.Redis(connection_pool=pool)
