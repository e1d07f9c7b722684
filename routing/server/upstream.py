"""The router's HTTP/1.1 client for engine calls: keep-alive connections per engine, httptools for parsing.

The request is written in one `write` and the body handed on as the parser produces it (a general client spent
about a quarter of the router's CPU per streamed request). Connections are kept per (host, port) and reused once a
response was read to its end; one not read to its end is closed, which is how an engine learns to abort. A reused
connection the engine had closed while idle fails before any byte of a response, and the request is sent once
more on a new one. Reading pauses while more than READ_HIGH_WATER bytes wait for the router. See
docs/routing.md#the-request-path.
"""

from __future__ import annotations

import asyncio
from collections import deque
from urllib.parse import urlsplit

import httptools

READ_HIGH_WATER = 256 * 1024
IDLE_PER_HOST = 256


class UpstreamError(Exception):
    """The engine could not be reached, or the connection broke before the response ended."""


class UpstreamConnectError(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    """The engine sent nothing within a time limit (its first token, or the next piece of a stream)."""


class UpstreamClosed(UpstreamError):
    pass


class StallWatch:
    """Gives up a wait for an engine's next piece that lasts `limit` seconds, at the cost of two attribute
    writes per piece: one timer per stream, moved on lazily, where a timeout context per piece (a timer
    scheduled and cancelled each time) cost about 10 us a piece. When a wait runs over, the waiting task is
    cancelled and `check` turns that cancellation into UpstreamTimeout."""

    def __init__(self, limit: float):
        self.limit = limit
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.since: float | None = None  # when the current wait began; None while not waiting
        self.fired = False
        self._handle: asyncio.TimerHandle | None = None

    def waiting(self) -> None:
        self.since = self.loop.time()
        if self._handle is None:
            self._handle = self.loop.call_at(self.since + self.limit, self._due)

    def done(self) -> None:
        self.since = None

    def _due(self) -> None:
        self._handle = None
        if self.since is None:
            return  # not waiting: the next wait schedules the timer again
        due = self.since + self.limit
        if self.loop.time() >= due:
            self.fired = True
            self.task.cancel()
        else:
            self._handle = self.loop.call_at(due, self._due)

    def check(self) -> None:
        """In a handler of CancelledError: raise UpstreamTimeout if the cancellation was this watch's doing
        (else the caller re-raises it)."""
        if self.fired:
            self.fired = False
            if self.task.uncancel() == 0:  # else someone else cancelled the task too: that stands
                raise UpstreamTimeout(f"nothing for {self.limit:g} s") from None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class _Connection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool, key: tuple[str, int]):
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.response: Response | None = None

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamClosed(f"malformed response from the engine: {exc}"))
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        response = self.response
        if response is not None and response._head.done() and response._delimited_by_close():
            response._finish()  # a body without a length ends with the connection
        else:
            self._fail(UpstreamClosed("the engine closed the connection"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        response = self.response
        if response is not None:
            response.status = self.parser.get_status_code()
            response.keep_alive = self.parser.should_keep_alive()
            if not response._head.done():
                response._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None:
            response._feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None:
            response._finish()

    def _fail(self, exc: Exception) -> None:
        response = self.response
        if response is not None:
            response._fail(exc)

    # used by the pool and the response
    def send(self, response: Response, data: bytes) -> None:
        self.response = response
        self.parser = httptools.HttpResponseParser(self)  # a fresh parser per response
        self.transport.write(data)

    def release(self) -> None:
        """The response was read to its end: keep the connection for the next request, or close it."""
        response, self.response = self.response, None
        if self.closed or response is None or not response.keep_alive:
            self.close()
        else:
            self.pool._put(self)

    def close(self) -> None:
        self.response = None
        if not self.closed:
            self.closed = True
            self.transport.close()


class AnswerTooLarge(Exception):
    """An engine's answer, or one event of its stream, over what the router holds (ROUTER_MAX_ANSWER_BYTES,
    ROUTER_MAX_EVENT_BYTES)."""

    def __init__(self, limit: int):
        super().__init__(f"over {limit} bytes")
        self.limit = limit


class Response:
    """One engine response: `status` and `header()` once the head arrived, then `chunks()` or `read()`."""

    def __init__(self, connection: _Connection):
        self._connection = connection
        self._head: asyncio.Future = asyncio.get_running_loop().create_future()
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._done = False
        self._error: Exception | None = None
        self._paused = False
        self.status = 0
        self.keep_alive = False

    def _delimited_by_close(self) -> bool:
        return self.header(b"content-length") is None and self.header(b"transfer-encoding") is None

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        for key, value in self._headers:
            if key == name:
                return value
        return default

    async def chunks(self):
        """The body, piece by piece as it arrives."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._paused and self._buffered < READ_HIGH_WATER:
                    self._paused = False
                    if not self._connection.closed:
                        self._connection.transport.resume_reading()
                yield chunk
                continue
            if self._done:
                return
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; AnswerTooLarge past `limit` bytes (the rest is not read)."""
        chunks, size = [], 0
        async for chunk in self.chunks():
            size += len(chunk)
            if limit is not None and size > limit:
                raise AnswerTooLarge(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    # fed by the connection
    def _feed(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > READ_HIGH_WATER and not self._paused and not self._connection.closed:
            self._paused = True
            self._connection.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, exc: Exception) -> None:
        if self._done:
            return
        if not self._head.done():
            self._head.set_exception(exc)
        elif self._error is None:
            self._error = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Post:
    """`async with pool.post(...) as response`: the connection goes back to the pool only when the response
    was read to its end; otherwise it is closed."""

    def __init__(self, pool: UpstreamPool, url: str, body: bytes, headers: list[tuple[str, str]]):
        self.pool, self.url, self.body, self.headers = pool, url, body, headers
        self.response: Response | None = None

    async def __aenter__(self) -> Response:
        host, port, path = self.pool.target(self.url)
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 address in brackets
        head = [f"POST {path} HTTP/1.1\r\nhost: {authority}\r\ncontent-length: {len(self.body)}\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in self.headers]
        data = "".join(head).encode("latin-1") + b"\r\n" + self.body
        connection, reused = await self.pool._get(host, port)
        try:
            self.response = await self._send(connection, data)
        except UpstreamClosed:
            if not reused:
                raise
            # An idle connection the engine had closed: nothing of this request was answered; once more on a
            # new connection.
            connection, _ = await self.pool._get(host, port, fresh=True)
            self.response = await self._send(connection, data)
        return self.response

    async def _send(self, connection: _Connection, data: bytes) -> Response:
        response = Response(connection)
        self.response = response
        connection.send(response, data)
        try:
            await response._head
        except BaseException:
            connection.close()
            raise
        return response

    async def __aexit__(self, exc_type, exc, tb) -> None:
        response = self.response
        if response is None:
            return
        if exc_type is None and response._done and not response._chunks:
            response._connection.release()
        else:
            response._connection.close()


class UpstreamPool:
    def __init__(self, connect_timeout: float):
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._targets: dict[str, tuple[str, int, str]] = {}

    def post(self, url: str, body: bytes, headers: list[tuple[str, str]]) -> _Post:
        return _Post(self, url, body, headers)

    def target(self, url: str) -> tuple[str, int, str]:
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamConnectError(f"engines are reached over plain http, not {url!r}")
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            target = (parts.hostname, parts.port or 80, path)
            if len(self._targets) > 10_000:
                self._targets.clear()
            self._targets[url] = target
        return target

    async def _get(self, host: str, port: int, fresh: bool = False) -> tuple[_Connection, bool]:
        idle = self._idle.get((host, port))
        while idle and not fresh:
            connection = idle.pop()
            if not connection.closed:
                return connection, True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, (host, port)), host, port
                )
        except TimeoutError as exc:
            raise UpstreamConnectError(f"connecting to {host}:{port} timed out") from exc
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
        return connection, False

    def _put(self, connection: _Connection) -> None:
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) < IDLE_PER_HOST:
            idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
