"""The precise prefix-cache index in Redis, shared by every router replica.

Layout (block keys are the router's, 16 hex characters, see routing/kvindex/blocks.py):

    px:{deployment}:{block key}   HASH  endpoint id -> tier: "g" (GPU), "c" (CPU), "s" (speculative)
    pxe:{endpoint}                HASH  engine block hash (decimal) -> "{deployment}:{block key}"
    pxsp:{deployment}             ZSET  "{endpoint}|{block key}" scored by the time its speculative entry expires

The KV-event ingester owns `pxe:` and writes "g"/"c" entries; the router writes "s" entries after each routing
decision, which lapse unless an event confirms them. A lookup is one Lua call that returns, per endpoint, how many
of the prompt's leading blocks it holds in each tier; speculative blocks of a long prompt count as GPU blocks.
See docs/routing.md#prefix-routing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

TIERS = ("g", "c", "s")

# Both lookups take ARGV[1] = "px:{deployment}:" and ARGV[2] = the prompt's block keys, concatenated (16 hex
# characters each), and return a flat list: endpoint, GPU blocks, CPU blocks, speculative blocks, ...

# The exact walk, block by block from the first, until no endpoint holds the next one. For short prompts.
LOOKUP_WALK = """
local prefix, keys = ARGV[1], ARGV[2]
local alive = nil
local result = {}
local function emit(endpoint, counts)
  result[#result + 1] = endpoint
  result[#result + 1] = counts.g
  result[#result + 1] = counts.c
  result[#result + 1] = counts.s
end
for i = 1, #keys / 16 do
  local fields = redis.call('HGETALL', prefix .. string.sub(keys, (i - 1) * 16 + 1, i * 16))
  if #fields == 0 then break end
  local here = {}
  for j = 1, #fields, 2 do here[fields[j]] = fields[j + 1] end
  if alive == nil then
    alive = {}
    for endpoint, tier in pairs(here) do
      alive[endpoint] = {g = 0, c = 0, s = 0}
      alive[endpoint][tier] = 1
    end
  else
    local any = false
    for endpoint, counts in pairs(alive) do
      local tier = here[endpoint]
      if tier then
        counts[tier] = counts[tier] + 1
        any = true
      else
        emit(endpoint, counts)
        alive[endpoint] = nil
      end
    end
    if not any then break end
  end
end
if alive then
  for endpoint, counts in pairs(alive) do emit(endpoint, counts) end
end
return result
"""

# For long prompts: per endpoint holding the first block, a binary search for the last block it holds, and
# another for where its GPU blocks end and its CPU blocks begin. Exact when an engine's cached blocks of a prompt
# form a prefix with the GPU part first, which is how prefix caches evict (a chain's tail goes first);
# O(endpoints x log blocks) Redis reads instead of one per block.
LOOKUP_BISECT = """
local prefix, keys = ARGV[1], ARGV[2]
local n = #keys / 16
local function key(i) return prefix .. string.sub(keys, (i - 1) * 16 + 1, i * 16) end
local result = {}
local first = redis.call('HGETALL', key(1))
for j = 1, #first, 2 do
  local endpoint = first[j]
  local lo, hi = 1, n
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if redis.call('HEXISTS', key(mid), endpoint) == 1 then lo = mid else hi = mid - 1 end
  end
  local depth = lo
  local fast = 0
  if first[j + 1] ~= 'c' and redis.call('HGET', key(depth), endpoint) ~= 'c' then
    fast = depth  -- its last block is on the GPU, so all before it are
  elseif first[j + 1] ~= 'c' then
    local glo, ghi = 1, depth
    while glo < ghi do
      local mid = math.floor((glo + ghi + 1) / 2)
      if redis.call('HGET', key(mid), endpoint) ~= 'c' then glo = mid else ghi = mid - 1 end
    end
    fast = glo
  end
  result[#result + 1] = endpoint
  result[#result + 1] = fast
  result[#result + 1] = depth - fast
  result[#result + 1] = 0
end
return result
"""
BISECT_FROM_BLOCKS = 64

# ARGV: deployment, endpoint, expires_at, block keys... Never downgrades a real entry to speculative.
SPECULATE = """
local deployment, endpoint, expires = ARGV[1], ARGV[2], ARGV[3]
for i = 4, #ARGV do
  if redis.call('HSETNX', 'px:' .. deployment .. ':' .. ARGV[i], endpoint, 's') == 1 then
    redis.call('ZADD', 'pxsp:' .. deployment, expires, endpoint .. '|' .. ARGV[i])
  end
end
return 1
"""

# ARGV: deployment, now. Drops speculative entries that lapsed without an event confirming them.
EXPIRE_SPECULATIVE = """
local deployment, now = ARGV[1], ARGV[2]
local lapsed = redis.call('ZRANGEBYSCORE', 'pxsp:' .. deployment, '-inf', now)
for _, member in ipairs(lapsed) do
  local bar = string.find(member, '|', 1, true)
  local endpoint, key = string.sub(member, 1, bar - 1), string.sub(member, bar + 1)
  local hash = 'px:' .. deployment .. ':' .. key
  if redis.call('HGET', hash, endpoint) == 's' then redis.call('HDEL', hash, endpoint) end
end
redis.call('ZREMRANGEBYSCORE', 'pxsp:' .. deployment, '-inf', now)
return #lapsed
"""


@dataclass(frozen=True, slots=True)
class Held:
    """How many of a prompt's leading blocks an endpoint holds, by tier."""

    gpu: int = 0
    cpu: int = 0
    speculative: int = 0

    @property
    def blocks(self) -> int:
        return self.gpu + self.cpu + self.speculative


class PrefixIndex:
    """The router's side: one-round-trip lookups and speculative entries (redis.asyncio client)."""

    def __init__(self, redis, speculative_ttl_s: float = 3.0):
        self.redis = redis
        self.speculative_ttl_s = speculative_ttl_s
        self._walk = redis.register_script(LOOKUP_WALK)
        self._bisect = redis.register_script(LOOKUP_BISECT)
        self._speculate = redis.register_script(SPECULATE)
        self._expire = redis.register_script(EXPIRE_SPECULATIVE)

    async def lookup(self, deployment_id: int, block_keys: list[str]) -> dict[int, Held]:
        if not block_keys:
            return {}
        script = self._bisect if len(block_keys) >= BISECT_FROM_BLOCKS else self._walk
        flat = await script(args=[f"px:{deployment_id}:", "".join(block_keys)])
        held = {}
        for index in range(0, len(flat), 4):
            endpoint = int(flat[index])
            held[endpoint] = Held(int(flat[index + 1]), int(flat[index + 2]), int(flat[index + 3]))
        return held

    async def speculate(self, deployment_id: int, endpoint_id: int, block_keys: list[str]) -> None:
        if block_keys:
            expires = time.time() + self.speculative_ttl_s
            await self._speculate(args=[deployment_id, endpoint_id, expires, *block_keys])

    async def expire_speculative(self, deployment_id: int) -> int:
        return int(await self._expire(args=[deployment_id, time.time()]))
