"""Entitlements, aliases and flow control on real processes: router processes (uvicorn, the Channels app) in front
of a simulator engine that runs two requests at once, called with the official SDKs and raw HTTP."""

from __future__ import annotations

import asyncio
import threading
import time

import anthropic
import httpx
import openai
import pytest
import redis
from django.conf import settings

from routing.models import RoutingPolicy
from serving.models import Endpoint, Health, ModelDeployment, Pool
from tenants.keys import api_key_create
from tenants.models import ModelAlias, Scope, Team, Tenant
from tenants.usage_stream import stream_key

from ..serving.engines import MODEL_DIR, MODEL_NAME, start_engine
from .conftest import RouterProcess, start_router, wait_for_version
from .router_metrics import router_metrics
from .usage import usage_events

SLOTS = 2  # the engine's max_num_seqs


@pytest.fixture(scope="module")
def narrow_engine():
    # Two requests run at once; each output token takes 20 ms.
    engine = start_engine("sim", "--decode-time", "0.02", "--max-num-seqs", str(SLOTS))
    yield engine
    engine.stop()


class World:
    def __init__(self, routers: list[RouterProcess], engine):
        self.routers = routers
        self.deployment = ModelDeployment.objects.create(
            name="tiny",
            served_model_name=MODEL_NAME,
            model_source=str(MODEL_DIR),
            engine_kind="sim",
            max_model_len=4096,
        )
        pool = Pool.objects.create(deployment=self.deployment, name="main", replicas=1, max_num_seqs=SLOTS)
        Endpoint.objects.create(
            pool=pool, name="tiny-main-0", url=engine.url, role="both", health=Health.HEALTHY
        )
        self.policy = RoutingPolicy.objects.create(
            deployment=self.deployment, mode="least_loaded", max_wait_standard_s=30, max_wait_batch_s=30
        )
        self.teams: dict[str, Team] = {}
        self.keys: dict[str, str] = {}

    def tenant(
        self, slug: str, *, weight: int = 1, ceiling: str = "interactive", team_class: str = "standard"
    ):
        tenant = Tenant.objects.create(
            name=slug.title(), slug=slug, fair_share_weight=weight, max_priority_class=ceiling
        )
        team = Team.objects.create(tenant=tenant, name="Agents", slug="agents", priority_class=team_class)
        self.teams[slug] = team
        self.keys[slug] = api_key_create(team=team, name="agent", scopes=[Scope.INFERENCE]).secret
        return team

    def sync(self) -> None:
        from inference_platform.config_version import bump_config_version

        version = bump_config_version()
        for router in self.routers:
            wait_for_version(router, version)


@pytest.fixture
def world(transactional_db, narrow_engine):
    # Only this test's usage events in the stream (ids of tenants repeat from test to test).
    redis.Redis.from_url(settings.REDIS_URL).delete(stream_key())
    router = start_router()
    world = World([router], narrow_engine)
    yield world
    for router in world.routers:
        router.stop()


def chat(url: str, key: str, max_tokens: int, *, priority: str | None = None, timeout: float = 60) -> dict:
    """One streamed chat request; what it got and when its first token came (monotonic)."""
    headers = {"authorization": f"Bearer {key}"}
    if priority:
        headers["x-priority-class"] = priority
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Summarise the repository layout."}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    first = None
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=timeout
    ) as resp:
        for line in resp.iter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.monotonic()
        return {"status": resp.status_code, "first": first, "headers": dict(resp.headers)}


def saturate(world: World, key: str, tokens: int = 60, second: int | None = None) -> list[threading.Thread]:
    """Fill both of the engine's slots with long requests (`tokens` of 20 ms: 1.2 s; the second one `second`
    tokens if given), and wait until the router sees them."""
    lengths = [tokens, second or tokens]
    threads = [threading.Thread(target=chat, args=(world.routers[0].url, key, n)) for n in lengths]
    for thread in threads:
        thread.start()
    time.sleep(0.4)
    return threads


def router_metric(router: RouterProcess, name: str) -> float:
    text = router_metrics(router.url, timeout=5)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line == name
    )


# --- entitlements and aliases ------------------------------------------------------------------------------------


