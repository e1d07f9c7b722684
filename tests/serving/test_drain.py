"""Scale-down drops nothing: real simulator engines run by the local orchestrator, a real router process in
front of them, streams in flight on both engines when the pool goes from two replicas to one."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import psutil

from serving import services
from serving.models import Endpoint, Health, ModelDeployment, ObservedStatus, Pool
from tenants.keys import api_key_create
from tenants.models import Scope, Team, Tenant
from tests.routing.conftest import start_router

MODEL = "drain-qwen"


def reconcile(deployment: ModelDeployment) -> ModelDeployment:
    services.deployment_reconcile(deployment_id=deployment.pk)
    deployment.refresh_from_db()
    return deployment


@contextlib.contextmanager
def served_through_a_router(deployment: ModelDeployment):
    """Once the deployment's engines are ready: a router process in front of them and a key it accepts."""
    deadline = time.monotonic() + 60
    while reconcile(deployment).observed_status != ObservedStatus.READY:
        assert time.monotonic() < deadline, deployment.status_message
        time.sleep(0.3)
    team = Team.objects.create(tenant=Tenant.objects.create(name="A", slug="a"), name="T", slug="t")
    key = api_key_create(team=team, name="agent", scopes=[Scope.INFERENCE])
    router = start_router()
    try:
        ready = time.monotonic() + 30
        headers = {"authorization": f"Bearer {key.secret}"}
        while not httpx.get(f"{router.url}/v1/models", headers=headers).json().get("data"):
            assert time.monotonic() < ready, router.log()[-2000:]
            time.sleep(0.3)
        yield router, key
    finally:
        router.stop()


def stream(router_url: str, secret: str, results: list, index: int, max_tokens: int = 60) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Request {index}: list the files."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    chunks, done = 0, False
    with httpx.stream(
        "POST",
        f"{router_url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {secret}"},
        timeout=60,
    ) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: ") and '"content":"' in line and '"role"' not in line:
                chunks += 1
        results[index] = (response.status_code, chunks, done)


def test_a_scale_down_during_streams_completes_every_request(live_engines, settings):
    # An engine told to stop gets a second, far less than the streams below take: only the drain saves them.
    settings.ENGINE_STOP_GRACE_S = 1
    deployment = ModelDeployment.objects.create(
        name="drain",
        served_model_name=MODEL,
        model_source="models/tiny-qwen",
        engine_kind="sim",
        max_model_len=2048,
    )
    Pool.objects.create(
        deployment=deployment, name="main", replicas=2, extra_engine_args=["--decode-time", "0.08"]
    )
    with served_through_a_router(deployment) as (router, key):
        results: list = [None] * 6
        threads = [
            threading.Thread(target=stream, args=(router.url, key.secret, results, i)) for i in range(6)
        ]
        for thread in threads:
            thread.start()
        time.sleep(1.0)  # every stream is under way, on both engines (round-robin)
        running = {e.name: e.pid for e in Endpoint.objects.filter(pool__deployment=deployment)}
        assert len(running) == 2

        Pool.objects.filter(deployment=deployment).update(replicas=1)
        reconcile(deployment)
        draining = list(Endpoint.objects.filter(pool__deployment=deployment, draining_since__isnull=False))
        deadline = time.monotonic() + 60
        while Endpoint.objects.filter(pool__deployment=deployment).count() > 1:
            assert time.monotonic() < deadline, deployment.status_message
            time.sleep(0.2)
            reconcile(deployment)
        [survivor] = Endpoint.objects.filter(pool__deployment=deployment)
        [victim] = set(running) - {survivor.name}
        for thread in threads:
            thread.join(timeout=60)

        # Every stream ran to its end, none cut by the scale-down.
        assert all(r is not None for r in results), results
        assert results == [(200, 60, True)] * 6
        assert [e.name for e in draining] == [victim]  # drained, not stopped at once
        # Its engine is gone once drained; new requests go to the engine that stays.
        gone = not psutil.pid_exists(running[victim]) or psutil.Process(running[victim]).status() == "zombie"
        assert gone and survivor.health == Health.HEALTHY
        after = httpx.post(
            f"{router.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"authorization": f"Bearer {key.secret}"},
            timeout=30,
        )
        assert after.status_code == 200, after.text
