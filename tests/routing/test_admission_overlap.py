"""Under a quota, a precise request's prefix-index lookup is in Redis while its quota check is, not after it.

No mock: the router talks to the real Redis through a byte relay that holds the quota check's script call until
the index lookup's script call has come through as well. Sent in parallel, the check is released at once; sent
one after the other, it waits out the relay's patience and the relay counts it.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from urllib.parse import urlsplit

import httpx
from django.conf import settings

from routing.admission import ADMIT
from routing.models import RoutingPolicy
from routing.prefix_index import LOOKUP_BISECT, LOOKUP_WALK

from ..serving.engines import MODEL_NAME
from .conftest import make_fleet, set_quota, start_router


def sha(script: str) -> bytes:
    return hashlib.sha1(script.encode()).hexdigest().encode()  # what redis-py's EVALSHA sends


class GatingRelay:
    """Relays every connection to Redis; a command carrying `hold` waits until one carrying any of `until` has
    been seen (or `patience` seconds), and `waited_alone` counts those that waited the patience out."""

    def __init__(self, target: tuple[str, int], hold: bytes, until: tuple[bytes, ...], patience: float):
        self.target, self.hold, self.until, self.patience = target, hold, until, patience
        self.held = 0
        self.waited_alone = 0
        self.loop = asyncio.new_event_loop()
        self._seen = asyncio.Event()
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def rearm(self) -> None:
        async def clear() -> None:
            self._seen.clear()

        asyncio.run_coroutine_threadsafe(clear(), self.loop).result(timeout=5)

    async def _serve(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        server_in, server_out = await asyncio.open_connection(*self.target)
        await asyncio.gather(
            self._pump(client_in, server_out, outbound=True),
            self._pump(server_in, client_out, outbound=False),
        )

    async def _pump(self, reader, writer, outbound: bool) -> None:
        try:
            while chunk := await reader.read(65536):
                if outbound:
                    if any(mark in chunk for mark in self.until):
                        self._seen.set()
                    if self.hold in chunk:
                        self.held += 1
                        try:
                            await asyncio.wait_for(self._seen.wait(), self.patience)
                        except TimeoutError:
                            self.waited_alone += 1
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


def ask(fleet, text: str) -> httpx.Response:
    return httpx.post(
        f"{fleet.router.url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 4},
        headers={"authorization": f"Bearer {fleet.key.secret}"},
        timeout=30,
    )


def test_under_a_quota_the_index_lookup_runs_alongside_the_quota_check(transactional_db, sim_pair):
    redis = urlsplit(settings.REDIS_URL)
    relay = GatingRelay(
        (redis.hostname, redis.port),
        hold=sha(ADMIT),
        until=(sha(LOOKUP_WALK), sha(LOOKUP_BISECT)),
        patience=2.0,
    )
    router = start_router({"REDIS_URL": f"redis://127.0.0.1:{relay.port}{redis.path or '/0'}"})
    try:
        fleet = make_fleet(router, sim_pair)
        policy = RoutingPolicy.objects.create(deployment=fleet.deployment, mode="precise")
        set_quota(fleet, requests_per_minute=100)
        prompt = "Summarise the repository's build steps. " * 40

        for text in (prompt, prompt + "And its tests."):
            relay.rearm()
            assert ask(fleet, text).status_code == 200
        assert relay.held >= 2  # the quota check went through the relay, once per request at least
        assert relay.waited_alone == 0, router.log()[-2000:]

        # The relay does catch a quota check sent alone: approximate routing asks Redis nothing else.
        policy.mode = "approximate"
        policy.save()
        fleet.sync()
        relay.rearm()
        assert ask(fleet, prompt + "And its linters.").status_code == 200
        assert relay.waited_alone == 1
    finally:
        router.stop()
        relay.close()
