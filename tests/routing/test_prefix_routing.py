"""Prefix-aware routing through the real router: a conversation whose context grows stays where its prefix is
cached, other conversations spread, a session sticks, and the load guard stops a burst piling onto one engine."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from routing.models import RoutingPolicy

from ..serving.engines import MODEL_NAME, start_engine
from .conftest import make_fleet
from .usage import usage_events


def conversation(seed: int, turns: int) -> list[list[dict]]:
    history = [{"role": "system", "content": f"Agent {seed}. " + "You work on repository files. " * 60}]
    rounds = []
    for turn in range(turns):
        history = [*history, {"role": "user", "content": f"step {turn} of task {seed}"}]
        rounds.append(list(history))
        history = [*history, {"role": "assistant", "content": f"done step {turn}"}]
    return rounds


def ask(fleet, messages, **extra) -> httpx.Response:
    headers = {"authorization": f"Bearer {fleet.key.secret}", **extra.pop("headers", {})}
    response = httpx.post(
        f"{fleet.router.url}/v1/chat/completions",
        headers=headers,
        timeout=60,
        json={"model": MODEL_NAME, "messages": messages, "max_tokens": 2, **extra},
    )
    assert response.status_code == 200, response.text
    return response


@pytest.fixture
def four_engines():
    engines = [start_engine("sim", "--decode-time", "0.001", events=False) for _ in range(4)]
    yield engines
    for engine in engines:
        engine.stop()


@pytest.fixture
def approx_fleet(router_process, four_engines):
    fleet = make_fleet(router_process, four_engines)
    RoutingPolicy.objects.create(deployment=fleet.deployment, mode="approximate")
    fleet.sync()
    return fleet


def test_a_growing_conversation_stays_on_the_engine_holding_its_prefix(approx_fleet):
    ids = [ask(approx_fleet, messages).headers["x-request-id"] for messages in conversation(1, 5)]
    events = sorted(usage_events(ids, wait_for=5), key=lambda e: ids.index(e.request_id))
    assert len({e.endpoint for e in events}) == 1
    assert all(e.cached_prompt_tokens >= 256 for e in events[1:])  # the engine really had the prefix


def test_different_conversations_spread_over_the_engines(approx_fleet):
    ids = [ask(approx_fleet, conversation(seed, 1)[0]).headers["x-request-id"] for seed in range(8)]
    endpoints = [e.endpoint for e in usage_events(ids, wait_for=8)]
    assert len(set(endpoints)) == 4 and max(endpoints.count(e) for e in set(endpoints)) == 2


def test_a_session_sticks_to_its_engine(router_process, four_engines):
    fleet = make_fleet(router_process, four_engines)
    RoutingPolicy.objects.create(deployment=fleet.deployment, mode="least_loaded", session_affinity_weight=5)
    fleet.sync()
    ids = [
        ask(fleet, [{"role": "user", "content": f"short {i}"}], headers={"x-session-id": "s-1"}).headers[
            "x-request-id"
        ]
        for i in range(6)
    ]
    assert len({e.endpoint for e in usage_events(ids, wait_for=6)}) == 1


def test_the_load_guard_spreads_a_burst_sharing_one_prefix(router_process):
    engines = [start_engine("sim", "--decode-time", "0.02", events=False) for _ in range(2)]
    try:
        fleet = make_fleet(router_process, engines)
        RoutingPolicy.objects.create(deployment=fleet.deployment, mode="approximate", load_guard_ratio=1.0)
        fleet.sync()
        shared = conversation(7, 1)[0]
        ask(fleet, shared)  # the prefix now lives on one engine

        async def burst():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(
                    *[
                        client.post(
                            f"{fleet.router.url}/v1/chat/completions",
                            headers={"authorization": f"Bearer {fleet.key.secret}"},
                            json={
                                "model": MODEL_NAME,
                                "max_tokens": 20,
                                "messages": [*shared, {"role": "user", "content": f"sub-agent {i}"}],
                            },
                        )
                        for i in range(8)
                    ]
                )

        ids = [r.headers["x-request-id"] for r in asyncio.run(burst())]
        endpoints = [e.endpoint for e in usage_events(ids, wait_for=8)]
        assert len(set(endpoints)) == 2  # without the guard all eight would go to the prefix's engine
    finally:
        for engine in engines:
            engine.stop()


def test_a_policy_changed_through_the_api_applies_without_a_restart(approx_fleet, client_for):
    from django.contrib.auth import get_user_model

    from inference_platform.config_version import CONFIG_VERSION_KEY, _redis

    operator = get_user_model().objects.create_superuser("ops", password="long-enough-password-1")
    policy = RoutingPolicy.objects.get(deployment=approx_fleet.deployment)
    before = int(_redis().get(CONFIG_VERSION_KEY))
    response = client_for(operator).patch(
        f"/api/routing-policies/{policy.pk}/", {"mode": "round_robin"}, format="json"
    )
    assert response.status_code == 200
    from .conftest import wait_for_version

    wait_for_version(approx_fleet.router, before + 1)
    # Round-robin now: one conversation's turns go to every engine in turn instead of staying on one.
    ids = [ask(approx_fleet, messages).headers["x-request-id"] for messages in conversation(3, 4)]
    assert len({e.endpoint for e in usage_events(ids, wait_for=4)}) == 4
