"""The index lookups on their own: the exact walk and the bisection agree where cached blocks form prefixes;
and the speculative entries a routing decision writes."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from inference_platform.ports import free_port
from routing.info import DeploymentInfo, EndpointInfo, PolicyInfo
from routing.kvindex.blocks import block_keys, chain_seed, hex_keys
from routing.kvindex.prefix import PrefixRouting, index_vs_record
from routing.kvindex.prefix_index import BISECT_FROM_BLOCKS, Held, PrefixIndex
from routing.rendering.tokenize import token_ids
from routing.scheduling.affinity import ApproximateIndex
from routing.scheduling.load import EndpointLoad
from routing.scheduling.pipeline import Candidate
from routing.server import metrics


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("blocks", [10, BISECT_FROM_BLOCKS + 37])
def test_walk_and_bisection_agree_on_prefix_closed_holdings(blocks):
    deployment = 880_000 + blocks
    rng = random.Random(blocks)
    keys = hex_keys(block_keys([rng.randrange(100, 4000) for _ in range(blocks * 16)], 16, chain_seed("t")))
    # endpoint -> (GPU blocks, then CPU blocks)
    holdings = {1: (blocks, 0), 2: (blocks // 3, 0), 3: (2, blocks // 2), 4: (0, 5)}

    async def scenario():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            async with client.pipeline(transaction=False) as pipe:
                for endpoint, (gpu, cpu) in holdings.items():
                    for index, key in enumerate(keys[: gpu + cpu]):
                        pipe.hset(f"px:{deployment}:{key}", str(endpoint), "g" if index < gpu else "c")
                await pipe.execute()
            index = PrefixIndex(client)
            found = await index.lookup(deployment, keys)
            walked = await index._walk(args=[f"px:{deployment}:", "".join(keys)])
            missing = await index.lookup(
                deployment, hex_keys(block_keys(list(range(200, 400)), 16, chain_seed("t")))
            )
            return found, walked, missing
        finally:
            await client.delete(*[f"px:{deployment}:{key}" for key in keys])
            await client.aclose()

    found, walked, missing = run(scenario())
    expected = {endpoint: Held(gpu, cpu, 0) for endpoint, (gpu, cpu) in holdings.items()}
    assert found == expected
    walked = {
        int(walked[i]): Held(int(walked[i + 1]), int(walked[i + 2]), int(walked[i + 3]))
        for i in range(0, len(walked), 4)
    }
    assert walked == expected
    assert missing == {}


def precise_deployment(deployment_id: int) -> DeploymentInfo:
    """A precise deployment of model "t" (16-token blocks) on endpoints 1 and 2, which nothing here calls."""
    return DeploymentInfo(
        id=deployment_id,
        name="t",
        served_model_name="t",
        max_model_len=32768,
        block_size=16,
        policy=PolicyInfo(mode="precise"),
        endpoints=tuple(EndpointInfo(i, f"e{i}", f"http://127.0.0.1:{9000 + i}", "both", 1) for i in (1, 2)),
        created=0,
    )


def prefix_routing(client, lookup_timeout: float = 5.0) -> PrefixRouting:
    """The router's prefix routing on this Redis client. Its lookups wait up to `lookup_timeout` before routing
    on the replica's own record: production's 10 ms is too little for a test machine busy with engines, except in
    the test of that fallback, which sets its own."""
    routing = PrefixRouting(client)
    routing.lookup_timeout = lookup_timeout
    return routing


async def ask(routing: PrefixRouting, deployment: DeploymentInfo, tokens: list[int]):
    """The routing inputs of a completion whose prompt is these token ids, as the router builds them."""
    return await routing.context(deployment, {"prompt": tokens}, token_ids(tokens), "/v1/completions", None)


def test_a_decision_writes_speculative_entries_only_for_the_blocks_the_chosen_engine_lacks():
    deployment = precise_deployment(881_001)
    endpoints = deployment.endpoints
    tokens = [random.Random(7).randrange(100, 4000) for _ in range(20 * 16 + 5)]
    keys = hex_keys(block_keys(tokens, 16, chain_seed("t")))

    async def decide(routing: PrefixRouting, endpoint: EndpointInfo):
        ctx = await ask(routing, deployment, tokens)
        candidates = [Candidate(e, EndpointLoad()) for e in endpoints]
        predicted = routing.chosen(deployment, ctx, candidates[endpoints.index(endpoint)], candidates)
        await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not asyncio.current_task()))
        return ctx.held, predicted

    async def scenario():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            for key in keys[:12]:
                await client.hset(f"px:{deployment.id}:{key}", "1", "g")
            routing = prefix_routing(client)
            speculate, sent = routing.index.speculate, []

            async def recorded(deployment_id, endpoint_id, block_keys):
                sent.append((endpoint_id, list(block_keys)))
                await speculate(deployment_id, endpoint_id, block_keys)

            routing.index.speculate = recorded
            first = await decide(routing, endpoints[0])
            written_first = set(await client.zrange(f"pxsp:{deployment.id}", 0, -1))
            second = await decide(routing, endpoints[1])
            written = set(await client.zrange(f"pxsp:{deployment.id}", 0, -1)) - written_first
            after = await routing.index.lookup(deployment.id, keys)
            return first, written_first, second, written, after, sent
        finally:
            await client.delete(f"pxsp:{deployment.id}", *[f"px:{deployment.id}:{key}" for key in keys])
            await client.aclose()

    (held, predicted), written_first, (held_second, _), written_second, after, sent = run(scenario())
    assert held == {1: Held(gpu=12)} and predicted == 12 * 16
    # Endpoint 1 holds the first 12 blocks: only the 8 after them are sent, and get speculative entries.
    assert sent == [(1, keys[12:]), (2, keys)]
    assert written_first == {f"1|{key}".encode() for key in keys[12:]}
    assert held_second == {1: Held(gpu=12, speculative=8)}
    # Endpoint 2 held nothing of the prompt: every block gets one.
    assert written_second == {f"2|{key}".encode() for key in keys}
    assert after == {1: Held(gpu=12, speculative=8), 2: Held(speculative=20)}


def test_the_replicas_record_gives_each_endpoints_leading_blocks_and_those_sent_since_a_moment():
    record = ApproximateIndex(capacity_blocks=100)
    keys = [f"{i:016x}" for i in range(10)]
    record.record(1, keys[:6], now=100.0)
    record.record(2, keys[:3], now=100.5)
    record.record(1, keys[:2], now=100.6)
    assert record.lookup(keys) == {1: 6, 2: 3}
    assert record.lookup(["f" * 16, *keys]) == {}  # a different first block: nothing leads
    # Sent since 100.4: endpoint 1 only its last two blocks (sent again at 100.6), endpoint 2 its three.
    assert record.lookup(keys, since=100.4) == {1: 2, 2: 3}
    assert record.lookup(keys, since=100.55) == {1: 2}
    assert record.lookup(keys, since=100.7) == {}


def test_a_lookup_in_flight_at_a_decision_sees_that_decision_when_it_comes_back():
    """Two requests sharing a new prompt, a moment apart: the second one's lookup left for Redis before the
    first was placed, so Redis's answer cannot hold the first's speculative entries; the router's own record
    of its recent decisions fills them in."""
    deployment = precise_deployment(881_002)
    endpoints = deployment.endpoints
    tokens = [random.Random(8).randrange(100, 4000) for _ in range(10 * 16)]
    keys = hex_keys(block_keys(tokens, 16, chain_seed("t")))

    async def scenario():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            routing = prefix_routing(client)
            lookup, answered, release = routing.index.lookup, asyncio.Event(), asyncio.Event()

            async def held_back(deployment_id, block_keys):
                found = await lookup(deployment_id, block_keys)
                answered.set()
                await release.wait()  # Redis has answered; the first request is placed meanwhile
                return found

            first = await ask(routing, deployment, tokens)
            routing.index.lookup = held_back
            second = asyncio.create_task(ask(routing, deployment, tokens))
            await answered.wait()
            candidates = [Candidate(e, EndpointLoad()) for e in endpoints]
            routing.chosen(deployment, first, candidates[1], candidates)
            release.set()
            second = await second
            await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not asyncio.current_task()))
            return first.held, second.held
        finally:
            await client.delete(f"pxsp:{deployment.id}", *[f"px:{deployment.id}:{key}" for key in keys])
            await client.aclose()

    first, second = run(scenario())
    assert first == {}
    assert second == {2: Held(speculative=10)}


def fallback_count(reason: str) -> float:
    return metrics.of(metrics.index_fallbacks, "t", reason)._value.get()


@pytest.mark.parametrize("redis_is", ["refusing connections", "not answering"])
def test_when_redis_fails_or_stalls_a_precise_lookup_routes_on_the_replicas_own_record(redis_is):
    """No mock: a port nobody listens on, or a server that accepts and never answers."""
    deployment = precise_deployment(881_003)
    endpoints = deployment.endpoints
    tokens = [random.Random(9).randrange(100, 4000) for _ in range(6 * 16)]
    reason = "error" if redis_is == "refusing connections" else "timeout"

    async def scenario():
        silent = None
        if redis_is == "refusing connections":
            url = f"redis://127.0.0.1:{free_port()}/0"
        else:
            silent = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
            url = f"redis://127.0.0.1:{silent.sockets[0].getsockname()[1]}/0"
        client = aioredis.Redis.from_url(url, socket_timeout=5)
        try:
            # A refused connection is an error however long it takes; a silent server is waited on 0.2 s.
            routing = prefix_routing(client, 5.0 if redis_is == "refusing connections" else 0.2)
            candidates = [Candidate(e, EndpointLoad()) for e in endpoints]
            first = await ask(routing, deployment, tokens[:64])
            routing.chosen(deployment, first, candidates[1], candidates)
            started = time.perf_counter()
            second = await ask(routing, deployment, tokens)
            return first.held, second.held, time.perf_counter() - started
        finally:
            await client.aclose()
            if silent is not None:
                silent.close()

    before = fallback_count(reason)
    first, second, took = run(scenario())
    assert first == {}
    # The first request's 4 blocks, from where this replica sent them.
    assert second == {2: Held(speculative=4)}
    assert fallback_count(reason) == before + 2
    assert took < 1.0  # not held up until the client's own 5 s socket timeout


def test_a_lookup_timer_made_late_by_a_busy_loop_waits_one_more_period_for_the_index():
    """The loop held 60 ms (a large body parsed, say) just as a lookup was sent: its 20 ms timer fires 40 ms
    late, with Redis's answer waiting to be read. The index answers; a stalled Redis still falls back."""
    deployment = precise_deployment(881_005)
    tokens = [random.Random(13).randrange(100, 4000) for _ in range(4 * 16)]
    keys = hex_keys(block_keys(tokens, 16, chain_seed("t")))

    async def scenario():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            for key in keys:
                await client.hset(f"px:{deployment.id}:{key}", "1", "g")
            routing = prefix_routing(client, 0.02)
            await ask(routing, deployment, tokens[:16])  # connected: the next lookup is one round trip
            asyncio.get_running_loop().call_soon(time.sleep, 0.06)
            return await ask(routing, deployment, tokens)
        finally:
            await client.delete(f"pxsp:{deployment.id}", *[f"px:{deployment.id}:{key}" for key in keys])
            await client.aclose()

    late_before, fallbacks_before = (
        metrics.of(metrics.index_late_loop, "t")._value.get(),
        fallback_count("timeout"),
    )
    ctx = run(scenario())
    assert ctx.from_index and ctx.held == {1: Held(gpu=4)}
    assert metrics.of(metrics.index_late_loop, "t")._value.get() == late_before + 1
    assert fallback_count("timeout") == fallbacks_before


