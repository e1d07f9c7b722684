"""Scorers of the prompt's leading blocks an engine already holds: precise (the engines' KV events) and
approximate (where this router sent which blocks before)."""

from __future__ import annotations

from collections.abc import Sequence


def common_floor(held: Sequence[float]) -> float:
    """What most candidates hold (the median; nothing with two or fewer): blocks every engine soon has, like a
    system prompt, which cost the same wherever the request goes."""
    return sorted(held)[(len(held) - 1) // 2] if len(held) > 2 else 0.0


def distinct_shares(held: list[float], blocks: int) -> list[float]:
    """Each candidate's leading blocks as a share of the prompt, counting only what sets it apart: the blocks
    beyond common_floor, so that what most candidates hold does not pull the request towards one engine."""
    if not blocks:
        return [0.0] * len(held)
    floor = common_floor(held)
    span = blocks - floor
    if span <= 0:
        return [0.0] * len(held)
    return [min(1.0, max(0.0, h - floor) / span) for h in held]


class PrecisePrefixScorer:
    """The share of the prompt's blocks, from the first, that the engine holds (its KV events say so) beyond
    what most candidates hold, weighted by tier: a block in GPU memory counts fully, one in CPU memory less."""

    def score(self, ctx, candidates, policy):
        found = map(ctx.held.get, [c.endpoint.id for c in candidates])
        gpu, cpu = policy.gpu_tier_weight, policy.cpu_tier_weight
        held = [0.0 if h is None else (h.gpu + h.speculative) * gpu + h.cpu * cpu for h in found]
        return distinct_shares(held, ctx.block_count)


class ApproximatePrefixScorer:
    """The share of the prompt's leading blocks this router sent to the engine before, beyond what most
    candidates were sent (for engines without KV events)."""

    def score(self, ctx, candidates, policy):
        held = [float(ctx.approx_held.get(c.endpoint.id, 0)) for c in candidates]
        return distinct_shares(held, ctx.block_count)
