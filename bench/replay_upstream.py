"""A replaying upstream: answers every POST with one canned response, in a single write.

    python bench/replay_upstream.py --port P --body FILE

FILE holds the body the simulator streamed for the benchmark's request (captured once by router_overhead.py),
so gateways see byte-for-byte the engine's event stream, framed as the simulator frames it (chunked transfer
encoding), but the upstream costs one parser feed and one `write` per request. GET /health answers 200. Use it
when the simulator itself, not the gateway, would be the bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio

import httptools


def build_response(body: bytes) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\n"
        b"Content-Type: text/event-stream; charset=utf-8\r\n"
        b"Cache-Control: no-cache\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    return head + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"


HEALTH = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


class Server(asyncio.Protocol):
    def __init__(self, stream: bytes):
        self.stream = stream
        self.parser = httptools.HttpRequestParser(self)
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        self.transport.write(self.stream if method == b"POST" else HEALTH)
        if not self.parser.should_keep_alive():
            self.transport.close()


def main() -> None:
    import uvloop

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--body", required=True)
    args = parser.parse_args()
    with open(args.body, "rb") as f:
        stream = build_response(f.read())

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: Server(stream), args.host, args.port, backlog=4096)
        async with server:
            await server.serve_forever()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
