"""The fleet: engines of one pool, a router running the platform's routing pipeline on the virtual clock, and the
event loop between them.

What the router does around a pick is done here as the router does it (routing/exchange.py, routing/prefix.py):
the request's context (block keys, what each engine holds), the endpoints' load (EndpointLoad, updated at dispatch,
first token and end, with the engines' scraped running/waiting/KV use refreshed once a second), then
routing.pipeline.Pipeline.choose, then the record of the decision. The scoring itself is the platform's code.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .clock import VirtualClock
from .django_env import ensure_django
from .engine import Engine, Seq
from .profile import Profile
from .trace import TRACE_BLOCK_TOKENS, TraceRequest

ensure_django()

from routing.affinity import ApproximateIndex  # noqa: E402
from routing.framework import RequestContext  # noqa: E402
from routing.info import DeploymentInfo, EndpointInfo, PolicyInfo  # noqa: E402
from routing.load import RECENT_WINDOW_S, EndpointLoad  # noqa: E402
from routing.pipeline import Pipeline  # noqa: E402
from routing.prefix import with_recent  # noqa: E402
from routing.prefix_index import Held  # noqa: E402
from routing.steps import request_weight  # noqa: E402

MODES = ("precise", "approximate", "least_loaded", "round_robin")
SCRAPE_EVERY_S = 1.0  # the worker scrapes the engines' /metrics once a second
SPECULATIVE_TTL_S = 3.0  # the router's speculative index entries (ROUTER_SPECULATIVE_TTL_SECONDS)


@dataclass
class RouterState:
    endpoint: int
    weight: float
    lane: object


@dataclass
class Result:
    mode: str
    engines: int
    profile: Profile
    seqs: list[Seq]
    engine_objs: list[Engine]
    makespan_s: float
    cpu_s: float
    picks: dict[int, int] = field(default_factory=dict)


def deployment_for(mode: str, engines: int, profile: Profile, block_tokens: int, **policy) -> DeploymentInfo:
    """The router's own view of the simulated deployment: one pool of aggregated engines, the policy's mode."""
    endpoints = tuple(
        EndpointInfo(
            id=i + 1,
            name=f"engine-{i}",
            url=f"sim://engine-{i}",
            role="both",
            pool_id=1,
            max_num_seqs=profile.max_num_seqs,
        )
        for i in range(engines)
    )
    return DeploymentInfo(
        id=1,
        name="planned",
        served_model_name="planned",
        max_model_len=1 << 30,
        block_size=block_tokens,
        policy=PolicyInfo(**{"mode": mode, **policy}),
        endpoints=endpoints,
        created=0,
    )


class Simulation:
    def __init__(
        self,
        requests: list[TraceRequest],
        engines: int,
        profile: Profile,
        mode: str = "precise",
        pipeline: Pipeline | None = None,
        block_tokens: int = TRACE_BLOCK_TOKENS,
        policy: dict | None = None,
        approx_capacity_blocks: int | None = None,
        on_pick: Callable[[TraceRequest, int], None] | None = None,
    ):
        self.requests = requests
        self.profile = profile
        self.mode = mode
        self.pipeline = pipeline or Pipeline()
        self.bt = block_tokens
        self.deployment = deployment_for(mode, engines, profile, block_tokens, **(policy or {}))
        self.clock = VirtualClock()
        self.pipeline.clock = self.clock.monotonic  # every plugin reads ctx.now, set from it at each choice
        self._events: list[tuple[float, int, int, object, int]] = []
        self._n = 0
        self.engines = {
            e.id: Engine(e.id, profile, block_tokens, self._schedule_step, self._first_token, self._finished)
            for e in self.deployment.endpoints
        }
        self.loads = {e.id: EndpointLoad() for e in self.deployment.endpoints}
        capacity = approx_capacity_blocks or profile.kv_blocks(block_tokens) or 4096
        self.approximate = ApproximateIndex(capacity)
        self._scraped_at = -1.0
        self.seqs: list[Seq] = []
        self.on_pick = on_pick
        self.picks: dict[int, int] = {e: 0 for e in self.engines}

    # Events: (time, order, kind, object, generation); kind 0 an arrival at the router, 1 an engine's iteration
    # ending, 2 a routed request reaching its engine's scheduler (after the profile's request overhead).
    def _schedule_step(self, at: float, engine: Engine, gen: int) -> None:
        self._n += 1
        heapq.heappush(self._events, (at, self._n, 1, engine, gen))

    def run(self) -> Result:
        started = time.process_time()
        for r in self.requests:
            self._n += 1
            self._events.append((r.arrival_s, self._n, 0, r, 0))
        heapq.heapify(self._events)
        events = self._events
        clock = self.clock
        last = 0.0
        while events:
            at, _, kind, obj, gen = heapq.heappop(events)
            clock.now = at
            last = at
            if kind == 0:
                self._arrive(obj)
            elif kind == 1:
                obj.step_done(at, gen)
            else:
                self.engines[obj.router_state.endpoint].submit(obj, at)
        return Result(
            self.mode,
            len(self.engines),
            self.profile,
            self.seqs,
            list(self.engines.values()),
            last,
            time.process_time() - started,
            self.picks,
        )

    # The router.
    def _scrape(self, now: float) -> None:
        """The engines' /metrics as the router last read them: refreshed once a second."""
        tick = now // SCRAPE_EVERY_S
        if tick == self._scraped_at:
            return
        self._scraped_at = tick
        for eid, engine in self.engines.items():
            load = self.loads[eid]
            load.running = float(len(engine.running))
            load.waiting = float(len(engine.waiting))
            load.kv_usage = engine.kv_usage()

    def context(self, r: TraceRequest, now: float) -> RequestContext:
        keys = list(r.full_blocks(self.bt))
        ctx = RequestContext(model=self.deployment.served_model_name, session_id=r.session)
        ctx.prompt_tokens_estimate = r.input_tokens
        mode = self.deployment.policy.mode
        if mode not in ("precise", "approximate"):
            return ctx
        ctx.block_keys = keys  # the trace's block ids stand for the router's block keys
        ctx.block_count = len(keys)
        if mode == "precise":
            # The index built from the engines' KV events: the leading blocks each engine's cache holds, with
            # this router's recent decisions counted as speculative until their events would confirm them.
            held = {}
            for eid, engine in self.engines.items():
                n = engine.held(keys)
                if n:
                    held[eid] = Held(gpu=n)
            ctx.held = with_recent(held, self.approximate.lookup(keys, since=now - SPECULATIVE_TTL_S))
            ctx.from_index = True
        else:
            ctx.approx_held = self.approximate.lookup(keys)
        return ctx

    def _arrive(self, r: TraceRequest) -> None:
        now = self.clock.now
        self._scrape(now)
        ctx = self.context(r, now)
        chosen, _ = self.pipeline.choose(self.deployment, ctx, self.loads)
        if chosen is None:
            raise RuntimeError("the pipeline left no engine")
        eid = chosen.endpoint.id
        self.picks[eid] += 1
        if self.on_pick is not None:
            self.on_pick(r, eid)
        mode = self.deployment.policy.mode
        predicted_blocks = 0
        if ctx.block_keys:
            if mode == "precise":
                held = ctx.held.get(eid)
                predicted_blocks = held.blocks if held else 0
            else:
                predicted_blocks = ctx.approx_held.get(eid, 0)
            self.approximate.record(eid, ctx.block_keys, now)
        predicted = min(predicted_blocks * self.bt, max(0, r.input_tokens - 1))
        load = self.loads[eid]
        weight = request_weight(r.input_tokens, predicted)
        load.begin(weight)
        load.assigned(now, RECENT_WINDOW_S, weight)
        lane = load.prefill_began(float(max(0, r.input_tokens - predicted)), now)
        seq = Seq(request=r, blocks=r.full_blocks(self.bt), routed_s=now)
        seq.router_state = RouterState(eid, weight, lane)
        self.seqs.append(seq)
        overhead = self.profile.request_overhead_s
        if overhead > 0:
            self._n += 1
            heapq.heappush(self._events, (now + overhead, self._n, 2, seq, 0))
        else:
            self.engines[eid].submit(seq, now)

    def _first_token(self, seq: Seq, now: float) -> None:
        state = seq.router_state
        self.loads[state.endpoint].prefill_ended(state.lane, now, True)

    def _finished(self, seq: Seq, now: float) -> None:
        state = seq.router_state
        load = self.loads[state.endpoint]
        if seq.first_token_s < 0:  # refused before a first token
            load.prefill_ended(state.lane, now, False)
        load.end(state.weight)


def simulate(requests: list[TraceRequest], engines: int, profile: Profile, mode: str, **kw) -> Result:
    return Simulation(requests, engines, profile, mode, **kw).run()
