"""Endpoint picking as a pipeline of small plugins, as in llm-d's endpoint picker.

Filters narrow the candidates; each scorer returns a score in [0, 1] per candidate; the policy's weights combine
them; the picker takes the best, breaking ties in round-robin order. A new scorer is one class and one entry in
SCORERS.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .state import DeploymentInfo, EndpointInfo


@dataclass
class RequestContext:
    """What the scorers may look at about one request."""

    model: str
    prompt_tokens_estimate: int = 0
    session_id: str | None = None
    exclude: frozenset[int] = frozenset()  # endpoints already tried for this request


@dataclass
class EndpointLoad:
    active: int = 0  # requests this router replica has in flight there
    running: float = 0.0  # from the engine's /metrics
    waiting: float = 0.0
    kv_usage: float = 0.0


@dataclass
class Candidate:
    endpoint: EndpointInfo
    load: EndpointLoad
    scores: dict[str, float] = field(default_factory=dict)


class Filter(Protocol):
    def __call__(self, ctx: RequestContext, candidates: list[Candidate]) -> list[Candidate]: ...


class Scorer(Protocol):
    name: str

    def score(self, ctx: RequestContext, candidates: Sequence[Candidate]) -> list[float]: ...


def not_excluded(ctx: RequestContext, candidates: list[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.endpoint.id not in ctx.exclude]


def serves_decode(ctx: RequestContext, candidates: list[Candidate]) -> list[Candidate]:
    """An aggregated request runs where decoding happens: pools of role 'both' or 'decode'."""
    return [c for c in candidates if c.endpoint.role in ("both", "decode")] or candidates


class QueueScorer:
    """Fewer queued and running requests score higher: the router's own in-flight count plus the engine's queue."""

    name = "queue"

    def score(self, ctx, candidates):
        depths = [c.load.active + c.load.waiting for c in candidates]
        worst = max(depths) or 1
        return [1.0 - depth / worst for depth in depths]


class KvUtilizationScorer:
    name = "kv_utilization"

    def score(self, ctx, candidates):
        return [1.0 - min(1.0, max(0.0, c.load.kv_usage)) for c in candidates]


MODE_SCORERS: dict[str, list[tuple[Scorer, str]]] = {
    # (scorer, the policy attribute holding its weight)
    "round_robin": [],
    "least_loaded": [(QueueScorer(), "queue_weight"), (KvUtilizationScorer(), "kv_utilization_weight")],
}


class Picker:
    """Highest weighted score wins; ties go round-robin, so equal endpoints share the load evenly."""

    def __init__(self):
        self._turns: dict[int, itertools.count] = {}

    def pick(self, deployment: DeploymentInfo, candidates: list[Candidate], totals: list[float]) -> Candidate:
        best = max(totals)
        tied = [c for c, total in zip(candidates, totals, strict=True) if total >= best - 1e-9]
        turn = next(self._turns.setdefault(deployment.id, itertools.count()))
        return tied[turn % len(tied)]


class Pipeline:
    def __init__(self, filters: Sequence[Filter] = (not_excluded, serves_decode)):
        self.filters = list(filters)
        self.picker = Picker()

    def choose(
        self, deployment: DeploymentInfo, ctx: RequestContext, loads: dict[int, EndpointLoad]
    ) -> Candidate | None:
        candidates = [Candidate(e, loads.get(e.id) or EndpointLoad()) for e in deployment.endpoints]
        for keep in self.filters:
            candidates = keep(ctx, candidates)
        if not candidates:
            return None
        totals = [0.0] * len(candidates)
        for scorer, weight_name in MODE_SCORERS.get(deployment.policy.mode, MODE_SCORERS["least_loaded"]):
            weight = getattr(deployment.policy, weight_name)
            for index, value in enumerate(scorer.score(ctx, candidates)):
                candidates[index].scores[scorer.name] = value
                totals[index] += weight * value
        return self.picker.pick(deployment, candidates, totals)
