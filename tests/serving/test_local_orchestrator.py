"""The local orchestrator against real simulator processes: start, scale, crash, change, stop, delete."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import psutil
import pytest

from serving import services
from serving.models import Endpoint, EndpointLifetime, Health, ModelDeployment, ObservedStatus, Pool
from serving.orchestrators import processes
from tenants.models import Role
from tests.conftest import make_user
from tests.workers import celery_worker_process


def marked_processes(owner: str) -> list[psutil.Process]:
    """Live processes that carry this platform instance's engine mark."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(processes.MARK_OWNER) == owner:
                found.append(proc)
    return found


def engine_pids(owner: str) -> set[int]:
    return {proc.pid for proc in marked_processes(owner) if processes.is_leader(proc)}


@pytest.fixture
def owner(db, settings) -> str:
    """This test's platform instance; every engine it leaves is killed at teardown, pass or fail."""
    settings.ENGINE_RESTART_BACKOFF_S = 1
    settings.ENGINE_STOP_GRACE_S = 5
    mark = processes.owner_id()
    yield mark
    leftovers = marked_processes(mark)
    for proc in leftovers:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(leftovers, timeout=10)


@pytest.fixture
def deployment(owner) -> ModelDeployment:
    deployment = ModelDeployment.objects.create(
        name="orch",
        served_model_name="orch-qwen",
        model_source="models/tiny-qwen",
        engine_kind="sim",
        max_model_len=2048,
    )
    Pool.objects.create(deployment=deployment, name="main", replicas=1, max_num_seqs=8)
    return deployment


def reconcile_until(deployment: ModelDeployment, status: str, timeout: float = 30) -> ModelDeployment:
    deadline = time.monotonic() + timeout
    while True:
        services.deployment_reconcile(deployment_id=deployment.pk)
        deployment.refresh_from_db()
        if deployment.observed_status == status:
            return deployment
        if time.monotonic() > deadline:
            raise AssertionError(f"not {status} after {timeout} s: {deployment.status_message}")
        time.sleep(0.3)


def set_pool(deployment: ModelDeployment, **fields) -> None:
    Pool.objects.filter(deployment=deployment, name="main").update(**fields)


def endpoints(deployment: ModelDeployment) -> list[Endpoint]:
    return list(Endpoint.objects.filter(pool__deployment=deployment).order_by("name"))


def test_it_scales_up_and_down(deployment, owner):
    reconcile_until(deployment, ObservedStatus.READY)
    [first] = endpoints(deployment)
    assert first.name == "orch-main-0" and first.health == Health.HEALTHY and first.last_seen_at
    assert engine_pids(owner) == {first.pid}
    assert httpx.get(f"{first.url}/health", timeout=5).status_code == 200
    models = httpx.get(f"{first.url}/v1/models", timeout=5).json()
    assert [model["id"] for model in models["data"]] == ["orch-qwen"]
    assert first.kv_events_endpoint.startswith("tcp://127.0.0.1:")

    set_pool(deployment, replicas=2)
    reconcile_until(deployment, ObservedStatus.READY)
    both = endpoints(deployment)
    assert [e.name for e in both] == ["orch-main-0", "orch-main-1"]
    assert both[0].pid == first.pid and both[0].url == first.url
    assert engine_pids(owner) == {both[0].pid, both[1].pid}
    assert httpx.get(f"{both[1].url}/v1/models", timeout=5).status_code == 200

    set_pool(deployment, replicas=1)
    services.deployment_reconcile(deployment_id=deployment.pk)
    # The younger engine (no cache held, nothing in flight) is drained first: no new requests, still running.
    drained = Endpoint.objects.get(name="orch-main-1")
    assert drained.draining_since is not None and drained.pid in engine_pids(owner)
    deadline = time.monotonic() + 30
    while len(endpoints(deployment)) > 1:
        assert time.monotonic() < deadline, deployment.status_message
        time.sleep(0.3)
        services.deployment_reconcile(deployment_id=deployment.pk)
        deployment.refresh_from_db()
    assert [e.name for e in endpoints(deployment)] == ["orch-main-0"]
    assert engine_pids(owner) == {first.pid}
    # Each engine's lifetime: started, ready; the removed one drained, then stopped.
    lives = {life.endpoint_name: life for life in EndpointLifetime.objects.filter(deployment_name="orch")}
    assert set(lives) == {"orch-main-0", "orch-main-1"}
    assert all(life.ready_at and life.ready_at >= life.started_at for life in lives.values())
    gone = lives["orch-main-1"]
    assert gone.started_at <= gone.ready_at <= gone.draining_at <= gone.stopped_at
    assert lives["orch-main-0"].stopped_at is None and lives["orch-main-0"].draining_at is None
    assert not psutil.pid_exists(both[1].pid) or both[1].pid not in engine_pids(owner)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{both[1].url}/health", timeout=2)


def test_a_killed_engine_is_seen_unhealthy_and_restarted(deployment, owner):
    reconcile_until(deployment, ObservedStatus.READY)
    [before] = endpoints(deployment)
    os.kill(before.pid, signal.SIGKILL)
    psutil.Process(before.pid).wait(timeout=5)

    services.deployment_reconcile(deployment_id=deployment.pk)
    [seen] = endpoints(deployment)
    deployment.refresh_from_db()
    assert seen.health == Health.UNHEALTHY
    assert deployment.observed_status == ObservedStatus.PROGRESSING
    assert "exited; restart in" in deployment.status_message

    reconcile_until(deployment, ObservedStatus.READY)
    [after] = endpoints(deployment)
    assert after.health == Health.HEALTHY
    assert after.restart_count == 1 and after.pid != before.pid and after.url == before.url
    assert engine_pids(owner) == {after.pid}


