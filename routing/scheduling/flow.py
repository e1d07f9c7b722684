"""Flow control: while a deployment is saturated, new requests wait here, in the router, instead of in the
engines' queues, and leave in order of priority class, then of weighted fair share across tenants, then across
the teams of a tenant. See docs/flow-control.md.

- Saturated: the deployment's engines cannot start another request without one of them queueing more than
  `saturation_waiting_per_engine` requests beyond its `max_num_seqs` (counted from the requests in flight there,
  this replica's and the other replicas' as traded every ROUTER_LOAD_SHARE_SECONDS, plus the requests let through
  and not yet sent); or every engine's KV cache is `saturation_kv_utilization` full (scraped); or the uncached
  prompt tokens awaiting a first token exceed `saturation_prefill_tokens_per_engine` per engine.
- Share is counted in tokens of work, prompt tokens not cached plus output tokens: estimated when a request is
  let through, corrected when it ends. Each tenant's (and team's) work decays with time constant
  ROUTER_FAIR_SHARE_WINDOW_S, so a tenant is served by what it received lately, not since the router started.
  The next request is the oldest of the team furthest behind (work over weight) in the tenant furthest behind, in
  the highest class waiting.
- Across replicas: each replica publishes its decayed work per tenant and team to Redis with its loads, and orders
  its queue by the sum of all replicas' figures. The gate is shared through the traded loads; which replica fills
  a freed slot is a race, so the shares hold approximately (docs/flow-control.md measures the drift).
- A request that waits past its class's limit is refused (429, `Retry-After`); one whose client disconnects leaves
  the queue and nothing is billed (routing/server/exchange.py).
- Spare slots: while saturated, a tenant ahead of its fair share (more work lately, over its weight, than the
  mean of the active tenants) may not take an engine's last `saturation_spare_slots_per_engine` slots.
  They are kept for the tenants behind theirs, so an interactive agent's next turn finds a slot instead of waiting
  for one of the flood's requests to end. A lone tenant is never ahead of the mean, so it may use them all.
- Where a waiter goes: one whose prompt an engine holds well beyond what the others hold (`Affinity`) waits for a
  slot on that engine, while waiters behind it take slots elsewhere, for as long as recomputing that extra prefix
  elsewhere would take; the slot it gets is reserved for it (EndpointLoad.reserved) until it is sent. Any other
  waiter goes where the routing pipeline sends it, among the engines with a free slot (filters.with_room).

Over 400 lines: the gate, the order and the sharing across replicas read one another's state (what waits, what was
let through, each tenant's work), and stay together.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from routing.contracts import QUEUE_KEY, SERVED_KEY, TTL_S, others_queued, others_work
from routing.info import DECODE_ROLES, DeploymentInfo, KeyInfo
from routing.scheduling.filters import slot_limit
from routing.scheduling.load import EndpointLoad
from routing.server import metrics

CLASSES = ("interactive", "standard", "batch")  # dispatch order (tenants.models.PRIORITY_RANK)
# How long a replica leaves a free turn to a waiter at another replica that comes first (two trades of loads).
HOLD_S = 0.2
# Output tokens expected of a request before the deployment has finished any (then the running mean).
DEFAULT_OUTPUT_ESTIMATE = 256.0
# Seconds per prompt token an engine prefills, until the router has learned it (EndpointLoad.prefill_s_per_token).
DEFAULT_PREFILL_S_PER_TOKEN = 5e-5
# A tenant let through a request this recently is active (an agent thinking between turns still is): the spare
# slots are kept for it while it is behind its share.
ACTIVE_S = 10.0
# A prefix held in one engine only is worth waiting for when it is at least this long, and for at most this long.
AFFINITY_MIN_TOKENS = 512
AFFINITY_MAX_WAIT_S = 5.0


class QueueTimeout(Exception):
    """The request waited past its class's limit."""

    def __init__(self, waited: float, retry_after: int):
        super().__init__(f"waited {waited:.1f} s")
        self.waited, self.retry_after = waited, retry_after


