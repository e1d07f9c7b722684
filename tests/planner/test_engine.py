"""The simulated engine's block bookkeeping, against plain reference versions of it."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from planner.engine import Engine, _take_oldest
from planner.profile import Profile
from planner.trace import TraceRequest

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


@pytest.mark.parametrize("kv_tokens", [40_000, 400_000])
def test_decoding_counted_for_the_engine_matches_decoding_each_sequence(kv_tokens):
    """The engine-wide decode count (without speculation) against the pass over each decoding sequence that
    speculative decoding takes (`counted` off): the same tokens, timings, preemptions, blocks and inter-token
    gaps, request by request, with the cache tight enough to preempt and with room to spare."""
    from planner.sim import Simulation

    rng = random.Random(11)
    rows, fresh = [], 10_000
    for i in range(400):
        shared = list(range(1 + rng.randrange(4) * 10, 1 + rng.randrange(4) * 10 + rng.randint(2, 12)))
        blocks = (*shared, *range(fresh, fresh + rng.randint(1, 20)))
        fresh += 25
        rows.append(
            TraceRequest(
                i, i * 0.01, len(blocks) * 512 + 37, rng.choice([1, 2, 30, 2000]), blocks, f"t{i % 3}"
            )
        )
    profile = Profile(name="test", kv_capacity_tokens=kv_tokens, max_num_seqs=24, decode_per_seq_s=5e-4)

    def run(counted: bool):
        sim = Simulation(rows, 3, profile, "precise")
        for e in sim.engines.values():
            e.counted = counted
        result = sim.run()
        seqs = sorted(result.seqs, key=lambda s: s.request.index)
        per_seq = [(s.first_token_s, s.finished_s, s.generated, s.preemptions, s.cached_tokens) for s in seqs]
        engines = [(e.preemptions, e.evictions, e.busy_s, e.peak_resident, e.itl) for e in result.engine_objs]
        return per_seq, engines

    counted, each = run(True), run(False)
    assert counted == each
    per_seq, engines = counted
    assert all(generated == r.output_tokens for (_, _, generated, _, _), r in zip(per_seq, rows, strict=True))
    if kv_tokens < 100_000:
        assert sum(e[0] for e in engines) > 0  # it preempted
