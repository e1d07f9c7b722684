"""KV-event ingestion throughput: blocks per second from msgpack event batches into the real Redis index.

    .venv/bin/python -m bench.kv_ingest

Without REDIS_URL it re-runs itself under the devstack (state in .local/bench-kv); uses Redis database 15 and
deletes its px:/pxe: keys before and after.
Two paths per batch shape, both single-threaded in this process:
- handle: pre-encoded batches through KVIngester.handle (sequence check, msgpack decode, router keys, writes
  sent as one script call per 256 batches, as a busy poll round drains them);
- zmq: a publisher process sends the same batches over a PUB socket; the ingester's own poll loop receives,
  applies and writes them (end to end).
blocks/s is over wall time (it includes waiting for Redis to run the writes); blocks/cpu-s over this process's
CPU time, i.e. what one ingester core sustains when Redis runs on another.
Synthetic workload: 128-token blocks; each batch is one BlockStored chaining `blocks` new blocks onto the
previous batch's last block (a new prompt every 32 batches), plus one BlockRemoved of an older block.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import sys
import threading
import time

import msgpack
import redis
import zmq

from bench import harness as h

BENCH_REDIS_DB = 15

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

BLOCK = 128


def make_batches(count: int, blocks: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    payloads = []
    next_hash = 1
    parent = None
    stored: list[int] = []
    for index in range(count):
        if index % 32 == 0:
            parent = None
        hashes = list(range(next_hash, next_hash + blocks))
        next_hash += blocks
        events = [
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": [rng.randrange(150_000) for _ in range(blocks * BLOCK)],
                "block_size": BLOCK,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None] * blocks,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        ]
        if len(stored) > 64:
            events.append(
                {"type": "BlockRemoved", "block_hashes": [stored.pop(0)], "medium": "GPU", "group_idx": 0}
            )
        stored.extend(hashes)
        parent = hashes[-1]
        payloads.append(msgpack.packb([time.time(), events, 0], use_bin_type=True))
    return payloads


def clean(client: redis.Redis) -> None:
    for pattern in ("px:*", "pxe:*", "pxsp:*"):
        keys = list(client.scan_iter(match=pattern, count=10_000))
        for start in range(0, len(keys), 10_000):
            client.delete(*keys[start : start + 10_000])


def ingester(client: redis.Redis):
    from routing.kvindex.kv_ingest import Source
    from routing.kvindex.kv_ingest_stream import KVIngester

    ing = KVIngester(client)
    ing.sources[1] = Source(1, 1, "bench-model", "http://127.0.0.1:1")
    ing.replay_endpoints[1] = None
    return ing


def run_handle(client: redis.Redis, payloads: list[bytes]) -> tuple[float, float]:
    ing = ingester(client)
    source = ing.sources[1]
    started, cpu = time.perf_counter(), time.process_time()
    for start in range(0, len(payloads), 256):
        for seq in range(start, min(start + 256, len(payloads))):
            ing.handle(ing.writes, source, seq, payloads[seq])
        ing.writes.flush()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    ing.close()
    return elapsed, cpu


def publish(endpoint: str, payloads: list[bytes], ready) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(0)
    pub.bind(endpoint)
    ready.wait()
    time.sleep(0.5)  # let the subscription arrive
    for seq, payload in enumerate(payloads):
        pub.send_multipart((b"kv@127.0.0.1:1@bench-model", seq.to_bytes(8, "big"), payload))
    time.sleep(1)
    pub.close(linger=2000)
    ctx.term()


def run_zmq(client: redis.Redis, payloads: list[bytes]) -> tuple[float, float]:
    ing = ingester(client)
    port = 20000 + random.randrange(20000)
    endpoint = f"tcp://127.0.0.1:{port}"
    sock = ing._sub()
    sock.connect(endpoint)
    ing.sockets[1] = sock
    ing.socket_source[sock] = 1
    ing.poller.register(sock, zmq.POLLIN)
    ready = multiprocessing.Event()
    publisher = multiprocessing.Process(target=publish, args=(endpoint, payloads, ready))
    publisher.start()
    ready.set()
    source = ing.sources[1]
    while source.last_seq < 0:
        ing.poll_once(100)
    started, cpu = time.perf_counter(), time.process_time()
    deadline = time.monotonic() + 120
    while source.last_seq < len(payloads) - 1 and time.monotonic() < deadline:
        ing.poll_once(100)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    publisher.join()
    ing.close()
    if source.last_seq < len(payloads) - 1:
        raise RuntimeError(f"received up to seq {source.last_seq} of {len(payloads) - 1}")
    return elapsed, cpu


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 8, 16])
    args = parser.parse_args(argv)
    h.under_devstack("kv_ingest", argv, ("REDIS_URL",), state_dir=".local/bench-kv")
    import django

    django.setup()
    # named in the URL: a `db=` argument to from_url loses to the URL's own database (redis://host:port/0)
    client = redis.Redis.from_url(h.with_path(os.environ["REDIS_URL"], f"/{BENCH_REDIS_DB}"))
    print(
        f"{'blocks/batch':>12} {'path':>7} {'batches':>8} {'blocks':>8} {'wall s':>7} {'blocks/s':>9} {'cpu s':>6} {'blocks/cpu-s':>12}"
    )
    for blocks in args.blocks:
        batches = max(1000, args.batches // blocks)
        payloads = make_batches(batches, blocks)
        for path, runner in (("handle", run_handle), ("zmq", run_zmq)):
            clean(client)
            elapsed, cpu = runner(client, payloads)
            total = batches * blocks
            print(
                f"{blocks:>12} {path:>7} {batches:>8} {total:>8} {elapsed:>7.2f} {total / elapsed:>9,.0f}"
                f" {cpu:>6.2f} {total / cpu:>12,.0f}"
            )
    clean(client)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main(sys.argv[1:]))
