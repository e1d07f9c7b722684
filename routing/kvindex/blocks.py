"""The router's own block keys: chained hashes over fixed-size blocks of token ids.

The chain is seeded by the model and anything else that makes the same tokens mean a different KV cache (a LoRA
adapter, a cache salt). A cache salt enters only the first block's key, as in vLLM, so two salts share no key at
all. See docs/routing.md#prefix-routing.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from hashlib import blake2b

KEY_BYTES = 8


@lru_cache(maxsize=4096)  # one per model, adapter and tenant (or shared-cache group) in use
def chain_seed(model: str, lora: str | None = None, cache_salt: str | None = None) -> bytes:
    return blake2b(f"{model}\x00{lora or ''}\x00{cache_salt or ''}".encode(), digest_size=KEY_BYTES).digest()


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    seed: bytes,
    *,
    parent: bytes | None = None,
    limit: int | None = None,
) -> list[bytes]:
    """Keys of the full blocks of `token_ids`, chained from `parent` (or the seed for a prompt's first block)."""
    tokens = token_ids if isinstance(token_ids, array) else array("I", token_ids)
    raw = tokens.tobytes()
    step = block_size * tokens.itemsize
    count = len(tokens) // block_size
    if limit is not None:
        count = min(count, limit)
    keys = []
    previous = parent or seed
    for index in range(count):
        previous = blake2b(
            raw[index * step : (index + 1) * step], digest_size=KEY_BYTES, key=previous
        ).digest()
        keys.append(previous)
    return keys


def hex_keys(keys: Sequence[bytes]) -> list[str]:
    return [key.hex() for key in keys]


class PromptKeyCache:
    """The block keys of recent prompts, so a prompt that extends one of them (an agent's next turn) keys only
    its new blocks: the shared leading blocks are found with a few comparisons of raw token bytes (memcmp)
    instead of hashing each block again. Entries are grouped by the prompt's first block; each group keeps its
    `per_head` most recent prompts, and the most recently used groups are kept within `max_bytes` of prompts."""

    def __init__(self, max_bytes: int = 128 * 1024 * 1024, per_head: int = 8):
        self.max_bytes, self.per_head = max_bytes, per_head
        self._groups: OrderedDict[tuple, list[tuple[bytes, list[str]]]] = OrderedDict()
        self._bytes = 0

    def hex_keys(self, tokens: array, block_size: int, seed: bytes) -> list[str]:
        step = block_size * tokens.itemsize
        count = len(tokens) // block_size
        if count == 0:
            return []
        raw = tokens.tobytes()
        head = (seed, block_size, raw[:step])
        group = self._groups.get(head)
        reuse, known = 0, None
        if group is not None:
            self._groups.move_to_end(head)
            for old_raw, old_keys in reversed(group):
                most = min(len(old_keys), count)
                if most <= reuse:  # an earlier, shorter turn of the same conversation: it cannot share more
                    continue
                shared = _shared_blocks(raw, old_raw, most, step)
                if shared > reuse:
                    reuse, known = shared, old_keys
                    if shared == count:
                        break
        keys = known[:reuse] if known else []
        if reuse < count:
            parent = bytes.fromhex(keys[-1]) if keys else None
            rest = block_keys(tokens[reuse * block_size :], block_size, seed, parent=parent)
            keys = keys + [key.hex() for key in rest]
        if group is None:
            group = self._groups[head] = []
        kept = raw[: count * step]
        group.append((kept, keys))
        self._bytes += len(kept)
        if len(group) > self.per_head:
            self._bytes -= len(group.pop(0)[0])
        while self._bytes > self.max_bytes and len(self._groups) > 1:
            _, dropped = self._groups.popitem(last=False)
            self._bytes -= sum(len(entry[0]) for entry in dropped)
        return keys


def _shared_blocks(raw: bytes, old: bytes, most: int, step: int) -> int:
    """How many leading blocks of `raw` equal `old`'s, at most `most`: one comparison when all do, and when the
    last differs (a next turn, where the previous prompt's last block held its generation prompt) the next
    comparisons step back from the end, doubling; then a binary search. Each is a memcmp without copying."""
    view = memoryview(old)
    if raw.startswith(view[: most * step]):
        return most
    low, high, back = 1, most - 1, 1  # the first block is shared (same group); block `most` is not
    while high - back > low:
        if raw.startswith(view[: (high - back + 1) * step]):
            low = high - back + 1
            break
        high, back = high - back, back * 2
    while low < high:
        middle = (low + high + 1) // 2
        if raw.startswith(view[: middle * step]):
            low = middle
        else:
            high = middle - 1
    return low
