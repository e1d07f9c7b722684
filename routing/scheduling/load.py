"""Endpoint load: what this router replica keeps per engine (requests in flight and sent lately, the prefill
backlog each engine has yet to compute, with the prefill speed learned from first tokens), and the trade through
Redis that adds the engines' scraped load and the other replicas' own load to it. See docs/routing.md#load."""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field

from routing.contracts import REPLICA_LOAD_KEY, TTL_S, others_load
from routing.info import EndpointInfo

RECENT_WINDOW_S = 5.0
# Prefills shorter than this do not teach the prefill speed: their time is mostly the engine's fixed overhead.
RATE_SAMPLE_TOKENS = 2048
SERVED_WINDOW_S = 30.0


@dataclass(eq=False, slots=True)
class Prefill:
    """One prefill in an engine's lane; compared by identity, so equal ones (two fully cached prompts) stay apart."""

    tokens: float


@dataclass
class EndpointLoad:
    active: int = 0  # requests this router replica has in flight there
    running: float = 0.0  # from the engine's /metrics
    waiting: float = 0.0
    kv_usage: float = 0.0
    work: float = 0.0  # requests in flight there, each weighed by the prefill it brings (request_weight)
    others: float = 0.0  # own() of the other router replicas there, as they last published it
    others_active: int = 0  # their requests in flight there
    reserved: int = (
        0  # requests flow control let through for a slot here, not yet sent (routing/scheduling/flow.py)
    )
    # Prefill backlog: the uncached prompt tokens of this replica's requests there awaiting a first token.
    prefill: float = 0.0
    others_prefill: float = 0.0  # the other replicas' prefill backlog there (their prefill_left)
    # Seconds per prefilled token there, learned from first tokens (0: not yet known); see prefill_left.
    prefill_s_per_token: float = 0.0
    _lane: deque[Prefill] = field(default_factory=deque)  # this replica's prefills there, in the order sent
    # When the lane's oldest prefill began: its send, or the first token of the one before it.
    _head_since: float = 0.0
    _recent: float = 0.0
    _recent_at: float = 0.0
    _served: float = 0.0
    _served_at: float = 0.0

    def prefill_began(self, tokens: float, now: float) -> Prefill:
        """A prefill of `tokens` uncached prompt tokens is sent there; the handle is for prefill_ended."""
        entry = Prefill(tokens)
        if not self._lane:
            self._head_since = now
        self._lane.append(entry)
        self.prefill += tokens
        return entry

    def prefill_ended(self, entry: Prefill, now: float, first_token: bool = True) -> None:
        """That prefill is over (`first_token`: its first token came now; else the request ended without one).
        The lane's oldest prefill ending on its first token tells how fast the engine prefills: the time since it
        began, over its tokens."""
        self.prefill -= entry.tokens
        if self._lane and self._lane[0] is entry:
            self._lane.popleft()
            took = now - self._head_since
            if first_token and entry.tokens >= RATE_SAMPLE_TOKENS and took > 0:
                self._learn(took / entry.tokens)
            self._head_since = now
        else:
            with contextlib.suppress(ValueError):
                self._lane.remove(entry)

    def _learn(self, sample: float) -> None:
        known = self.prefill_s_per_token
        if known:
            # One sample moves the estimate a fifth of the way, and at most by half or double: a prompt the
            # engine found cached beyond the router's guess comes back fast without being the engine's speed.
            sample = min(max(sample, known / 2), known * 2)
            sample = known + (sample - known) / 5
        self.prefill_s_per_token = sample

    def prefill_left(self, now: float) -> float:
        """The prefill backlog less what the engine has computed of the oldest one since it began (at the
        learned speed): a long prompt near the end of its prefill is not a long wait for the next request."""
        if not self._lane or not self.prefill_s_per_token:
            return self.prefill
        head = self._lane[0].tokens
        done = min(head, (now - self._head_since) / self.prefill_s_per_token)
        return max(0.0, self.prefill - done)

    def begin(self, weight: float = 1.0) -> None:
        """A request of this replica starts there (weight: request_weight)."""
        self.active += 1
        self.work += weight

    def end(self, weight: float = 1.0) -> None:
        self.active -= 1
        self.work -= weight

    def assigned(self, now: float, window_s: float, weight: float = 1.0) -> None:
        """Count a request sent there, by its weight; the count decays with time constant `window_s`."""
        self._recent = self.recent(now, window_s) + weight
        self._recent_at = now
        self._served = self.served(now) + 1.0
        self._served_at = now

    def served(self, now: float) -> float:
        """Requests sent there over the last half minute or so (decayed, unweighted): where the long-lived
        sessions sit, for placing a request no engine has a reason to take."""
        if not self._served:
            return 0.0
        return self._served * math.exp(-(now - self._served_at) / SERVED_WINDOW_S)

    def own(self, now: float) -> float:
        """This replica's load there, for the load guard: in flight and sent lately, weighed."""
        return self.work + self.recent(now, RECENT_WINDOW_S)

    def recent(self, now: float, window_s: float) -> float:
        """Requests sent there lately (exponentially decayed): load that short requests leave no trace of in
        the in-flight count."""
        if not self._recent:
            return 0.0
        return self._recent * math.exp(-(now - self._recent_at) / window_s)


