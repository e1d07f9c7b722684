"""The picker and its tie-breaks: the highest weighted total wins; among equals, the mode's tie-breaks narrow the
field in the order listed, and what is left takes turns. See docs/routing.md#the-plugin-framework.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from routing.scheduling.scorers.prefix_match import common_floor
from routing.scheduling.scorers.queue import QUEUE_DEPTH_SCALE

if TYPE_CHECKING:
    from routing.info import PolicyInfo
    from routing.scheduling.pipeline import Candidate, Choice, RequestContext, TieBreak

# Prefill work that counts as none among equals: two blocks' worth, a few milliseconds on an engine.
PREFILL_TIE_TOKENS = 256


def prefill_ahead(ctx: RequestContext, candidates: Sequence[Candidate], block_size: int) -> list[float]:
    """Prompt tokens to compute there before this request's first token: the uncached prompt tokens of the
    requests awaiting a first token there (from every router replica), plus this prompt's own part beyond
    what most candidates hold (as in distinct_shares: a system prompt every engine soon holds does not pull a
    request anywhere). An engine the load guard took the prefix from counts as holding nothing more."""
    held = []
    for c in candidates:
        h = ctx.held.get(c.endpoint.id)
        blocks = h.blocks if h is not None else ctx.approx_held.get(c.endpoint.id, 0)
        held.append(0 if c.guarded else blocks)
    floor = int(common_floor(held))
    span = max(0, ctx.prompt_tokens_estimate - floor * block_size)
    now = ctx.now
    return [
        c.load.prefill_left(now) + c.load.others_prefill + max(0, span - max(0, h - floor) * block_size)
        for c, h in zip(candidates, held, strict=True)
    ]


def tie_margin(policy: PolicyInfo) -> float:
    """How far below the best total a candidate still counts as its equal: what one more request in flight
    costs in the queue score (0.5 at the default weights). Differences that small are of the moment (a request
    that ends in a few milliseconds, a few percent of KV cache), while a new session keeps coming back to where
    it lands, so they should not decide where it lands."""
    return policy.queue_weight / QUEUE_DEPTH_SCALE


def soonest_first_token(choice: Choice, at: list[int]) -> list[int]:
    """Among equals, those where the first token comes soonest (the least prefill_ahead, within
    PREFILL_TIE_TOKENS): scores within the margin can still hide a long wait."""
    work = prefill_ahead(choice.ctx, choice.candidates, choice.deployment.block_size)
    least = min(work[i] for i in at)
    return [i for i in at if work[i] <= least + PREFILL_TIE_TOKENS]


def fewest_sent_lately(choice: Choice, at: list[int]) -> list[int]:
    """Among equals, the engines sent the fewest requests lately (within half a request): a new session goes
    where fewer live."""
    now = choice.ctx.now
    candidates = choice.candidates
    served = [candidates[i].load.served(now) for i in at]
    least = min(served)
    return [i for i, s in zip(at, served, strict=True) if s <= least + 0.5]


class Picker:
    """Highest weighted total wins; equals go through the tie-breaks, then take turns (round-robin per
    deployment)."""

    def __init__(self):
        self._turns: dict[int, itertools.count] = {}

    def pick(self, choice: Choice, totals: list[float], tie_breaks: Sequence[TieBreak] = ()) -> Candidate:
        best = max(totals)
        margin = tie_margin(choice.deployment.policy) + 1e-9
        at = [i for i, total in enumerate(totals) if total >= best - margin]
        for tie_break in tie_breaks:
            if len(at) < 2:
                break
            at = tie_break(choice, at)
        turn = next(self._turns.setdefault(choice.deployment.id, itertools.count()))
        return choice.candidates[at[turn % len(at)]]
