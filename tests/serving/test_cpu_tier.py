"""The simulator's CPU offload tier (vLLM's OffloadingConnector), on real simulator processes.

Blocks are written through to the CPU tier as they are computed (BlockStored medium CPU); a GPU eviction drops
only the GPU copy (BlockRemoved medium GPU); a later request whose prefix continues into CPU-held blocks loads
them, faster than recomputing and slower than a GPU hit, and they count as cached tokens in its usage; the CPU
tier evicts its least recently used blocks when full (BlockRemoved medium CPU).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from .engines import MODEL_NAME, EventSubscriber, events_of, start_engine

BLOCK = 128
PREFILL_TIME_PER_TOKEN = 0.001  # a cold 513-token prompt takes about 0.51 s to prefill


def prompt_of(n_blocks: int, salt: int) -> list[int]:
    """n full blocks and one more token (so every full block can be a hit)."""
    return [(i * 17 + salt * 131) % 3000 + 100 for i in range(n_blocks * BLOCK)] + [7]


def complete(engine, prompt) -> tuple[dict, float]:
    start = time.monotonic()
    response = httpx.post(
        f"{engine.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1},
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert response.status_code == 200, response.text
    return response.json()["usage"], elapsed


def blocks_by_tokens(events: list[dict], kind: str, medium: str) -> dict[tuple, int]:
    """Per block: its token ids -> its hash, from BlockStored events of one medium."""
    found = {}
    for event in events:
        if event["type"] == kind and event["medium"] == medium:
            for i, block_hash in enumerate(event["block_hashes"]):
                found[tuple(event["token_ids"][i * BLOCK : (i + 1) * BLOCK])] = block_hash
    return found


def removed(events: list[dict], medium: str) -> list[int]:
    return [
        h for e in events if e["type"] == "BlockRemoved" and e["medium"] == medium for h in e["block_hashes"]
    ]


def block_tokens(prompt: list[int], index: int) -> tuple:
    return tuple(prompt[index * BLOCK : (index + 1) * BLOCK])


@pytest.fixture
def tiered_engine():
    """Six GPU blocks, sixteen CPU blocks, the default CPU restore time (a tenth of prefill per token)."""
    engine = start_engine(
        "sim",
        "--num-gpu-blocks-override",
        "6",
        "--cpu-offload-blocks",
        "16",
        "--prefill-time-per-token",
        str(PREFILL_TIME_PER_TOKEN),
    )
    yield engine
    engine.stop()


def test_gpu_evicted_blocks_are_restored_from_the_cpu_tier(tiered_engine):
    engine = tiered_engine
    a, b = prompt_of(4, 1), prompt_of(4, 2)
    subscriber = EventSubscriber(engine.events_endpoint)
    try:
        cold, recompute_time = complete(engine, a)
        gpu_hit, _ = complete(engine, a)
        complete(engine, b)  # needs 5 of the 6 GPU blocks: three of a's four cached blocks are evicted
        before = engine.metrics()
        restored, restore_time = complete(engine, a)
        after = engine.metrics()
        events = events_of(subscriber.messages(timeout=1.5))
    finally:
        subscriber.close()

    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    assert gpu_hit["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK
    # One block still on the GPU, three loaded from the CPU tier: all four count as cached, as vLLM's usage
    # counts local and connector-loaded tokens alike.
    assert restored["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == BLOCK
    assert (
        after["vllm:external_prefix_cache_hits_total"] - before["vllm:external_prefix_cache_hits_total"]
        == 3 * BLOCK
    )
    assert (
        after["vllm:external_prefix_cache_queries_total"] - before["vllm:external_prefix_cache_queries_total"]
        == len(a) - BLOCK
    )
    # 1 token recomputed + 384 restored at a tenth of the prefill time: about 0.04 s against 0.51 s cold. The
    # simulator sleeps for its modelled work, so those are lower bounds; on a loaded machine a request can take
    # longer than its work by a tenth of a second, so only the lower bounds and the order against a cold
    # prefill (ten times the work) are checked, not the 0.04 s gap between a GPU hit and a restore.
    assert 0.035 < restore_time < recompute_time
    assert recompute_time > 0.45

    gpu_stored = blocks_by_tokens(events, "BlockStored", "GPU")
    cpu_stored = blocks_by_tokens(events, "BlockStored", "CPU")
    a_hashes = [gpu_stored[block_tokens(a, i)] for i in range(4)]
    # Written through: every full block of a and b went to the CPU tier under the GPU's hash.
    assert [cpu_stored[block_tokens(a, i)] for i in range(4)] == a_hashes
    assert all(cpu_stored[block_tokens(b, i)] == gpu_stored[block_tokens(b, i)] for i in range(4))
    # The GPU dropped a's last three blocks (tail first); the CPU tier dropped nothing.
    assert sorted(removed(events, "GPU")[:3]) == sorted(a_hashes[1:])
    assert removed(events, "CPU") == []
    # Restored blocks are cached on the GPU again: a second GPU BlockStored for them, parented on block 0.
    restored_again = [
        e
        for e in events
        if e["type"] == "BlockStored" and e["medium"] == "GPU" and e["block_hashes"] == a_hashes[1:]
    ]
    assert len(restored_again) == 1 and restored_again[0]["parent_block_hash"] == a_hashes[0]


@pytest.fixture
def small_cpu_tier_engine():
    """A CPU tier of 4 blocks, sized the way vLLM sizes it: cpu_bytes_to_use over 128 KiB per block."""
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 4 * 128 * 1024},
    }
    engine = start_engine(
        "sim", "--num-gpu-blocks-override", "4", "--kv-transfer-config", json.dumps(transfer)
    )
    yield engine
    engine.stop()


def test_the_cpu_tier_evicts_its_least_recently_used_blocks(small_cpu_tier_engine):
    engine = small_cpu_tier_engine
    x, y, z = prompt_of(2, 3), prompt_of(2, 4), prompt_of(2, 5)
    subscriber = EventSubscriber(engine.events_endpoint)
    try:
        complete(engine, x)
        complete(engine, y)  # GPU: y's 3 blocks evict x's; CPU: x and y fill its 4 blocks
        assert complete(engine, x)[0]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK  # from CPU
        complete(engine, z)  # CPU tier full: y's blocks are now the least recently used and go
        events = events_of(subscriber.messages(timeout=1.5))
    finally:
        subscriber.close()
    cpu_stored = blocks_by_tokens(events, "BlockStored", "CPU")
    assert sorted(removed(events, "CPU")) == sorted(cpu_stored[block_tokens(y, i)] for i in range(2))
    assert complete(engine, y)[0]["prompt_tokens_details"]["cached_tokens"] == 0  # gone from both tiers
    assert complete(engine, z)[0]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK


def test_without_a_cpu_tier_nothing_goes_to_cpu(sim_engine):
    subscriber = EventSubscriber(sim_engine.events_endpoint)
    try:
        complete(sim_engine, prompt_of(2, 6))
        events = events_of(subscriber.messages(timeout=1.0))
    finally:
        subscriber.close()
    assert events and all(e.get("medium") in (None, "GPU") for e in events)
    assert sim_engine.metrics()["vllm:external_prefix_cache_queries_total"] == 0
