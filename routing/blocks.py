"""The router's own block keys: chained hashes over fixed-size blocks of token ids.

Keys are the router's, not the engine's: the KV-event ingester recomputes them from each BlockStored event's
token ids and parent, and keeps a per-endpoint map from the engine's hash to the router's key, so the index never
depends on an engine's hash seed or algorithm. The chain is seeded by the model and anything else that makes the
same tokens mean a different KV cache (a LoRA adapter, a cache salt).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

KEY_BYTES = 8


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
