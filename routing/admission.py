"""Admission control in Redis, atomic across router replicas.

One Lua script checks every limit of the team and of the key, and only if all pass records the request. Budgets
are reserve-then-settle; concurrency slots are leases (`ROUTER_CONCURRENCY_LEASE_SECONDS`) renewed by the admitting
replica (`Admission.renew_leases`) for at most `CONCURRENCY_MAX_HOLD_S`; an expired slot's id stays uncounted for
`UNSETTLED_RETAIN_S`, so a settlement replayed from the usage journal applies at most once. See
docs/routing.md#failures-timeouts-and-metering.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from decimal import Decimal

from django.conf import settings

from tenants.periods import period_bounds
from tenants.pricing import cost_from_prices

from .state import KeyInfo, Prices, QuotaInfo, Snapshot

# Money is counted in Redis as integers of 1e-8 of the currency unit, the ledger's precision.
MONEY_SCALE = Decimal("100000000")
# A request is counted for at most this long, however long it runs (a router that forgot to settle cannot hold
# a slot for ever).
CONCURRENCY_MAX_HOLD_S = 900
# How long the id of a slot whose lease ran out stays in the set (not counted), so that a late settlement
# from the journal can still tell it was never applied.
UNSETTLED_RETAIN_S = 3600

# KEYS: for each scope (the tenant when an operator set it ceilings, the team, then the key, each when it has a quota
# of its own) seven keys:
#   rpm, itpm, otpm, concurrency zset, token budget, spend budget, and a spare.
# ARGV: now, request id, n_scopes, then per scope: rpm_limit, itpm_limit, otpm_limit, conc_limit, tok_limit,
#   spend_limit, window_ttl, budget_ttl; then the request's: input_reserve, output_reserve, spend_reserve, and the
#   concurrency lease in seconds.
# A limit of -1 means none. Returns {0, scope_index, limit_name, retry_after} when refused, else
# {1, rpm_remaining, tokens_remaining} for the tightest scope.
ADMIT = """
local now = tonumber(ARGV[1])
local request_id = ARGV[2]
local n = tonumber(ARGV[3])
local per = 8
local base = 3 + n * per
local input_reserve = tonumber(ARGV[base + 1])
local output_reserve = tonumber(ARGV[base + 2])
local spend_reserve = tonumber(ARGV[base + 3])
local lease = tonumber(ARGV[base + 4])
local rpm_remaining = -1
local tok_remaining = -1
for s = 0, n - 1 do
  local a = 3 + s * per
  local k = s * 7
  local rpm, itpm, otpm, conc = tonumber(ARGV[a+1]), tonumber(ARGV[a+2]), tonumber(ARGV[a+3]), tonumber(ARGV[a+4])
  local tok, spend = tonumber(ARGV[a+5]), tonumber(ARGV[a+6])
  local window_ttl, budget_ttl = tonumber(ARGV[a+7]), tonumber(ARGV[a+8])
  if rpm >= 0 then
    local used = tonumber(redis.call('GET', KEYS[k+1]) or '0')
    if used + 1 > rpm then return {0, s, 'requests', window_ttl} end
    if rpm_remaining < 0 or rpm - used - 1 < rpm_remaining then rpm_remaining = rpm - used - 1 end
  end
  if itpm >= 0 and tonumber(redis.call('GET', KEYS[k+2]) or '0') + input_reserve > itpm then
    return {0, s, 'input_tokens', window_ttl}
  end
  if otpm >= 0 and tonumber(redis.call('GET', KEYS[k+3]) or '0') + output_reserve > otpm then
    return {0, s, 'output_tokens', window_ttl}
  end
  if conc >= 0 then
    if redis.call('ZCOUNT', KEYS[k+4], now, '+inf') + 1 > conc then return {0, s, 'concurrency', 1} end
  end
  if tok >= 0 then
    local used = tonumber(redis.call('GET', KEYS[k+5]) or '0')
    if used + input_reserve + output_reserve > tok then return {0, s, 'token_budget', budget_ttl} end
    if tok_remaining < 0 or tok - used < tok_remaining then tok_remaining = tok - used end
  end
  if spend >= 0 and tonumber(redis.call('GET', KEYS[k+6]) or '0') + spend_reserve > spend then
    return {0, s, 'spend_budget', budget_ttl}
  end
