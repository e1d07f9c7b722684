"""The scheduler: endpoint picking as a pipeline of small plugins, as in llm-d's endpoint picker; the plugin
interfaces, the data they see, the registry that names them, and the pipeline that runs them.

Four kinds of plugin: a filter narrows the candidates, a scorer scores each in [0, 1] (weighed by the policy
field registered with it), a step adjusts the scores once all are in, a tie-break narrows the picker's equals. A
mode is a list of plugin names, in the order they run; the package (routing/scheduling/__init__.py) registers the
built-in ones into `REGISTRY` when any part of it is imported. The deployment's routing mode names the plugins to
run: filters, then scorers, then steps, then the policy's weights combine the scores and the picker
(routing/scheduling/picker.py) takes the best. See docs/routing.md#the-plugin-framework.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import mul
from typing import TYPE_CHECKING, Protocol

from routing.info import DECODE_ROLES
from routing.scheduling.load import EndpointLoad
from routing.scheduling.picker import Picker

if TYPE_CHECKING:
    from routing.info import DeploymentInfo, EndpointInfo, PolicyInfo
    from routing.kvindex.prefix_index import Held


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
    # Under flow control: how many requests an engine may queue beyond its max_num_seqs and still take this one
    # (the policy's saturation_waiting_per_engine); None: no limit (filters.with_room).
    room_beyond: float | None = None
    spare_slots: float = 0.0  # and how many of its slots to leave free (its tenant is ahead of its share)
    reserved_endpoint: int | None = None  # the engine whose slot flow control reserved for this request
    # The time every plugin reads (loads decay with it): the pipeline's clock when it chose (Pipeline.clock:
    # time.monotonic in the router, the virtual clock in planner/).
    now: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class Candidate:
    endpoint: EndpointInfo
    load: EndpointLoad
    scores: dict[str, float] = field(default_factory=dict)
    guarded: bool = False  # a step took its affinity scores away


@dataclass(slots=True)
class Choice:
    """One pick in progress, as the steps and tie-breaks see it."""

    deployment: DeploymentInfo
    ctx: RequestContext
    candidates: list[Candidate]
    affinity: tuple[str, ...]  # the keys of the scores that pull a request to an engine whatever its load
    # Set by a step before the load guard: whether to keep an over-loaded candidate's affinity after all.
    spare: Callable[[Candidate], bool] | None = None


class Filter(Protocol):
    def __call__(self, ctx: RequestContext, candidates: list[Candidate]) -> list[Candidate]: ...


class Scorer(Protocol):
    def score(
        self, ctx: RequestContext, candidates: Sequence[Candidate], policy: PolicyInfo
    ) -> list[float]: ...


class Step(Protocol):
    def __call__(self, choice: Choice) -> None: ...


class TieBreak(Protocol):
    def __call__(self, choice: Choice, at: list[int]) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class ScorerEntry:
    scorer: Scorer
    key: str  # its name in Candidate.scores; scorers of one thing (the prefix, precise or approximate) share it
    weight: str  # the routing policy's field holding its weight
    affinity: bool  # pulls a request to an engine whatever its load: the load guard takes it away


@dataclass(frozen=True, slots=True)
class ModePlugins:
    """A mode's plugins by kind, in the order listed, as the pipeline runs them."""

    filters: tuple[Filter, ...]
    scorers: tuple[tuple[str, Scorer], ...]  # (score key, scorer)
    steps: tuple[Step, ...]
    tie_breaks: tuple[TieBreak, ...]
    weight_of: dict[str, str]  # score key -> policy field, over every registered scorer
    affinity: tuple[str, ...]


