"""The fleet: engines of one pool, a router running the platform's routing pipeline on the virtual clock, and the
event loop between them.

What the router does around a pick is done here as the router does it (routing/server/exchange.py, routing/kvindex/prefix.py):
the request's context (block keys, what each engine holds), the endpoints' load (EndpointLoad, updated at dispatch,
first token and end, with the engines' scraped running/waiting/KV use refreshed once a second), then
routing.scheduling.pipeline.Pipeline.choose, then the record of the decision. The scoring itself is the platform's code.
Under the policy's flow control a request first passes the router's gate (planner/flow_sim.py).

Precise mode reads the fleet's directory of blocks (block -> engines holding it, kept by the engines) once along
the prompt, as the index's walk does, instead of asking each engine (`fast_index=False`: the old way, for tests).

Over 400 lines: the router's side of each feature (the index's walk, the gate, the P/D plans and transfers, the
autoscaler's engines coming and going) works on the one event loop and the same state (the deployment, the loads,
the engines); the parts that stand alone are in flow_sim.py and autoscale_sim.py.
"""

from __future__ import annotations

import gc
import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .clock import VirtualClock
from .django_env import ensure_django
from .engine import Engine, Seq
from .profile import Profile
from .trace import TRACE_BLOCK_TOKENS, TraceRequest

ensure_django()

from routing.info import PREFILL_ROLES, DeploymentInfo, EndpointInfo, KeyInfo, PolicyInfo  # noqa: E402
from routing.kvindex.prefix import with_recent  # noqa: E402
from routing.kvindex.prefix_index import Held  # noqa: E402
from routing.scheduling.affinity import ApproximateIndex, SessionMap  # noqa: E402
from routing.scheduling.disagg import plan_disaggregated, plan_peer_pull  # noqa: E402
from routing.scheduling.load import RECENT_WINDOW_S, EndpointLoad  # noqa: E402
from routing.scheduling.pipeline import Candidate, Pipeline, RequestContext  # noqa: E402
from routing.scheduling.steps import request_weight  # noqa: E402

MODES = ("precise", "approximate", "least_loaded", "round_robin")
SCRAPE_EVERY_S = 1.0  # the worker scrapes the engines' /metrics once a second
SPECULATIVE_TTL_S = 3.0  # the router's speculative index entries (ROUTER_SPECULATIVE_TTL_SECONDS)


@dataclass
class RouterState:
    endpoint: int
    weight: float
    lane: object
    ticket: object = None  # its turn under flow control


@dataclass
class PrefillLeg:
    """A disaggregated request's prefill on a prefill engine (one output token), before its KV moves."""

    endpoint: int
    weight: float
    lane: object
    decode: Seq


@dataclass(eq=False)
class Queued:
    """A request waiting at the router's gate."""

    request: TraceRequest
    ctx: RequestContext
    arrived: float
    waiter: object = None
    timed_out: bool = False


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
    timed_out: list[TraceRequest] = field(
        default_factory=list
    )  # refused at the gate past their class's limit
    flow_waits: dict[str, list[float]] = field(default_factory=dict)  # tenant -> seconds waited at the gate
    # Under the autoscaler: each engine's (start, stop) in seconds (start-up included), and (time, replicas asked,
    # engines ready) at each pass. Empty: the engines ran the whole run.
    lifetimes: list[tuple[float, float]] = field(default_factory=list)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    transfers: list[tuple[int, float]] = field(default_factory=list)  # P/D: (KV tokens moved, seconds) each
    pool_timelines: dict[str, list[tuple[float, int, int]]] = field(
        default_factory=dict
    )  # role -> its passes