# The load trade: one round trip, whatever the number of endpoints: for each endpoint (KEYS: its scraped hash, then its
# replica hash) the scraped hash, and this replica's field set (ARGV value not "") or withdrawn ("") before the
# replica hash is read back. ARGV: replica id, TTL, then one value per endpoint. Fields of replicas gone are
# deleted by HDEL commands in the same pipeline.
TRADE = """
local replica, ttl = ARGV[1], tonumber(ARGV[2])
local out = {}
for i = 1, #KEYS, 2 do
  local mine = KEYS[i + 1]
  local value = ARGV[2 + (i + 1) / 2]
  if value ~= "" then
    redis.call("HSET", mine, replica, value)
  else
    redis.call("HDEL", mine, replica)
  end
  redis.call("EXPIRE", mine, ttl)
  out[#out + 1] = redis.call("HGETALL", KEYS[i])
  out[#out + 1] = redis.call("HGETALL", mine)
end
return out
"""


def _hash(flat: list) -> dict:
    return dict(zip(flat[::2], flat[1::2], strict=True))


class LoadTrade:
    """The replicas' load trade through Redis, one script call (TRADE) per trade."""

    def __init__(self, redis):
        self.redis = redis
        self._script = redis.register_script(TRADE)

    async def __call__(
        self,
        scraped_key: str,
        endpoints: list[EndpointInfo],
        loads: dict[int, EndpointLoad],
        replica_id: str,
        stale: dict[str, list[bytes]],
    ) -> dict[str, list[bytes]]:
        """Read the engines' scraped load (the hashes `scraped_key` names, routing/scheduling/load_scraper.py) into `loads`,
        and trade this replica's own load per endpoint with the other replicas' (a hash per endpoint, a field per
        replica), so each one's load guard sees all of it. A replica with nothing there withdraws its field.
        `stale`: fields of replicas that died, seen at the last trade, deleted now; returns those seen at this
        one."""
        now, wall = time.monotonic(), time.time()
        keys: list[str] = []
        args: list = [replica_id, TTL_S]
        for endpoint in endpoints:
            keys += (scraped_key.format(endpoint.id), REPLICA_LOAD_KEY.format(endpoint.id))
            load = loads.get(endpoint.id)
            own = load.own(now) if load is not None else 0.0
            # In flight: what it has sent there and the slots flow control reserved for requests about to be.
            taken = load.active + load.reserved if load is not None else 0
            if load is not None and (taken or own > 0.01):
                args.append(f"{own:.3f} {taken} {wall:.3f} {load.prefill_left(now):.0f}")
            else:
                args.append("")
        if stale:
            async with self.redis.pipeline(transaction=False) as pipe:
                for key, fields in stale.items():
                    pipe.hdel(key, *fields)
                await self._script(keys=keys, args=args, client=pipe)
                replies = (await pipe.execute())[-1]
        else:
            replies = await self._script(keys=keys, args=args)
        seen: dict[str, list[bytes]] = {}
        for index, endpoint in enumerate(endpoints):
            row, published = _hash(replies[2 * index]), _hash(replies[2 * index + 1])
            load = loads.setdefault(endpoint.id, EndpointLoad())
            load.running = float(row.get(b"running", 0))
            load.waiting = float(row.get(b"waiting", 0))
            load.kv_usage = float(row.get(b"kv_usage", 0))
            others = others_load(published, replica_id, wall)
            load.others, load.others_active, load.others_prefill = others.load, others.active, others.prefill
            if others.stale:
                seen[REPLICA_LOAD_KEY.format(endpoint.id)] = others.stale
        return seen
