"""Hot-path figures of prefix-aware routing, each measured on its own and printed as one table.

- index lookup: one PrefixIndex.lookup (one Lua call in Redis) for a 200K-token prompt (1,563 blocks of 128
  tokens), with the index holding that prompt's blocks on 8 endpoints to different depths;
- block keys: the router's chained keys for the same prompt;
- tokenisation per turn: a 200K-token conversation that grows by a short turn, tokenised with the router's
  piece cache (the first turn pays for everything, later turns for their new text only).

    .venv/bin/python bench/hot_path.py     (re-runs itself under the dev stack when REDIS_URL is unset)
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BLOCK = 128
BLOCKS = 1563
ENDPOINTS = 8
DEPLOYMENT = 990_001  # a deployment id no real deployment uses


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(name: str, samples_ms: list[float], note: str = "") -> tuple:
    return (name, len(samples_ms), statistics.median(samples_ms), percentile(samples_ms, 0.9), note)


async def bench_lookup(redis_url: str) -> list[tuple]:
    import redis.asyncio as aioredis

    from routing.blocks import block_keys, chain_seed, hex_keys
    from routing.prefix_index import PrefixIndex

    client = aioredis.Redis.from_url(redis_url)
    rng = random.Random(1)
    tokens = [rng.randrange(100, 4000) for _ in range(BLOCKS * BLOCK)]
    keys = hex_keys(block_keys(tokens, BLOCK, chain_seed("bench")))
    assert len(keys) == BLOCKS
    # Endpoint e holds the first (e + 1) / 8 of the prompt: every lookup walks all 1,563 blocks.
    async with client.pipeline(transaction=False) as pipe:
        for endpoint in range(ENDPOINTS):
            depth = BLOCKS * (endpoint + 1) // ENDPOINTS
            for key in keys[:depth]:
                pipe.hset(f"px:{DEPLOYMENT}:{key}", str(endpoint), "g")
        await pipe.execute()
    index = PrefixIndex(client)
    held = await index.lookup(DEPLOYMENT, keys)
    assert held[ENDPOINTS - 1].gpu == BLOCKS and held[0].gpu == BLOCKS // ENDPOINTS
    samples = []
    for _ in range(300):
        start = time.perf_counter()
        await index.lookup(DEPLOYMENT, keys)
        samples.append((time.perf_counter() - start) * 1000)
    miss = []
    cold = hex_keys(block_keys(tokens[::-1], BLOCK, chain_seed("bench")))
    for _ in range(300):
        start = time.perf_counter()
        await index.lookup(DEPLOYMENT, cold)
        miss.append((time.perf_counter() - start) * 1000)
    async with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.delete(f"px:{DEPLOYMENT}:{key}")
        await pipe.execute()
    await client.aclose()

    hashing = []
    for _ in range(50):
        start = time.perf_counter()
        block_keys(tokens, BLOCK, chain_seed("bench"))
        hashing.append((time.perf_counter() - start) * 1000)
    return [
        row("index lookup, 200K tokens, 8 endpoints holding 1/8..8/8", samples, "target: median <= 2 ms"),
        row("index lookup, 200K tokens, no block held", miss),
        row("block keys, 200K tokens (1,563 blocks)", hashing),
    ]


def bench_tokenize() -> list[tuple]:
    from routing.tokenize import RouterTokenizer

    tokenizer = RouterTokenizer(ROOT / "models" / "tiny-qwen")
    source = (Path(os.__file__).parent / "typing.py").read_text()
    context = source
    while len(tokenizer.encode_text(context)) < 200_000:
        context += source
    history = [{"role": "system", "content": context}]
    start = time.perf_counter()
    total = len(tokenizer.encode_chat(history))
    first = [(time.perf_counter() - start) * 1000]
    turns = []
    for turn in range(50):
        history = [
            *history,
            {"role": "user", "content": f"Now change function number {turn} and rerun tests."},
            {"role": "assistant", "content": f"Changed function {turn}; the tests pass."},
        ]
        start = time.perf_counter()
        tokenizer.encode_chat(history)
        turns.append((time.perf_counter() - start) * 1000)
    return [
        row(f"tokenise first turn ({total:,} tokens)", first),
        row("tokenise each next turn (+~30 tokens)", turns, "in proportion to the new text"),
    ]


def main() -> None:
    redis_url = os.environ.get("REDIS_URL")
    if not redis_url:
        os.execv(
            sys.executable,
            [sys.executable, "-m", "inference_platform.devstack", "exec", "--", sys.executable, *sys.argv],
        )
    rows = asyncio.run(bench_lookup(redis_url)) + bench_tokenize()
    print(f"{'measure':58} {'n':>5} {'median ms':>10} {'p90 ms':>9}  note")
    for name, n, median, p90, note in rows:
        print(f"{name:58} {n:>5} {median:>10.3f} {p90:>9.3f}  {note}")


if __name__ == "__main__":
    main()
