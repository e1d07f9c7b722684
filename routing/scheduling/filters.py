"""Filters: which of a deployment's endpoints (of the roles asked for) may take the request at all."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from routing.scheduling.pipeline import Candidate, RequestContext


def slot_limit(max_num_seqs: int, queue: float, spare: float = 0.0) -> float:
    """How many requests an engine may have in flight before another would wait beyond the queue the policy allows
    (`queue`, saturation_waiting_per_engine), keeping `spare` of them free (at most half its slots; routing/scheduling/flow.py)."""
    return max_num_seqs + queue - min(spare, max_num_seqs / 2)


def not_excluded(ctx: RequestContext, candidates: list[Candidate]) -> list[Candidate]:
    """Not an endpoint this request already tried."""
    return [c for c in candidates if c.endpoint.id not in ctx.exclude]


def with_room(ctx: RequestContext, candidates: list[Candidate]) -> list[Candidate]:
    """Under flow control, an engine that can start the request now. The gate (routing/scheduling/flow.py) lets a request
    through because the deployment has a free slot somewhere; sent by affinity to an engine without one, it would
    wait in that engine's queue, where priority and fair share no longer order it. So: the engine whose slot the
    gate reserved for it, if any; else those with fewer requests in flight (this replica's and the others' as last
    traded) and reserved than their max_num_seqs plus the queue the policy allows; else, when none has room (the
    others' counts are stale, or the gate is off), all of them."""
    if ctx.reserved_endpoint is not None:
        mine = [c for c in candidates if c.endpoint.id == ctx.reserved_endpoint]
        if mine:
            return mine
    if ctx.room_beyond is None:
        return candidates
    beyond, spare = ctx.room_beyond, ctx.spare_slots
    roomy = [
        c
        for c in candidates
        if c.load.active + c.load.others_active + c.load.reserved
        < slot_limit(c.endpoint.max_num_seqs, beyond, spare)
    ]
    return roomy or candidates
