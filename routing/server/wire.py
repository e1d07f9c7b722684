"""ASGI plumbing shared by the app and the exchange: the callables' types, request headers and plain responses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]

JSON_HEADERS = [(b"content-type", b"application/json")]


def header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode(errors="replace")
    return None


def encode_headers(extra: dict | None) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), str(v).encode()) for k, v in (extra or {}).items()]


async def respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
