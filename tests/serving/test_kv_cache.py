"""The simulator's block pool on its own: prefix lookup, references, LRU eviction and events."""

import pytest

from simulator.kv_cache import Allocation, BlockPool, CpuTier, block_hashes, external_hash

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)


def make_pool(blocks=4):
    stored, removed = [], []
    pool = BlockPool(blocks, 4, on_stored=stored.append, on_removed=removed.append)
    return pool, stored, removed


def run_request(pool, tokens):
    hashes = block_hashes(tokens, pool.block_size)
    hit = pool.longest_prefix(hashes)
    allocation = Allocation()
    pool.acquire(hashes[:hit], allocation)
    assert pool.allocate_private(len(hashes) - hit, allocation)
    pool.commit_full_blocks(hashes[hit:], tokens[hit * 4 : len(hashes) * 4], allocation)
    return hit, allocation


def test_it_chains_hashes_so_a_block_depends_on_its_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]
    assert block_hashes([1, 2, 3], 4) == []  # only full blocks


def test_it_finds_a_shared_prefix_and_announces_only_new_blocks():
    pool, stored, _ = make_pool(8)
    hit, first = run_request(pool, [1, 2, 3, 4, 5, 6, 7, 8])
    assert hit == 0 and len(stored) == 1 and stored[0]["parent_block_hash"] is None
    hit, second = run_request(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert hit == 2 and len(stored) == 2
    assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][-1]
    assert stored[1]["token_ids"] == [9, 10, 11, 12]


def test_it_never_evicts_a_block_in_use_and_evicts_the_oldest_free_one_first():
    pool, _, removed = make_pool(3)
    _, a = run_request(pool, [1, 1, 1, 1])
    _, b = run_request(pool, [2, 2, 2, 2])
    _, c = run_request(pool, [3, 3, 3, 3])
    assert pool.free_blocks == 0 and not pool.allocate_private(1, Allocation())
    pool.release(b)
    pool.release(a)
    assert abs(pool.usage - 1 / 3) < 1e-9
    assert pool.allocate_private(1, Allocation())
    assert removed == [{"block_hashes": [external_hash(block_hashes([2, 2, 2, 2], 4)[0])], "medium": "GPU"}]


def make_tiered_pool(gpu_blocks=2, cpu_blocks=4):
    stored, removed = [], []
    cpu = CpuTier(cpu_blocks, 4, on_stored=stored.append, on_removed=removed.append)
    pool = BlockPool(gpu_blocks, 4, on_stored=stored.append, on_removed=removed.append, cpu=cpu)
    return pool, cpu, stored, removed


def test_blocks_are_written_through_to_the_cpu_tier_and_outlive_a_gpu_eviction():
    pool, cpu, stored, removed = make_tiered_pool()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    hashes = block_hashes(tokens, 4)
    _, a = run_request(pool, tokens)
    assert [e["medium"] for e in stored] == ["GPU", "CPU"]
    assert stored[0]["block_hashes"] == stored[1]["block_hashes"] == [external_hash(h) for h in hashes]
    assert stored[1]["token_ids"] == tokens and stored[1]["parent_block_hash"] is None
    pool.release(a)
    _, b = run_request(pool, [9, 9, 9, 9, 8, 8, 8, 8])  # evicts both of a's GPU blocks
    assert [e["medium"] for e in removed] == ["GPU", "GPU"]
    assert pool.longest_prefix(hashes) == 0 and cpu.longest_prefix(hashes) == 2


def test_the_cpu_tier_evicts_least_recently_used_and_a_touch_refreshes():
    cpu_stored, cpu_removed = [], []
    cpu = CpuTier(3, 4, on_stored=cpu_stored.append, on_removed=cpu_removed.append)
    x, y, z = (block_hashes([n] * 4, 4) for n in (1, 2, 3))
    cpu.store(x, [1] * 4, None)
    cpu.store(y, [2] * 4, None)
    cpu.store(x + y, [1] * 4 + [2] * 4, None)  # already held: refreshed, not announced again
    assert len(cpu_stored) == 2
    cpu.touch(x)  # x is now the most recently used
    cpu.store(z, [3] * 4, None)
    cpu.store(block_hashes([4] * 4, 4), [4] * 4, None)
    assert cpu_removed == [{"block_hashes": [external_hash(y[0])], "medium": "CPU"}]
    assert cpu.contains(x[0]) and not cpu.contains(y[0]) and len(cpu) == 3


def test_a_cpu_tier_run_after_a_held_block_names_it_as_parent():
    cpu_stored = []
    cpu = CpuTier(4, 4, on_stored=cpu_stored.append)
    hashes = block_hashes(list(range(12)), 4)
    cpu.store(hashes[:1], list(range(4)), None)
    cpu.store(hashes, list(range(12)), None)
    assert cpu_stored[1]["block_hashes"] == [external_hash(h) for h in hashes[1:]]
    assert cpu_stored[1]["parent_block_hash"] == external_hash(hashes[0])
    assert cpu_stored[1]["token_ids"] == list(range(4, 12))
