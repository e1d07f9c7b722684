"""Only an admitted request is tokenized and looked up in the prefix index: the quota check comes first, and a
request the quota refuses costs the router no tokenizer time and Redis no index lookup.

No mock: the router talks to the real Redis through a byte relay that records, in order, which of the scripts
of interest each command it forwards calls.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from urllib.parse import urlsplit

import httpx
from django.conf import settings

from routing.kvindex.prefix_index import LOOKUP_BISECT, LOOKUP_WALK
from routing.metering.admission import ADMIT
from routing.models import RoutingPolicy

from ..serving.engines import MODEL_NAME
from .conftest import make_fleet, set_quota, start_router


def sha(script: str) -> bytes:
    return hashlib.sha1(script.encode()).hexdigest().encode()  # what redis-py's EVALSHA sends


class RecordingRelay:
    """Relays every connection to Redis, and appends to `seen` the name of each marked script a command calls."""

    def __init__(self, target: tuple[str, int], marks: dict[bytes, str]):
        self.target, self.marks = target, marks
        self.seen: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def take(self) -> list[str]:
        seen, self.seen = self.seen, []
        return seen

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
                    self.seen.extend(name for mark, name in self.marks.items() if mark in chunk)
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


def test_the_quota_check_comes_first_and_a_refused_request_is_never_looked_up(transactional_db, sim_pair):
    redis = urlsplit(settings.REDIS_URL)
    relay = RecordingRelay(
        (redis.hostname, redis.port),
        {sha(ADMIT): "admit", sha(LOOKUP_WALK): "lookup", sha(LOOKUP_BISECT): "lookup"},
    )
    router = start_router({"REDIS_URL": f"redis://127.0.0.1:{relay.port}{redis.path or '/0'}"})
    try:
        fleet = make_fleet(router, sim_pair)
        RoutingPolicy.objects.create(deployment=fleet.deployment, mode="precise")
        set_quota(fleet, input_tokens_per_minute=5000)
        prompt = "Summarise the repository's build steps. " * 40
        relay.take()

        for text in (prompt, prompt + "And its tests."):
            assert ask(fleet, text).status_code == 200
            seen = relay.take()
            assert seen[:1] == ["admit"] and "lookup" in seen, seen

        refused = ask(
            fleet, prompt * 4
        )  # its bound (bytes of text, over 6000) alone is over the minute's tokens
        assert refused.status_code == 429, refused.text
        assert relay.take() == ["admit"]  # checked, refused, and never tokenized nor looked up
    finally:
        router.stop()
        relay.close()