def max_wait(deployment: DeploymentInfo, priority: str) -> float:
    return float(getattr(deployment.policy, f"max_wait_{priority}_s", 60.0))


@dataclass(slots=True)
class Decayed:
    """A sum that decays exponentially with time constant `tau`."""

    value: float = 0.0
    at: float = 0.0

    def get(self, now: float, tau: float) -> float:
        if not self.value:
            return 0.0
        return self.value * math.exp(-(now - self.at) / tau)

    def add(self, amount: float, now: float, tau: float) -> None:
        self.value = max(0.0, self.get(now, tau) + amount)
        self.at = now


@dataclass(frozen=True, slots=True)
class Affinity:
    """The engine holding a request's prompt beyond the others, and how long a wait for it is worth."""

    endpoint: int
    patience_s: float


def affinity(
    deployment: DeploymentInfo, loads: dict[int, EndpointLoad], held: dict[int, int]
) -> Affinity | None:
    """Where a request should wait for a slot (`held`: the leading blocks of its prompt each engine holds): the
    decode engine holding the most of it, if that is AFFINITY_MIN_TOKENS beyond the next one. It is worth waiting
    for as long as computing that difference would take elsewhere, at the engines' learned prefill speed (capped
    at AFFINITY_MAX_WAIT_S). None: anywhere will do."""
    engines = [e.id for e in deployment.endpoints if e.role in DECODE_ROLES]
    if len(engines) < 2 or not held:
        return None
    ranked = sorted(engines, key=lambda e: held.get(e, 0), reverse=True)
    extra = (held.get(ranked[0], 0) - held.get(ranked[1], 0)) * deployment.block_size
    if extra < AFFINITY_MIN_TOKENS:
        return None
    speeds = [
        load.prefill_s_per_token for e in engines if (load := loads.get(e)) and load.prefill_s_per_token
    ]
    per_token = max(speeds) if speeds else DEFAULT_PREFILL_S_PER_TOKEN
    return Affinity(ranked[0], min(AFFINITY_MAX_WAIT_S, extra * per_token))


@dataclass(eq=False, slots=True)
class Waiter:
    key: KeyInfo
    priority: str
    work: float
    arrived: float
    future: asyncio.Future  # its result: the engine reserved for it, or None
    affinity: Affinity | None = None

    def bound_to(self, now: float) -> int | None:
        """The engine it still waits for (its affinity, while that is worth waiting for)."""
        if self.affinity is not None and now - self.arrived < self.affinity.patience_s:
            return self.affinity.endpoint
        return None


@dataclass(eq=False)
class Ticket:
    """A request let through the gate: its share of work, charged when let through, corrected when it ends."""

    flow: DeploymentFlow
    key: KeyInfo
    priority: str
    charged: float
    queued_s: float
    endpoint: int | None = None  # the engine whose slot the gate reserved for it
    ahead: bool = False  # its tenant was ahead of its share: the spare slots are not for it
    pending: bool = True  # let through, not yet counted in an engine's load
    done: bool = False

    def started(self) -> None:
        """Its request now counts in an engine's load (EndpointLoad.begin)."""
        if self.pending:
            self.pending = False
            self.flow.pending -= 1
            self.flow.control.unreserve(self.endpoint)

    def finish(self, work: float, output_tokens: int | None = None) -> None:
        """It ended having cost `work` tokens of work (0 if it never reached an engine)."""
        if self.done:
            return
        self.done = True
        self.started()
        self.flow.charge(self.key, work - self.charged)
        if output_tokens is not None:
            self.flow.learn_output(output_tokens)
        self.flow.control.wake(self.flow)