def deployment_for(
    mode: str,
    engines: int,
    profile: Profile,
    block_tokens: int,
    prefill_engines: int = 0,
    kv_both: bool = False,
    **policy,
) -> DeploymentInfo:
    """The router's own view of the simulated deployment: one pool of aggregated engines, the policy's mode; or,
    with `prefill_engines`, a decode pool of `engines` and a prefill pool of that many."""
    endpoints = tuple(
        EndpointInfo(
            id=i + 1,
            name=f"engine-{i}",
            url=f"sim://engine-{i}",
            role="decode" if prefill_engines else "both",
            pool_id=1,
            max_num_seqs=profile.max_num_seqs,
            kv_both=kv_both,
        )
        for i in range(engines)
    ) + tuple(
        EndpointInfo(
            id=engines + i + 1,
            name=f"prefill-{i}",
            url=f"sim://prefill-{i}",
            role="prefill",
            pool_id=2,
            max_num_seqs=profile.max_num_seqs,
        )
        for i in range(prefill_engines)
    )
    return DeploymentInfo(
        id=1,
        name="planned",
        served_model_name="planned",
        max_model_len=1 << 30,
        block_size=block_tokens,
        # Flow control only where the policy asks for it (the router's default is on; a replay of a trace usually
        # wants what the engines would do with every request).
        policy=PolicyInfo(**{"mode": mode, "flow_control": False, **policy}),
        endpoints=endpoints,
        created=0,
    )


def engine_ids(mask: int) -> list[int]:
    """The engine ids in a directory mask (bit 1 << id)."""
    ids = []
    while mask:
        low = mask & -mask
        ids.append(low.bit_length() - 1)
        mask ^= low
    return ids


