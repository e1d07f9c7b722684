"""A bounded KV cache of fixed-size blocks with prefix caching over full blocks and LRU eviction, and an
optional CPU tier below it (vLLM's OffloadingConnector with its CPU spec and LRU policy).

Block hashes follow vLLM's default scheme (sha256 over a pickle of parent hash, block token ids and extra
keys, seeded from PYTHONHASHSEED), so a block gets the same hash here as on a vLLM engine with the same seed.
A request's `cache_salt` is an extra key of its first block only, as in vLLM: the same tokens under another salt
chain from another first hash, so they share no cached block. The GPU pool's BlockStored events say so in
`extra_keys` (one entry per block: `[salt]` for a salted first block, else None); the CPU tier's carry none, as
vLLM 0.32's offloading connector publishes none.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MASK64 = (1 << 64) - 1


def _sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


NONE_HASH = _sha256(os.environ.get("PYTHONHASHSEED") or "vllm-none-hash")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    parent: bytes | None = None,
    start: int = 0,
    cache_salt: str | None = None,
) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids` from block index `start` on. `cache_salt` salts the
    sequence's first block: give it when `token_ids` start at the sequence's first token (no `parent`)."""
    hashes = []
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        extra = (("cache_salt", cache_salt),) if cache_salt and begin == 0 and parent is None else None
        parent = _sha256((parent or NONE_HASH, tuple(token_ids[begin : begin + block_size]), extra))
        hashes.append(parent)
    return hashes


def event_extra_keys(first_index: int, count: int, cache_salt: str | None) -> list[list[str] | None]:
    """The `extra_keys` of a BlockStored for `count` blocks from block index `first_index` of a sequence."""
    keys: list[list[str] | None] = [None] * count
    if cache_salt and first_index == 0 and count:
        keys[0] = [cache_salt]
    return keys


def external_hash(block_hash: bytes) -> int:
    """The 64-bit integer form vLLM puts in KV events (the low 64 bits of the digest)."""
    return int.from_bytes(block_hash, "big") & MASK64


@dataclass
class _Block:
    refs: int = 0


@dataclass
class Allocation:
    """What one request holds: cached full blocks (by hash) and a count of private, not-yet-full blocks."""

    hashes: list[bytes] = field(default_factory=list)
    private_blocks: int = 0
    cache_salt: str | None = None  # the request's, which its first block's hash and event carry


class BlockPool:
    """Blocks of one tier. `on_stored` and `on_removed` receive events in vLLM's shapes."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        medium: str = "GPU",
        on_stored: Callable[[dict], None] | None = None,
        on_removed: Callable[[dict], None] | None = None,
        on_cleared: Callable[[], None] | None = None,
        cpu: CpuTier | None = None,
    ):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.medium = medium
        self._cached: dict[bytes, _Block] = {}
        self._evictable: OrderedDict[bytes, None] = (
            OrderedDict()
        )  # cached blocks no request holds, oldest first
        self._private = 0  # blocks held by requests that are not (yet) full and cached
        self._on_stored = on_stored or (lambda event: None)
        self._on_removed = on_removed or (lambda event: None)
        self._on_cleared = on_cleared or (lambda: None)
        self.cpu = cpu  # the offload tier every newly computed full block is written through to

    # --- accounting ---------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks that can be handed out now, evicting unreferenced cached blocks if need be."""
        return self.num_blocks - self._private - (len(self._cached) - len(self._evictable))

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests, as vLLM's kv_cache_usage_perc."""
        return min(1.0, 1.0 - self.free_blocks / self.num_blocks)

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._cached

    def longest_prefix(self, hashes: Sequence[bytes]) -> int:
        count = 0
        for block_hash in hashes:
            if block_hash not in self._cached:
                break
            count += 1
        return count

    # --- a request's life ---------------------------------------------------------------------------
    def can_allocate(self, hit_blocks: Sequence[bytes], new_blocks: int) -> bool:
        reclaimed_hits = sum(1 for h in hit_blocks if h in self._evictable)
        return self.free_blocks - reclaimed_hits >= new_blocks

    def acquire(self, hashes: Sequence[bytes], allocation: Allocation) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block_hash in hashes:
            block = self._cached[block_hash]
            if block.refs == 0:
                self._evictable.pop(block_hash, None)
            block.refs += 1
            allocation.hashes.append(block_hash)

    def allocate_private(self, count: int, allocation: Allocation, *, force: bool = False) -> bool:
        """Reserve `count` blocks for tokens being computed. Evicts as needed; fails if full unless forced."""
        if not self._make_room(count) and not force:
            return False
        self._private += count
        allocation.private_blocks += count
        return True

    def release_private(self, count: int, allocation: Allocation) -> None:
        """Give back `count` of the request's private blocks (the prefix they were for turned out cached)."""
        count = min(count, allocation.private_blocks)
        self._private -= count
        allocation.private_blocks -= count

    def commit_full_blocks(
        self, hashes: Sequence[bytes], token_ids: Sequence[int], allocation: Allocation
    ) -> None:
        """Turn private blocks that are now full into cached blocks, and announce the new ones.

        Consecutive new blocks go out as one BlockStored (parent hash, all their token ids), as vLLM does.
        """
        run: list[int] = []  # indexes into `hashes` of the current run of newly stored blocks
        for index, block_hash in enumerate(hashes):
            use = min(1, allocation.private_blocks)
            allocation.private_blocks -= use
            self._private -= use
            block = self._cached.get(block_hash)
            if block is None:
                block = self._cached[block_hash] = _Block()
                if run and run[-1] != index - 1:
                    self._announce(hashes, token_ids, run, allocation)
                    run = []
                run.append(index)
            elif block.refs == 0:
                self._evictable.pop(block_hash, None)
            block.refs += 1
        if run:
            self._announce(hashes, token_ids, run, allocation)
        if self.cpu is not None and hashes:
            self.cpu.store(hashes, token_ids, allocation.hashes[-1] if allocation.hashes else None)
        allocation.hashes.extend(hashes)

    def _announce(self, hashes, token_ids, run: list[int], allocation: Allocation) -> None:
        first = run[0]
        parent = hashes[first - 1] if first > 0 else (allocation.hashes[-1] if allocation.hashes else None)
        size = self.block_size
        self._on_stored(
            {
                "block_hashes": [external_hash(hashes[i]) for i in run],
                "parent_block_hash": external_hash(parent) if parent else None,
                "token_ids": list(token_ids[first * size : (run[-1] + 1) * size]),
                "block_size": size,
                "medium": self.medium,
                # `hashes` continue the request's chain after the blocks it already holds.
                "extra_keys": event_extra_keys(
                    len(allocation.hashes) + first, len(run), allocation.cache_salt
                ),
            }
        )

    def release(self, allocation: Allocation) -> None:
        """Drop a finished request's references. Its tail blocks become the first to be evicted."""
        self._private -= allocation.private_blocks
        allocation.private_blocks = 0
        for block_hash in reversed(allocation.hashes):
            block = self._cached.get(block_hash)
            if block is None:
                continue
            block.refs -= 1
            if block.refs == 0:
                self._evictable[block_hash] = None
        allocation.hashes.clear()

    def clear(self) -> bool:
        """Drop every cached block (vLLM's reset_prefix_cache). Refused while a request holds blocks."""
        if len(self._cached) != len(self._evictable) or self._private:
            return False
        self._cached.clear()
        self._evictable.clear()
        if self.cpu is not None:
            self.cpu.clear()  # the one AllBlocksCleared event tells indexes to forget every tier
        self._on_cleared()
        return True

    # --- eviction -----------------------------------------------------------------------------------
    def _make_room(self, needed: int) -> bool:
        unused = self.num_blocks - self._private - len(self._cached)
        while unused < needed and self._evictable:
            block_hash, _ = self._evictable.popitem(last=False)
            del self._cached[block_hash]
            unused += 1
            self._on_removed({"block_hashes": [external_hash(block_hash)], "medium": self.medium})
        return unused >= needed