@dataclass(eq=False)
class DeploymentFlow:
    """One deployment's queue and shares on this replica."""

    control: FlowControl
    deployment: DeploymentInfo
    # class -> tenant id -> team id -> waiters, oldest first
    queues: dict[str, dict[int, dict[int, deque[Waiter]]]] = field(default_factory=dict)
    waiting: int = 0
    pending: int = 0  # let through, not yet in an engine's load
    tenants: dict[int, Decayed] = field(default_factory=dict)  # work served, this replica
    teams: dict[int, Decayed] = field(default_factory=dict)
    weights: dict[int, int] = field(default_factory=dict)  # tenant or team id (teams negated) -> weight
    others: dict[str, float] = field(default_factory=dict)  # "t<id>"/"m<id>" -> the other replicas' work
    # (class, tenant id) waiting at other replicas, from their published queues
    queued_elsewhere: set[tuple[str, int]] = field(default_factory=set)
    # Since when this replica has held back a turn for a waiter of another replica that comes first (HOLD_S).
    holding_since: float | None = None
    output_mean: float = DEFAULT_OUTPUT_ESTIMATE
    saturated_since: float | None = None
    active_at: dict[int, float] = field(default_factory=dict)  # tenant id -> when last let through here
    _wakeup: asyncio.Handle | None = None
    _polling: bool = False  # _wakeup is the poll (call_later), not a look on the next turn of the event loop

    # --- shares ---
    def charge(self, key: KeyInfo, work: float) -> None:
        now, tau = self.control.clock(), self.control.window_s
        self.tenants.setdefault(key.tenant_id, Decayed()).add(work, now, tau)
        self.teams.setdefault(key.team_id, Decayed()).add(work, now, tau)

    def learn_output(self, tokens: int) -> None:
        self.output_mean += (tokens - self.output_mean) / 20

    def behind(self, now: float, tenant_id: int) -> float:
        """A tenant's work lately (all replicas') over its weight: the smallest is served first."""
        served = self.tenants.get(tenant_id)
        mine = served.get(now, self.control.window_s) if served else 0.0
        return (mine + self.others.get(f"t{tenant_id}", 0.0)) / self.weights.get(tenant_id, 1)

    def ahead_of_share(self, now: float, tenant_id: int) -> bool:
        """Whether the tenant has had more work lately, over its weight, than the mean of the active tenants
        (let through here in the last ACTIVE_S, or waiting at any replica): such a tenant may not take the spare
        slots. A tenant alone, or once the others have gone quiet, is ahead of no one."""
        tenants = {t for t, at in self.active_at.items() if now - at < ACTIVE_S}
        tenants.update(t for teams in self.queues.values() for t in teams)
        tenants.update(t for _, t in self.queued_elsewhere)
        tenants.add(tenant_id)
        if len(tenants) < 2:
            return False
        shares = [self.behind(now, t) for t in tenants]
        return self.behind(now, tenant_id) > sum(shares) / len(shares)

    def team_behind(self, now: float, team_id: int) -> float:
        served = self.teams.get(team_id)
        mine = served.get(now, self.control.window_s) if served else 0.0
        return (mine + self.others.get(f"m{team_id}", 0.0)) / self.weights.get(-team_id, 1)

    def published(self, now: float) -> dict[str, float]:
        tau = self.control.window_s
        out = {f"t{t}": round(d.get(now, tau), 1) for t, d in self.tenants.items()}
        out.update({f"m{t}": round(d.get(now, tau), 1) for t, d in self.teams.items()})
        return {k: v for k, v in out.items() if v >= 1.0}

    # --- the queue ---
    def push(self, waiter: Waiter) -> None:
        key = waiter.key
        self.weights[key.tenant_id] = key.tenant_weight
        self.weights[-key.team_id] = key.team_weight
        tenants = self.queues.setdefault(waiter.priority, {})
        tenants.setdefault(key.tenant_id, {}).setdefault(key.team_id, deque()).append(waiter)
        self.waiting += 1
        metrics.of(
            metrics.flow_queued, self.deployment.served_model_name, waiter.priority, str(key.tenant_id)
        ).inc()

    def remove(self, waiter: Waiter) -> bool:
        """Take a waiter out (it gave up or timed out); False if it was already let through."""
        key = waiter.key
        teams = self.queues.get(waiter.priority, {}).get(key.tenant_id, {})
        line = teams.get(key.team_id)
        if line is None or waiter not in line:
            return False
        line.remove(waiter)
        self._forget(waiter, teams, line)
        return True

    def _forget(self, waiter: Waiter, teams: dict, line: deque) -> None:
        key = waiter.key
        if not line:
            del teams[key.team_id]
            if not teams:
                tenants = self.queues[waiter.priority]
                del tenants[key.tenant_id]
                if not tenants:
                    del self.queues[waiter.priority]
        self.waiting -= 1
        metrics.of(
            metrics.flow_queued, self.deployment.served_model_name, waiter.priority, str(key.tenant_id)
        ).dec()

    def best(
        self, now: float, blocked: set[tuple[str, int, int]] = frozenset()
    ) -> tuple[str, int, int] | None:
        """Where the next waiter is: the highest class waiting; in it, the tenant furthest behind its share,
        then its team furthest behind. None when nothing waits. `blocked`: lines passed over this time (their
        oldest waits for a slot on a full engine)."""
        for priority in CLASSES:
            tenants = self.queues.get(priority)
            if not tenants:
                continue
            open_teams = {
                tenant_id: [t for t in teams if (priority, tenant_id, t) not in blocked]
                for tenant_id, teams in tenants.items()
            }
            open_tenants = [t for t, teams in open_teams.items() if teams]
            if not open_tenants:
                continue
            tenant_id = min(open_tenants, key=lambda t: (self.behind(now, t), _oldest(tenants[t])))
            teams = tenants[tenant_id]
            team_id = min(
                open_teams[tenant_id], key=lambda t: (self.team_behind(now, t), teams[t][0].arrived)
            )
            return priority, tenant_id, team_id
        return None

    def pop(self, priority: str, tenant_id: int, team_id: int) -> Waiter:
        """That team's oldest waiter, out of the queue."""
        teams = self.queues[priority][tenant_id]
        line = teams[team_id]
        waiter = line.popleft()
        self._forget(waiter, teams, line)
        return waiter

    def served_elsewhere_first(self, now: float, priority: str, tenant_id: int, work: float) -> bool:
        """Whether another replica has a waiter that comes before this one across the fleet: a higher class, or a
        tenant further behind its share by more than this request's work."""
        rank = CLASSES.index(priority)
        mine = self.behind(now, tenant_id)
        for other_priority, other_tenant in self.queued_elsewhere:
            other_rank = CLASSES.index(other_priority) if other_priority in CLASSES else len(CLASSES)
            if other_rank < rank:
                return True
            if other_rank == rank and other_tenant != tenant_id:
                weight = self.weights.get(other_tenant, 1)
                if self.behind(now, other_tenant) + work / weight < mine:
                    return True
        return False

    def queued_by(self) -> list[list]:
        """[[class, tenant id, count], ...]: what waits here now (for the portal's live page)."""
        return [
            [priority, tenant_id, sum(len(line) for line in teams.values())]
            for priority, tenants in self.queues.items()
            for tenant_id, teams in tenants.items()
        ]