def _count_of(digits: list[int], eid: int) -> int:
    """An engine's count from bit-sliced counters (digit k: a mask of the engines whose count has bit k)."""
    return sum(((digit >> eid) & 1) << k for k, digit in enumerate(digits))


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
        prefill_engines: int = 0,
        autoscale=None,
        fast_index: bool = True,
        kv_both: bool = False,
        prefill_autoscale=None,
        recorded_routes: bool = False,
    ):
        if prefill_autoscale is not None and not prefill_engines:
            raise ValueError("prefill_autoscale scales a prefill pool: give prefill_engines")

        self.requests = requests
        # Send each request to the engine the recorded run sent it to (TraceRequest.endpoint), where the trace
        # says, instead of where the pipeline would: the engines' model apart from the routing's.
        self.recorded_routes = recorded_routes
        self._routes: dict[int, int] = {}  # recorded engine number -> index among this deployment's engines
        self.profile = profile
        self.mode = mode
        self.pipeline = pipeline or Pipeline()
        self.bt = block_tokens
        self.deployment = deployment_for(
            mode, engines, profile, block_tokens, prefill_engines, kv_both, **(policy or {})
        )
        self.transfers: list[tuple[int, float]] = []  # P/D: (KV tokens moved, seconds) per request
        self.clock = VirtualClock()
        self.pipeline.clock = self.clock.monotonic  # every plugin reads ctx.now, set from it at each choice
        self._events: list[tuple[float, int, int, object, int]] = []
        self._n = 0
        self.fast_index = fast_index
        self.directory: dict[int, int] = {}  # block -> a mask of the engines holding it (either tier)
        self._on_gpu: dict[int, Held] = {}  # held_fast's answers for engines without a CPU tier, by count
        self.cpu_directory: dict[int, int] = {}  # block -> a mask of the engines holding it in their CPU tier
        self.engines = {
            e.id: Engine(
                e.id,
                profile,
                block_tokens,
                self._schedule_step,
                self._first_token,
                self._finished,
                self.directory,
                self.cpu_directory,
            )
            for e in self.deployment.endpoints
        }
        self.loads = {e.id: EndpointLoad() for e in self.deployment.endpoints}
        self._first_endpoints = self.deployment.endpoints
        self._pool_of = {e.id: e.pool_id for e in self.deployment.endpoints}
        capacity = approx_capacity_blocks or profile.kv_blocks(block_tokens) or 4096
        self.approximate = ApproximateIndex(capacity)
        # The router's session map (routing/kvindex/prefix.py): a session's last engine, on the virtual clock.
        self.sessions = SessionMap(clock=self.clock.monotonic)
        self._scraped_at = -1.0
        self.seqs: list[Seq] = []
        self.on_pick = on_pick
        self.picks: dict[int, int] = {e: 0 for e in self.engines}
        self.flow = None
        if self.deployment.policy.flow_control:
            from .flow_sim import VirtualFlowControl

            self.flow = VirtualFlowControl(self.loads, self._call_at, self.clock.monotonic)
        self.keys: dict[str, KeyInfo] = {}
        # The autoscaler of each pool that has one: `autoscale` the aggregated pool's (or, with a prefill pool, the
        # decode pool's), `prefill_autoscale` the prefill pool's.
        self.autoscaler = self.prefill_autoscaler = None
        self.lifetimes: dict[int, list[float]] = {eid: [0.0, -1.0] for eid in self.engines}
        self.starting: list[int] = []  # engines asked for, not ready yet
        self.draining: set[int] = set()
        self.timeline: list[
            tuple[float, int, int]
        ] = []  # every pool's: (time, replicas asked, engines ready)
        self._left = len(requests)  # requests not yet finished or refused
        if autoscale is not None or prefill_autoscale is not None:
            from .autoscale_sim import Autoscaler

            if autoscale is not None:
                self.autoscaler = Autoscaler(self, autoscale, 1, "decode" if prefill_engines else "both")
            if prefill_autoscale is not None:
                self.prefill_autoscaler = Autoscaler(self, prefill_autoscale, 2, "prefill")
        self.autoscalers = [a for a in (self.autoscaler, self.prefill_autoscaler) if a is not None]
        self.timed_out: list[TraceRequest] = []
        self.flow_waits: dict[str, list[float]] = {}

    # Events: (time, order, kind, object, generation); kind 0 an arrival at the router, 1 an engine's iteration
    # ending, 2 a routed request reaching its engine's scheduler (after the profile's request overhead), 3 a call
    # (the gate's looks and timeouts, a request let through being sent).
    def _schedule_step(self, at: float, engine: Engine, gen: int) -> None:
        self._n += 1
        heapq.heappush(self._events, (at, self._n, 1, engine, gen))

    def _call_at(self, at: float, fn: Callable[[], None]) -> None:
        self._n += 1
        heapq.heappush(self._events, (at, self._n, 3, fn, 0))

    def run(self) -> Result:
        # The run makes millions of small containers (sequences, the directory's entries, the index's records)
        # and no garbage cycles worth collecting while it runs: the cyclic collector's passes over them were a
        # fifth of its time. Collection resumes when it ends.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if collecting:
                gc.enable()

    def _run(self) -> Result:
        started = time.process_time()
        for r in self.requests:
            self._n += 1
            self._events.append((r.arrival_s, self._n, 0, r, 0))
        heapq.heapify(self._events)
        for autoscaler in self.autoscalers:
            self._call_at(0.0, lambda a=autoscaler: self._autoscale(a))
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
            elif kind == 3:
                obj()
            else:
                self.engines[obj.router_state.endpoint].submit(obj, at)
        lifetimes = []
        if self.autoscalers:
            lifetimes = [(a, b if b >= 0 else last) for a, b in self.lifetimes.values()]
        return Result(
            self.mode,
            len(self.deployment.endpoints) if not self.autoscalers else len(self.engines),
            self.profile,
            self.seqs,
            list(self.engines.values()),
            last,
            time.process_time() - started,
            self.picks,
            self.timed_out,
            self.flow_waits,
            lifetimes,
            self.timeline,
            self.transfers,
            {a.role: a.timeline for a in self.autoscalers},
        )

    # The autoscalers' passes and what they ask for (planner/autoscale_sim.py).
    def _autoscale(self, autoscaler) -> None:
        if self._left <= 0:
            return
        now = self.clock.now
        autoscaler.tick(now)
        # The fleet's engines at this pass: every pool's replicas asked for, and its engines ready.
        asked = sum(a.replicas for a in self.autoscalers)
        fixed = [
            e for e in self.deployment.endpoints if e.pool_id not in {a.pool_id for a in self.autoscalers}
        ]
        self.timeline.append((now, asked + len(fixed), len(self.deployment.endpoints)))
        self._call_at(now + autoscaler.spec.interval_s, lambda: self._autoscale(autoscaler))

    def pool_endpoints(self, pool_id: int) -> list[int]:
        """The ids of a pool's ready engines (1: the aggregated or decode pool, 2: the prefill pool)."""
        return [e.id for e in self.deployment.endpoints if e.pool_id == pool_id]

    def start_engine(self, now: float, startup_s: float, pool_id: int = 1) -> None:
        eid = max(self.engines) + 1
        self.engines[eid] = Engine(
            eid,
            self.profile,
            self.bt,
            self._schedule_step,
            self._first_token,
            self._finished,
            self.directory,
            self.cpu_directory,
        )
        self.loads[eid] = EndpointLoad()
        self.picks[eid] = 0
        self.lifetimes[eid] = [now, -1.0]
        self.starting.append(eid)
        self._pool_of[eid] = pool_id
        self._call_at(now + startup_s, lambda: self._ready(eid))

    def _ready(self, eid: int) -> None:
        if eid not in self.starting:  # let go while starting
            return
        self.starting.remove(eid)
        pool_id = self._pool_of[eid]
        like = next(e for e in self._first_endpoints if e.pool_id == pool_id)  # the pool's role and options
        name = f"{like.name.rsplit('-', 1)[0]}-{eid - 1}"
        endpoint = replace(like, id=eid, name=name, url=f"sim://{name}")
        self._set_endpoints((*self.deployment.endpoints, endpoint))

    def drain_engine(self, now: float, pool_id: int = 1) -> None:
        """Let one of a pool's engines go: one still starting first; else the ready one with the fewest requests
        in flight (the latest among equals) leaves the routing and stops once it has nothing running or waiting.
        A pool keeps one ready engine."""
        starting = [eid for eid in self.starting if self._pool_of[eid] == pool_id]
        if starting:
            eid = starting[-1]
            self.starting.remove(eid)
            self.lifetimes[eid][1] = now
            return
        ready = self.pool_endpoints(pool_id)
        if len(ready) <= 1:
            return
        eid = min(reversed(ready), key=lambda e: self.loads[e].active)
        self._set_endpoints(tuple(e for e in self.deployment.endpoints if e.id != eid))
        self.draining.add(eid)
        self._stop_if_idle(eid, now)

    def _stop_if_idle(self, eid: int, now: float) -> None:
        engine = self.engines[eid]
        if eid in self.draining and not engine.running and not engine.waiting and not self.loads[eid].active:
            self.draining.discard(eid)
            self.lifetimes[eid][1] = now

    def _set_endpoints(self, endpoints: tuple) -> None:
        self.deployment = replace(self.deployment, endpoints=endpoints)
        if self.flow is not None:
            self.flow.wake(self.flow.flow(self.deployment))  # the gate's snapshot, and a look at the new room

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
        if r.session:
            ctx.session_endpoint = self.sessions.get(r.session)
        mode = self.deployment.policy.mode
        if mode not in ("precise", "approximate"):
            return ctx
        ctx.block_keys = keys  # the trace's block ids stand for the router's block keys
        ctx.block_count = len(keys)
        if mode == "precise":
            # The index built from the engines' KV events: the leading blocks each engine's cache holds, by tier,
            # with this router's recent decisions counted as speculative until their events would confirm them.
            held = self.held_fast(keys) if self.fast_index else self.held_slow(keys)
            beyond = {eid: h.blocks for eid, h in held.items()}
            recent = self.approximate.lookup(keys, since=now - SPECULATIVE_TTL_S, beyond=beyond)
            ctx.held = with_recent(held, recent)
            ctx.from_index = True
        else:
            ctx.approx_held = self.approximate.lookup(keys)
        return ctx

    def held_slow(self, keys: list[int]) -> dict[int, Held]:
        """Each engine asked in turn (engines x blocks)."""
        held = {}
        for eid, engine in self.engines.items():
            gpu, cpu = engine.held_tiers(keys)
            if gpu or cpu:
                held[eid] = Held(gpu=gpu, cpu=cpu)
        return held

    def held_fast(self, keys: list[int]) -> dict[int, Held]:
        """One walk along the prompt through the directory, as the index's walk goes: the engines holding the
        first block, each until the first block it lacks (one mask test per block while all still hold it);
        once one engine is left, along its own cache. With CPU tiers, the CPU directory's mask of each block
        counts the engines holding it there, so the tiers come out of the same walk."""
        directory, in_cpu = self.directory, self.cpu_directory if self.profile.cpu_tier_tokens > 0 else None
        alive = directory.get(keys[0], 0) if keys else 0  # a mask of engine ids
        counts: dict[int, int] = {}
        # Per engine, how many of its leading blocks so far are in its CPU tier: counters kept bit-sliced (digit k
        # of every engine's count in one mask), so a block adds its mask to all of them in a few integer ops.
        digits: list[int] = []
        tiers: dict[int, tuple[int, int]] = {}  # the engine the walk ended along its own cache: (GPU, CPU)
        i, n = 0, len(keys)
        while alive:  # every engine in `alive` holds blocks 0..i
            if in_cpu is not None:
                carry = alive & in_cpu.get(keys[i], 0)
                k = 0
                while carry:  # add block i's mask to the counters, digit by digit
                    if k == len(digits):
                        digits.append(carry)
                        break
                    digits[k], carry = digits[k] ^ carry, digits[k] & carry
                    k += 1
            i += 1
            if not alive & (alive - 1):  # one engine left
                eid = alive.bit_length() - 1
                known = None if in_cpu is None else _count_of(digits, eid)
                gpu, cpu = tiers[eid] = self.engines[eid].held_tiers(keys, i, known)
                counts[eid] = gpu + cpu
                alive = 0
                break
            if i == n:
                break
            still = alive & directory.get(keys[i], 0)
            if still != alive:
                for eid in engine_ids(alive & ~still):
                    counts[eid] = i
                alive = still
        for eid in engine_ids(alive):
            counts[eid] = i
        held = {}
        on_gpu = self._on_gpu  # Held is frozen: one a count, shared
        some_cpu = 0  # the engines with any leading block in the CPU tier
        for digit in digits:
            some_cpu |= digit
        for eid in sorted(counts):
            c = counts[eid]
            if eid in tiers:
                gpu, cpu = tiers[eid]
            elif not (some_cpu >> eid) & 1:
                gpu, cpu = c, 0
            else:
                cpu = _count_of(digits, eid)
                gpu = c - cpu
            held[eid] = (
                (on_gpu.get(c) or on_gpu.setdefault(c, Held(gpu=c))) if not cpu else Held(gpu=gpu, cpu=cpu)
            )
        return held

    def _key(self, r: TraceRequest) -> KeyInfo:
        """The router's key for the trace's tenant: one key, team and tenant a tenant, weight 1."""
        key = self.keys.get(r.tenant)
        if key is None:
            n = len(self.keys) + 1
            key = self.keys[r.tenant] = KeyInfo(n, f"k{n}", n, n, frozenset(), None)
        return key

    def _arrive(self, r: TraceRequest) -> None:
        now = self.clock.now
        self._scrape(now)
        ctx = self.context(r, now)
        if self.flow is None:
            self._dispatch(r, ctx, None)
            return
        # The gate, as the exchange asks it (Exchange._wait_turn): the blocks each engine holds, the work.
        blocks = {e: h.blocks for e, h in ctx.held.items()} if ctx.held else ctx.approx_held
        uncached = r.input_tokens - max(blocks.values(), default=0) * self.bt
        flow = self.flow.flow(self.deployment)
        work = self.flow.estimate(flow, uncached, r.output_tokens)
        key = self._key(r)
        priority = getattr(r, "priority", None) or key.priority_class
        queued = Queued(r, ctx, now)

        def on_turn(ticket) -> None:
            if queued.waiter is None:  # let through at once
                self._dispatch(r, ctx, ticket)
            else:  # let through by the gate's pump: sent on the next turn, as the exchange's await returns
                self._call_at(self.clock.now, lambda: self._dispatch(r, ctx, ticket))

        waiter = self.flow.admit(self.deployment, key, priority, work, blocks or {}, on_turn)
        if waiter is not None:
            queued.waiter = waiter
            self._call_at(now + self.flow.limit(self.deployment, priority), lambda: self._timeout(queued))

    def _timeout(self, queued: Queued) -> None:
        if self.flow.timeout(self.deployment, queued.waiter):
            self._left -= 1
            r = queued.request
            self.timed_out.append(r)
            self.flow_waits.setdefault(r.tenant, []).append(self.clock.now - queued.arrived)

    def _dispatch(self, r: TraceRequest, ctx: RequestContext, ticket) -> None:
        now = self.clock.now
        if ticket is not None:
            self.flow_waits.setdefault(r.tenant, []).append(ticket.queued_s)
            policy = self.deployment.policy
            # Only where it can start now (filters.with_room), as the exchange sends a request let through.
            ctx.room_beyond = policy.saturation_waiting_per_engine
            ctx.spare_slots = policy.saturation_spare_slots_per_engine if ticket.ahead else 0.0
            ctx.reserved_endpoint = ticket.endpoint
        chosen, candidates = self.pipeline.choose(self.deployment, ctx, self.loads)
        if chosen is None:
            raise RuntimeError("the pipeline left no engine")
        if self.recorded_routes and r.endpoint is not None:
            chosen = self._recorded_route(r.endpoint, candidates)
        eid = chosen.endpoint.id
        if r.session:
            self.sessions.put(r.session, eid)
        plan = None
        if self.deployment.has_prefill_pool or chosen.endpoint.kv_both:
            plan = self._plan(ctx, chosen, candidates)
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
        if ticket is not None:
            ticket.started()
        load.assigned(now, RECENT_WINDOW_S, weight)
        # Nothing to prefill here when another engine computes the prompt (routing/server/exchange.py).
        remote = plan is not None and plan.prefill is not None
        lane = load.prefill_began(0.0 if remote else float(max(0, r.input_tokens - predicted)), now)
        seq = Seq(request=r, blocks=r.full_blocks(self.bt), routed_s=now)
        seq.router_state = RouterState(eid, weight, lane, ticket)
        self.seqs.append(seq)
        if remote:
            self._prefill_elsewhere(seq, plan, now)
            return
        overhead = self.profile.request_overhead_s
        if overhead > 0:
            self._n += 1
            heapq.heappush(self._events, (now + overhead, self._n, 2, seq, 0))
        else:
            self.engines[eid].submit(seq, now)

    def _recorded_route(self, route: int, candidates: list[Candidate]) -> Candidate:
        """The engine the recorded run sent this request to: the recorded engines, numbered in order of first
        appearance, taken in turn as this deployment's (which of them is which does not matter: they start
        alike, their caches empty)."""
        engines = [e for e in self.deployment.endpoints if e.role not in PREFILL_ROLES]
        endpoint = engines[self._routes.setdefault(route, len(self._routes) % len(engines))]
        for c in candidates:
            if c.endpoint.id == endpoint.id:
                return c
        return Candidate(endpoint, self.loads[endpoint.id])

    # Prefill/decode pools and peer pulls: the router's plans (routing.scheduling.disagg), the KV moved over NIXL.
    def _plan(self, ctx: RequestContext, chosen, candidates):
        deployment = self.deployment

        def prefill_choice():
            picked, _ = self.pipeline.choose(deployment, ctx, self.loads, PREFILL_ROLES)
            return picked

        plan = plan_disaggregated(deployment, ctx, chosen, prefill_choice)
        if plan.kind == "aggregated":
            plan = plan_peer_pull(deployment, ctx, chosen, candidates)
        return plan

    def _prefill_elsewhere(self, seq: Seq, plan, now: float) -> None:
        """Disaggregated: the prompt is prefilled on the prefill engine (one token), then the decode engine pulls
        the KV it lacks. Peer pull: it pulls the holder's blocks it lacks at once."""
        r = seq.request
        source = plan.prefill.id
        if plan.kind == "peer_pull":
            self._transfer(seq, source, now)
            return
        load = self.loads[source]
        weight = request_weight(r.input_tokens, 0)
        load.begin(weight)
        load.assigned(now, RECENT_WINDOW_S, weight)
        lane = load.prefill_began(float(plan.uncached_tokens), now)
        leg = Seq(request=replace(r, output_tokens=1), blocks=seq.blocks, routed_s=now)
        leg.router_state = PrefillLeg(source, weight, lane, seq)
        self.engines[source].submit(leg, now)

    def _transfer(self, seq: Seq, source: int, now: float) -> None:
        """Move the prompt's full blocks the source holds and the decode engine lacks, at the profile's NIXL
        cost; the request reaches the decode engine's scheduler when they are there, holding them (Seq.pulled_upto)
        until it is admitted."""
        decode = self.engines[seq.router_state.endpoint]
        holder = self.engines[source]
        have = sum(decode.held_tiers(seq.blocks))
        there = sum(holder.held_tiers(seq.blocks))
        moving = seq.blocks[have:there]
        tokens = len(moving) * self.bt
        seconds = self.profile.nixl_fixed_s + self.profile.nixl_per_token_s * tokens
        seq.transferred_tokens = tokens
        self.transfers.append((tokens, seconds))

        def arrive() -> None:
            seq.pulled_upto = there
            decode.submit(seq, self.clock.now)

        self._call_at(now + seconds, arrive)

    def _first_token(self, seq: Seq, now: float) -> None:
        state = seq.router_state
        self.loads[state.endpoint].prefill_ended(state.lane, now, True)
        if isinstance(state, PrefillLeg):
            return
        for autoscaler in self.autoscalers:
            autoscaler.first_token(now, now - seq.request.arrival_s)

    def _finished(self, seq: Seq, now: float) -> None:
        state = seq.router_state
        load = self.loads[state.endpoint]
        if seq.first_token_s < 0:  # refused before a first token
            load.prefill_ended(state.lane, now, False)
        load.end(state.weight)
        if self.draining:
            self._stop_if_idle(state.endpoint, now)
        if isinstance(state, PrefillLeg):
            state.decode.remote_cached = max(0, seq.cached_tokens)
            self._transfer(state.decode, state.endpoint, now)
            return
        self._left -= 1
        for autoscaler in self.autoscalers:
            autoscaler.finished(now, seq)
        if state.ticket is not None:
            served = seq.first_token_s >= 0
            work = seq.request.input_tokens - seq.cached_tokens + seq.request.output_tokens if served else 0
            state.ticket.finish(float(work), seq.request.output_tokens if served else None)


def simulate(requests: list[TraceRequest], engines: int, profile: Profile, mode: str, **kw) -> Result:
    return Simulation(requests, engines, profile, mode, **kw).run()
