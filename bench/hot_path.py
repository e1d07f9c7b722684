"""Hot-path figures of prefix-aware routing, each measured on its own and printed as one table.

- index lookup: one PrefixIndex.lookup (one Lua call in Redis) for a 200K-token prompt (1,563 blocks of 128
  tokens), with the index holding that prompt's blocks on 8 endpoints to different depths;
- block keys: the router's chained keys for the same prompt;
- tokenisation per turn: a 200K-token conversation that grows by a short turn, tokenised with the router's
  piece cache (the first turn pays for everything, later turns for their new text only);
- the router's whole per-turn cost for the next turn of a ~200K-token tool-using session, Claude Code-shaped and
  OpenAI-shaped: parse the body, render it as the engine will, tokenise, block keys, the precise index lookup;
  each part, the turn's CPU time, and the render the whole template would take on the same turns.

    .venv/bin/python -m bench.hot_path [--rounds N]     (re-runs itself under the dev stack when REDIS_URL is unset)

With rounds, each row is the median of the rounds' medians, with their range; the last line says how much of the
machine its host (a VM's) took for others meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from bench import harness as h

ROOT = h.ROOT

BLOCK = 128
BLOCKS = 1563
ENDPOINTS = 8
DEPLOYMENT = 990_001  # a deployment id no real deployment uses


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(name: str, samples_ms: list[float], note: str = "") -> tuple:
    return (name, samples_ms, note)


async def bench_lookup(redis_url: str) -> list[tuple]:
    import redis.asyncio as aioredis

    from routing.kvindex.blocks import block_keys, chain_seed, hex_keys
    from routing.kvindex.prefix_index import PrefixIndex

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
    from routing.rendering.tokenize import RouterTokenizer

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


def agent_conversation(path: str, tokenizer, target_tokens: int = 200_000) -> dict:
    """A tool-using coding session of about `target_tokens`, as Claude Code (`/v1/messages`) or an OpenAI-SDK
    agent (`/v1/chat/completions`) sends it: a system prompt and 16 tools, then turns of an assistant tool call
    and its result (a file's contents)."""
    source = (Path(os.__file__).parent / "typing.py").read_text()
    files = [source[i : i + 6000] for i in range(0, len(source) - 6000, 6000)]
    schema = {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "offset": {"type": "integer"},
            "limit": {"type": "integer"},
        },
        "required": ["path"],
    }
    names = [f"tool_{i}" for i in range(16)]
    system = "You are a coding agent. Follow the repository's conventions. " * 60
    if path == "/v1/messages":
        payload = {
            "model": "tiny-qwen",
            "max_tokens": 317,
            "stream": True,
            "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": n, "description": f"Tool {n}.", "input_schema": schema} for n in names],
            "messages": [{"role": "user", "content": "Fix the failing test in typing.py."}],
        }
    else:
        payload = {
            "model": "tiny-qwen",
            "max_tokens": 317,
            "stream": True,
            "tools": [
                {
                    "type": "function",
                    "function": {"name": n, "description": f"Tool {n}.", "parameters": schema},
                }
                for n in names
            ],
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "Fix the failing test in typing.py."},
            ],
        }
    turn = 0
    while len(tokenizer.encode_request(payload, path)) < target_tokens:
        add_turn(payload, path, turn, files[turn % len(files)])
        turn += 1
    return payload


def add_turn(payload: dict, path: str, turn: int, text: str) -> None:
    call_id = f"call_{turn:04d}"
    arguments = {"path": f"src/module_{turn}.py", "limit": 400}
    if path == "/v1/messages":
        payload["messages"] += [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Reading module {turn}."},
                    {"type": "tool_use", "id": call_id, "name": f"tool_{turn % 16}", "input": arguments},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": text}]},
        ]
    else:
        payload["messages"] += [
            {
                "role": "assistant",
                "content": f"Reading module {turn}.",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": f"tool_{turn % 16}", "arguments": json.dumps(arguments)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": text},
        ]


