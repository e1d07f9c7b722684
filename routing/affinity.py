"""What one router replica remembers about where it sent things: prefixes (for engines without KV events)
and sessions. Bounded, in memory."""

from __future__ import annotations

import time
from collections import OrderedDict, deque


class ApproximateIndex:
    """Per endpoint, the block keys this router sent there, least recently sent evicted first once an endpoint's
    record reaches its KV capacity in blocks."""

    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self._where: dict[str, set[int]] = {}
        self._lru: dict[int, OrderedDict[str, None]] = {}

    def lookup(self, keys: list[str]) -> dict[int, int]:
        """Per endpoint, how many of the leading keys it was sent."""
        held: dict[int, int] = {}
        alive: set[int] | None = None
        for index, key in enumerate(keys):
            here = self._where.get(key)
            if not here:
                break
            alive = set(here) if alive is None else alive & here
            if not alive:
                break
            for endpoint in alive:
                held[endpoint] = index + 1
        return held

    def record(self, endpoint: int, keys: list[str]) -> None:
        lru = self._lru.setdefault(endpoint, OrderedDict())
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                self._where.setdefault(key, set()).add(endpoint)
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


class RecentDecisions:
    """This replica's own decisions of the last `ttl_s` seconds, for precise routing: the prompts' block keys by
    endpoint. A lookup already on its way to Redis when a decision is made cannot see the speculative entries
    that decision writes there; merging these in as its answer comes back closes that gap for this replica's
    own requests (the other replicas see the entries in Redis)."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._decisions: deque[tuple[float, int, list[str]]] = deque()
        self._senders: dict[str, dict[int, int]] = {}  # block key -> endpoint -> decisions that sent it there

    def record(self, endpoint: int, keys: list[str], now: float) -> None:
        self._expire(now)
        if not keys or self.ttl_s <= 0:
            return
        self._decisions.append((now + self.ttl_s, endpoint, keys))
        for key in keys:
            senders = self._senders.setdefault(key, {})
            senders[endpoint] = senders.get(endpoint, 0) + 1

    def leading(self, keys: list[str], now: float) -> dict[int, int]:
        """Per endpoint, how many of the leading keys a recent decision sent there."""
        self._expire(now)
        first = self._senders.get(keys[0]) if keys else None
        if not first:
            return {}
        held: dict[int, int] = {}
        alive = set(first)
        for index in range(1, len(keys)):
            here = self._senders.get(keys[index], {})
            for endpoint in [e for e in alive if e not in here]:
                held[endpoint] = index
                alive.discard(endpoint)
            if not alive:
                return held
        for endpoint in alive:
            held[endpoint] = len(keys)
        return held

    def _expire(self, now: float) -> None:
        decisions = self._decisions
        while decisions and decisions[0][0] <= now:
            _, endpoint, keys = decisions.popleft()
            for key in keys:
                senders = self._senders[key]
                if senders[endpoint] > 1:
                    senders[endpoint] -= 1
                else:
                    del senders[endpoint]
                    if not senders:
                        del self._senders[key]


class SessionMap:
    """x-session-id -> the endpoint that served it last, for `ttl_s` seconds."""

    def __init__(self, ttl_s: float = 600, max_sessions: int = 200_000):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._items: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def get(self, session_id: str) -> int | None:
        item = self._items.get(session_id)
        if item is None or item[1] < time.monotonic():
            return None
        return item[0]

    def put(self, session_id: str, endpoint: int) -> None:
        self._items[session_id] = (endpoint, time.monotonic() + self.ttl_s)
        self._items.move_to_end(session_id)
        while len(self._items) > self.max_sessions:
            self._items.popitem(last=False)
