"""What one router replica remembers about where it sent things: prefixes (for engines without KV events)
and sessions. Bounded, in memory."""

from __future__ import annotations

import time
from collections import OrderedDict


class ApproximateIndex:
    """Per endpoint, the block keys this router sent there and when it last did, least recently sent evicted
    first once an endpoint's record reaches its KV capacity in blocks."""

    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self._where: dict[str, set[int]] = {}
        self._lru: dict[int, OrderedDict[str, float]] = {}  # endpoint -> block key -> when last sent there

    def lookup(self, keys: list[str], since: float | None = None) -> dict[int, int]:
        """Per endpoint, how many of the leading keys it was sent (at or after `since`, when given)."""
        held: dict[int, int] = {}
        alive: set[int] | None = None
        for index, key in enumerate(keys):
            here = self._where.get(key)
            if not here:
                break
            alive = set(here) if alive is None else alive & here
            if since is not None:
                alive = {endpoint for endpoint in alive if self._lru[endpoint][key] >= since}
            if not alive:
                break
            for endpoint in alive:
                held[endpoint] = index + 1
        return held

    def record(self, endpoint: int, keys: list[str], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        lru = self._lru.setdefault(endpoint, OrderedDict())
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            else:
                self._where.setdefault(key, set()).add(endpoint)
            lru[key] = now
        while len(lru) > self.capacity:
            old, _ = lru.popitem(last=False)
            owners = self._where.get(old)
            if owners is not None:
                owners.discard(endpoint)
                if not owners:
                    del self._where[old]

    def forget(self, endpoint: int) -> None:
        for key in self._lru.pop(endpoint, {}):
            owners = self._where.get(key)
            if owners is not None:
                owners.discard(endpoint)
                if not owners:
                    del self._where[key]


class SessionMap:
    """A session (routing/server/sessions.py) -> the endpoint that served it last, for `ttl_s` seconds."""

    def __init__(self, ttl_s: float = 600, max_sessions: int = 200_000, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock  # planner/ gives a virtual one
        self._items: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def get(self, session_id: str) -> int | None:
        item = self._items.get(session_id)
        if item is None or item[1] < self.clock():
            return None
        return item[0]

    def put(self, session_id: str, endpoint: int) -> None:
        self._items[session_id] = (endpoint, self.clock() + self.ttl_s)
        self._items.move_to_end(session_id)
        while len(self._items) > self.max_sessions:
            self._items.popitem(last=False)
