"""Router replicas trade their own load per endpoint through Redis, so each one's load guard counts the others'
requests too (real Redis; the routers are in-process Router objects, not servers)."""

from __future__ import annotations

import asyncio
import time

from django.conf import settings

from routing.contracts import MAX_AGE_S, REPLICA_LOAD_KEY, others_load
from routing.info import DeploymentInfo, EndpointInfo, PolicyInfo
from routing.scheduling.load import EndpointLoad, LoadTrade
from routing.scheduling.pipeline import Candidate
from routing.scheduling.steps import load_guard
from routing.server.app import Router
from routing.server.redis_pool import router_redis
from routing.snapshot import Snapshot


def snapshot() -> Snapshot:
    endpoints = (
        EndpointInfo(901, "e0", "http://e0", "both", 1),
        EndpointInfo(902, "e1", "http://e1", "both", 1),
    )
    deployment = DeploymentInfo(1, "tiny", "tiny", 4096, 128, PolicyInfo(), endpoints, 0)
    return Snapshot(deployments={"tiny": deployment})


def replica() -> Router:
    """One router replica's state on the real Redis, with a two-endpoint snapshot (no server around it)."""
    router = Router()
    router.redis = router_redis(settings.REDIS_URL, 4)
    router.trade_loads = LoadTrade(router.redis)
    router.snapshot = snapshot()
    return router


def test_each_replica_sees_the_load_the_other_sends_to_an_endpoint():
    async def check():
        a, b = replica(), replica()
        try:
            busy = a.loads.setdefault(901, EndpointLoad())
            for _ in range(3):
                busy.begin(1.0)
            busy.prefill = 6000.0  # their prompts' uncached tokens, no first token yet
            await a._refresh_loads()  # publishes
            await b._refresh_loads()  # reads
            assert b.loads[901].others_active == 3 and b.loads[901].others >= 3.0
            assert b.loads[901].others_prefill == 6000.0
            assert b.loads[902].others == 0 and b.loads[902].others_active == 0
            assert a.loads[901].others == 0  # its own field is not counted twice
            for _ in range(3):
                busy.end(1.0)
            busy.prefill = 0.0
            busy._recent = 0.0
            await a._refresh_loads()  # an idle replica withdraws its field
            await b._refresh_loads()
            assert b.loads[901].others_active == 0 and b.loads[901].others == 0
            assert b.loads[901].others_prefill == 0
        finally:
            for router in (a, b):
                await router.redis.aclose()

    asyncio.run(check())


def test_stale_and_malformed_fields_do_not_count():
    now = time.time()
    published = {
        b"me": f"9 9 {now} 100".encode(),
        b"other": f"2.5 2 {now - 1} 4096".encode(),
        b"gone": f"7 7 {now - MAX_AGE_S - 1} 50".encode(),
        b"junk": b"not a load",
    }
    assert others_load(published, "me", now) == (2.5, 2, 4096.0, [b"gone", b"junk"])


def test_a_dead_replicas_field_is_deleted_by_the_next_replica_that_sees_it():
    async def check():
        a = replica()
        key = REPLICA_LOAD_KEY.format(901)
        try:
            await a.redis.delete(key)
            await a.redis.hset(key, "crashed", f"5 5 {time.time() - MAX_AGE_S - 1} 0")
            await a._refresh_loads()  # sees it, does not count it
            assert a.loads[901].others == 0
            await a._refresh_loads()  # deletes it
            assert await a.redis.hkeys(key) == []
        finally:
            await a.redis.delete(key)
            await a.redis.aclose()

    asyncio.run(check())


def test_replicas_trade_loads_more_often_than_they_poll_the_configuration():
    async def check():
        a, b = replica(), replica()
        for router in (a, b):
            router.poll_interval = 60.0  # no configuration poll during the test
            router.load_share_interval = 0.05
        tasks = [asyncio.create_task(r._refresh_forever()) for r in (a, b)]
        try:
            a.loads.setdefault(902, EndpointLoad()).begin(1.0)
            started = time.monotonic()
            while b.loads.get(902) is None or b.loads[902].others_active != 1:
                assert time.monotonic() - started < 2, "b never saw a's request"
                await asyncio.sleep(0.01)
            a.loads[902].end(1.0)
            a.loads[902]._recent = 0.0
            while b.loads[902].others_active != 0:
                assert time.monotonic() - started < 4, "b never saw a's request end"
                await asyncio.sleep(0.01)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for router in (a, b):
                await router.redis.aclose()

    asyncio.run(check())


def test_the_guard_drops_affinity_for_an_engine_other_replicas_keep_busy():
    endpoints = [EndpointInfo(i, f"e{i}", f"http://e{i}", "both", 1) for i in range(2)]
    holder, idle = Candidate(endpoints[0], EndpointLoad()), Candidate(endpoints[1], EndpointLoad())
    holder.scores = {"prefix": 1.0, "session": 1.0}
    load_guard([holder, idle], 1.3, now=time.monotonic())
    assert not holder.guarded  # this replica sent it nothing: no reason to move
    holder.load.others, holder.load.others_active = 6.0, 6
    load_guard([holder, idle], 1.3, now=time.monotonic())
    assert holder.guarded and holder.scores["prefix"] == 0.0
