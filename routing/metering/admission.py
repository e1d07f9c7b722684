"""Admission control in Redis, atomic across router replicas.

One Lua script checks every limit (a row of tenants/limits.py) of every scope a request counts against (its
tenant's ceilings, its team's quota, its key's), and only if all pass records the request. Budgets
are reserve-then-settle; concurrency slots are leases (`ROUTER_CONCURRENCY_LEASE_SECONDS`) renewed by the admitting
replica (`Admission.renew_leases`) for at most `CONCURRENCY_MAX_HOLD_S`; an expired slot's id stays uncounted for
`UNSETTLED_RETAIN_S`, so a settlement replayed from the usage journal applies at most once. See
docs/routing.md#failures-timeouts-and-metering.

Over 400 lines: the scripts and the Python that builds their arguments are one contract and change together."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal

import orjson
from django.conf import settings
from redis.exceptions import ConnectionError as RedisConnectionError

from routing.contracts import MONEY_SCALE, quota_counter_key, quota_keys
from routing.info import KeyInfo, Prices, QuotaInfo
from routing.snapshot import Snapshot
from tenants.limits import LIMITS, message
from tenants.periods import period_bounds
from tenants.pricing import cost_from_prices

# Money is counted in Redis as integers of 1e-8 of the currency unit, the ledger's precision.
# A request is counted for at most this long, however long it runs (a router that forgot to settle cannot hold
# a slot for ever).
CONCURRENCY_MAX_HOLD_S = 900
# How long the id of a slot whose lease ran out stays in the set (not counted), so that a late settlement
# from the journal can still tell it was never applied.
UNSETTLED_RETAIN_S = 3600
# Every admitted request under a quota, and every request an engine may be serving (routing/metering/finisher.py, `opened`),
# until it is settled, by its lease deadline (see REAP); its orphan record; and the mark of one reaped.
LEASES_KEY = "q:leases"
ORPHAN_PREFIX = "q:orphan:"
REAPED_PREFIX = "q:reaped:"
# A request's lease must have run out this long before its orphan record is settled: a replica whose link to
# Redis broke renews its leases within a second of it coming back, and replays its journal's settlements.
REAP_GRACE_S = 10.0
# How long an orphan record outlives the most a request is counted for.
ORPHAN_TTL_S = CONCURRENCY_MAX_HOLD_S + UNSETTLED_RETAIN_S


def _named(script: str) -> str:
    """A script with the keys above in place of their names."""
    return (
        script.replace("'LEASES'", f"'{LEASES_KEY}'")
        .replace("'ORPHAN'", f"'{ORPHAN_PREFIX}'")
        .replace("'REAPED'", f"'{REAPED_PREFIX}'")
    )


# Both scripts take their arguments by name: one JSON document in ARGV[1], built from the quota kinds' table
# (tenants/limits.py). Each limit names its counter (an index into KEYS), what a request adds to it (`counts`), its
# limit (-1: none, counted all the same) and its counter's time to live. Amounts are strings, so that Redis's
# integers stay exact.
#
# ADMIT: {now, id, lease, amounts: {counts: amount}, scopes: [[{key, counts, limit, ttl, code, retry, shown}]]}.
# Checks every limit of every scope, and only if all pass records the request in every counter. Returns
# {0, scope_index, code, retry_after} when refused, else {1, requests_remaining, tokens_remaining} for the
# tightest scope (-1 where none applies).
ADMIT = """
local r = cjson.decode(ARGV[1])
local amounts = {}
for name, value in pairs(r.amounts) do amounts[name] = tonumber(value) end
local remaining = {}
for s, limits in ipairs(r.scopes) do
  for _, l in ipairs(limits) do
    if l.limit >= 0 then
      local after
      if l.counts == 'slot' then
        after = redis.call('ZCOUNT', KEYS[l.key], r.now, '+inf') + 1
      else
        after = tonumber(redis.call('GET', KEYS[l.key]) or '0') + amounts[l.counts]
      end
      if after > l.limit then return {0, s - 1, l.code, l.retry} end
      if l.shown then
        local left = l.limit - after
        if remaining[l.shown] == nil or left < remaining[l.shown] then remaining[l.shown] = left end
      end
    end
  end