def _oldest(teams: dict[int, deque[Waiter]]) -> float:
    return min(line[0].arrived for line in teams.values())


def saturated(
    deployment: DeploymentInfo,
    loads: dict[int, EndpointLoad],
    pending: int,
    now: float,
    spare: float = 0.0,
) -> str:
    """Why the deployment cannot take another request without queueing it in an engine ("" if it can), not
    counting `spare` slots of each engine (the spare slots, for a tenant ahead of its share)."""
    policy = deployment.policy
    engines = [e for e in deployment.endpoints if e.role in DECODE_ROLES]
    if not engines:
        return ""  # nothing to queue for: the exchange answers 503
    queue = policy.saturation_waiting_per_engine
    room, kv_full, backlog = -pending, True, 0.0
    for endpoint in engines:
        load = loads.get(endpoint.id)
        if load is None:
            room += slot_limit(endpoint.max_num_seqs, queue, spare)
            kv_full = False
            continue
        in_flight = load.active + load.others_active
        room += max(0.0, slot_limit(endpoint.max_num_seqs, queue, spare) - in_flight)
        kv_full = kv_full and load.kv_usage >= policy.saturation_kv_utilization
    for endpoint in deployment.endpoints:
        load = loads.get(endpoint.id)
        if load is not None:
            backlog += load.prefill_left(now) + load.others_prefill
    if room < 1:
        return "queues"
    if kv_full:
        return "kv_cache"
    if backlog > policy.saturation_prefill_tokens_per_engine * len(deployment.endpoints):
        return "prefill"
    return ""


