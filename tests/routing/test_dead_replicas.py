"""A replica that dies with requests admitted, and a Redis that loses its data: against the suite's Redis, with
the real admission scripts and the finisher's background work.

- A request admitted under a quota whose replica never settles it is settled by a live replica once its lease
  has run out: its reservation given back, a usage event (failed, no tokens) appended, once; a settlement of it
  that arrives later (from a journal) is not applied on top.
- When Redis comes back empty, each replica appends again the usage events Redis took from it lately.
- A budget counter Redis lost is raised back to the ledger.

bench/faults.py injects the same faults into a running platform (tests/bench/test_faults.py)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from types import SimpleNamespace

import redis
import redis.asyncio as aioredis

from routing.contracts import USAGE_EPOCH_KEY, quota_counters
from routing.metering import admission as admission_module
from routing.metering.admission import Admission
from routing.metering.finisher import Finisher
from tenants.limits import LIMITS
from tenants.usage_stream import FIELD, UsageEvent

TEAM = 880_101
QUOTA = SimpleNamespace(
    **{
        **{limit.field: None for limit in LIMITS},
        "max_concurrent_requests": 10,
        "token_budget": 1_000_000,
    },
    budget_period="day",
)


def event(request_id: str, output: int = 0) -> UsageEvent:
    return UsageEvent(
        request_id=request_id,
        tenant_id=1,
        team_id=TEAM,
        api_key_id=1,
        deployment_id=None,
        model="tiny",
        endpoint="",
        prompt_tokens=0,
        cached_prompt_tokens=0,
        output_tokens=output,
        ttft_ms=None,
        latency_ms=None,
        status="failed",
        created_at=datetime.now(UTC),
    )


def stream_events(client: redis.Redis, stream: str) -> list[dict]:
    return [json.loads(fields[FIELD.encode()]) for _, fields in client.xrange(stream)]


def test_a_request_whose_replica_died_is_settled_and_billed_once_by_a_live_replica(monkeypatch, settings):
    settings.USAGE_STREAM = "usage:test-dead-replica"
    monkeypatch.setattr(admission_module, "REAP_GRACE_S", 0.0)
    sync = redis.Redis.from_url(settings.REDIS_URL)
    sync.delete(settings.USAGE_STREAM, admission_module.LEASES_KEY)

    async def scenario():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        dead, live = Admission(client, lease_s=0.2), Admission(client, lease_s=0.2)
        try:
            admitted = await dead.admit(
                request_id="orphan-1",
                scopes=[("team", TEAM, QUOTA)],
                input_reserve=5_000,
                output_reserve=1_000,
                spend_reserve=0,
                orphan_event=event("orphan-1").encode(),
            )
            assert admitted.admitted
            held = quota_counters(sync, kind="team", ident=TEAM, quota=QUOTA)
            assert held["token_budget"] == 6_000 and held["max_concurrent_requests"] == 1
            # The lease has not run out: nothing to reap.
            assert await live.reap_orphans() == 0
            await asyncio.sleep(0.3)
            reaped = [await live.reap_orphans(), await live.reap_orphans()]
            # A settlement of it replayed later from a journal changes nothing.
            await client.script_load(admission_module.SETTLE)
            args = Admission.settlement_args(admitted.reservation, -1_000, -500, 0)
            async with client.pipeline(transaction=False) as pipe:
                await dead.settle_replayed_in(pipe, admitted.reservation.keys, args)
                late = await pipe.execute()
            return reaped, late
        finally:
            await client.aclose()

    try:
        reaped, late = asyncio.run(scenario())
        assert reaped == [1, 0] and late == [0]
        after = quota_counters(sync, kind="team", ident=TEAM, quota=QUOTA)
        assert after["token_budget"] == 0 and after["max_concurrent_requests"] == 0
        billed = stream_events(sync, settings.USAGE_STREAM)
        assert [(e["request_id"], e["status"], e["prompt_tokens"]) for e in billed] == [
            ("orphan-1", "failed", 0)
        ]
    finally:
        sync.delete(settings.USAGE_STREAM, *sync.keys(f"q:team:{TEAM}:*"), *sync.keys("q:*orphan-1"))
        sync.close()


def test_a_request_settled_by_its_replica_is_never_reaped(monkeypatch, settings):
    settings.USAGE_STREAM = "usage:test-dead-replica-settled"
    monkeypatch.setattr(admission_module, "REAP_GRACE_S", 0.0)
    sync = redis.Redis.from_url(settings.REDIS_URL)

    async def scenario():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        admission = Admission(client, lease_s=0.1)
        try:
            admitted = await admission.admit(
                request_id="settled-1",
                scopes=[("team", TEAM, QUOTA)],
                input_reserve=5_000,
                output_reserve=1_000,
                spend_reserve=0,
                orphan_event=event("settled-1").encode(),
            )
            await client.script_load(admission_module.SETTLE)
            async with client.pipeline(transaction=False) as pipe:
                admission.settle_in(pipe, admitted.reservation, -4_000, -900, 0)
                await pipe.execute()
            await asyncio.sleep(0.2)
            return await admission.reap_orphans()
        finally:
            await client.aclose()

    try:
        assert asyncio.run(scenario()) == 0
        assert quota_counters(sync, kind="team", ident=TEAM, quota=QUOTA)["token_budget"] == 1_100
        assert not sync.exists(admission_module.ORPHAN_PREFIX + "settled-1")
        assert sync.zscore(admission_module.LEASES_KEY, "settled-1") is None
    finally:
        sync.delete(settings.USAGE_STREAM, *sync.keys(f"q:team:{TEAM}:*"))
        sync.close()


def test_events_redis_took_are_appended_again_when_it_lost_its_data(settings, tmp_path):
    settings.USAGE_STREAM = "usage:test-epoch"
    settings.ROUTER_USAGE_JOURNAL_DIR = str(tmp_path / "journal")
    sync = redis.Redis.from_url(settings.REDIS_URL)
    sync.delete(settings.USAGE_STREAM, USAGE_EPOCH_KEY)

    async def scenario():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        finisher = Finisher(client, Admission(client))
        try:
            await finisher._check_epoch()
            for n in range(3):
                await finisher.settle(
                    None, input_tokens=0, output_tokens=n, spend=0, event=event(f"epoch-{n}", n)
                )
            await finisher._check_epoch()  # the same Redis: nothing again
            assert len(stream_events(sync, settings.USAGE_STREAM)) == 3
            sync.delete(settings.USAGE_STREAM, USAGE_EPOCH_KEY)  # Redis lost its data
            await finisher._check_epoch()
        finally:
            await finisher.stop()
            await client.aclose()

    try:
        asyncio.run(scenario())
        again = stream_events(sync, settings.USAGE_STREAM)
        assert [e["request_id"] for e in again] == ["epoch-0", "epoch-1", "epoch-2"]
    finally:
        sync.delete(settings.USAGE_STREAM, USAGE_EPOCH_KEY)
        sync.close()


def test_a_budget_counter_redis_lost_is_raised_back_to_the_ledger(db, settings):
    from routing.metering.quota_restore import quota_counters_restore
    from routing.snapshot import _quota
    from tenants.keys import api_key_create
    from tenants.models import Quota, Scope, Team, Tenant, UsageRecord

    tenant = Tenant.objects.create(name="Restore", slug="restore")
    team = Team.objects.create(tenant=tenant, name="Agents", slug="agents")
    quota = Quota.objects.create(team=team, token_budget=1_000_000, budget_period="day")
    key = api_key_create(team=team, name="k", scopes=[Scope.INFERENCE])
    for n in range(3):
        UsageRecord.objects.create(
            request_id=f"restore-{n}",
            tenant=tenant,
            team=team,
            api_key=key.api_key,
            model="tiny",
            prompt_tokens=1_000,
            output_tokens=100,
            status="completed",
        )
    sync = redis.Redis.from_url(settings.REDIS_URL)
    info = _quota(quota)
    try:
        sync.delete(*sync.keys(f"q:team:{team.id}:*") or ["none"])  # Redis lost them
        raised = quota_counters_restore(sync)
        assert raised == [f"team {team.id} token_budget: 0 -> 3300"]
        assert quota_counters(sync, kind="team", ident=team.id, quota=info)["token_budget"] == 3_300
        assert quota_counters_restore(sync) == []  # at the ledger: left alone
    finally:
        sync.delete(*sync.keys(f"q:team:{team.id}:*") or ["none"])
        sync.close()