end
for _, limits in ipairs(r.scopes) do
  for _, l in ipairs(limits) do
    local key = KEYS[l.key]
    if l.counts == 'slot' then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', r.now - RETAIN)
      redis.call('ZADD', key, r.now + r.lease, r.id)
      redis.call('EXPIRE', key, math.ceil(r.lease) + RETAIN)
    else
      redis.call('INCRBY', key, r.amounts[l.counts])
      redis.call('EXPIRE', key, l.ttl)
    end
  end
end
if r.orphan then
  redis.call('ZADD', KEYS[#KEYS - 1], r.now + r.lease, r.id)
  redis.call('SET', KEYS[#KEYS], r.orphan, 'EX', HOLD + RETAIN)
end
return {1, remaining.requests or -1, remaining.tokens or -1}
""".replace("RETAIN", str(UNSETTLED_RETAIN_S)).replace("HOLD", str(CONCURRENCY_MAX_HOLD_S))

# SETTLE: {id, replay, deltas: {counts: delta}, scopes: [[{key, counts}]]}: the settled limits of each scope, a slot
# freed and a counter corrected by what the request used less what it reserved. With `replay` (a settlement read
# back from the usage journal) nothing is done unless a scope still holds the request's slot, so a settlement that
# reached Redis once (its reply lost) is not applied twice. Returns 1 when applied, 0 when not. A counter whose key
# is gone (a minute's, once that minute is over) is left alone.
SETTLE = """
local r = cjson.decode(ARGV[1])
if redis.call('EXISTS', 'REAPED' .. r.id) == 1 then return 0 end
if r.replay then
  local held = false
  for _, limits in ipairs(r.scopes) do
    for _, l in ipairs(limits) do
      if l.counts == 'slot' and redis.call('ZSCORE', KEYS[l.key], r.id) then held = true end
    end
  end
  if not held then return 0 end
end
for _, limits in ipairs(r.scopes) do
  for _, l in ipairs(limits) do
    local key = KEYS[l.key]
    if l.counts == 'slot' then
      redis.call('ZREM', key, r.id)
    elseif redis.call('EXISTS', key) == 1 then
      redis.call('INCRBY', key, r.deltas[l.counts])
    end
  end
end
redis.call('ZREM', 'LEASES', r.id)
redis.call('DEL', 'ORPHAN' .. r.id)
return 1
"""
SETTLE = _named(SETTLE)

# REAP: {cutoff, limit, retain, stream, field}. A request whose replica died (SIGKILL, a lost machine) is never
# settled: its slot's lease runs out, but its reservation would stay in the budget counters until their period
# ends, and its usage would never reach the ledger. Every admitted request under a quota is in LEASES (scored by
# its slot's lease deadline, renewed with it) with its orphan record: the settlement that gives back what it
# reserved beyond what its event bills, and that usage event (status failed; its prompt as the router counted it once the request is on its way
# to an engine, before that no tokens). A request without a quota has a record with no settlement, written once
# it is on its way to an engine (routing/metering/finisher.py, `opened`). Requests whose lease ran out before `cutoff` are
# settled from that record, their event appended to the usage stream, and marked reaped (for `retain` seconds) so
# that a settlement of theirs arriving later, from a journal, is not applied on top. Returns how many.
REAP = """
local r = cjson.decode(ARGV[1])
local ids = redis.call('ZRANGEBYSCORE', 'LEASES', '-inf', r.cutoff, 'LIMIT', 0, r.limit)
local reaped = 0
for _, id in ipairs(ids) do
  redis.call('ZREM', 'LEASES', id)
  local raw = redis.call('GET', 'ORPHAN' .. id)
  if raw then
    redis.call('DEL', 'ORPHAN' .. id)
    local o = cjson.decode(raw)
    for _, limits in ipairs(o.scopes) do
      for _, l in ipairs(limits) do
        local key = o.keys[l.key]
        if l.counts == 'slot' then
          redis.call('ZREM', key, id)
        elseif redis.call('EXISTS', key) == 1 then
          redis.call('INCRBY', key, o.deltas[l.counts])
        end
      end
    end
    redis.call('XADD', r.stream, '*', r.field, o.event)
    redis.call('SET', 'REAPED' .. id, '1', 'EX', r.retain)
    reaped = reaped + 1
  end
end
return reaped
"""
REAP = _named(REAP)

# A request that takes no tokens of a quota (count_tokens): counted against the requests per minute of each scope,
# refused when one is at its limit. KEYS: each scope's requests-per-minute counter. ARGV: the window's time to live,
# then each scope's limit. Returns {0, scope_index, retry_after} when refused, else {1, remaining} for the tightest.
COUNT_REQUEST = """
local window_ttl = tonumber(ARGV[1])
local remaining = -1
for s = 1, #KEYS do
  local used = tonumber(redis.call('GET', KEYS[s]) or '0')
  local rpm = tonumber(ARGV[s + 1])
  if used + 1 > rpm then return {0, s - 1, window_ttl} end
  if remaining < 0 or rpm - used - 1 < remaining then remaining = rpm - used - 1 end
end
for s = 1, #KEYS do
  redis.call('INCR', KEYS[s]); redis.call('EXPIRE', KEYS[s], window_ttl + 60)
end
return {1, remaining}
"""

# Keys per scope in a settlement journaled before the table (six limits and a spare key), for its replay.
JOURNALED_KEYS_PER_SCOPE = 7
# The limits whose remainder the answer's headers show (x-ratelimit-remaining-<name>).
SHOWN = {"requests_per_minute": "requests", "token_budget": "tokens"}


# A quota's scope: its kind ("tenant", "team" or "key"), the id of what it limits, and its quota (None: no quota).
Scope = tuple[str, int, QuotaInfo | None]


def quota_scopes(snapshot: Snapshot, key: KeyInfo) -> list[Scope]:
    """The scopes a key's requests count against, widest first: its tenant's ceilings (pooled over all of the
    tenant's teams and keys, so that a tenant's admins cannot add teams to get more), its team's quota, its own."""
    return [
        ("tenant", key.tenant_id, snapshot.tenant_quotas.get(key.tenant_id)),
        ("team", key.team_id, snapshot.team_quotas.get(key.team_id)),
        ("key", key.id, snapshot.key_quotas.get(key.id)),
    ]


@dataclass
class Reservation:
    request_id: str
    keys: list[str]
    scopes: int
    input_tokens: int
    output_tokens: int
    spend: int  # in 1e-8 units


@dataclass
class Decision:
    admitted: bool
    reservation: Reservation | None = None
    scope: str = ""
    limit: str = ""
    retry_after: int = 0
    headers: dict | None = None

    @property
    def message(self) -> str:
        return f"Rate limit reached for this {self.scope}: {message(self.limit)}."


def money_units(amount: Decimal) -> int:
    return int((amount * MONEY_SCALE).to_integral_value())


def cost_units(prices: Prices | None, prompt: int, cached: int, output: int) -> int:
    """A request's cost in 1e-8 units, computed exactly as the ledger computes it."""
    if prices is None:
        return 0
    cost = cost_from_prices(
        prices.input_per_mtok,
        prices.cached_input_per_mtok,
        prices.output_per_mtok,
        prompt,
        min(cached, prompt),
        output,
    )
    return money_units(cost)


class Admission:
    def __init__(self, redis, lease_s: float | None = None):
        self.redis = redis
        self._admit = redis.register_script(ADMIT)
        self._settle = redis.register_script(SETTLE)
        self._count_request = redis.register_script(COUNT_REQUEST)
        self._reap = redis.register_script(REAP)
        if lease_s is None:
            lease_s = settings.ROUTER_CONCURRENCY_LEASE_SECONDS
        self.lease_s = float(lease_s)
        # This replica's admitted requests not yet settled (or journaled), with when each was admitted
        # (monotonic): their slots' leases are renewed while they are here.
        self.held: dict[str, tuple[Reservation, float]] = {}

    @staticmethod
    def _scope_keys(kind: str, ident: int, quota: QuotaInfo, minute: int, budget_start: int) -> list[str]:
        """A scope's counters, one per limit in the table's order: a minute's name its minute, a budget's its
        period and start."""
        return quota_keys(kind, ident, quota.budget_period, minute, budget_start)

    async def admit(
        self,
        *,
        request_id: str,
        scopes: list[Scope],
        input_reserve: int,
        output_reserve: int,
        spend_reserve: int,
        orphan_event: str | None = None,
    ) -> Decision:
        """Admit a request against every scope that has a quota (`quota_scopes`), all or none. `orphan_event`
        (an encoded usage event) is what the ledger gets for it if its replica dies before settling it (REAP)."""
        scopes = [(kind, ident, quota) for kind, ident, quota in scopes if quota is not None]
        reservation = Reservation(request_id, [], len(scopes), input_reserve, output_reserve, spend_reserve)
        if not scopes:
            return Decision(True, reservation)
        now = time.time()
        minute = int(now // 60)
        window_ttl = 60 - int(now % 60)
        documented = []
        for kind, ident, quota in scopes:
            start, end = _period_of_minute(quota.budget_period, minute)
            budget_ttl = max(1, int(end - now))
            base = len(reservation.keys)
            reservation.keys += self._scope_keys(kind, ident, quota, minute, start)
            limits = []
            for index, limit in enumerate(LIMITS):
                retry = (
                    1 if limit.window == "running" else window_ttl if limit.window == "minute" else budget_ttl
                )
                entry = {
                    "key": base + index + 1,
                    "counts": limit.counts,
                    "limit": _limit(getattr(quota, limit.field), limit.money),
                    "code": limit.code,
                    "retry": retry,
                    "ttl": window_ttl + 60 if limit.window == "minute" else budget_ttl + 3600,
                }
                if limit.field in SHOWN:
                    entry["shown"] = SHOWN[limit.field]
                limits.append(entry)
            documented.append(limits)
        amounts = {
            "request": "1",
            "input": str(input_reserve),
            "output": str(output_reserve),
            "tokens": str(input_reserve + output_reserve),
            "spend": str(spend_reserve),
        }
        document = {
            "now": now,
            "id": request_id,
            "lease": self.lease_s,
            "amounts": amounts,
            "scopes": documented,
        }
        keys = reservation.keys
        if orphan_event is not None:
            document["orphan"] = orphan_record(reservation, orphan_event)
            keys = [*keys, LEASES_KEY, ORPHAN_PREFIX + request_id]
        argument = orjson.dumps(document)
        try:
            result = await self._admit(keys=keys, args=[argument])
        except RedisConnectionError:
            # After Redis restarts, each pooled connection fails once (and is dropped) before a fresh one works:
            # without this, as many requests as the pool held were refused. A script whose reply alone was lost
            # is counted twice, which errs against the team by one reservation until the period ends.
            result = await self._admit(keys=keys, args=[argument])
        if result[0] == 1:
            self.held[request_id] = (reservation, time.monotonic())
            headers = {}
            if result[1] >= 0:
                headers["x-ratelimit-remaining-requests"] = str(result[1])
            if result[2] >= 0:
                headers["x-ratelimit-remaining-tokens"] = str(result[2])
            return Decision(True, reservation, headers=headers)
        scope_index, limit, retry_after = int(result[1]), result[2], int(result[3])
        limit = limit.decode() if isinstance(limit, bytes) else limit
        kind, _, quota = scopes[scope_index]
        return _refused(kind, quota, limit, retry_after)

    async def count_request(self, scopes: list[Scope]) -> Decision:
        """Count a request that takes no tokens, slot or budget (count_tokens) against the requests per minute
        of its scopes (`quota_scopes`), in the same counters `admit` checks; refused when one is at its limit."""
        scopes = [(k, i, q) for k, i, q in scopes if q is not None and q.requests_per_minute is not None]
        if not scopes:
            return Decision(True)
        now = time.time()
        minute = int(now // 60)
        window_ttl = 60 - int(now % 60)
        rpm = next(limit for limit in LIMITS if limit.field == "requests_per_minute")
        keys = [quota_counter_key(rpm, kind, ident, "", minute, 0) for kind, ident, _ in scopes]
        args = [window_ttl, *(int(quota.requests_per_minute) for _, _, quota in scopes)]
        result = await self._count_request(keys=keys, args=args)
        if result[0] == 1:
            return Decision(True, headers={"x-ratelimit-remaining-requests": str(result[1])})
        kind, _, quota = scopes[int(result[1])]
        return _refused(kind, quota, "requests", int(result[2]))

    def settle_in(
        self, pipe, reservation: Reservation, input_delta: int, output_delta: int, spend_delta: int
    ) -> None:
        """Queue the settlement on a pipeline (see routing/metering/finisher.py); it runs when the pipeline executes.
        Called by its script's SHA: a pipeline given the script itself asks Redis whether it has it (SCRIPT
        EXISTS, a round trip) on every execute. A Redis that lost its scripts answers NOSCRIPT, and the
        finisher settles the batch again as a replay, which loads them."""
        args = self.settlement_args(reservation, input_delta, output_delta, spend_delta)
        pipe.evalsha(self._settle.sha, len(reservation.keys), *reservation.keys, _settlement(args, False))

    async def settle_replayed_in(self, pipe, keys: list[str], args: list) -> None:
        """Queue a settlement read back from the journal (`settlement_args`): applied only if its request still
        holds a slot id, so at most once."""
        scopes = args[1]
        old = JOURNALED_KEYS_PER_SCOPE
        if scopes and len(keys) == scopes * old != scopes * len(LIMITS):  # journaled with a spare key a scope
            keys = [key for index, key in enumerate(keys) if index % old != old - 1]
        await self._settle(keys=keys, args=[_settlement(args, True)], client=pipe)

    @staticmethod
    def settlement_args(
        reservation: Reservation, input_delta: int, output_delta: int, spend_delta: int
    ) -> list:
        """What a settlement needs besides the reservation's keys, as the usage journal keeps it."""
        return [reservation.request_id, reservation.scopes, input_delta, output_delta, spend_delta]

    def release(self, reservation: Reservation | None) -> None:
        """Stop renewing a request's slot: it was settled, or its settlement went to the journal (then its
        lease runs out, and the replay frees it at once if Redis is back sooner)."""
        if reservation is not None:
            self.held.pop(reservation.request_id, None)

    async def renew_leases(self, records: Iterable[str] = ()) -> int:
        """Extend the lease of every slot this replica holds, and of the orphan records of its requests without
        a quota (`records`: their ids), in one round trip; return how many. A slot or record already settled is
        not brought back (ZADD XX only updates ids still there)."""
        now_mono, now = time.monotonic(), time.time()
        slot = next(index for index, limit in enumerate(LIMITS) if limit.counts == "slot")
        by_key: dict[str, list[str]] = {}
        for request_id, (reservation, admitted_at) in list(self.held.items()):
            if now_mono - admitted_at > CONCURRENCY_MAX_HOLD_S:
                del self.held[request_id]
                continue
            for scope in range(reservation.scopes):
                by_key.setdefault(reservation.keys[scope * len(LIMITS) + slot], []).append(request_id)
        leased = [rid for ids in by_key.values() for rid in ids] + list(records)
        if not leased:
            return 0
        deadline = now + self.lease_s
        async with self.redis.pipeline(transaction=False) as pipe:
            for key, request_ids in by_key.items():
                pipe.zadd(key, dict.fromkeys(request_ids, deadline), xx=True)
                pipe.expire(key, math.ceil(self.lease_s) + UNSETTLED_RETAIN_S)
            pipe.zadd(LEASES_KEY, dict.fromkeys(leased, deadline), xx=True)
            await pipe.execute()
        return len(leased)

    def record_in(self, pipe, reservation: Reservation, record: str) -> None:
        """Queue a request's orphan record (`orphan_record`) with its lease on a pipeline: what REAP settles it
        from if this replica dies first. Under a quota it replaces the one admission wrote, only while that one
        is there (XX): a request settled meanwhile is not brought back, so its reservation is never given back
        twice."""
        deadline = time.time() + self.lease_s
        under_quota = reservation.scopes > 0
        pipe.set(ORPHAN_PREFIX + reservation.request_id, record, ex=ORPHAN_TTL_S, xx=under_quota)
        pipe.zadd(LEASES_KEY, {reservation.request_id: deadline}, xx=under_quota)

    @staticmethod
    def forget_in(pipe, request_id: str) -> None:
        """Queue the removal of the orphan record of a request without a quota, which settles nothing."""
        pipe.delete(ORPHAN_PREFIX + request_id)
        pipe.zrem(LEASES_KEY, request_id)

    async def reap_orphans(self, limit: int = 500) -> int:
        """Settle the requests whose replica died before settling them (REAP): their reservations given back,
        their usage events (failed, their prompts where known) appended to the stream; returns how many. Safe
        from every replica at once."""
        from tenants.usage_stream import FIELD, stream_key

        argument = {
            "cutoff": time.time() - REAP_GRACE_S,
            "limit": limit,
            "retain": UNSETTLED_RETAIN_S,
            "stream": stream_key(),
            "field": FIELD,
        }
        return int(await self._reap(args=[orjson.dumps(argument)]))


def _settlement(args: list, replay: bool) -> bytes:
    """The settle script's argument, from `settlement_args`: each scope's settled limits, by name."""
    request_id, scopes, d_in, d_out, d_spend = args[:5]
    deltas = {"input": str(d_in), "output": str(d_out), "tokens": str(d_in + d_out), "spend": str(d_spend)}
    settled = [(index, limit.counts) for index, limit in enumerate(LIMITS) if limit.settled]
    documented = [
        [{"key": scope * len(LIMITS) + index + 1, "counts": counts} for index, counts in settled]
        for scope in range(scopes)
    ]
    return orjson.dumps({"id": request_id, "replay": replay, "deltas": deltas, "scopes": documented})


def orphan_record(reservation: Reservation, event: str, input_used: int = 0, spend_used: int = 0) -> str:
    """What REAP needs to settle a request nobody settled: its keys, the settlement that gives back all it
    reserved but what its usage event bills (`input_used` prompt tokens costing `spend_used`; nothing without a
    quota), and that event."""
    deltas = {
        "input": str(input_used - reservation.input_tokens),
        "output": str(-reservation.output_tokens),
        "tokens": str(input_used - reservation.input_tokens - reservation.output_tokens),
        "spend": str(spend_used - reservation.spend),
    }
    settled = [(index, limit.counts) for index, limit in enumerate(LIMITS) if limit.settled]
    scopes = [
        [{"key": scope * len(LIMITS) + index + 1, "counts": counts} for index, counts in settled]
        for scope in range(reservation.scopes)
    ]
    record = {"keys": reservation.keys, "scopes": scopes, "deltas": deltas, "event": event}
    return orjson.dumps(record).decode()


def _refused(kind: str, quota: QuotaInfo, limit: str, retry_after: int) -> Decision:
    retry_after = max(1, retry_after)
    headers = {"retry-after": str(retry_after), "x-ratelimit-reset-requests": f"{retry_after}s"}
    if quota.requests_per_minute is not None:
        headers["x-ratelimit-limit-requests"] = str(quota.requests_per_minute)
    if quota.token_budget is not None:
        headers["x-ratelimit-limit-tokens"] = str(quota.token_budget)
    return Decision(False, scope=kind, limit=limit, retry_after=retry_after, headers=headers)


@functools.lru_cache(maxsize=64)
def _period_of_minute(period: str, minute: int) -> tuple[int, int]:
    """The budget period holding this minute (minutes since the epoch), as UTC timestamps. Periods start on a
    minute boundary, so every moment of a minute is in the same period."""
    from datetime import UTC, datetime

    start, end = period_bounds(period, datetime.fromtimestamp(minute * 60, UTC))
    return int(start.timestamp()), int(end.timestamp())


def _limit(value, money: bool = False) -> int:
    """A limit as the scripts compare it: -1 for none, money in 1e-8 units."""
    if value is None:
        return -1
    return money_units(value) if money else int(value)
