"""Endpoint picking as a pipeline of small plugins, as in llm-d's endpoint picker.

Filters narrow the candidates; each scorer returns a score in [0, 1] per candidate; the policy's weights combine
them; the picker takes the best, counting totals within one request in flight of it as equal and sending those
to the engine with the least prefill ahead, then to the one sent the fewest requests lately, then round-robin.
A new scorer is one class and one entry in SCORERS.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .prefix_index import Held
from .state import DeploymentInfo, EndpointInfo, PolicyInfo


@dataclass
class RequestContext:
    """What the scorers may look at about one request."""

    model: str
    prompt_tokens_estimate: int = 0
    session_id: str | None = None
    exclude: frozenset[int] = frozenset()  # endpoints already tried for this request
    block_keys: list[str] = field(default_factory=list)  # the router's keys of the prompt's full blocks
    block_count: int = 0
    held: dict[int, Held] = field(default_factory=dict)  # precise: leading blocks each endpoint holds
    from_index: bool = (
        False  # precise: `held` is the index's answer (not this replica's record, Redis failing)
    )
    approx_held: dict[int, int] = field(default_factory=dict)  # approximate: leading blocks sent there before
    session_endpoint: int | None = None


@dataclass(eq=False, slots=True)
class Prefill:
    """One prefill in an engine's lane; compared by identity, so equal ones (two fully cached prompts) stay apart."""

    tokens: float


@dataclass
class EndpointLoad:
    active: int = 0  # requests this router replica has in flight there
    running: float = 0.0  # from the engine's /metrics
    waiting: float = 0.0
    kv_usage: float = 0.0
    work: float = 0.0  # requests in flight there, each weighed by the prefill it brings (request_weight)
    others: float = 0.0  # own() of the other router replicas there, as they last published it
    others_active: int = 0  # their requests in flight there
    # Prefill backlog: the uncached prompt tokens of this replica's requests there awaiting a first token.
    prefill: float = 0.0
    others_prefill: float = 0.0  # the other replicas' prefill backlog there (their prefill_left)
    # Seconds per prefilled token there, learned from first tokens (0: not yet known); see prefill_left.
    prefill_s_per_token: float = 0.0
    _lane: deque[Prefill] = field(default_factory=deque)  # this replica's prefills there, in the order sent
    # When the lane's oldest prefill began: its send, or the first token of the one before it.
    _head_since: float = 0.0
    _recent: float = 0.0
    _recent_at: float = 0.0
    _served: float = 0.0
    _served_at: float = 0.0

    def prefill_began(self, tokens: float, now: float) -> Prefill:
        """A prefill of `tokens` uncached prompt tokens is sent there; the handle is for prefill_ended."""
        entry = Prefill(tokens)
        if not self._lane:
            self._head_since = now
        self._lane.append(entry)
        self.prefill += tokens
        return entry

    def prefill_ended(self, entry: Prefill, now: float, first_token: bool = True) -> None:
        """That prefill is over (`first_token`: its first token came now; else the request ended without one).
        The lane's oldest prefill ending on its first token tells how fast the engine prefills: the time since it
        began, over its tokens."""
        self.prefill -= entry.tokens
        if self._lane and self._lane[0] is entry:
            self._lane.popleft()
            took = now - self._head_since
            if first_token and entry.tokens >= RATE_SAMPLE_TOKENS and took > 0:
                self._learn(took / entry.tokens)
            self._head_since = now
        else:
            with contextlib.suppress(ValueError):
                self._lane.remove(entry)

    def _learn(self, sample: float) -> None:
        known = self.prefill_s_per_token
        if known:
            # One sample moves the estimate a fifth of the way, and at most by half or double: a prompt the
            # engine found cached beyond the router's guess comes back fast without being the engine's speed.
            sample = min(max(sample, known / 2), known * 2)
            sample = known + (sample - known) / 5
        self.prefill_s_per_token = sample

    def prefill_left(self, now: float) -> float:
        """The prefill backlog less what the engine has computed of the oldest one since it began (at the
        learned speed): a long prompt near the end of its prefill is not a long wait for the next request."""
        if not self._lane or not self.prefill_s_per_token:
            return self.prefill
        head = self._lane[0].tokens
        done = min(head, (now - self._head_since) / self.prefill_s_per_token)
        return max(0.0, self.prefill - done)

    def begin(self, weight: float = 1.0) -> None:
        """A request of this replica starts there (weight: request_weight)."""
        self.active += 1
        self.work += weight

    def end(self, weight: float = 1.0) -> None:
        self.active -= 1
        self.work -= weight

    def assigned(self, now: float, window_s: float, weight: float = 1.0) -> None:
        """Count a request sent there, by its weight; the count decays with time constant `window_s`."""
        self._recent = self.recent(now, window_s) + weight
        self._recent_at = now
        self._served = self.served(now) + 1.0
        self._served_at = now

    def served(self, now: float) -> float:
        """Requests sent there over the last half minute or so (decayed, unweighted): where the long-lived
        sessions sit, for placing a request no engine has a reason to take."""
        if not self._served:
            return 0.0
        return self._served * math.exp(-(now - self._served_at) / SERVED_WINDOW_S)

    def own(self, now: float) -> float:
        """This replica's load there, for the load guard: in flight and sent lately, weighed."""
        return self.work + self.recent(now, RECENT_WINDOW_S)

    def recent(self, now: float, window_s: float) -> float:
        """Requests sent there lately (exponentially decayed): load that short requests leave no trace of in
        the in-flight count."""
        if not self._recent:
            return 0.0
        return self._recent * math.exp(-(now - self._recent_at) / window_s)


