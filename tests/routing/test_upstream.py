"""The router's engine client against a real HTTP server (aiohttp's): keep-alive reuse, a stale idle connection,
an engine dying mid-body, an early exit closing the connection (the engine's abort), chunked and plain bodies."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from routing.server.upstream import READ_HIGH_WATER, UpstreamClosed, UpstreamConnectError, UpstreamPool

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)


class Engine:
    """An aiohttp server standing in for an engine, recording what it saw."""

    def __init__(self):
        self.peers: list[tuple[str, int]] = []
        self.bodies: list[bytes] = []
        self.disconnected = asyncio.Event()
        app = web.Application()
        app.router.add_post("/json", self.json)
        app.router.add_post("/stream", self.stream)
        app.router.add_post("/die", self.die)
        app.router.add_post("/slow", self.slow)
        app.router.add_post("/big", self.big)
        self.runner = web.AppRunner(app, keepalive_timeout=75)

    async def start(self, host: str = "127.0.0.1") -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    async def json(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername"))
        self.bodies.append(await request.read())
        return web.json_response({"ok": True, "id": request.headers.get("x-request-id")})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        self.peers.append(request.transport.get_extra_info("peername"))
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)  # chunked
        for i in range(5):
            await response.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0)
        await response.write_eof()
        return response

    async def die(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 0\n\n")
        request.transport.close()
        return response

    async def big(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "application/octet-stream"})
        await response.prepare(request)
        piece = bytes(range(256)) * 256  # 64 KB
        for _ in range(BIG // len(piece)):
            await response.write(piece)
        await response.write_eof()
        return response

    async def slow(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(1000):
                await response.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(0.01)
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        return response


def run(coroutine_function, host: str = "127.0.0.1"):
    async def main():
        engine = Engine()
        base = await engine.start(host)
        pool = UpstreamPool(connect_timeout=2)
        try:
            await coroutine_function(engine, base, pool)
        finally:
            pool.close()
            await engine.runner.cleanup()

    asyncio.run(main())


HEADERS = [("content-type", "application/json"), ("x-request-id", "r-1")]
BIG = 16 * 1024 * 1024


def test_json_answers_reuse_one_connection():
    async def check(engine, base, pool):
        for i in range(3):
            async with pool.post(f"{base}/json", b'{"n": %d}' % i, HEADERS) as response:
                assert response.status == 200
                assert response.header(b"content-type").startswith(b"application/json")
                assert await response.read() == b'{"ok": true, "id": "r-1"}'
        assert engine.bodies == [b'{"n": 0}', b'{"n": 1}', b'{"n": 2}']
        assert len(set(engine.peers)) == 1  # kept alive

    run(check)


def test_a_chunked_stream_arrives_whole_and_in_order():
    async def check(engine, base, pool):
        async with pool.post(f"{base}/stream", b"{}", HEADERS) as response:
            body = b"".join([chunk async for chunk in response.chunks()])
        assert body == b"".join(f"data: {i}\n\n".encode() for i in range(5))
        async with pool.post(f"{base}/stream", b"{}", HEADERS) as response:
            await response.read()
        assert len(set(engine.peers)) == 1

    run(check)


def test_a_reused_connection_the_engine_had_closed_is_replaced_without_an_error():
    """The engine answers one request per connection and closes the next one unanswered, as a server does
    that closes an idle keep-alive connection just as a request goes out on it."""

    async def check(engine, base, pool):
        connections = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            for answered in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(
                    next(
                        line.split(b":")[1]
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    )
                )
                await reader.readexactly(length)
                if answered:
                    break
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
                )
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/json"
        async with server:
            for _ in range(3):
                async with pool.post(url, b"{}", HEADERS) as response:
                    assert response.status == 200 and await response.read() == b"{}"
        assert connections == 3  # each reuse failed unanswered and went out again on a new connection


def test_an_engine_dying_mid_body_raises_after_what_it_sent():
    async def check(engine, base, pool):
        got = []
        with pytest.raises(UpstreamClosed):
            async with pool.post(f"{base}/die", b"{}", HEADERS) as response:
                async for chunk in response.chunks():
                    got.append(chunk)
        assert b"".join(got) == b"data: 0\n\n"

    run(check)


def test_leaving_a_stream_early_closes_the_connection_so_the_engine_stops():
    async def check(engine, base, pool):
        async with pool.post(f"{base}/slow", b"{}", HEADERS) as response:
            async for _ in response.chunks():
                break
        await asyncio.wait_for(engine.disconnected.wait(), 2)
        assert not any(pool._idle.values())

    run(check)


def test_a_slow_reader_pauses_the_socket_and_loses_nothing():
    async def check(engine, base, pool):
        async with pool.post(f"{base}/big", b"{}", HEADERS) as response:
            await asyncio.sleep(0.3)  # not reading: the engine's bytes pile up to the high-water mark
            assert response._paused
            assert READ_HIGH_WATER < response._buffered < BIG
            body = await response.read()
            assert not response._paused
        assert body == bytes(range(256)) * (BIG // 256)

    run(check)


def test_nothing_listening_is_a_connect_error():
    async def check(engine, base, pool):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with pytest.raises(UpstreamConnectError):
            async with pool.post(f"http://127.0.0.1:{port}/json", b"{}", HEADERS):
                pass
        with pytest.raises(UpstreamConnectError):
            async with pool.post("https://engine.example/json", b"{}", HEADERS):
                pass

    run(check)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_engine_on_an_ipv6_address():
    async def check(engine, base, pool):
        assert base.startswith("http://[::1]:")
        async with pool.post(f"{base}/json", b"{}", HEADERS) as response:
            assert response.status == 200 and b'"ok": true' in await response.read()

    run(check, host="::1")


def test_a_stall_watch_gives_up_only_a_wait_that_runs_over_its_limit():
    from routing.server.upstream import StallWatch, UpstreamTimeout

    async def waits(pieces: list[float], idle: float, limit: float) -> None:
        """Wait for each piece (seconds) under the watch, idling between waits without it."""
        watch = StallWatch(limit)
        try:
            for piece in pieces:
                watch.waiting()
                try:
                    await asyncio.sleep(piece)
                except asyncio.CancelledError:
                    watch.check()
                    raise
                finally:
                    watch.done()
                await asyncio.sleep(idle)  # sending to the client: not the engine's time
        finally:
            watch.close()

    # Short waits with long pauses between them: the pauses do not count.
    asyncio.run(waits([0.02] * 5, idle=0.08, limit=0.05))
    # One wait longer than the limit is given up.
    with pytest.raises(UpstreamTimeout):
        asyncio.run(waits([0.01, 0.3], idle=0, limit=0.05))

    async def cancelled_from_outside() -> None:
        task = asyncio.create_task(waits([5], idle=0, limit=10))
        await asyncio.sleep(0.02)
        task.cancel()
        await task

    # A cancellation that is not the watch's stays a cancellation.
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled_from_outside())
