"""The index lookups on their own: the exact walk and the bisection agree where cached blocks form prefixes."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from routing.blocks import block_keys, chain_seed, hex_keys
from routing.prefix_index import BISECT_FROM_BLOCKS, Held, PrefixIndex


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
