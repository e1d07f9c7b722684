"""The simulated engine's block bookkeeping, against plain reference versions of it."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from planner.engine import Engine, _take_oldest
from planner.profile import Profile

pytestmark = pytest.mark.unit

PROFILE = Profile(name="test", kv_capacity_tokens=200_000, max_num_seqs=16, cpu_tier_tokens=100 * 512)


def engine() -> Engine:
    def ignore(*args) -> None:
        return None

    return Engine(0, PROFILE, 512, ignore, ignore, ignore, {})


def reference_held_tiers(e: Engine, blocks: tuple[int, ...]) -> tuple[int, int]:
    """The leading blocks held in either tier, counted block by block."""
    gpu = cpu = 0
    for h in blocks:
        if h in e.ref:
            gpu += 1
        elif h in e.cpu:
            cpu += 1
        else:
            break
    return gpu, cpu


def test_held_tiers_counts_the_leading_blocks_of_either_tier_however_they_interleave():
    rng = random.Random(7)
    e = engine()
    for _ in range(500):
        blocks = tuple(range(rng.randint(0, 30)))
        e.ref = {}
        e.cpu = OrderedDict()
        # Each block on the GPU, in the CPU tier or in neither, in runs or mixed.
        mixed = rng.random() < 0.5
        tier = rng.choice("gcn")
        for h in blocks:
            if mixed or rng.random() < 0.2:
                tier = rng.choice("ggccn")
            if tier == "g":
                e.ref[h] = 1
            elif tier == "c":
                e.cpu[h] = None
        expected = reference_held_tiers(e, blocks)
        assert e.held_tiers(blocks) == expected
        # The first `start` blocks are known held (the directory's walk): the counts are the same.
        start = rng.randint(0, sum(expected))
        assert e.held_tiers(blocks, start) == expected


def test_held_tiers_without_a_cpu_tier_counts_the_gpu_run():
    e = engine()
    e.ref = {1: 1, 2: 1, 4: 1}
    assert e.held_tiers((1, 2, 3, 4)) == (2, 0)
    assert e.held_tiers((1, 2, 3, 4), 2) == (2, 0)


def test_take_oldest_removes_and_returns_the_least_recent_first():
    lru = OrderedDict((h, None) for h in (5, 3, 9, 1))
    lru.move_to_end(3)
    assert _take_oldest(lru, 2) == [5, 9]
    assert list(lru) == [1, 3]