class Registry:
    """Plugins by name (one namespace for all kinds) and modes as lists of those names.

    Register plugins before the modes that list them; each registration recompiles the modes' plans, so a
    pipeline reading `plans` sees a change at once.
    """

    def __init__(self) -> None:
        self.filters: dict[str, Filter] = {}
        self.scorers: dict[str, ScorerEntry] = {}
        self.steps: dict[str, Step] = {}
        self.tie_breaks: dict[str, TieBreak] = {}
        self.modes: dict[str, tuple[str, ...]] = {}
        self.plans: dict[str, ModePlugins] = {}

    def filter(self, name: str, plugin: Filter) -> None:
        self._add(self.filters, name, plugin)

    def scorer(
        self, name: str, plugin: Scorer, *, weight: str, key: str | None = None, affinity: bool = False
    ) -> None:
        """Register a scorer, weighed by the policy field `weight`, scoring under `key` (its name by default)."""
        key = key or name
        for entry in self.scorers.values():
            if entry.key == key and (entry.weight, entry.affinity) != (weight, affinity):
                raise ValueError(f"scorers of {key!r} must share one weight field and affinity")
        self._add(self.scorers, name, ScorerEntry(plugin, key, weight, affinity))

    def step(self, name: str, plugin: Step) -> None:
        self._add(self.steps, name, plugin)

    def tie_break(self, name: str, plugin: TieBreak) -> None:
        self._add(self.tie_breaks, name, plugin)

    def mode(self, name: str, plugins: Iterable[str]) -> None:
        names = tuple(plugins)
        unknown = [n for n in names if not any(n in kind for kind in self._kinds())]
        if unknown:
            raise KeyError(f"mode {name!r} lists unregistered plugins: {', '.join(unknown)}")
        self.modes[name] = names
        self._compile()

    @property
    def weight_fields(self) -> tuple[str, ...]:
        """The policy fields holding scorer weights, in the order registered."""
        return tuple(dict.fromkeys(entry.weight for entry in self.scorers.values()))

    @property
    def affinity(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.key for e in self.scorers.values() if e.affinity))

    def copy(self) -> Registry:
        other = Registry()
        for mine, theirs in zip(self._kinds(), other._kinds(), strict=True):
            theirs.update(mine)
        other.modes.update(self.modes)
        other._compile()
        return other

    def _kinds(self) -> tuple[dict, ...]:
        return (self.filters, self.scorers, self.steps, self.tie_breaks)

    def _add(self, kind: dict, name: str, plugin) -> None:
        if any(name in k for k in self._kinds()):
            raise ValueError(f"a routing plugin named {name!r} is registered already")
        kind[name] = plugin
        self._compile()

    def _compile(self) -> None:
        weight_of = {e.key: e.weight for e in self.scorers.values()}
        affinity = self.affinity
        self.plans = {
            mode: ModePlugins(
                filters=tuple(self.filters[n] for n in names if n in self.filters),
                scorers=tuple(
                    (self.scorers[n].key, self.scorers[n].scorer) for n in names if n in self.scorers
                ),
                steps=tuple(self.steps[n] for n in names if n in self.steps),
                tie_breaks=tuple(self.tie_breaks[n] for n in names if n in self.tie_breaks),
                weight_of=weight_of,
                affinity=affinity,
            )
            for mode, names in self.modes.items()
        }


# The registry the router runs on; routing/scheduling/__init__.py registers the built-in plugins and modes into it.
REGISTRY = Registry()


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
        scores = [c.scores for c in candidates]
        for key, scorer in plan.scorers:
            values = list(scorer.score(ctx, candidates, policy))
            if len(values) != len(scores):
                raise ValueError(f"scorer {key!r} gave {len(values)} scores for {len(scores)} candidates")
            # Each candidate's score set under `key` (map: no Python-level loop a candidate).
            deque(map(dict.__setitem__, scores, repeat(key), values), maxlen=0)
        choice = Choice(deployment, ctx, candidates, plan.affinity)
        if len(candidates) > 1:
            for step in plan.steps:
                step(choice)
        weights = {name: getattr(policy, field) for name, field in plan.weight_of.items()}
        # Each candidate's weighted scores summed in the order they were set (map: no generator a candidate).
        totals = [sum(map(mul, map(weights.__getitem__, c.scores), c.scores.values())) for c in candidates]
        return self.picker.pick(choice, totals, plan.tie_breaks), candidates