@dataclass
class Candidate:
    endpoint: EndpointInfo
    load: EndpointLoad
    scores: dict[str, float] = field(default_factory=dict)
    guarded: bool = False  # the load guard dropped its affinity scores


class Filter(Protocol):
    def __call__(self, ctx: RequestContext, candidates: list[Candidate]) -> list[Candidate]: ...


class Scorer(Protocol):
    name: str

    def score(
        self, ctx: RequestContext, candidates: Sequence[Candidate], policy: PolicyInfo
    ) -> list[float]: ...


def not_excluded(ctx: RequestContext, candidates: list[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.endpoint.id not in ctx.exclude]


QUEUE_DEPTH_SCALE = 4
DECODE_ROLES = ("both", "decode")
PREFILL_ROLES = ("prefill",)


class QueueScorer:
    """Fewer queued and running requests score higher: the requests in flight there from every router replica
    plus the engine's queue, against the deepest queue or QUEUE_DEPTH_SCALE, whichever is more: one or two
    requests in flight is not a queue worth giving a cached prefix up for."""

    name = "queue"

    def score(self, ctx, candidates, policy):
        depths = [c.load.active + c.load.others_active + c.load.waiting for c in candidates]
        worst = max(max(depths), QUEUE_DEPTH_SCALE)
        return [1.0 - depth / worst for depth in depths]


class PrefillBacklogScorer:
    """Less prefill queued ahead scores higher: the uncached prompt tokens of the requests sent there (by every
    router replica) that have not had a first token yet, against this prompt's length or the longest backlog,
    whichever is more. Counted in the prompt's own length, as the prefix score is, the two trade like for like:
    the time to first token is the prefill waited for plus the prefill the request brings. The queue score counts
    requests; this counts the work in front of this one."""

    name = "prefill"

    def score(self, ctx, candidates, policy):
        now = time.monotonic()
        backlogs = [c.load.prefill_left(now) + c.load.others_prefill for c in candidates]
        scale = max(max(backlogs), ctx.prompt_tokens_estimate, 1)
        return [1.0 - b / scale for b in backlogs]


class KvUtilizationScorer:
    name = "kv_utilization"

    def score(self, ctx, candidates, policy):
        return [1.0 - min(1.0, max(0.0, c.load.kv_usage)) for c in candidates]


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

    name = "prefix"

    def score(self, ctx, candidates, policy):
        held = []
        for c in candidates:
            h = ctx.held.get(c.endpoint.id)
            held.append(
                0.0
                if h is None
                else (h.gpu + h.speculative) * policy.gpu_tier_weight + h.cpu * policy.cpu_tier_weight
            )
        return distinct_shares(held, ctx.block_count)


class ApproximatePrefixScorer:
    """The share of the prompt's leading blocks this router sent to the engine before, beyond what most
    candidates were sent (for engines without KV events)."""

    name = "prefix"

    def score(self, ctx, candidates, policy):
        held = [float(ctx.approx_held.get(c.endpoint.id, 0)) for c in candidates]
        return distinct_shares(held, ctx.block_count)


class SessionAffinityScorer:
    """1 for the engine that served this `x-session-id` last."""

    name = "session"

    def score(self, ctx, candidates, policy):
        return [1.0 if c.endpoint.id == ctx.session_endpoint else 0.0 for c in candidates]


RECENT_WINDOW_S = 5.0
# Prefills shorter than this do not teach the prefill speed: their time is mostly the engine's fixed overhead.
RATE_SAMPLE_TOKENS = 2048
SERVED_WINDOW_S = 30.0
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
    candidates: list[Candidate], ratio: float, spare: Callable[[Candidate], bool] | None = None
) -> None:
    """Keep affinity from piling everything on one engine: an engine loaded beyond `ratio` times the mean
    (plus one request of slack) loses its prefix and session scores, unless `spare` says to keep them. Load is
    what is in flight or queued there plus what was sent there lately, each request weighed by the prefill it
    brings: this replica's requests as they are, the other replicas' as they last published them."""
    now = time.monotonic()
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
        candidate.scores["prefix"] = 0.0
        candidate.scores["session"] = 0.0
        candidate.guarded = True


def over_their_share(candidates: Sequence[Candidate], ratio: float) -> list[bool]:
    """Which candidates were sent more than `ratio` times the mean over the last half minute (served(), plus
    one request of slack): where more than a fair share of the long-lived sessions live."""
    now = time.monotonic()
    return above_the_mean([c.load.served(now) for c in candidates], ratio)