class FlowControl:
    """Every deployment's gate and queue on this router replica."""

    def __init__(
        self,
        loads: dict[int, EndpointLoad],
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`clock`: what every share, wait and turn is timed by (planner/ gives a virtual one)."""
        self.loads = loads
        self.window_s = window_s
        self.clock = clock
        self.flows: dict[int, DeploymentFlow] = {}

    def flow(self, deployment: DeploymentInfo) -> DeploymentFlow:
        flow = self.flows.get(deployment.id)
        if flow is None:
            flow = self.flows[deployment.id] = DeploymentFlow(self, deployment)
            metrics.of(metrics.flow_saturated, deployment.served_model_name).set(0)
        else:
            flow.deployment = deployment  # the latest snapshot's endpoints and policy
        return flow

    def estimate(self, flow: DeploymentFlow, uncached_prompt: float, output_bound: int) -> float:
        """The work a request is expected to cost: its uncached prompt and the output the deployment's requests
        have been producing (at most its bound)."""
        return max(0.0, uncached_prompt) + min(float(output_bound), flow.output_mean)

    def arrive(
        self,
        deployment: DeploymentInfo,
        key: KeyInfo,
        priority: str,
        work: float,
        held: dict[int, int] | None,
        new_future: Callable[[], asyncio.Future],
    ) -> Ticket | Waiter:
        """A request's turn, decided as it arrives: its Ticket when it goes at once, else its Waiter, queued, whose
        future (`new_future()`, made only then) gets (engine, ahead) when `pump` lets it through. `held`: the leading
        blocks of its prompt each engine holds, for where it should wait (affinity)."""
        flow = self.flow(deployment)
        now = self.clock()
        if not deployment.policy.flow_control:
            self._let_through(flow, key, priority, work)
            return Ticket(flow, key, priority, work, 0.0)
        if not flow.waiting and not self._saturated(flow, now):
            # Room, and nobody waiting: it goes, unless only spare slots are left and its tenant is ahead of its
            # share (the share is looked at only then: this is every request's path).
            spare = deployment.policy.saturation_spare_slots_per_engine
            tight = bool(spare) and bool(saturated(deployment, self.loads, flow.pending, now, spare))
            if not (tight and flow.ahead_of_share(now, key.tenant_id)):
                self._let_through(flow, key, priority, work)
                return Ticket(flow, key, priority, work, 0.0)
        waiter = Waiter(key, priority, work, now, new_future(), affinity(deployment, self.loads, held or {}))
        flow.push(waiter)
        # Its turn may be now (a spare slot it may take, a slot on its engine): look at once, not at the next poll.
        self.wake(flow)
        return waiter

    async def enter(
        self,
        deployment: DeploymentInfo,
        key: KeyInfo,
        priority: str,
        work: float,
        started: float,
        held: dict[int, int] | None = None,
    ) -> Ticket:
        """Wait for the request's turn (`arrive`); returns its ticket. Raises QueueTimeout past the class's limit;
        a cancellation (the client went away) takes it out of the queue."""
        turn = self.arrive(deployment, key, priority, work, held, asyncio.get_running_loop().create_future)
        if isinstance(turn, Ticket):
            return turn
        waiter, flow, model = turn, self.flow(deployment), deployment.served_model_name
        limit = max_wait(deployment, priority)
        try:
            async with asyncio.timeout(limit):
                await waiter.future
        except TimeoutError:
            if flow.remove(waiter):
                waited = self.clock() - waiter.arrived
                metrics.of(metrics.flow_rejected, model, priority, str(key.tenant_id)).inc()
                metrics.of(metrics.flow_wait, model, priority).observe(waited)
                raise QueueTimeout(waited, max(1, math.ceil(min(limit, 30.0) / 4))) from None
            # let through as the timer fired: take the turn
        except BaseException:
            if not flow.remove(waiter) and waiter.future.done() and not waiter.future.cancelled():
                # Let through but gone: give its turn (and the slot reserved for it) back.
                flow.pending -= 1
                self.unreserve(waiter.future.result()[0])
                flow.charge(key, -work)
                self.wake(flow)
            raise
        waited = self.clock() - waiter.arrived
        metrics.of(metrics.flow_wait, model, priority).observe(waited)
        endpoint, ahead = waiter.future.result()
        return Ticket(flow, key, priority, work, waited, endpoint, ahead)

    def _let_through(self, flow: DeploymentFlow, key: KeyInfo, priority: str, work: float) -> None:
        """Count a request let through: pending until sent, its tenant active, its estimated work charged."""
        flow.pending += 1
        flow.active_at[key.tenant_id] = self.clock()
        flow.weights[key.tenant_id] = key.tenant_weight
        flow.weights[-key.team_id] = key.team_weight
        flow.charge(key, work)
        metrics.of(
            metrics.flow_dispatched, flow.deployment.served_model_name, priority, str(key.tenant_id)
        ).inc()

    def room_at(self, flow: DeploymentFlow, endpoint_id: int, ahead: bool = False) -> float:
        """Slots free on that engine: its max_num_seqs plus the queue the policy allows (less the spare slots,
        for a tenant `ahead` of its share), less the requests in flight there (every replica's) and those the gate
        reserved it for."""
        endpoint = next((e for e in flow.deployment.endpoints if e.id == endpoint_id), None)
        if endpoint is None:
            return 0.0
        load = self.loads.get(endpoint_id)
        taken = load.active + load.others_active + load.reserved if load is not None else 0
        policy = flow.deployment.policy
        spare = policy.saturation_spare_slots_per_engine if ahead else 0.0
        return slot_limit(endpoint.max_num_seqs, policy.saturation_waiting_per_engine, spare) - taken

    def unreserve(self, endpoint_id: int | None) -> None:
        load = self.loads.get(endpoint_id) if endpoint_id is not None else None
        if load is not None and load.reserved > 0:
            load.reserved -= 1

    def _saturated(self, flow: DeploymentFlow, now: float, ahead: bool = False) -> bool:
        """Whether it is saturated (for a tenant `ahead` of its share: counting the spare slots as taken)."""
        if ahead:
            spare = flow.deployment.policy.saturation_spare_slots_per_engine
            return bool(spare and saturated(flow.deployment, self.loads, flow.pending, now, spare)) or (
                self._saturated(flow, now)
            )
        reason = saturated(flow.deployment, self.loads, flow.pending, now)
        was = flow.saturated_since is not None
        if bool(reason) != was:  # the gauge is set on a change only: this runs for every request
            flow.saturated_since = now if reason else None
            metrics.of(metrics.flow_saturated, flow.deployment.served_model_name).set(1 if reason else 0)
        return bool(reason)

    def pump(self, flow: DeploymentFlow) -> None:
        """Let waiters through while the deployment has room. A turn that a waiter at another replica should
        have (a higher class, or a tenant further behind) is left to it for up to HOLD_S, time for that replica
        to see the room at its next trade of loads; past that this replica takes it, so no engine idles long."""
        flow._wakeup = None
        now = self.clock()
        blocked: set[tuple[str, int, int]] = set()
        while flow.waiting and not self._saturated(flow, now):
            where = flow.best(now, blocked)
            if where is None:
                break
            priority, tenant_id, team_id = where
            head = flow.queues[priority][tenant_id][team_id][0]
            if flow.queued_elsewhere and flow.served_elsewhere_first(now, priority, tenant_id, head.work):
                if flow.holding_since is None:
                    flow.holding_since = now
                if now - flow.holding_since < HOLD_S:
                    break
            flow.holding_since = None
            ahead = flow.ahead_of_share(now, tenant_id)
            endpoint = head.bound_to(now)
            if endpoint is not None:
                full = self.room_at(flow, endpoint, ahead) < 1
            else:
                full = ahead and self._saturated(flow, now, ahead)
            if full:
                # It waits for its engine, or for a slot that is not spare; the lines behind it may go.
                blocked.add(where)
                continue
            waiter = flow.pop(priority, tenant_id, team_id)
            if waiter.future.done():  # cancelled meanwhile
                continue
            self._let_through(flow, waiter.key, waiter.priority, waiter.work)
            if endpoint is not None:
                self.loads.setdefault(endpoint, EndpointLoad()).reserved += 1
            waiter.future.set_result((endpoint, ahead))
        if flow.waiting:
            self._arm(flow)

    def wake(self, flow: DeploymentFlow) -> None:
        """A request ended, one joined the queue or the loads changed: let waiters through on the next turn of
        the event loop, not at the next poll (a pending poll is cut short)."""
        if not flow.waiting or (flow._wakeup is not None and not flow._polling):
            return  # nobody to let through, or a look is already due on the next turn
        if flow._wakeup is not None:
            flow._wakeup.cancel()
        flow._wakeup, flow._polling = asyncio.get_running_loop().call_soon(self.pump, flow), False

    def _arm(self, flow: DeploymentFlow) -> None:
        # Loads of other replicas and the engines' KV use change without a local event: look again shortly.
        if flow._wakeup is None:
            flow._wakeup, flow._polling = asyncio.get_running_loop().call_later(0.05, self.pump, flow), True

    def wake_all(self) -> None:
        for flow in self.flows.values():
            self.wake(flow)

    # --- sharing across replicas ---
    async def share(self, redis, replica_id: str) -> None:
        """Publish this replica's work per tenant and team and its queue; read the other replicas' work."""
        busy = [f for f in self.flows.values() if f.tenants or f.waiting]
        if not busy:
            return
        now, wall = self.clock(), time.time()
        # Where each flow's reads (the others' work, their queues) are among the replies.
        reads: list[tuple[int, int]] = []
        async with redis.pipeline(transaction=False) as pipe:
            for flow in busy:
                served = flow.published(now)
                key = SERVED_KEY.format(flow.deployment.id)
                if served:
                    pipe.hset(key, replica_id, orjson.dumps({"at": wall, "work": served}))
                else:
                    pipe.hdel(key, replica_id)
                pipe.expire(key, TTL_S)
                work_read = len(pipe)
                pipe.hgetall(key)
                queue_key = QUEUE_KEY.format(flow.deployment.id)
                if flow.waiting or flow.saturated_since is not None:
                    state = {
                        "at": wall,
                        "saturated": flow.saturated_since is not None,
                        "queued": flow.queued_by(),
                    }
                    pipe.hset(queue_key, replica_id, orjson.dumps(state))
                    pipe.expire(queue_key, TTL_S)
                else:
                    pipe.hdel(queue_key, replica_id)
                reads.append((work_read, len(pipe)))
                pipe.hgetall(queue_key)
            replies = await pipe.execute()
        for flow, (work_read, queue_read) in zip(busy, reads, strict=True):
            published, queues = replies[work_read], replies[queue_read]
            flow.others = others_work(published, replica_id, wall, self.window_s)
            flow.queued_elsewhere = others_queued(queues, replica_id, wall)
            self.wake(flow)
