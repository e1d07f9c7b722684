"""The router's HTTP server protocol: uvicorn's httptools protocol with limits on a request's headers.

httptools buffers a request's headers whole, however long, and uvicorn waits for them however slowly they come:
one client could hold a replica's memory with megabytes of headers, or its connections with headers sent a byte at
a time. Here a request whose headers pass ROUTER_MAX_HEADER_BYTES is answered 431, and one whose headers are not
complete ROUTER_HEADER_TIMEOUT_SECONDS after their first byte is answered 408; either way the connection is closed.
Serve the router with `uvicorn ... --http routing.server.http_server:LimitedHttpToolsProtocol`.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_limits: tuple[int, float] | None = None


def header_limits() -> tuple[int, float]:
    """(ROUTER_MAX_HEADER_BYTES, ROUTER_HEADER_TIMEOUT_SECONDS), read once the app has configured Django."""
    global _limits
    if _limits is None:
        from django.conf import settings

        _limits = settings.ROUTER_MAX_HEADER_BYTES, settings.ROUTER_HEADER_TIMEOUT_SECONDS
    return _limits


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_header_bytes, self.header_timeout = header_limits()
        self._reading_headers = True  # until a request's headers are complete; again after its body
        self._header_bytes = 0
        self._tail = b""  # the last bytes of headers seen, where their end may begin
        self._header_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        if self._reading_headers:
            if not self._header_bytes:
                self._cancel_timer()
                self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)
            # Counted before the parser sees them (it would hold them all): up to the blank line that ends them.
            seen = self._tail + data
            end = seen.find(b"\r\n\r\n")
            self._header_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._tail))
            if self._header_bytes > self.max_header_bytes:
                return self._refuse(431, f"Request headers over {self.max_header_bytes} bytes.")
            self._tail = seen[-3:]
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._cancel_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_headers, self._header_bytes, self._tail = True, 0, b""

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._reading_headers and self._header_bytes:
            self._refuse(408, f"Request headers not complete within {self.header_timeout:g} s.")

    def _cancel_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _refuse(self, status: int, message: str) -> None:
        self._cancel_timer()
        if self.transport.is_closing():
            return
        self.logger.info("refused a request: %s", message)
        body = message.encode()
        reason = b"Request Timeout" if status == 408 else b"Request Header Fields Too Large"
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, reason, len(body), body)
        )
        self.transport.close()
