"""A router process SIGKILLed with a stream in flight: a live router process settles the request from its orphan
record in Redis (routing/metering/admission.py, REAP), and the ledger bills it (failed, its prompt, no output), whether or
not its team has a quota. Real router processes, a real simulator engine, the usage ingestion run here."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
import redis
from django.conf import settings

from routing.contracts import quota_counters
from routing.models import RoutingPolicy
from routing.snapshot import _quota
from tenants.models import Quota, UsageRecord
from tenants.tasks import ingest_usage

from ..serving.engines import MODEL_NAME, start_engine
from .conftest import make_fleet, start_router

# Short leases, so that the dead process's requests are settled within seconds (its lease, REAP_GRACE_S and the
# live process's next look, every ORPHANS_EVERY_S).
SHORT_LEASE = {"ROUTER_CONCURRENCY_LEASE_SECONDS": "1"}
MESSAGES = [{"role": "user", "content": "Count slowly from one to two hundred, one number a line."}]


@pytest.fixture
def doomed_fleet(transactional_db):
    router = start_router(SHORT_LEASE)
    engine = start_engine("sim", "--decode-time", "0.05")
    fleet = make_fleet(router, [engine])
    RoutingPolicy.objects.create(
        deployment=fleet.deployment, mode="approximate"
    )  # the router counts the prompt
    fleet.sync()
    yield fleet
    router.stop()
    engine.stop()


def stream_until_killed(fleet) -> str:
    """Stream a chat completion and SIGKILL the router once five tokens came; the request's id."""
    received = 0
    try:
        with httpx.stream(
            "POST",
            f"{fleet.router.url}/v1/chat/completions",
            timeout=30,
            headers={"authorization": f"Bearer {fleet.key.secret}"},
            json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 200, "stream": True},
        ) as response:
            assert response.status_code == 200, response.read()
            request_id = response.headers["x-request-id"]
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    received += 1
                    if received == 5:
                        fleet.router.process.send_signal(signal.SIGKILL)
    except httpx.HTTPError:
        pass  # the connection dies with the process
    assert received >= 5 and fleet.router.process.wait(timeout=10) == -signal.SIGKILL
    return request_id


def billed(request_id: str, timeout: float = 60) -> UsageRecord | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ingest_usage.apply()
        record = UsageRecord.objects.filter(request_id=request_id).first()
        if record is not None:
            return record
        time.sleep(1)
    return None


@pytest.mark.parametrize("under_quota", [False, True], ids=["no quota", "team quota"])
def test_a_stream_on_a_killed_router_is_billed_its_prompt_by_a_live_one(doomed_fleet, under_quota):
    fleet = doomed_fleet
    quota = None
    if under_quota:
        quota = Quota.objects.create(team=fleet.team, max_concurrent_requests=5, token_budget=1_000_000)
        fleet.sync()
    request_id = stream_until_killed(fleet)

    live = start_router(SHORT_LEASE)
    try:
        # What the engine counts for this prompt, through the live process.
        answer = httpx.post(
            f"{live.url}/v1/chat/completions",
            timeout=30,
            headers={"authorization": f"Bearer {fleet.key.secret}"},
            json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1},
        )
        assert answer.status_code == 200, answer.text
        prompt = answer.json()["usage"]["prompt_tokens"]
        record = billed(request_id)
        assert record is not None, f"not in the ledger:\n{live.log()[-3000:]}"
        assert (record.status, record.prompt_tokens, record.output_tokens) == ("failed", prompt, 0)
        assert record.team_id == fleet.team.id and prompt > 0
        assert "settled 1 requests a dead replica admitted" in live.log()
        if quota is not None:  # its reservation given back but for its prompt: the counter holds the ledger's
            client = redis.Redis.from_url(settings.REDIS_URL)
            counted = quota_counters(client, kind="team", ident=fleet.team.id, quota=_quota(quota))
            client.close()
            assert counted["max_concurrent_requests"] == 0
            assert counted["token_budget"] == answer.json()["usage"]["total_tokens"] + prompt
    finally:
        live.stop()


def test_a_request_in_flight_has_an_orphan_record_only_past_the_delay_and_none_after_it_ends(
    settings, tmp_path
):
    """In process, against the suite's Redis: a request that ends within OPEN_RECORD_AFTER_S costs Redis no
    record; one still in flight after it has one, with its lease, which its ending removes."""
    import asyncio
    from datetime import UTC, datetime

    import redis.asyncio as aioredis

    from routing.metering.admission import LEASES_KEY, ORPHAN_PREFIX, Admission, Reservation
    from routing.metering.finisher import OPEN_RECORD_AFTER_S, Finisher, InFlight
    from tenants.usage_stream import UsageEvent

    settings.USAGE_STREAM = "usage:test-open-records"
    settings.ROUTER_USAGE_JOURNAL_DIR = str(tmp_path / "journal")
    sync = redis.Redis.from_url(settings.REDIS_URL)

    def event(request_id: str) -> UsageEvent:
        return UsageEvent(
            request_id=request_id,
            tenant_id=1,
            team_id=1,
            api_key_id=1,
            deployment_id=None,
            model="tiny",
            endpoint="",
            prompt_tokens=7,
            cached_prompt_tokens=0,
            output_tokens=3,
            ttft_ms=None,
            latency_ms=None,
            status="completed",
            created_at=datetime.now(UTC),
        )

    def written(request_id: str) -> tuple[bool, bool]:
        return bool(sync.exists(ORPHAN_PREFIX + request_id)), sync.zscore(LEASES_KEY, request_id) is not None

    async def scenario() -> list[tuple[bool, bool]]:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        finisher = Finisher(client, Admission(client))
        seen = []
        try:
            for request_id, runs_for in (("open-short", 0.0), ("open-long", 3 * OPEN_RECORD_AFTER_S)):
                reservation = Reservation(request_id, [], 0, 0, 0, 0)
                finisher.opened(reservation, lambda rid=request_id: InFlight(event(rid).encode(), 7))
                await asyncio.sleep(runs_for)
                seen.append(written(request_id))
                await finisher.settle(
                    reservation, input_tokens=7, output_tokens=3, spend=0, event=event(request_id)
                )
                seen.append(written(request_id))
            await asyncio.sleep(2 * OPEN_RECORD_AFTER_S)  # no timer writes the ended requests' records late
            seen += [written("open-short"), written("open-long")]
        finally:
            await finisher.stop()
            await client.aclose()
        return seen

    try:
        assert (
            asyncio.run(scenario())
            == [(False, False)] * 2 + [(True, True), (False, False)] + [(False, False)] * 2
        )
    finally:
        sync.delete(settings.USAGE_STREAM)
        sync.close()