class CpuTier:
    """The CPU tier of vLLM's OffloadingConnector: a bounded LRU of full blocks, keyed by the same hashes.

    As in vLLM 0.32 (OffloadingConnectorScheduler._build_store_jobs), blocks are written through: every full
    block a request computes is stored here as well as on the GPU, not when the GPU evicts it. A GPU eviction
    then only drops the GPU copy, and a later request whose prefix continues into blocks held here loads them
    instead of recomputing them. Stored blocks are announced with medium "CPU" and whole token ids (vLLM with
    `self_describing_kv_events`); blocks dropped by the LRU are announced as BlockRemoved with medium "CPU".
    """

    medium = "CPU"

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        on_stored: Callable[[dict], None] | None = None,
        on_removed: Callable[[dict], None] | None = None,
    ):
        if num_blocks < 1:
            raise ValueError("the CPU tier needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._on_stored = on_stored or (lambda event: None)
        self._on_removed = on_removed or (lambda event: None)

    def __len__(self) -> int:
        return len(self._blocks)

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def longest_prefix(self, hashes: Sequence[bytes], start: int = 0) -> int:
        """How many blocks from `hashes[start]` on are held here, one after another."""
        count = 0
        for block_hash in hashes[start:]:
            if block_hash not in self._blocks:
                break
            count += 1
        return count

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark blocks as just used (a request is loading them)."""
        for block_hash in hashes:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)

    def store(self, hashes: Sequence[bytes], token_ids: Sequence[int], parent: bytes | None) -> None:
        """Store consecutive full blocks (`token_ids` are theirs, `parent` the hash before the first one).

        Blocks already held are refreshed; new ones evict the least recently used blocks to make room. New
        blocks go out as one BlockStored per run of consecutive new blocks.
        """
        size = self.block_size
        fresh = [i for i, h in enumerate(hashes) if h not in self._blocks][: self.num_blocks]
        self.touch(hashes)
        evicted = []
        while self._blocks and len(self._blocks) + len(fresh) > self.num_blocks:
            evicted.append(self._blocks.popitem(last=False)[0])
        if evicted:
            self._on_removed({"block_hashes": [external_hash(h) for h in evicted], "medium": self.medium})
        runs: list[list[int]] = []
        for index in fresh:
            self._blocks[hashes[index]] = None
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first = run[0]
            before = hashes[first - 1] if first > 0 else parent
            self._on_stored(
                {
                    "block_hashes": [external_hash(hashes[i]) for i in run],
                    "parent_block_hash": external_hash(before) if before else None,
                    "token_ids": list(token_ids[first * size : (run[-1] + 1) * size]),
                    "block_size": size,
                    "medium": self.medium,
                }
            )

    def clear(self) -> None:
        self._blocks.clear()
