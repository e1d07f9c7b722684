"""Apply engines' KV-cache events to the prefix index in Redis (layout: routing/kvindex/prefix_index.py).

Per endpoint, an in-memory map from the engine's block hashes to the router's keys and media resolves a
BlockStored event's parent and a BlockRemoved event's entries without a read from Redis; `pxe:{endpoint}` mirrors
it for a restarted ingester. Cache salts are read from a first block's `extra_keys`. Writes leave as one Lua call
per poll round, packed with msgpack. See docs/routing.md#prefix-routing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgpack

from routing.contracts import endpoint_map_key
from routing.kvindex.blocks import block_keys, chain_seed

log = logging.getLogger(__name__)

GPU, CPU = 1, 2
MEDIA = {"GPU": GPU, None: GPU, "CPU": CPU}  # vLLM before `medium` existed had only the GPU pool
MASK = (1 << 64) - 1
MAX_SEEDS = 65_536  # chain seeds kept per endpoint: one per adapter and salt (tenant, or shared-cache group)


# ARGV[1]: msgpack of a flat list of operations: "h" key field value | "d" key field | "x" key.
# Hashes and ids travel as strings (Lua numbers are doubles and would round 64-bit hashes).
APPLY_WRITES = """
local ops = cmsgpack.unpack(ARGV[1])
local i, n = 1, #ops
while i <= n do
  local op = ops[i]
  if op == 'h' then
    redis.call('HSET', ops[i + 1], ops[i + 2], ops[i + 3])
    i = i + 4
  elseif op == 'd' then
    redis.call('HDEL', ops[i + 1], ops[i + 2])
    i = i + 3
  else
    redis.call('DEL', ops[i + 1])
    i = i + 2
  end
end
return n
"""


# Items (an operation's code, keys and values) in one APPLY_WRITES call: a few milliseconds of Redis's time.
FLUSH_ITEMS = 20_000
OP_ITEMS = {"h": 4, "d": 3, "x": 2}


class Writes:
    """Index writes queued in order, sent to Redis in script calls of bounded size."""

    def __init__(self, redis):
        self.ops: list[str] = []
        self._script = redis.register_script(APPLY_WRITES)

    def hset(self, key: str, field: str, value: str) -> None:
        self.ops += ("h", key, field, value)

    def hdel(self, key: str, field: str) -> None:
        self.ops += ("d", key, field)

    def delete(self, key: str) -> None:
        self.ops += ("x", key)

    def flush(self) -> None:
        """In calls of at most FLUSH_ITEMS items: a script holds Redis for as long as it runs, and one carrying an
        engine's replayed buffer (or a whole endpoint's entries to drop) ran for seconds, every admission and
        lookup meanwhile refused with BUSY."""
        ops, self.ops = self.ops, []
        start = 0
        while len(ops) - start > FLUSH_ITEMS:
            end = start
            while end - start < FLUSH_ITEMS:
                end += OP_ITEMS[ops[end]]  # whole operations only
            self._script(args=[msgpack.packb(ops[start:end], use_bin_type=False)])
            start = end
        if start < len(ops):
            self._script(args=[msgpack.packb(ops[start:], use_bin_type=False)])


def engine_hash(value: int | bytes) -> int:
    """vLLM's external hash: an int, or (with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) bytes of which it would
    take the low 64 bits."""
    if value.__class__ is int:
        return value
    return int.from_bytes(value, "big") & MASK


def tier_of(media: int) -> str:
    return "g" if media & GPU else "c"


@dataclass
class Source:
    """One endpoint's event stream as the ingester knows it."""

    endpoint_id: int
    deployment_id: int
    model: str
    url: str
    last_seq: int = -1
    # engine hash -> [router key (bytes), media bits]
    blocks: dict[int, list] = field(default_factory=dict)
    orphans: int = 0  # BlockStored events skipped because their parent was unknown
    block_size: int | None = None  # the deployment's, which the router keys prompts by; None: not checked
    # Why this engine's blocks cannot be keyed as the router keys prompts (its block size, its model), or None.
    mismatch: str | None = None
    reported_at: float = -1e9
    _seeds: dict[tuple[str | None, str | None], bytes] = field(default_factory=dict)

    @property
    def px_prefix(self) -> str:
        return f"px:{self.deployment_id}:"

    @property
    def map_key(self) -> str:
        return endpoint_map_key(self.endpoint_id)

    def seed(self, lora_name: str | None, cache_salt: str | None = None) -> bytes:
        seed = self._seeds.get((lora_name, cache_salt))
        if seed is None:
            if len(self._seeds) >= MAX_SEEDS:
                self._seeds.clear()
            seed = self._seeds[lora_name, cache_salt] = chain_seed(self.model, lora_name, cache_salt)
        return seed


def first_block_salt(event: dict) -> str | None:
    """The cache salt of a parent-less BlockStored's first block, from its `extra_keys` entry: vLLM lists there,
    in order, the LoRA name (when `lora_name` is set), multimodal `[identifier, offset]` pairs, the salt, and
    prompt-embedding digests (bytes), so the salt is the one plain string after the LoRA name."""
    entry = (event.get("extra_keys") or [None])[0]
    if not entry:
        return None
    strings = [key for key in entry if isinstance(key, str)]
    if event.get("lora_name") is not None:
        strings = strings[1:]
    return strings[0] if strings else None