end
for s = 0, n - 1 do
  local a = 3 + s * per
  local k = s * 7
  local window_ttl, budget_ttl = tonumber(ARGV[a+7]), tonumber(ARGV[a+8])
  redis.call('INCR', KEYS[k+1]); redis.call('EXPIRE', KEYS[k+1], window_ttl + 60)
  redis.call('INCRBY', KEYS[k+2], input_reserve); redis.call('EXPIRE', KEYS[k+2], window_ttl + 60)
  redis.call('INCRBY', KEYS[k+3], output_reserve); redis.call('EXPIRE', KEYS[k+3], window_ttl + 60)
  redis.call('ZREMRANGEBYSCORE', KEYS[k+4], '-inf', now - RETAIN)
  redis.call('ZADD', KEYS[k+4], now + lease, request_id); redis.call('EXPIRE', KEYS[k+4], math.ceil(lease) + RETAIN)
  redis.call('INCRBY', KEYS[k+5], input_reserve + output_reserve); redis.call('EXPIRE', KEYS[k+5], budget_ttl + 3600)
  redis.call('INCRBY', KEYS[k+6], spend_reserve); redis.call('EXPIRE', KEYS[k+6], budget_ttl + 3600)
end
return {1, rpm_remaining, tok_remaining}
""".replace("RETAIN", str(UNSETTLED_RETAIN_S))

# KEYS as for ADMIT. ARGV: request id, n_scopes, input delta, output delta, spend delta, and 1 when replayed from
# the journal: then nothing is done unless a scope still holds the request's id, so a settlement that reached
# Redis once (its reply lost) is not applied twice. Returns 1 when applied, 0 when not.
# The minute windows are only corrected while they are still the current ones (the keys name their minute).
SETTLE = """
local request_id = ARGV[1]
local n = tonumber(ARGV[2])
local d_in, d_out, d_spend = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if ARGV[6] == '1' then
  local held = false
  for s = 0, n - 1 do
    if redis.call('ZSCORE', KEYS[s * 7 + 4], request_id) then held = true end
  end
  if not held then return 0 end
end
for s = 0, n - 1 do
  local k = s * 7
  if redis.call('EXISTS', KEYS[k+2]) == 1 then redis.call('INCRBY', KEYS[k+2], d_in) end
  if redis.call('EXISTS', KEYS[k+3]) == 1 then redis.call('INCRBY', KEYS[k+3], d_out) end
  redis.call('ZREM', KEYS[k+4], request_id)
  if redis.call('EXISTS', KEYS[k+5]) == 1 then redis.call('INCRBY', KEYS[k+5], d_in + d_out) end
  if redis.call('EXISTS', KEYS[k+6]) == 1 then redis.call('INCRBY', KEYS[k+6], d_spend) end
