"""The simulator's block pool on its own: prefix lookup, references, LRU eviction and events."""

from serving.simulator.kv_cache import Allocation, BlockPool, block_hashes, external_hash


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
