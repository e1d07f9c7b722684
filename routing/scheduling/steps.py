"""Steps: rules that run once every score is in and weigh the candidates against each other. Each one a mode
lists runs in the order listed (on two candidates or more): session_spare (before load_guard),
new_session_spread, load_guard. See docs/routing.md#modes-scorers-and-steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from routing.scheduling.picker import PREFILL_TIE_TOKENS, prefill_ahead
from routing.scheduling.pipeline import REGISTRY

if TYPE_CHECKING:
    from routing.scheduling.pipeline import Candidate, Choice, RequestContext

CACHED_REQUEST_WEIGHT = 0.25


def request_weight(prompt_tokens: int, cached_tokens: int) -> float:
    """What a request adds to an engine's load, for the load guard: a whole unit when its prompt must be
    computed there, a quarter (its decode slot and the prefill's fixed cost) when the engine holds all of it. A
    burst of sub-agents sharing a held context is light work for its holder and should not push it away."""
    if prompt_tokens <= 0:
        return 1.0
    uncached = max(0.0, 1.0 - cached_tokens / prompt_tokens)
    return CACHED_REQUEST_WEIGHT + (1.0 - CACHED_REQUEST_WEIGHT) * uncached


def above_the_mean(values: Sequence[float], ratio: float) -> list[bool]:
    """Which values exceed `ratio` times their mean plus one request of slack: the line of the load guard and
    of a session's share."""
    line = ratio * sum(values) / len(values) + 1
    return [value > line for value in values]


def load_guard(
    candidates: list[Candidate],
    ratio: float,
    spare: Callable[[Candidate], bool] | None = None,
    affinity: Sequence[str] | None = None,
    *,
    now: float,
) -> None:
    """Keep affinity from piling everything on one engine: an engine loaded beyond `ratio` times the mean
    (plus one request of slack) loses its affinity scores (`affinity`: the registry's, prefix and session),
    unless `spare` says to keep them. Load is what is in flight or queued there plus what was sent there lately,
    each request weighed by the prefill it brings: this replica's requests as they are, the other replicas' as
    they last published them."""
    keys = REGISTRY.affinity if affinity is None else affinity
    loads = [c.load.own(now) + c.load.others + c.load.waiting for c in candidates]
    # Only an engine with work in hand now is guarded: a lone conversation's quick turns on an idle fleet
    # stay with their prefix, however many were sent lately. All are judged before any is marked, so `spare`
    # sees the candidates as they were.
    over = [
        c
        for c, above in zip(candidates, above_the_mean(loads, ratio), strict=True)
        if above and c.load.active + c.load.others_active + c.load.waiting >= 1
    ]
    for candidate in over:
        if spare is not None and spare(candidate):
            continue
        for key in keys:
            candidate.scores[key] = 0.0
        candidate.guarded = True


def over_their_share(candidates: Sequence[Candidate], ratio: float, now: float) -> list[bool]:
    """Which candidates were sent more than `ratio` times the mean over the last half minute (served(), plus
    one request of slack): where more than a fair share of the long-lived sessions live."""
    return above_the_mean([c.load.served(now) for c in candidates], ratio)


def spread_new_session(
    candidates: list[Candidate], ratio: float, affinity: Sequence[str] | None = None, *, now: float
) -> None:
    """A session's first request decides where its later turns live, so it does not go to an engine over its
    share (over_their_share) for the sake of a prefix: such an engine loses its affinity scores for it (the
    session score is nothing yet). What a new session shares with others is a system prompt, which costs one
    prefill to copy; sessions piled on the engines that held it first cost for as long as they live."""
    keys = REGISTRY.affinity if affinity is None else affinity
    for candidate, over in zip(candidates, over_their_share(candidates, ratio, now), strict=True):
        if over:
            for key in keys:
                candidate.scores[key] = 0.0
            candidate.guarded = True


def session_engine_if_soonest(
    ctx: RequestContext, candidates: Sequence[Candidate], block_size: int, ratio: float
) -> Callable[[Candidate], bool]:
    """For load_guard: spare the engine serving this request's session while its first token would still come
    soonest there (prefill_ahead, within PREFILL_TIE_TOKENS of the least) and it is not over its share of the
    sessions (over_their_share). Sent elsewhere, the turn or sub-agent would compute its whole context again
    while its engine has little prefill queued; the "sent lately" part of the guard's load is what trips it
    there, and counts requests that are decoding, not prefilling. An engine over its share is not spared:
    moving a session off it costs one recomputed context and evens the fleet out for the session's remaining
    turns."""

    def spare(candidate: Candidate) -> bool:
        if candidate.endpoint.id != ctx.session_endpoint:
            return False
        at = candidates.index(candidate)
        if over_their_share(candidates, ratio, ctx.now)[at]:
            return False
        ahead = prefill_ahead(ctx, candidates, block_size)
        return ahead[at] <= min(ahead) + PREFILL_TIE_TOKENS

    return spare


def session_spare(choice: Choice) -> None:
    """A request of a known session: let the load guard spare its engine (session_engine_if_soonest)."""
    ctx = choice.ctx
    if ctx.session_endpoint is not None:
        deployment = choice.deployment
        choice.spare = session_engine_if_soonest(
            ctx, choice.candidates, deployment.block_size, deployment.policy.load_guard_ratio
        )


def new_session_spread(choice: Choice) -> None:
    """A session's first request (a session id, no engine yet): spread_new_session."""
    ctx = choice.ctx
    if ctx.session_endpoint is None and ctx.session_id:
        spread_new_session(
            choice.candidates, choice.deployment.policy.load_guard_ratio, choice.affinity, now=ctx.now
        )


def guard(choice: Choice) -> None:
    """The load guard (load_guard), sparing what an earlier step said to spare."""
    policy = choice.deployment.policy
    load_guard(choice.candidates, policy.load_guard_ratio, choice.spare, choice.affinity, now=choice.ctx.now)
