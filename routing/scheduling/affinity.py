"""What one router replica remembers about where it sent things: prefixes (for engines without KV events)
and sessions. Bounded, in memory."""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from functools import partial
from itertools import compress, islice, repeat, takewhile
from operator import is_, not_

_is_none = partial(is_, None)


# The reverse map (key -> the endpoints sent it) kept as endpoints gain and lose keys, a prompt's worth at a time:
# C-level passes over the keys.
def _enter_all(owners: dict, keys: list, member: int) -> None:
    """`member` now holds `keys` (none of which it held)."""
    if not keys:
        return
    sets = list(map(owners.get, keys))
    if None in sets:
        # A set of its own for each new key: copies of a one-member set (set.copy is cheaper than building one).
        owners.update(zip(compress(keys, map(_is_none, sets)), map(set.copy, repeat({member})), strict=False))
        sets = filter(None, sets)
    deque(map(set.add, sets, repeat(member)), maxlen=0)


def _leave_all(owners: dict, keys: list, member: int) -> None:
    """`member` no longer holds `keys` (each of which it held)."""
    if not keys:
        return
    sets = list(map(owners.__getitem__, keys))
    deque(map(set.discard, sets, repeat(member)), maxlen=0)
    deque(map(owners.__delitem__, compress(keys, map(not_, sets))), maxlen=0)


class ApproximateIndex:
    """Per endpoint, the block keys this router sent there and when it last did, least recently sent evicted
    first once an endpoint's record reaches its KV capacity in blocks."""

    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self._where: dict[str, set[int]] = {}
        self._lru: dict[int, OrderedDict[str, float]] = {}  # endpoint -> block key -> when last sent there

    def lookup(
        self, keys: list[str], since: float | None = None, beyond: dict[int, int] | None = None
    ) -> dict[int, int]:
        """Per endpoint, how many of the leading keys it was sent (at or after `since`, when given); with
        `beyond` (endpoint -> blocks already known held), only the endpoints whose count passes it, found with
        one look at the key past it for the others, which is all an index's answer takes from a replica's record
        (routing/kvindex/prefix.py `with_recent`).

        Only the endpoints sent the first key can hold any. Without `since`: one walk along the keys with the
        endpoints holding all of them so far, a C-level subset test a key while they all hold it, and once one
        is left, a C-level run along its own record. With `since`: each of them read along its own record until
        a key it lacks or was sent before then (takewhile over the record, C-level)."""
        first = self._where.get(keys[0]) if keys else None
        if not first:
            return {}
        if since is None:
            held = self._walk(keys, first)
            return {e: n for e, n in held.items() if n > beyond.get(e, 0)} if beyond else held
        held: dict[int, int] = {}
        since = float(since)  # float.__le__ below: an int would answer NotImplemented
        end = len(keys)
        for endpoint in first:
            lru = self._lru[endpoint]
            floor = beyond.get(endpoint, 0) if beyond else 0
            if floor and (floor >= end or lru.get(keys[floor], -math.inf) < since):
                continue  # it cannot pass the known count
            n = len(list(takewhile(since.__le__, map(lru.get, keys, repeat(-math.inf)))))
            if n > floor:
                held[endpoint] = n
        return held

    def _walk(self, keys: list[str], first: set[int]) -> dict[int, int]:
        where, held = self._where, {}
        alive = first  # the record's own set until it shrinks (never changed here)
        index, end = 1, len(keys)
        while index < end:
            if len(alive) == 1:
                (endpoint,) = alive
                held[endpoint] = index + len(list(takewhile(self._lru[endpoint].__contains__, keys[index:])))
                return held
            here = where.get(keys[index])
            if not here:
                break
            if not alive <= here:
                still = alive & here
                for endpoint in alive - still:
                    held[endpoint] = index
                if not still:
                    return held
                alive = still
            index += 1
        for endpoint in alive:
            held[endpoint] = index
        return held

    def record(self, endpoint: int, keys: list[str], now: float | None = None) -> None:
        """The keys sent to `endpoint` now, in prompt order: the most recently sent, each keeping one place."""
        now = time.monotonic() if now is None else now
        lru = self._lru.setdefault(endpoint, OrderedDict())
        # The time of each (the new ones join the end, in the prompt's order, so they are read off the end), then
        # every one to the end in the prompt's order: C-level passes.
        before = len(lru)
        lru.update(zip(keys, repeat(now)))
        added = len(lru) - before
        fresh = list(islice(reversed(lru), added))[::-1] if added else []
        deque(map(lru.move_to_end, keys), maxlen=0)
        _enter_all(self._where, fresh, endpoint)
        excess = len(lru) - self.capacity
        if excess > 0:
            # The least recently sent, read off the front and then deleted (C-level, not a popitem call each).
            evicted = list(islice(lru, excess))
            deque(map(lru.__delitem__, evicted), maxlen=0)
            _leave_all(self._where, evicted, endpoint)

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