async def bench_agent_turn(redis_url: str) -> list[tuple]:
    """The router's whole per-turn cost for the next turn of a ~200K-token tool-using session: parse the body,
    render it as the engine will, tokenise, block keys, one precise index lookup."""
    import orjson
    import redis.asyncio as aioredis

    from routing.kvindex.blocks import PromptKeyCache, block_keys, chain_seed, hex_keys
    from routing.kvindex.prefix_index import PrefixIndex
    from routing.rendering.tokenize import RouterTokenizer

    client = aioredis.Redis.from_url(redis_url)
    index = PrefixIndex(client)
    rows = []
    # As the router runs (routing/server/app.py): long-lived objects frozen, young collections every 50,000 objects.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    for path, name in (
        ("/v1/messages", "Claude Code /v1/messages"),
        ("/v1/chat/completions", "OpenAI tool chat"),
    ):
        tokenizer = RouterTokenizer(ROOT / "models" / "tiny-qwen")
        payload = agent_conversation(path, tokenizer)
        seed = chain_seed("tiny-qwen")
        keys = hex_keys(block_keys(tokenizer.encode_request(payload, path), BLOCK, seed))
        async with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hset(f"px:{DEPLOYMENT}:{key}", "1", "g")
            await pipe.execute()
        prompt_keys = PromptKeyCache()
        prompt_keys.hex_keys(tokenizer.encode_request(payload, path), BLOCK, seed)
        parts: dict[str, list[float]] = {"parse": [], "render": [], "tokenise": [], "keys": [], "lookup": []}
        totals, cpu, whole, size, turns = [], [], [], 0, []
        for turn in range(40):
            add_turn(payload, path, 1000 + turn, f"ok, step {turn} passes")
            body = orjson.dumps(payload)
            c0 = time.process_time()
            t0 = time.perf_counter()
            parsed = orjson.loads(body)
            t1 = time.perf_counter()
            text, known = tokenizer.render_prompt(parsed, path)
            t2 = time.perf_counter()
            ids = tokenizer.encode_text(text, known)
            t3 = time.perf_counter()
            keys = prompt_keys.hex_keys(ids, BLOCK, seed)
            t4 = time.perf_counter()
            await index.lookup(DEPLOYMENT, keys)
            t5 = time.perf_counter()
            for part, (a, b) in zip(parts, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5)), strict=True):
                parts[part].append((b - a) * 1000)
            totals.append((t5 - t0) * 1000)
            cpu.append((time.process_time() - c0) * 1000)
            size = len(ids)
            turns.append((body, text))
        # Side by side, on the same turns: the template rendered over every message, as each turn did before.
        for body, text in turns:
            parsed = orjson.loads(body)
            t0 = time.perf_counter()
            expected = tokenizer.render(tokenizer.chat_inputs(parsed, path))
            whole.append((time.perf_counter() - t0) * 1000)
            assert text == expected
        async with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.delete(f"px:{DEPLOYMENT}:{key}")
            await pipe.execute()
        rows.append(row(f"next turn, {name} ({size:,} tokens)", totals, "target: 3 ms"))
        short = "messages" if path == "/v1/messages" else "chat"
        rows.append(row(f"  {short}: the same turns, CPU time", cpu, "the wall time less waits (Redis)"))
        rows += [row(f"  {short}: {part}", samples) for part, samples in parts.items()]
        rows.append(
            row(f"  {short}: render, the whole template instead", whole, "as every turn rendered before")
        )
    await client.aclose()
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat everything; medians of the rounds' medians"
    )
    args = parser.parse_args(argv)
    h.under_devstack("hot_path", argv, ("REDIS_URL",))
    redis_url = os.environ["REDIS_URL"]
    rounds: dict[str, list[tuple]] = {}
    before = h.cpu_ticks()
    for _ in range(args.rounds):
        rows = (
            asyncio.run(bench_lookup(redis_url)) + bench_tokenize() + asyncio.run(bench_agent_turn(redis_url))
        )
        for name, samples, note in rows:
            rounds.setdefault(name, []).append((samples, note))
    print(f"{'measure':58} {'n':>5} {'median ms':>10} {'rounds ms':>13} {'p90 ms':>9}  note")
    for name, results in rounds.items():
        medians = [statistics.median(samples) for samples, _ in results]
        pooled = [x for samples, _ in results for x in samples]
        spread = f"{min(medians):.2f}-{max(medians):.2f}"
        print(
            f"{name:58} {len(results[0][0]):>5} {statistics.median(medians):>10.3f} {spread:>13} "
            f"{percentile(pooled, 0.9):>9.3f}  {results[0][1]}"
        )
    steal = h.steal_share(before, h.cpu_ticks())
    if steal is not None:
        print(f"CPU time the VM's host took for others (steal) during the run: {steal:.0%} of the machine's")


if __name__ == "__main__":
    main(sys.argv[1:])