def test_a_team_restricted_to_other_models_gets_a_404_and_does_not_see_the_model(world):
    team = world.tenant("acme")
    world.sync()
    client = openai.OpenAI(base_url=f"{world.routers[0].url}/v1", api_key=world.keys["acme"], max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL_NAME]

    team.restrict_models = True
    team.save()
    world.sync()
    assert [m.id for m in client.models.list()] == []
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(
            model="no-such", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert refused.value.message.replace(MODEL_NAME, "no-such") == missing.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(MODEL_NAME)

    team.deployments.add(world.deployment)  # entitled again, by name
    world.sync()
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.usage.completion_tokens == 4


def test_a_key_narrowed_to_no_model_of_its_team_is_refused(world):
    world.tenant("acme")
    narrowed = api_key_create(team=world.teams["acme"], name="narrow", scopes=[Scope.INFERENCE])
    other = ModelDeployment.objects.create(
        name="other", served_model_name="other-model", model_source=str(MODEL_DIR), engine_kind="sim"
    )
    narrowed.api_key.deployments.add(other)
    world.sync()
    client = anthropic.Anthropic(base_url=world.routers[0].url, api_key=narrowed.secret, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as refused:
        client.messages.create(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["error"]["type"] == "not_found_error"
    assert MODEL_NAME not in [m.id for m in client.models.list()]


def test_an_alias_serves_its_deployment_and_moves_with_it(world):
    world.tenant("acme")
    world.tenant("globex")
    ModelAlias.objects.create(tenant=world.teams["acme"].tenant, name="coder", deployment=world.deployment)
    world.sync()
    url = world.routers[0].url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=world.keys["acme"], max_retries=0)
    assert sorted(m.id for m in client.models.list()) == ["coder", MODEL_NAME]
    reply = client.chat.completions.create(
        model="coder", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.usage.completion_tokens == 3
    claude = anthropic.Anthropic(base_url=url, api_key=world.keys["acme"], max_retries=0)
    message = claude.messages.create(
        model="coder", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.usage.output_tokens == 3
    assert claude.messages.count_tokens(
        model="coder", messages=[{"role": "user", "content": "hi"}]
    ).input_tokens
    tenant_id = world.teams["acme"].tenant_id
    [event] = [e for e in usage_events(wait_for=2) if e.tenant_id == tenant_id and e.output_tokens == 3][:1]
    assert event.deployment_id == world.deployment.id

    # Another tenant's agents cannot call it.
    other = openai.OpenAI(base_url=f"{url}/v1", api_key=world.keys["globex"], max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.create(
            model="coder", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )


# --- priority classes and flow control -----------------------------------------------------------------------------


def test_queued_requests_leave_by_class_and_usage_records_carry_it(world):
    world.tenant("acme", team_class="interactive")
    world.sync()
    key, url = world.keys["acme"], world.routers[0].url
    # Slots free one at a time, 0.8 s apart: at 1.2 s (the first), 2.0 s (the first waiter let through, 0.8 s
    # long), 2.8 s (the second); the second long request holds its slot until 3 s.
    busy = saturate(world, key, 60, 150)
    results: dict[str, dict] = {}

    def one(priority: str) -> None:
        results[priority] = chat(url, key, 40, priority=priority)

    waiting = []
    for priority in ("batch", "standard", "interactive"):  # arrive lowest class first
        thread = threading.Thread(target=one, args=(priority,))
        thread.start()
        waiting.append(thread)
        time.sleep(0.15)
    assert router_metric(world.routers[0], "router_flow_queued_requests") == 3
    for thread in busy + waiting:
        thread.join(30)
    assert {p: r["status"] for p, r in results.items()} == dict.fromkeys(results, 200)
    order = sorted(results, key=lambda p: results[p]["first"])
    assert order == ["interactive", "standard", "batch"]
    events = [e for e in usage_events(wait_for=5) if e.tenant_id == world.teams["acme"].tenant_id]
    assert sorted(e.priority_class for e in events if e.output_tokens == 40) == [
        "batch",
        "interactive",
        "standard",
    ]
    assert all(e.queued_ms and e.queued_ms > 300 for e in events if e.output_tokens == 40)


def test_a_key_cannot_ask_for_a_class_above_its_own(world):
    world.tenant("acme", ceiling="standard", team_class="standard")
    world.sync()
    reply = chat(world.routers[0].url, world.keys["acme"], 2, priority="interactive")
    assert reply["status"] == 403


def test_a_request_waiting_past_its_class_limit_gets_a_429_and_pays_nothing(world):
    world.policy.max_wait_batch_s = 0.5
    world.policy.save()
    world.tenant("acme")
    world.sync()
    key, url = world.keys["acme"], world.routers[0].url
    busy = saturate(world, key, tokens=150)
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key=key, max_retries=0, default_headers={"x-priority-class": "batch"}
    )
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert 0.4 < time.monotonic() - started < 1.2
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.code == "overloaded" and "saturated" in refused.value.message
    claude = anthropic.Anthropic(
        base_url=url, api_key=key, max_retries=0, default_headers={"x-priority-class": "batch"}
    )
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        claude.messages.create(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert overloaded.value.status_code == 529
    assert overloaded.value.body["error"]["type"] == "overloaded_error"
    for thread in busy:
        thread.join(30)
    tenant_id = world.teams["acme"].tenant_id
    rejected = [e for e in usage_events(wait_for=4) if e.status == "rejected" and e.tenant_id == tenant_id]
    assert len(rejected) == 2
    assert all((e.prompt_tokens, e.output_tokens, e.priority_class) == (0, 0, "batch") for e in rejected)
    assert router_metric(world.routers[0], "router_flow_rejected_total") == 2


def test_a_client_that_disconnects_while_queued_leaves_the_queue_and_pays_nothing(world, narrow_engine):
    world.tenant("acme")
    world.sync()
    key, url = world.keys["acme"], world.routers[0].url
    before = narrow_engine.metrics().get("vllm:request_success_total", 0)
    busy = saturate(world, key)
    with pytest.raises(httpx.ReadTimeout):
        chat(url, key, 4, timeout=0.5)
    time.sleep(0.3)
    assert router_metric(world.routers[0], "router_flow_queued_requests") == 0
    for thread in busy:
        thread.join(30)
    events = usage_events(wait_for=3)
    [gone] = [e for e in events if e.status == "cancelled" and e.tenant_id == world.teams["acme"].tenant_id]
    assert (gone.prompt_tokens, gone.output_tokens, gone.endpoint) == (0, 0, "")
    time.sleep(0.5)
    assert (
        narrow_engine.metrics().get("vllm:request_success_total", 0) - before == SLOTS
    )  # it never got there


async def flood(url: str, key: str, seconds: float, concurrency: int, max_tokens: int) -> int:
    """`concurrency` agents sending back to back for `seconds`; the output tokens they got."""
    done = 0
    stop = time.monotonic() + seconds
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens}

    async def agent(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < stop:
            reply = await client.post(f"{url}/v1/chat/completions", json=body)
            if reply.status_code == 200 and time.monotonic() < stop:
                done += reply.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=60, headers={"authorization": f"Bearer {key}"}) as client:
        await asyncio.gather(*(agent(client) for _ in range(concurrency)))
    return done


async def two_floods(world: World, urls: tuple[str, str], seconds: float) -> tuple[int, int]:
    a, b = await asyncio.gather(
        flood(urls[0], world.keys["a"], seconds, 6, 10), flood(urls[1], world.keys["b"], seconds, 6, 10)
    )
    return a, b


def test_two_flooding_tenants_share_the_engine_by_their_weights(world):
    world.tenant("a", weight=3)
    world.tenant("b", weight=1)
    world.sync()
    url = world.routers[0].url
    a, b = asyncio.run(two_floods(world, (url, url), 8))
    assert a + b > 0
    assert 2.4 < a / b < 3.75, (a, b)  # 3:1 within a fifth over eight seconds


def test_the_shares_hold_across_two_router_replicas(world, narrow_engine):
    world.routers.append(start_router())
    world.tenant("a")
    world.tenant("b")
    world.sync()
    # Each tenant comes through its own replica: only the shared work figures and queues can keep them even.
    a, b = asyncio.run(two_floods(world, (world.routers[0].url, world.routers[1].url), 8))
    assert 0.75 < a / b < 1.33, (a, b)
