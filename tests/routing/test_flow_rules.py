"""Flow control's rules without a server: when a deployment is saturated, who is served next, and how the other
replicas' shares are read (routing/scheduling/flow.py). The same rules on real processes: test_flow_control.py."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
import uvloop

from routing.contracts import others_queued, others_work
from routing.info import DeploymentInfo, EndpointInfo, KeyInfo, PolicyInfo
from routing.scheduling.flow import (
    CLASSES,
    DEFAULT_PREFILL_S_PER_TOKEN,
    Decayed,
    FlowControl,
    QueueTimeout,
    Waiter,
    affinity,
    saturated,
)
from routing.scheduling.load import EndpointLoad
from routing.scheduling.pipeline import Pipeline, RequestContext

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)


def deployment(engines: int = 2, **policy) -> DeploymentInfo:
    endpoints = tuple(
        EndpointInfo(i, f"e{i}", f"http://e{i}", "both", 1, max_num_seqs=4) for i in range(engines)
    )
    return DeploymentInfo(1, "d", "m", 4096, 16, PolicyInfo(**policy), endpoints, 0)


def key(tenant: int, team: int, *, tenant_weight: int = 1, team_weight: int = 1) -> KeyInfo:
    return KeyInfo(
        tenant * 100 + team,
        "ipk_x",
        team,
        tenant,
        frozenset(),
        None,
        tenant_weight=tenant_weight,
        team_weight=team_weight,
    )


def test_saturated_when_no_engine_can_start_another_request_without_queueing_it():
    d = deployment()
    loads = {0: EndpointLoad(active=4), 1: EndpointLoad(active=3)}
    assert saturated(d, loads, 0, 0.0) == ""  # one slot free
    assert saturated(d, loads, 1, 0.0) == "queues"  # ... taken by a request let through, not yet sent
    loads[1].others_active = 1  # or by another replica's request
    assert saturated(d, loads, 0, 0.0) == "queues"
    # Allowing a queue of two per engine: room again.
    assert saturated(deployment(saturation_waiting_per_engine=2.0), loads, 0, 0.0) == ""


def test_saturated_when_every_kv_cache_is_full_or_the_prefill_backlog_is_too_long():
    d = deployment(saturation_kv_utilization=0.9, saturation_prefill_tokens_per_engine=1000)
    loads = {0: EndpointLoad(kv_usage=0.95), 1: EndpointLoad(kv_usage=0.5)}
    assert saturated(d, loads, 0, 0.0) == ""  # one engine still has room in its cache
    loads[1].kv_usage = 0.91
    assert saturated(d, loads, 0, 0.0) == "kv_cache"
    loads = {0: EndpointLoad(prefill=1500.0), 1: EndpointLoad(others_prefill=600.0)}
    assert saturated(d, loads, 0, 0.0) == "prefill"


def test_under_flow_control_a_request_goes_only_to_an_engine_that_can_start_it():
    d = deployment(mode="round_robin")
    loads = {0: EndpointLoad(active=4), 1: EndpointLoad(active=2, others_active=1)}
    pipeline = Pipeline()
    # Without flow control the full engine takes its turn as the other does.
    picked = {pipeline.choose(d, RequestContext("m"), loads)[0].endpoint.id for _ in range(4)}
    assert picked == {0, 1}
    # Under it, only the engine with a free slot (counting the other replicas' requests) takes it...
    room = RequestContext("m", room_beyond=0.0)
    assert {pipeline.choose(d, room, loads)[0].endpoint.id for _ in range(4)} == {1}
    # ... or, allowing a queue of one per engine, either.
    queue = RequestContext("m", room_beyond=1.0)
    assert {pipeline.choose(d, queue, loads)[0].endpoint.id for _ in range(4)} == {0, 1}
    # When none can start it, none is ruled out (the others' counts may be stale).
    loads[1].others_active = 2
    assert {pipeline.choose(d, room, loads)[0].endpoint.id for _ in range(4)} == {0, 1}


def test_decayed_work_halves_over_the_window_times_ln_2():
    served = Decayed()
    served.add(100.0, 0.0, 10.0)
    assert abs(served.get(10.0 * 0.6931, 10.0) - 50.0) < 0.1
    served.add(-1000.0, 1.0, 10.0)
    assert served.get(1.0, 10.0) == 0.0  # never negative


def queue(flow, *waiters: tuple[KeyInfo, str]) -> None:
    loop = asyncio.new_event_loop()
    for index, (k, priority) in enumerate(waiters):
        flow.push(Waiter(k, priority, 10.0, float(index), loop.create_future()))


def order(flow) -> list[tuple[int, int, str]]:
    served = []
    while (where := flow.best(time.monotonic())) is not None:
        waiter = flow.pop(*where)
        flow.charge(waiter.key, waiter.work)
        served.append((waiter.key.tenant_id, waiter.key.team_id, waiter.priority))
    return served


def test_a_higher_class_always_leaves_first_then_the_tenant_furthest_behind():
    control = FlowControl({})
    flow = control.flow(deployment())
    a, b = key(1, 1), key(2, 2)
    flow.charge(a, 100.0)  # tenant 1 was served lately; tenant 2 not
    queue(flow, (a, "batch"), (a, "standard"), (b, "standard"), (a, "interactive"))
    assert order(flow) == [(1, 1, "interactive"), (2, 2, "standard"), (1, 1, "standard"), (1, 1, "batch")]
    assert flow.waiting == 0 and flow.queues == {}
    assert CLASSES == ("interactive", "standard", "batch")


def test_work_is_shared_by_weight_across_tenants_then_across_teams():
    control = FlowControl({})
    flow = control.flow(deployment())
    heavy, light = key(1, 1, tenant_weight=3), key(2, 2)
    queue(flow, *[(heavy, "standard")] * 40, *[(light, "standard")] * 40)
    first = order(flow)[:40]
    assert 29 <= sum(1 for tenant, _, _ in first if tenant == 1) <= 31  # 3:1 while both wait

    control = FlowControl({})
    flow = control.flow(deployment())
    team_a, team_b = key(1, 1, team_weight=1), key(1, 2, team_weight=1)
    other_tenant = key(2, 3)
    queue(
        flow, *[(team_a, "standard")] * 20, *[(team_b, "standard")] * 20, *[(other_tenant, "standard")] * 40
    )
    first = order(flow)[:40]
    teams = [team for _, team, _ in first]
    assert 19 <= teams.count(3) <= 21 and 9 <= teams.count(1) <= 11 and 9 <= teams.count(2) <= 11


def test_the_other_replicas_work_and_queues_are_read_back_when_fresh():
    now = time.time()
    published = {
        b"me": orjson.dumps({"at": now, "work": {"t1": 500.0}}),
        b"other": orjson.dumps({"at": now, "work": {"t1": 100.0, "m4": 40.0}}),
        b"dead": orjson.dumps({"at": now - 60, "work": {"t1": 1e6}}),
        b"junk": b"{",
    }
    work = others_work(published, "me", now, 60.0)
    assert set(work) == {"t1", "m4"} and abs(work["t1"] - 100.0) < 0.1
    queues = {
        b"me": orjson.dumps({"at": now, "queued": [["batch", 1, 3]]}),
        b"other": orjson.dumps(
            {"at": now, "saturated": True, "queued": [["standard", 2, 5], ["batch", 3, 0]]}
        ),
    }
    assert others_queued(queues, "me", now) == {("standard", 2)}


def test_a_replica_leaves_a_turn_to_a_tenant_further_behind_at_another_replica_for_a_moment():
    control = FlowControl({})
    flow = control.flow(deployment())
    a = key(1, 1)
    flow.charge(a, 1000.0)
    flow.others = {"t2": 10.0}
    flow.queued_elsewhere = {("standard", 2)}
    assert flow.served_elsewhere_first(time.monotonic(), "standard", 1, 10.0)
    assert not flow.served_elsewhere_first(time.monotonic(), "interactive", 1, 10.0)
    flow.queued_elsewhere = {("interactive", 2)}
    assert flow.served_elsewhere_first(time.monotonic(), "standard", 1, 10.0)


def test_a_waiter_past_its_class_limit_times_out_and_leaves_the_queue():
    async def run() -> None:
        control = FlowControl({0: EndpointLoad(active=4), 1: EndpointLoad(active=4)})
        d = deployment(max_wait_batch_s=0.2)
        try:
            await control.enter(d, key(1, 1), "batch", 10.0, 0.0)
        except QueueTimeout as exc:
            assert 0.15 < exc.waited < 1.0 and exc.retry_after >= 1
        else:
            raise AssertionError("it should have timed out")
        flow = control.flows[1]
        assert flow.waiting == 0 and flow.pending == 0

        # A cancelled wait (the client went away) leaves nothing behind either.
        task = asyncio.ensure_future(control.enter(d, key(1, 1), "standard", 10.0, 0.0))
        await asyncio.sleep(0.1)
        assert flow.waiting == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert flow.waiting == 0 and flow.pending == 0

        # Room again: the next request goes straight through, and its ticket gives the room back when done.
        control.loads[0].active = 0
        ticket = await control.enter(d, key(1, 1), "standard", 10.0, 0.0)
        assert ticket.queued_s == 0.0 and flow.pending == 1
        ticket.started()
        ticket.finish(25.0, 5)
        assert flow.pending == 0
        assert abs(flow.tenants[1].get(time.monotonic(), 60.0) - 25.0) < 0.1  # corrected to the work done

    asyncio.run(run())


@pytest.mark.parametrize("loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_a_request_that_ends_lets_the_next_waiter_through_at_once_not_at_the_next_poll(loop):
    async def turns(n: int = 3) -> None:
        for _ in range(n):
            await asyncio.sleep(0)

    async def run() -> None:
        control = FlowControl({0: EndpointLoad(active=3), 1: EndpointLoad(active=4)})
        d = deployment()
        flow = control.flow(d)
        ticket = await control.enter(d, key(1, 1), "standard", 10.0, 0.0)  # the last free slot
        ticket.started()
        control.loads[0].active = 4  # in flight there now
        waiter = asyncio.ensure_future(control.enter(d, key(2, 1), "standard", 10.0, 0.0))
        await turns()
        # Saturated: it waits, and the gate looks again every 50 ms for what changes without a local event.
        assert flow.waiting == 1 and flow._polling
        control.loads[0].active = 3  # the first request ends
        ticket.finish(20.0, 5)
        await turns()  # a few turns of the event loop, far less than the 50 ms poll
        assert waiter.done() and flow.waiting == 0
        assert (await waiter).queued_s < 0.05

        # One that joins the queue is looked at on the next turn too, whatever poll is pending.
        ticket = await waiter
        ticket.started()
        control.loads[0].active = 4
        blocked = asyncio.ensure_future(control.enter(d, key(2, 1), "standard", 10.0, 0.0))
        await turns()
        assert flow._polling
        control.loads[1].active = 3  # freed without a local event: the gate would see it at its next poll...
        joining = asyncio.ensure_future(control.enter(d, key(3, 1), "standard", 10.0, 0.0))
        await turns()  # ...but the request joining the queue makes it look now: the slot is taken (by the
        assert joining.done() and not blocked.done() and flow.waiting == 1  # tenant with no work yet)
        blocked.cancel()
        await asyncio.gather(blocked, return_exceptions=True)

    # The router runs on uvloop, whose timer handles are not asyncio's.
    with asyncio.Runner(loop_factory=loop) as runner:
        runner.run(run())


def test_a_waiter_whose_prompt_one_engine_holds_waits_for_a_slot_there_while_others_pass():
    d = deployment()  # two engines of 4 slots, 16-token blocks
    loads = {0: EndpointLoad(), 1: EndpointLoad()}
    # Held in one engine well beyond the other: worth waiting for, as long as computing the difference takes.
    bound = affinity(d, loads, {0: 100, 1: 10})
    assert bound is not None and bound.endpoint == 0
    assert abs(bound.patience_s - 90 * 16 * DEFAULT_PREFILL_S_PER_TOKEN) < 1e-9
    loads[1].prefill_s_per_token = 1e-4  # once learned, at the engines' speed
    assert abs(affinity(d, loads, {0: 100, 1: 10}).patience_s - 90 * 16 * 1e-4) < 1e-9
    # A difference shorter than AFFINITY_MIN_TOKENS, or nothing held, is no reason to wait.
    assert affinity(d, loads, {0: 12, 1: 0}) is None
    assert affinity(d, loads, {}) is None

    async def run() -> None:
        control = FlowControl({0: EndpointLoad(active=4), 1: EndpointLoad(active=4)})
        flow = control.flow(d)
        # B's prompt lives on engine 0; A's anywhere. B is further behind its share, so it comes first.
        control.loads[1].prefill_s_per_token = 1e-3  # patience of 1.6 s
        b = asyncio.ensure_future(control.enter(d, key(2, 1), "standard", 10.0, 0.0, {0: 100}))
        await asyncio.sleep(0.01)
        flow.charge(key(1, 1), 1000.0)
        a = asyncio.ensure_future(control.enter(d, key(1, 1), "standard", 10.0, 0.0, {}))
        await asyncio.sleep(0.01)
        assert flow.waiting == 2
        # Slots free on engine 1: B waits on for its engine; A, ahead of its share, may not take an engine's last
        # two slots (the spare ones, saturation_spare_slots_per_engine, 2 by default)...
        assert flow.ahead_of_share(time.monotonic(), 1) and not flow.ahead_of_share(time.monotonic(), 2)
        control.loads[1].active = 2
        control.wake(flow)
        await asyncio.sleep(0.02)
        assert not a.done() and not b.done()
        # ... but the one before them.
        control.loads[1].active = 1
        control.wake(flow)
        ticket_a = await asyncio.wait_for(a, 1.0)
        assert ticket_a.endpoint is None and ticket_a.ahead and not b.done()
        ticket_a.started()
        control.loads[1].active = 4
        # A slot frees on engine 0: reserved for B until its request is sent.
        control.loads[0].active = 3
        control.wake(flow)
        ticket_b = await asyncio.wait_for(b, 1.0)
        assert ticket_b.endpoint == 0 and not ticket_b.ahead and control.loads[0].reserved == 1
        assert control.room_at(flow, 0) == 0
        ticket_b.started()
        assert control.loads[0].reserved == 0

        # Past its patience, a waiter goes wherever a slot frees.
        control.loads[0].active = 4
        control.loads[1].prefill_s_per_token = 1e-5  # patience of 16 ms
        late = asyncio.ensure_future(control.enter(d, key(2, 1), "standard", 10.0, 0.0, {0: 100}))
        await asyncio.sleep(0.05)
        control.loads[1].active = 3
        control.wake(flow)
        assert (await asyncio.wait_for(late, 1.0)).endpoint is None

    asyncio.run(run())


def test_the_spare_slots_are_kept_only_for_an_active_tenant_behind_its_share():
    control = FlowControl({0: EndpointLoad(active=1), 1: EndpointLoad(active=1)})
    d = deployment()  # two engines of 4 slots; two spare slots each by default
    flow = control.flow(d)
    now = time.monotonic()
    a, b = key(1, 1), key(2, 1)
    flow.charge(a, 1000.0)
    flow.active_at[1] = now
    assert not flow.ahead_of_share(now, 1)  # alone, it is ahead of no one
    flow.charge(b, 10.0)
    flow.active_at[2] = now
    assert flow.ahead_of_share(now, 1) and not flow.ahead_of_share(now, 2)
    # A's requests see the engines full two slots early; B's see all four.
    assert control.room_at(flow, 0, ahead=True) == 1 and control.room_at(flow, 0) == 3
    assert saturated(d, control.loads, 2, now, spare=2.0) == "queues"
    assert saturated(d, control.loads, 2, now) == ""
    # At most half an engine's slots are kept spare, however many the policy asks for.
    assert (
        control.room_at(control.flow(deployment(saturation_spare_slots_per_engine=8.0)), 0, ahead=True) == 1
    )
    # Once B has gone quiet, A may have everything again.
    flow.active_at[2] = now - 60.0
    assert not flow.ahead_of_share(now, 1)