def decode_payload(payload: bytes) -> list[dict]:
    """The events of one batch: `[ts, events, dp_rank]`."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return batch[1]


def apply_events(writes: Writes, source: Source, events: list[dict]) -> int:
    """Queue the index writes for a batch's events; returns how many blocks it stored."""
    stored = 0
    for event in events:
        kind = event.get("type")
        if kind == "BlockStored":
            stored += _stored(writes, source, event)
        elif kind == "BlockRemoved":
            _removed(writes, source, event)
        elif kind == "AllBlocksCleared":
            clear_source(writes, source)
    return stored


def _stored(writes: Writes, source: Source, event: dict) -> int:
    media = MEDIA.get(event.get("medium"))
    if media is None or event.get("group_idx") not in (None, 0):
        return 0  # another storage tier, or a second KV-cache group (hybrid models) the router does not key
    if not event.get("token_ids") or not event.get("block_size"):
        # A placeholder (vLLM's offloading connector without self-describing events): nothing to key it by.
        return 0
    if source.block_size is not None and event["block_size"] != source.block_size:
        # Keyed this way, no router key would ever match: precise routing would score zero without a word.
        source.mismatch = (
            f"the engine stores blocks of {event['block_size']} tokens, the deployment's block_size is "
            f"{source.block_size}"
        )
        return 0
    blocks = source.blocks
    parent = event.get("parent_block_hash")
    parent_key = None
    if parent is not None:
        entry = blocks.get(engine_hash(parent))
        if entry is None:
            # The chain starts at a block this ingester never saw (it was cached before a gap): the router
            # keys of these blocks cannot be computed, so they stay out of the index.
            source.orphans += 1
            return 0
        parent_key = entry[0]
    hashes = event["block_hashes"]
    tokens, size = event["token_ids"], event["block_size"]
    if parent is not None:
        keys = block_keys(tokens, size, source.seed(event.get("lora_name")), parent=parent_key)
    else:
        # Without extra keys (the CPU tier's events) the event does not say how its first block was salted;
        # when that block is known by its engine hash (which covers the salt), it keeps its key.
        known = None if event.get("extra_keys") or not hashes else blocks.get(engine_hash(hashes[0]))
        if known is not None:
            keys = [known[0], *block_keys(tokens[size:], size, b"", parent=known[0])]
        else:
            keys = block_keys(tokens, size, source.seed(event.get("lora_name"), first_block_salt(event)))
    if len(keys) != len(hashes):
        log.warning(
            "endpoint %s: BlockStored with %d hashes but %d full blocks of tokens; keying the first %d",
            source.endpoint_id,
            len(hashes),
            len(keys),
            min(len(keys), len(hashes)),
        )
    prefix = source.px_prefix
    endpoint = str(source.endpoint_id)
    map_key = source.map_key
    deployment = f"{source.deployment_id}:"
    ops = writes.ops
    for value, key in zip(hashes, keys, strict=False):
        engine = value if value.__class__ is int else engine_hash(value)
        entry = blocks.get(engine)
        if entry is None:
            blocks[engine] = entry = [key, media]
        else:
            entry[0] = key
            entry[1] |= media
        hex_key = key.hex()
        ops += (
            "h", prefix + hex_key, endpoint, "g" if entry[1] & GPU else "c",
            "h", map_key, str(engine), deployment + hex_key,
        )  # fmt: skip
    return min(len(hashes), len(keys))


def _removed(writes: Writes, source: Source, event: dict) -> None:
    media = MEDIA.get(event.get("medium"))
    if media is None:
        return
    blocks = source.blocks
    prefix = source.px_prefix
    endpoint = str(source.endpoint_id)
    for value in event["block_hashes"]:
        engine = engine_hash(value)
        entry = blocks.get(engine)
        if entry is None or not entry[1] & media:
            continue
        entry[1] &= ~media
        if entry[1]:
            # Still held in the other tier (say evicted from GPU, kept in the CPU offload).
            writes.hset(prefix + entry[0].hex(), endpoint, tier_of(entry[1]))
        else:
            del blocks[engine]
            writes.hdel(prefix + entry[0].hex(), endpoint)
            writes.hdel(source.map_key, str(engine))


def clear_source(writes: Writes, source: Source) -> None:
    """Drop every index entry of the endpoint that this ingester wrote."""
    prefix = source.px_prefix
    endpoint = str(source.endpoint_id)
    for key, _ in source.blocks.values():
        writes.hdel(prefix + key.hex(), endpoint)
    writes.delete(source.map_key)
    source.blocks.clear()


def clear_stored(redis, endpoint_id: int) -> int:
    """Drop the entries an endpoint has in Redis, read back from its `pxe:` map (e.g. left by an earlier
    ingester process, or of an endpoint deleted while none ran). Returns how many blocks it cleared."""
    map_key = endpoint_map_key(endpoint_id)
    cleared = 0
    with redis.pipeline(transaction=False) as pipe:
        for _, value in redis.hscan_iter(map_key, count=1000):
            pipe.execute_command("HDEL", f"px:{value.decode()}", endpoint_id)
            cleared += 1
            if len(pipe) >= 1000:
                pipe.execute()
        pipe.delete(map_key)
        pipe.execute()
    return cleared
