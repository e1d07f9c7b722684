"""Endpoint picking as a pipeline of small plugins, as in llm-d's endpoint picker.

The deployment's routing mode names the plugins to run: filters, then scorers, then steps, then the policy's
weights combine the scores and the picker (routing/picker.py) takes the best. See
docs/routing.md#the-plugin-framework.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import plugins  # noqa: F401  (registers the built-in plugins and modes)
from .framework import REGISTRY, Candidate, Choice, Registry, RequestContext
from .info import DECODE_ROLES
from .load import EndpointLoad
from .picker import Picker

if TYPE_CHECKING:
    from .info import DeploymentInfo

# The mode a policy naming no registered mode gets (the database's choices allow none such).
FALLBACK_MODE = "least_loaded"


class Pipeline:
    def __init__(self, registry: Registry = REGISTRY, clock: Callable[[], float] = time.monotonic):
        """`clock`: what `ctx.now` is set from at each choice, for every plugin (planner/ gives a virtual one)."""
        self.registry = registry
        self.picker = Picker()
        self.clock = clock

    def choose(
        self,
        deployment: DeploymentInfo,
        ctx: RequestContext,
        loads: dict[int, EndpointLoad],
        roles: tuple[str, ...] = DECODE_ROLES,
    ) -> tuple[Candidate | None, list[Candidate]]:
        """Pick among the endpoints of these roles (the decode side by default; PREFILL_ROLES for a prefill leg)."""
        ctx.now = self.clock()
        candidates = [
            Candidate(e, loads.get(e.id) or EndpointLoad()) for e in deployment.endpoints if e.role in roles
        ]
        policy = deployment.policy
        plans = self.registry.plans
        plan = plans.get(policy.mode) or plans[FALLBACK_MODE]
        for keep in plan.filters:
            candidates = keep(ctx, candidates)
        if not candidates:
            return None, []
        for key, scorer in plan.scorers:
            for candidate, value in zip(candidates, scorer.score(ctx, candidates, policy), strict=True):
                candidate.scores[key] = value
        choice = Choice(deployment, ctx, candidates, plan.affinity)
        if len(candidates) > 1:
            for step in plan.steps:
                step(choice)
        weight_of = plan.weight_of
        totals = [
            sum(getattr(policy, weight_of[name]) * value for name, value in c.scores.items())
            for c in candidates
        ]
        return self.picker.pick(choice, totals, plan.tie_breaks), candidates