def test_a_hung_engine_is_stopped_and_restarted(deployment, owner, settings):
    settings.ENGINE_HUNG_RESTART_S = 1
    settings.ENGINE_STOP_GRACE_S = 1
    reconcile_until(deployment, ObservedStatus.READY)
    [before] = endpoints(deployment)
    os.kill(before.pid, signal.SIGSTOP)  # alive, but answers nothing
    try:
        services.deployment_reconcile(deployment_id=deployment.pk)
        [seen] = endpoints(deployment)
        assert seen.health == Health.UNHEALTHY and psutil.pid_exists(before.pid)
        time.sleep(1.5)
        services.deployment_reconcile(deployment_id=deployment.pk)  # hung for longer than allowed: stopped
        assert not psutil.pid_exists(before.pid)
    finally:
        if psutil.pid_exists(before.pid):
            os.kill(before.pid, signal.SIGCONT)
    reconcile_until(deployment, ObservedStatus.READY)
    [after] = endpoints(deployment)
    assert after.health == Health.HEALTHY and after.pid != before.pid and after.restart_count == 1


def test_reconciling_twice_changes_nothing(deployment, owner):
    set_pool(deployment, replicas=2)
    reconcile_until(deployment, ObservedStatus.READY)
    volatile = {"health", "last_seen_at"}
    fields = [f.attname for f in Endpoint._meta.concrete_fields if f.attname not in volatile]
    rows = list(Endpoint.objects.order_by("pk").values(*fields))
    pids = engine_pids(owner)

    for _ in range(2):
        result = services.deployment_reconcile(deployment_id=deployment.pk)
        assert result.status == ObservedStatus.READY
    assert list(Endpoint.objects.order_by("pk").values(*fields)) == rows
    assert engine_pids(owner) == pids


def test_changing_a_pool_option_restarts_its_engines(deployment, owner):
    reconcile_until(deployment, ObservedStatus.READY)
    [before] = endpoints(deployment)

    set_pool(deployment, max_num_seqs=4)
    reconcile_until(deployment, ObservedStatus.READY)
    [after] = endpoints(deployment)
    assert after.pid != before.pid and after.config_hash != before.config_hash
    assert after.url == before.url and after.restart_count == 0
    assert engine_pids(owner) == {after.pid}
    cmdline = psutil.Process(after.pid).cmdline()
    assert cmdline[cmdline.index("--max-num-seqs") + 1] == "4"


def test_deleting_a_deployment_leaves_no_process_behind(deployment, owner):
    reconcile_until(deployment, ObservedStatus.READY)
    assert engine_pids(owner)

    deployment.delete()
    assert not Endpoint.objects.exists()
    # Its engines are stopped once routers can no longer be sending them anything and they are idle.
    deadline = time.monotonic() + 20
    while marked_processes(owner):
        assert time.monotonic() < deadline
        services.engines_sweep()
        time.sleep(0.2)


def test_a_stopped_deployment_runs_nothing(deployment, owner):
    set_pool(deployment, replicas=2)
    reconcile_until(deployment, ObservedStatus.READY)
    assert len(engine_pids(owner)) == 2

    ModelDeployment.objects.filter(pk=deployment.pk).update(desired_status="stopped")
    deployment = reconcile_until(deployment, ObservedStatus.STOPPED)
    assert deployment.status_message == "Stopped."
    assert marked_processes(owner) == [] and endpoints(deployment) == []


def test_an_option_it_cannot_render_fails_clearly(deployment, owner):
    set_pool(deployment, speculative_method="eagle", num_speculative_tokens=4)  # needs a draft model
    deployment = reconcile_until(deployment, ObservedStatus.FAILED)
    assert "EAGLE speculative decoding needs a draft model" in deployment.status_message
    assert marked_processes(owner) == []


# --- through the API and a real Celery worker ----------------------------------------------------------


@pytest.fixture
def celery_worker(transactional_db, owner):
    with celery_worker_process("test-celery-worker.log") as log:
        yield log


def test_a_deployment_made_through_the_api_is_started_by_the_worker(celery_worker, client_for, owner):
    operator = make_user("ops", Role.OPERATOR)
    response = client_for(operator).post(
        "/api/deployments/",
        {
            "name": "via-api",
            "served_model_name": "via-api-qwen",
            "model_source": "models/tiny-qwen",
            "engine_kind": "sim",
            "pools": [{"name": "main", "replicas": 1, "max_num_seqs": 8}],
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    deployment = ModelDeployment.objects.get(pk=response.json()["id"])

    deadline = time.monotonic() + 60
    while deployment.observed_status != ObservedStatus.READY:
        assert time.monotonic() < deadline, (
            f"worker did not bring it up: {deployment.status_message}\n{celery_worker.read_text()[-3000:]}"
        )
        time.sleep(0.5)
        deployment.refresh_from_db()
    [endpoint] = endpoints(deployment)
    assert endpoint.health == Health.HEALTHY and engine_pids(owner) == {endpoint.pid}
    assert httpx.get(f"{endpoint.url}/v1/models", timeout=5).json()["data"][0]["id"] == "via-api-qwen"

    # Deleting it through the API has the worker stop its engine.
    assert client_for(operator).delete(f"/api/deployments/{deployment.pk}/").status_code == 204
    deadline = time.monotonic() + 30
    while marked_processes(owner):
        assert time.monotonic() < deadline, "the worker left the engine running"
        time.sleep(0.5)
