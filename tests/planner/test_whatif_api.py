"""What-if runs through the API (/api/what-if-runs/): from recorded TrafficTraceEntry rows through a real Celery
worker to the stored result, the input a run is refused with, and who may run or see one."""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from planner.models import RunStatus, WhatIfRun
from portal.models import AcceleratorPrice
from portal.tasks import rollup_usage
from routing.models import TrafficTraceEntry
from serving.models import AutoscalingPolicy, EndpointLifetime
from tenants.models import Role

from ..conftest import make_usage, make_user
from ..workers import celery_worker_process

SESSIONS = 6  # per tenant
TURNS = 4  # per session
API = "/api/what-if-runs/"


def _hash(*parts) -> bytes:
    return hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()


def record_traffic(world, *, base=None, keys=None) -> dict:
    """Recorded traffic for the world's deployment over two minutes from `base`: per key, SESSIONS agents'
    conversations of TURNS turns (each prompt the one before plus 512 tokens), with the ledger's records of the
    same requests, two engines' lifetimes at a configured GPU price and a TTFT objective on the pool."""
    base = base or (timezone.now() - timedelta(hours=2)).replace(second=0, microsecond=0)
    keys = keys or [world.key_a1, world.key_b1]
    deployment = world.deployment
    n = 0
    for key in keys:
        team = key.api_key.team
        for s in range(SESSIONS):
            for turn in range(TURNS):
                prompt = 1024 + 512 * turn + 50
                at = base + timedelta(seconds=s * 10 + turn * 2.5)
                request_id = f"wi-{team.pk}-{s}-{turn}"
                TrafficTraceEntry.objects.create(
                    request_id=request_id,
                    arrived_at=at,
                    deployment_id=deployment.pk,
                    endpoint="http://127.0.0.1:1",
                    tenant_id=team.tenant_id,
                    team_id=team.pk,
                    api_key_id=key.api_key.pk,
                    session=_hash("session", team.pk, s).hex(),
                    prompt_tokens=prompt,
                    cached_tokens=0,
                    output_tokens=30,
                    block_size=deployment.block_size,
                    block_hashes=b"".join(
                        _hash(team.pk, s, k) for k in range(prompt // deployment.block_size)
                    ),
                )
                make_usage(
                    key,
                    request_id,
                    deployment=deployment,
                    prompt_tokens=prompt,
                    cached_prompt_tokens=0,
                    output_tokens=30,
                    ttft_ms=200 + 10 * turn,
                    latency_ms=200 + 10 * turn + 29 * 20,
                    created_at=at,
                )
                n += 1
    rollup_usage()
    pool = deployment.pools.get()
    pool.accelerator = "nvidia-h100-80gb"
    pool.save()
    AcceleratorPrice.objects.update_or_create(
        accelerator="nvidia-h100-80gb", defaults={"price_per_gpu_hour": 2}
    )
    for i in range(2):
        EndpointLifetime.objects.create(
            pool=pool,
            deployment_name=deployment.name,
            pool_name=pool.name,
            endpoint_name=f"main-{i}",
            accelerator="nvidia-h100-80gb",
            gpus=1,
            started_at=base - timedelta(hours=1),
        )
    AutoscalingPolicy.objects.update_or_create(pool=pool, defaults={"ttft_p90_s": 0.05, "itl_p90_s": 0.5})
    return {"since": base, "until": base + timedelta(minutes=10), "requests": n}


def body(world, period, **changes) -> dict:
    return {
        "deployment": world.deployment.pk,
        "since": period["since"].isoformat(),
        "until": period["until"].isoformat(),
        "changes": changes,
    }


# --- end to end, with a real worker ---------------------------------------------------------------------------


def whatif_queue() -> str:
    """The queue CELERY_TASK_ROUTES sends what-if runs to."""
    from inference_platform.celery import app

    return app.amqp.router.route({}, "planner.run_what_if")["queue"].name


@pytest.fixture
def celery_worker(transactional_db):
    from inference_platform.celery import app

    with celery_worker_process(
        "test-whatif-worker.log", [app.conf.task_default_queue, whatif_queue()]
    ) as log:
        yield log


def test_a_run_goes_from_recorded_traffic_through_the_worker_to_its_result(world, client_for, celery_worker):
    period = record_traffic(world)
    a, b = str(world.tenant_a.pk), str(world.tenant_b.pk)
    changes = {"engines": {"main": 4}, "mode": "least_loaded", "traffic": {"tenants": {a: 2, b: 0}}}
    response = client_for(world.operator).post(API, body(world, period, **changes), format="json")
    assert response.status_code == 201, response.content
    run_id = response.json()["id"]
    assert response.json()["status"] == "pending"

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        run = client_for(world.operator).get(f"{API}{run_id}/").json()
        if run["status"] in ("succeeded", "failed"):
            break
        time.sleep(0.2)
    assert run["status"] == "succeeded", f"{run}\n{celery_worker.read_text()[-3000:]}"
    assert run["progress"] == 100 and run["requested_by"] == world.operator.username
    result = run["result"]
    per_key = SESSIONS * TURNS
    assert result["trace"] == {
        "recorded_requests": 2 * per_key,
        "replayed_requests": 2 * per_key,  # A doubled, B removed
        "sampled_share": 1.0,
    }
    before, after = result["baseline"], result["changed"]
    assert before["fleet"] == {
        "engines": {"main": 2},
        "prefill_pools": [],
        "mode": "precise",
        "profile": "sim-bench",
        "gpus_per_engine": 1,
        "gpu_price_per_hour": 2.0,
    }
    assert after["fleet"]["engines"] == {"main": 4} and after["fleet"]["mode"] == "least_loaded"
    assert before["finished"] == 2 * per_key and after["finished"] == 2 * per_key
    assert before["per_tenant"][a]["requests"] == per_key and before["per_tenant"][b]["requests"] == per_key
    assert set(after["per_tenant"]) == {a}  # B is gone
    assert after["per_tenant"][a]["requests"] == 2 * per_key
    # Conversations reuse their prefixes: the precise baseline finds cache hits.
    assert before["hit_share"] > 0.3
    assert before["ttft_p90"] > 0 and before["engine_hours"] > 0 and before["cost_per_mtok"] > 0
    actual = result["actual"]
    assert actual["requests"] == 2 * per_key
    assert actual["gpu_hours"] == pytest.approx(2 * 10 / 60)
    assert actual["gpu_cost"] == pytest.approx(2 * 2 * 10 / 60)
    assert 0.2 <= actual["ttft_p50"] <= 0.25 and actual["itl_p50"] == pytest.approx(0.02, rel=0.3)
    assert actual["per_tenant"][a]["request_share"] == 0.5
    # Held for the whole period, the deployment as it is costs what the period actually cost.
    assert before["period_gpu_hours"] == pytest.approx(actual["gpu_hours"])
    assert before["period_cost_per_mtok"] == pytest.approx(actual["cost_per_mtok"])
    assert after["period_gpu_hours"] == pytest.approx(2 * before["period_gpu_hours"])
    assert result["objectives"] == {"ttft_p90_s": 0.05, "itl_p90_s": 0.5}
    assert result["tenant_names"] == {a: "Acme", b: "Bolt"}

    listed = client_for(world.operator).get(API).json()
    assert [r["id"] for r in listed["results"]] == [run_id]


# --- progress and failures, the task's own code in this process -----------------------------------------------


def test_the_run_reports_its_progress_as_it_simulates(world):
    from planner.whatif import whatif_execute

    period = record_traffic(world)
    run = WhatIfRun.objects.create(
        deployment=world.deployment,
        since=period["since"],
        until=period["until"],
        baseline_profile="sim-bench",
    )
    seen: list[tuple[int, str]] = []
    whatif_execute(run, lambda percent, stage: seen.append((percent, stage)))
    percents = [p for p, _ in seen]
    assert percents == sorted(percents) and percents[-1] == 95
    baseline = [p for p, s in seen if s == "simulating the deployment as it is"]
    changed = [p for p, s in seen if s == "simulating the changed fleet"]
    assert len(baseline) > 10 and any(5 < p < 50 for p in baseline)
    assert len(changed) > 10 and any(50 < p < 95 for p in changed)


def test_a_run_that_cannot_be_simulated_ends_failed_with_a_message(world):
    from planner.tasks import run_what_if

    period = record_traffic(world)
    empty = WhatIfRun.objects.create(
        deployment=world.deployment,
        since=period["since"] - timedelta(days=3),
        until=period["since"] - timedelta(days=2),
        baseline_profile="sim-bench",
    )
    assert run_what_if(empty.pk) == "failed"
    empty.refresh_from_db()
    assert empty.status == RunStatus.FAILED and "no recorded traffic" in empty.message
    assert empty.finished_at is not None and empty.result is None

    broken = WhatIfRun.objects.create(
        deployment=world.deployment, since=period["since"], until=period["until"], baseline_profile="gone"
    )
    assert run_what_if(broken.pk) == "failed"
    broken.refresh_from_db()
    assert broken.status == RunStatus.FAILED and "FileNotFoundError" in broken.message
    assert run_what_if(broken.pk) == "not pending"  # a finished run is not run again


# --- bad input --------------------------------------------------------------------------------------------------

BAD = [
    (lambda w, p: {k: v for k, v in body(w, p).items() if k != "since"}, "since"),
    (lambda w, p: {**body(w, p), "until": (p["since"] - timedelta(minutes=1)).isoformat()}, "until"),
    (lambda w, p: {**body(w, p), "since": "yesterday"}, "since"),
    (lambda w, p: {**body(w, p), "deployment": 999999}, "deployment"),
    (
        lambda w, p: {
            **body(w, p),
            "since": (p["since"] - timedelta(days=9)).isoformat(),
            "until": (p["since"] - timedelta(days=8)).isoformat(),
        },
        "since",
    ),
    (lambda w, p: {**body(w, p), "baseline_profile": "../../etc/passwd"}, "profile"),
    (lambda w, p: {**body(w, p), "changes": ["engines"]}, "changes"),
    (lambda w, p: body(w, p, replicas=3), "changes"),
    (lambda w, p: body(w, p, engines={"nope": 3}), "changes.engines"),
    (lambda w, p: body(w, p, engines={"main": -1}), "changes.engines.main"),
    (lambda w, p: body(w, p, engines={"main": "4"}), "changes.engines.main"),
    (lambda w, p: body(w, p, engines={"main": 5000}), "changes.engines.main"),
    (lambda w, p: body(w, p, mode="fastest"), "changes.mode"),
    (lambda w, p: body(w, p, profile="h200"), "changes.profile"),
    (lambda w, p: body(w, p, gpu_price_per_hour=-1), "changes.gpu_price_per_hour"),
    (lambda w, p: body(w, p, gpu_price_per_hour="cheap"), "changes.gpu_price_per_hour"),
    (lambda w, p: body(w, p, traffic={"tenants": {"999999": 2}}), "changes.traffic.tenants"),
    (lambda w, p: body(w, p, traffic={"tenants": {"acme": 2}}), "changes.traffic.tenants"),
    (lambda w, p: body(w, p, traffic={"tenants": {"9" * 40: 2}}), "changes.traffic.tenants"),
    (lambda w, p: body(w, p, traffic={"all": 10**400}), "changes.traffic.all"),
    (lambda w, p: body(w, p, traffic={"teams": {str(w.team_a1.pk): 1000}}), "changes.traffic.teams.{team}"),
    (lambda w, p: body(w, p, traffic={"everyone": 2}), "changes.traffic"),
    (lambda w, p: body(w, p, traffic={"all": 5000}), "changes.traffic.all"),
    # The period must be over: rows still arriving could grow the trace past the limits checked here.
    (lambda w, p: {**body(w, p), "until": (timezone.now() + timedelta(minutes=5)).isoformat()}, "until"),
]


@pytest.mark.parametrize("make, field", BAD)
def test_bad_input_is_a_400_that_names_the_field(world, client_for, make, field):
    period = record_traffic(world)
    response = client_for(world.operator).post(API, make(world, period), format="json")
    assert response.status_code == 400, response.content
    assert field.replace("{team}", str(world.team_a1.pk)) in response.json(), response.json()
    assert not WhatIfRun.objects.exists()


def test_a_deployment_with_prefill_and_decode_pools_is_simulated_as_such(world, client_for):
    """A prefill pool beside the decode-side pool: both fleets run it as a prefill pool (the router's P/D plans
    move each long prompt's KV from it), its engines change like any pool's, and a fleet left nothing to decode on
    is refused at once."""
    from planner.whatif import baseline_fleet, changed_fleet, simulate_fleet
    from planner.whatif_traffic import recorded_trace
    from serving.models import Pool

    period = record_traffic(world)
    Pool.objects.create(
        deployment=world.deployment, name="pre", role="prefill", replicas=1, kv_connector="NixlConnector"
    )
    client = client_for(world.operator)
    response = client.post(API, body(world, period, engines={"main": 0, "pre": 2}), format="json")
    assert response.status_code == 400
    assert "no engines to decode on" in response.json()["changes.engines"]
    assert client.post(API, body(world, period, engines={"pre": 2}), format="json").status_code == 201

    baseline = baseline_fleet(world.deployment, "sim-bench")
    changed = changed_fleet(baseline, {"engines": {"pre": 3}})
    assert (baseline.prefill_engines, baseline.total_engines) == (1, 3)
    assert (changed.prefill_engines, changed.total_engines) == (3, 5)
    trace = recorded_trace(deployment_id=world.deployment.pk, since=period["since"], until=period["until"])
    before = simulate_fleet(trace.requests, baseline)
    assert before["fleet"]["prefill_pools"] == ["pre"]
    # Every prompt here is over the split threshold (1,024 uncached tokens) on its first turn: it was prefilled
    # on the prefill pool and its KV moved to a decode engine.
    assert before["transfers"] >= 2 * SESSIONS
    assert before["finished"] == len(trace.requests)
    assert simulate_fleet(trace.requests, changed)["engines"] == 5


# --- who may ------------------------------------------------------------------------------------------------


def test_only_operators_run_or_see_what_ifs(world, client_for):
    period = record_traffic(world)
    created = client_for(world.operator).post(API, body(world, period), format="json")
    assert created.status_code == 201
    run_id = created.json()["id"]
    assert WhatIfRun.objects.get().baseline_profile == "sim-bench"
    staff = make_user("stella", Role.OPERATOR)
    assert client_for(staff).get(f"{API}{run_id}/").status_code == 200
    for user in (world.admin_a, world.member_a1, world.admin_b):
        client = client_for(user)
        assert client.post(API, body(world, period), format="json").status_code == 403
        assert client.get(API).status_code == 403
        assert client.get(f"{API}{run_id}/").status_code == 403
    from rest_framework.test import APIClient

    assert APIClient().get(API).status_code == 401
    assert WhatIfRun.objects.count() == 1


def test_an_api_key_cannot_start_one(world):
    from rest_framework.test import APIClient

    period = record_traffic(world)
    client = APIClient(HTTP_AUTHORIZATION=f"Bearer {world.key_a1.secret}")
    assert client.post(API, body(world, period), format="json").status_code == 403


def test_a_run_records_its_changes_in_their_stored_form(world, client_for):
    period = record_traffic(world)
    team = str(world.team_b1.pk)
    response = client_for(world.operator).post(
        API,
        body(world, period, profile="illustrative-8b-h100", traffic={"teams": {team: 0.5}, "all": 1.5}),
        format="json",
    )
    assert response.status_code == 201, response.content
    assert response.json()["changes"] == {
        "profile": "illustrative-8b-h100",
        "traffic": {"teams": {team: 0.5}, "all": 1.5},
    }


# --- limits: runs at once, their queue, the block ids a run holds, the trace a run reads ---------------------------


def test_runs_go_to_their_own_queue():
    """Apart from reconcile, usage ingestion and the platform's other tasks, which a long run must not hold up."""
    assert whatif_queue() == "whatif"


def test_no_more_runs_at_once_than_the_limit_and_a_finished_run_frees_its_slot(world, client_for, settings):
    from planner.tasks import run_what_if

    settings.PLANNER_WHATIF_MAX_RUNNING = 2
    period = record_traffic(world)
    client = client_for(world.operator)
    first, second = (client.post(API, body(world, period), format="json") for _ in range(2))
    assert first.status_code == 201 and second.status_code == 201
    WhatIfRun.objects.filter(pk=second.json()["id"]).update(status=RunStatus.RUNNING)

    refused = client.post(API, body(world, period), format="json")
    assert refused.status_code == 429, refused.content
    assert "PLANNER_WHATIF_MAX_RUNNING is 2" in refused.json()["detail"]
    assert WhatIfRun.objects.count() == 2

    assert run_what_if(first.json()["id"]) == "succeeded"
    assert client.post(API, body(world, period), format="json").status_code == 201
    assert client.post(API, body(world, period), format="json").status_code == 429  # full again


def test_a_run_lost_past_the_timeout_gives_its_slot_to_the_next(world, client_for, settings):
    from planner.tasks import run_what_if

    settings.PLANNER_WHATIF_MAX_RUNNING = 1
    settings.PLANNER_WHATIF_TIMEOUT_S = 600
    period = record_traffic(world)
    client = client_for(world.operator)
    lost = client.post(API, body(world, period), format="json").json()["id"]
    WhatIfRun.objects.filter(pk=lost).update(
        status=RunStatus.RUNNING, created_at=timezone.now() - timedelta(seconds=599)
    )
    assert client.post(API, body(world, period), format="json").status_code == 429  # not lost yet
    WhatIfRun.objects.filter(pk=lost).update(created_at=timezone.now() - timedelta(seconds=601))
    assert client.post(API, body(world, period), format="json").status_code == 201
    run = WhatIfRun.objects.get(pk=lost)
    assert run.status == RunStatus.FAILED and "PLANNER_WHATIF_TIMEOUT_S" in run.message
    assert run_what_if(lost) == "not pending"  # its task, delivered late, does not run it


def test_two_starts_at_once_cannot_both_take_the_last_slot(world, transactional_db, settings, monkeypatch):
    """The second start waits for the first one's transaction, then counts its run."""
    import threading

    from django.db import connections, transaction

    from planner.tasks import run_what_if
    from planner.whatif import WhatIfBusy, whatif_create

    monkeypatch.setattr(run_what_if, "delay", lambda run_id: None)  # no worker here
    settings.PLANNER_WHATIF_MAX_RUNNING = 1
    period = record_traffic(world)

    def start():
        return whatif_create(
            deployment=world.deployment, since=period["since"], until=period["until"], changes={}
        )

    outcome: list = []

    def second() -> None:
        try:
            outcome.append(start())
        except WhatIfBusy as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    with transaction.atomic():
        start()  # the first start, not committed yet
        thread = threading.Thread(target=second)
        thread.start()
        deadline = time.monotonic() + 10
        with connection.cursor() as cursor:
            while thread.is_alive() and time.monotonic() < deadline:
                cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
                if cursor.fetchone()[0]:
                    break  # the second start waits for the lock
                time.sleep(0.02)
    thread.join(timeout=10)
    assert len(outcome) == 1 and isinstance(outcome[0], WhatIfBusy), outcome
    assert WhatIfRun.objects.count() == 1


# The prompt blocks (one per 512 tokens) of one key's recorded requests.
KEY_BLOCKS = SESSIONS * sum(-(-(1024 + 512 * turn + 50) // 512) for turn in range(TURNS))


def test_a_period_over_the_block_limit_is_refused_at_creation(world, client_for, settings):
    """Every copy a multiplier makes holds its own block ids: the limit counts them, not the requests."""
    period = record_traffic(world)
    held = 3 * KEY_BLOCKS  # A doubled; B once
    doubled = body(world, period, traffic={"tenants": {str(world.tenant_a.pk): 2}})
    client = client_for(world.operator)

    settings.PLANNER_WHATIF_MAX_BLOCKS = held - 1
    refused = client.post(API, doubled, format="json")
    assert refused.status_code == 400, refused.content
    assert (
        f"{held} block ids" in refused.json()["until"]
        and "PLANNER_WHATIF_MAX_BLOCKS" in refused.json()["until"]
    )
    assert client.post(API, body(world, period), format="json").status_code == 201  # unmultiplied, it fits

    settings.PLANNER_WHATIF_MAX_BLOCKS = held
    assert client.post(API, doubled, format="json").status_code == 201


def test_the_block_limit_is_checked_again_before_the_copies_are_made(
    world, client_for, settings, monkeypatch
):
    import planner.whatif
    from planner.tasks import run_what_if

    period = record_traffic(world)
    held = 4 * KEY_BLOCKS  # A tripled; B once
    traffic = {"tenants": {str(world.tenant_a.pk): 3}}
    created = client_for(world.operator).post(API, body(world, period, traffic=traffic), format="json")
    assert created.status_code == 201
    settings.PLANNER_WHATIF_MAX_BLOCKS = held - 1  # lowered since
    copied = []
    monkeypatch.setattr(planner.whatif, "multiply", lambda *args, **kw: copied.append(args) or [])

    assert run_what_if(created.json()["id"]) == "failed"
    run = WhatIfRun.objects.get()
    assert f"{held} block ids" in run.message and not copied


def test_a_run_replays_the_period_as_counted_when_it_was_created(world, client_for):
    """Entries drained into the period after the run was started are not replayed: the trace cannot grow past
    the limits the run was checked against."""
    from planner.tasks import run_what_if

    period = record_traffic(world)
    created = client_for(world.operator).post(API, body(world, period), format="json")
    assert created.status_code == 201
    for i in range(30):
        TrafficTraceEntry.objects.create(
            request_id=f"late-{i}",
            arrived_at=period["since"] + timedelta(seconds=i),
            deployment_id=world.deployment.pk,
            tenant_id=world.tenant_a.pk,
            team_id=world.team_a1.pk,
            api_key_id=world.key_a1.api_key.pk,
            prompt_tokens=600_000,
            cached_tokens=0,
            output_tokens=10,
            block_size=world.deployment.block_size,
        )
    assert run_what_if(created.json()["id"]) == "succeeded"
    run = WhatIfRun.objects.get()
    assert run.trace_requests == period["requests"]
    assert run.result["trace"]["recorded_requests"] == period["requests"]