end
return 1
"""

# A request that takes no tokens of a quota (count_tokens): counted against the requests per minute of each scope,
# refused when one is at its limit. KEYS: each scope's rpm key. ARGV: window_ttl, then each scope's rpm limit.
# Returns {0, scope_index, retry_after} when refused, else {1, rpm_remaining} for the tightest scope.
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

LIMIT_MESSAGES = {
    "requests": "requests per minute",
    "input_tokens": "input tokens per minute",
    "output_tokens": "output tokens per minute",
    "concurrency": "concurrent requests",
    "token_budget": "token budget for this period",
    "spend_budget": "spend budget for this period",
}


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
        return f"Rate limit reached for this {self.scope}: {LIMIT_MESSAGES.get(self.limit, self.limit)}."


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
        if lease_s is None:
            lease_s = settings.ROUTER_CONCURRENCY_LEASE_SECONDS
        self.lease_s = float(lease_s)
        # This replica's admitted requests not yet settled (or journaled), with when each was admitted
        # (monotonic): their slots' leases are renewed while they are here.
        self.held: dict[str, tuple[Reservation, float]] = {}

    @staticmethod
    def _scope_keys(kind: str, ident: int, quota: QuotaInfo, minute: int, budget_start: int) -> list[str]:
        base = f"q:{kind}:{ident}"
        return [
            _rpm_key(kind, ident, minute),
            f"{base}:itpm:{minute}",
            f"{base}:otpm:{minute}",
            f"{base}:conc",
            f"{base}:tok:{quota.budget_period}:{budget_start}",
            f"{base}:spend:{quota.budget_period}:{budget_start}",
            f"{base}:spare",
        ]

    async def admit(
        self,
        *,
        request_id: str,
        scopes: list[Scope],
        input_reserve: int,
        output_reserve: int,
        spend_reserve: int,
    ) -> Decision:
        """Admit a request against every scope that has a quota (`quota_scopes`), all or none."""
        scopes = [(kind, ident, quota) for kind, ident, quota in scopes if quota is not None]
        reservation = Reservation(request_id, [], len(scopes), input_reserve, output_reserve, spend_reserve)
        if not scopes:
            return Decision(True, reservation)
        now = time.time()
        minute = int(now // 60)
        window_ttl = 60 - int(now % 60)
        args: list = [now, request_id, len(scopes)]
        for kind, ident, quota in scopes:
            start, end = _period_of_minute(quota.budget_period, minute)
            reservation.keys += self._scope_keys(kind, ident, quota, minute, start)
            args += [
                _limit(quota.requests_per_minute),
                _limit(quota.input_tokens_per_minute),
                _limit(quota.output_tokens_per_minute),
                _limit(quota.max_concurrent_requests),
                _limit(quota.token_budget),
                money_units(quota.spend_budget) if quota.spend_budget is not None else -1,
                window_ttl,
                max(1, int(end - now)),
            ]
        args += [input_reserve, output_reserve, spend_reserve, self.lease_s]
        result = await self._admit(keys=reservation.keys, args=args)
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
        keys = [_rpm_key(kind, ident, minute) for kind, ident, _ in scopes]
        args = [window_ttl, *(int(quota.requests_per_minute) for _, _, quota in scopes)]
        result = await self._count_request(keys=keys, args=args)
        if result[0] == 1:
            return Decision(True, headers={"x-ratelimit-remaining-requests": str(result[1])})
        kind, _, quota = scopes[int(result[1])]
        return _refused(kind, quota, "requests", int(result[2]))

    def settle_in(
        self, pipe, reservation: Reservation, input_delta: int, output_delta: int, spend_delta: int
    ) -> None:
        """Queue the settlement on a pipeline (see routing/finisher.py); it runs when the pipeline executes.
        Called by its script's SHA: a pipeline given the script itself asks Redis whether it has it (SCRIPT
        EXISTS, a round trip) on every execute. A Redis that lost its scripts answers NOSCRIPT, and the
        finisher settles the batch again as a replay, which loads them."""
        args = [reservation.request_id, reservation.scopes, input_delta, output_delta, spend_delta, 0]
        pipe.evalsha(self._settle.sha, len(reservation.keys), *reservation.keys, *args)

    async def settle_replayed_in(self, pipe, keys: list[str], args: list) -> None:
        """Queue a settlement read back from the journal (`settlement_args`): applied only if its request still
        holds a slot id, so at most once."""
        await self._settle(keys=keys, args=[*args[:5], 1], client=pipe)

    @staticmethod
    def settlement_args(
        reservation: Reservation, input_delta: int, output_delta: int, spend_delta: int
    ) -> list:
        return [reservation.request_id, reservation.scopes, input_delta, output_delta, spend_delta]

    def release(self, reservation: Reservation | None) -> None:
        """Stop renewing a request's slot: it was settled, or its settlement went to the journal (then its
        lease runs out, and the replay frees it at once if Redis is back sooner)."""
        if reservation is not None:
            self.held.pop(reservation.request_id, None)

    async def renew_leases(self) -> int:
        """Extend the lease of every slot this replica holds, in one round trip; return how many. A slot already
        settled is not brought back (ZADD XX only updates ids still there)."""
        now_mono, now = time.monotonic(), time.time()
        by_key: dict[str, list[str]] = {}
        for request_id, (reservation, admitted_at) in list(self.held.items()):
            if now_mono - admitted_at > CONCURRENCY_MAX_HOLD_S:
                del self.held[request_id]
                continue
            for scope in range(reservation.scopes):
                by_key.setdefault(reservation.keys[scope * 7 + 3], []).append(request_id)
        if not by_key:
            return 0
        deadline = now + self.lease_s
        async with self.redis.pipeline(transaction=False) as pipe:
            for key, request_ids in by_key.items():
                pipe.zadd(key, dict.fromkeys(request_ids, deadline), xx=True)
                pipe.expire(key, math.ceil(self.lease_s) + UNSETTLED_RETAIN_S)
            await pipe.execute()
        return sum(len(ids) for ids in by_key.values())


def _rpm_key(kind: str, ident: int, minute: int) -> str:
    """The counter of a scope's requests in a minute (minutes since the epoch)."""
    return f"q:{kind}:{ident}:rpm:{minute}"


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


def _limit(value) -> int:
    return -1 if value is None else int(value)


def quota_counters(redis_client, *, kind: str, ident: int, quota) -> dict:
    """What admission has counted against a quota right now (sync client): the same Redis keys the admission
    script checks, so a page can show exactly what the next request will be judged against. Budgets include
    the reservations of requests still running."""
    from datetime import UTC, datetime

    now = time.time()
    start, _ = period_bounds(quota.budget_period, datetime.fromtimestamp(now, UTC))
    keys = Admission._scope_keys(kind, ident, quota, int(now // 60), int(start.timestamp()))
    with redis_client.pipeline(transaction=False) as pipe:
        pipe.get(keys[0])
        pipe.get(keys[1])
        pipe.get(keys[2])
        pipe.zcount(keys[3], now, "+inf")
        pipe.get(keys[4])
        pipe.get(keys[5])
        rpm, itpm, otpm, concurrent, tokens, spend = pipe.execute()
    return {
        "requests_per_minute": int(rpm or 0),
        "input_tokens_per_minute": int(itpm or 0),
        "output_tokens_per_minute": int(otpm or 0),
        "concurrent": int(concurrent or 0),
        "tokens": int(tokens or 0),
        "spend": Decimal(int(spend or 0)) / MONEY_SCALE,
    }