def spread_new_session(candidates: list[Candidate], ratio: float) -> None:
    """A session's first request decides where its later turns live, so it does not go to an engine over its
    share (over_their_share) for the sake of a prefix: such an engine loses its prefix score for it. What a new
    session shares with others is a system prompt, which costs one prefill to copy; sessions piled on the
    engines that held it first cost for as long as they live."""
    for candidate, over in zip(candidates, over_their_share(candidates, ratio), strict=True):
        if over:
            candidate.scores["prefix"] = 0.0
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
        if over_their_share(candidates, ratio)[at]:
            return False
        ahead = prefill_ahead(ctx, candidates, block_size)
        return ahead[at] <= min(ahead) + PREFILL_TIE_TOKENS

    return spare


LOAD_SCORERS: list[tuple[Scorer, str]] = [
    (QueueScorer(), "queue_weight"),
    (PrefillBacklogScorer(), "prefill_backlog_weight"),
    (KvUtilizationScorer(), "kv_utilization_weight"),
]
AFFINITY: list[tuple[Scorer, str]] = [(SessionAffinityScorer(), "session_affinity_weight")]
MODE_SCORERS: dict[str, list[tuple[Scorer, str]]] = {
    # (scorer, the policy attribute holding its weight)
    "round_robin": [],
    "least_loaded": [*LOAD_SCORERS, *AFFINITY],
    "approximate": [(ApproximatePrefixScorer(), "prefix_weight"), *LOAD_SCORERS, *AFFINITY],
    "precise": [(PrecisePrefixScorer(), "prefix_weight"), *LOAD_SCORERS, *AFFINITY],
}
WEIGHT_OF = {
    "prefix": "prefix_weight",
    "queue": "queue_weight",
    "prefill": "prefill_backlog_weight",
    "kv_utilization": "kv_utilization_weight",
    "session": "session_affinity_weight",
}


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
    now = time.monotonic()
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


class Picker:
    """Highest weighted score wins. Among equals (within tie_margin of the best): those where the first token
    comes soonest (the least prefill ahead, within PREFILL_TIE_TOKENS), then those sent the fewest requests
    lately (within half a request of the fewest) and, among those, round-robin, so equal endpoints share the load
    evenly."""

    def __init__(self):
        self._turns: dict[int, itertools.count] = {}

    def pick(
        self,
        deployment: DeploymentInfo,
        candidates: list[Candidate],
        totals: list[float],
        work: Callable[[], list[float]] | None = None,
    ) -> Candidate:
        best = max(totals)
        margin = tie_margin(deployment.policy) + 1e-9
        at = [i for i, total in enumerate(totals) if total >= best - margin]
        if len(at) > 1 and work is not None:
            # Among equals, those where the first token comes soonest (`work()`: prefill_ahead per candidate,
            # worked out only when there are equals): scores within the margin can still hide a long wait.
            work = work()
            least = min(work[i] for i in at)
            at = [i for i in at if work[i] <= least + PREFILL_TIE_TOKENS]
        tied = [candidates[i] for i in at]
        if len(tied) > 1:
            # Then the engines that were sent the least lately: a new session goes where fewer live.
            now = time.monotonic()
            served = [c.load.served(now) for c in tied]
            least = min(served)
            tied = [c for c, s in zip(tied, served, strict=True) if s <= least + 0.5]
        turn = next(self._turns.setdefault(deployment.id, itertools.count()))
        return tied[turn % len(tied)]


class Pipeline:
    def __init__(self, filters: Sequence[Filter] = (not_excluded,)):
        self.filters = list(filters)
        self.picker = Picker()

    def choose(
        self,
        deployment: DeploymentInfo,
        ctx: RequestContext,
        loads: dict[int, EndpointLoad],
        roles: tuple[str, ...] = DECODE_ROLES,
    ) -> tuple[Candidate | None, list[Candidate]]:
        """Pick among the endpoints of these roles (the decode side by default; PREFILL_ROLES for a prefill leg)."""
        candidates = [
            Candidate(e, loads.get(e.id) or EndpointLoad()) for e in deployment.endpoints if e.role in roles
        ]
        for keep in self.filters:
            candidates = keep(ctx, candidates)
        if not candidates:
            return None, []
        policy = deployment.policy
        scorers = MODE_SCORERS.get(policy.mode, LOAD_SCORERS)
        for scorer, _ in scorers:
            for candidate, value in zip(candidates, scorer.score(ctx, candidates, policy), strict=True):
                candidate.scores[scorer.name] = value
        if len(candidates) > 1:
            ratio = policy.load_guard_ratio
            spare = None
            if ctx.session_endpoint is not None:
                spare = session_engine_if_soonest(ctx, candidates, deployment.block_size, ratio)
            elif ctx.session_id:
                spread_new_session(candidates, ratio)
            load_guard(candidates, ratio, spare)
        totals = [
            sum(getattr(policy, WEIGHT_OF[name]) * value for name, value in c.scores.items())
            for c in candidates
        ]
        work = None
        if policy.mode != "round_robin":
            work = lambda: prefill_ahead(ctx, candidates, deployment.block_size)  # noqa: E731
        return self.picker.pick(deployment, candidates, totals, work), candidates