def test_index_vs_record_says_which_way_the_engines_differ_from_what_the_replica_sent():
    assert index_vs_record({1: Held(gpu=10)}, {1: 10}) == "same"
    assert index_vs_record({1: Held(gpu=4, speculative=6)}, {1: 10}) == "same"
    assert index_vs_record({}, {}) == "same"
    assert index_vs_record({1: Held(gpu=10), 2: Held(gpu=6)}, {1: 10}) == "engines_hold_more"
    assert index_vs_record({1: Held(gpu=4)}, {1: 10}) == "engines_hold_less"
    assert index_vs_record({1: Held(cpu=3)}, {1: 10, 2: 2}) == "engines_hold_less"
    assert index_vs_record({1: Held(gpu=4), 2: Held(gpu=6)}, {1: 10}) == "both"


def compared_count(answer: str) -> float:
    return metrics.of(metrics.index_vs_record, "t", answer)._value.get()


@pytest.mark.parametrize("engines", ["hold what another replica sent", "evicted what this replica sent"])
def test_a_sampled_decision_compares_the_index_with_the_replicas_record(engines, caplog):
    deployment = precise_deployment(881_004)
    endpoints = deployment.endpoints
    tokens = [random.Random(11).randrange(100, 4000) for _ in range(8 * 16)]
    keys = hex_keys(block_keys(tokens, 16, chain_seed("t")))
    answer = "engines_hold_more" if engines == "hold what another replica sent" else "engines_hold_less"

    async def scenario():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            routing = prefix_routing(client)
            routing.sample_rate = 1.0
            routing.recent_s = 0.0  # the record's sends below are not this moment's decisions
            if answer == "engines_hold_more":
                for key in keys[:6]:  # endpoint 2 holds 6 blocks this replica never sent there
                    await client.hset(f"px:{deployment.id}:{key}", "2", "g")
            else:
                routing.approximate.record(2, keys, now=time.monotonic() - 5)  # sent, since evicted
            ctx = await ask(routing, deployment, tokens)
            candidates = [Candidate(e, EndpointLoad()) for e in endpoints]
            routing.chosen(deployment, ctx, candidates[0], candidates)
            await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not asyncio.current_task()))
            return ctx
        finally:
            await client.delete(f"pxsp:{deployment.id}", *[f"px:{deployment.id}:{key}" for key in keys])
            await client.aclose()

    before = compared_count(answer)
    with caplog.at_level("INFO", logger="routing.decisions"):
        ctx = run(scenario())
    assert ctx.from_index
    assert compared_count(answer) == before + 1
    assert f"index_vs_record={answer}" in caplog.text
