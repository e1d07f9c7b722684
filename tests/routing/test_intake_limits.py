"""Work before admission, bounded (routing/server/intake.py, routing/server/http_server.py): a body's deadline and rate, one key's
requests still arriving, request headers' size and deadline, a client that never reads its answer, and the
session ids the affinity map keeps."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from inference_platform.ports import free_port
from routing.server import intake as intake_module
from routing.server.checks import HttpError
from routing.server.intake import ClientStalled, Intake
from routing.server.sessions import MAX_SESSION_CHARS, session_key

from ..serving.engines import MODEL_NAME, start_engine
from .conftest import ROOT, RouterProcess, database_url, make_fleet, start_router
from .usage import usage_events

CHAT = "/v1/chat/completions"


def open_request(url: str, path: str, key: str, length: int, first: bytes, rcvbuf: int | None = None):
    """A raw connection that has sent a request's headers (announcing `length` bytes of body) and `first`."""
    parts = urlsplit(url)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((parts.hostname, parts.port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: router\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    sock.sendall(head.encode() + first)
    return sock


def read_reply(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or `timeout`)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return data


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def chat(fleet, key: str, path: str = CHAT) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"authorization": f"Bearer {key}", "anthropic-version": "2023-06-01"}
    return httpx.post(f"{fleet.router.url}{path}", json=body, headers=headers, timeout=60)


# --- one key's requests still arriving ---------------------------------------------------------------------


@pytest.fixture
def capped_fleet(transactional_db, sim_pair):
    router = start_router({"ROUTER_INTAKE_PER_KEY": "2", "ROUTER_BODY_TIMEOUT_SECONDS": "3"})
    try:
        yield make_fleet(router, sim_pair)
    finally:
        router.stop()


def test_one_key_cannot_hold_more_requests_arriving_than_its_cap(capped_fleet):
    fleet = capped_fleet
    held = [open_request(fleet.router.url, CHAT, fleet.key.secret, 1000, b'{"model"') for _ in range(2)]
    try:
        time.sleep(0.5)  # the router has both open, their bodies unfinished
        refused = chat(fleet, fleet.key.secret)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert "still being received" in refused.json()["error"]["message"]
        counted = chat(fleet, fleet.key.secret, "/v1/messages/count_tokens")
        assert counted.status_code == 429 and counted.json()["type"] == "error"  # in Anthropic's shape there
        # Another key of the same team is not held up.
        assert chat(fleet, fleet.other_key.secret).status_code == 200
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while (status := chat(fleet, fleet.key.secret).status_code) == 429:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert status == 200


def test_a_body_that_stops_arriving_is_answered_408_and_its_connection_closed(capped_fleet):
    fleet = capped_fleet
    sock = open_request(fleet.router.url, CHAT, fleet.key.secret, 1000, b'{"model"')
    began = time.monotonic()
    reply = read_reply(sock, timeout=15)
    sock.close()
    assert status_of(reply) == 408, reply[:300]
    assert 2.5 < time.monotonic() - began < 10
    answer = reply.split(b"\r\n\r\n", 1)[1]
    body = orjson.loads(answer[answer.index(b"{") : answer.rindex(b"}") + 1])  # sent chunked
    assert "too slowly" in body["error"]["message"]
    assert b"connection: close" in reply.lower()
    # Its key's place is free again.
    assert chat(fleet, fleet.key.secret).status_code == 200


def test_a_body_slower_than_the_minimum_rate_is_cut_off(monkeypatch):
    monkeypatch.setattr(intake_module, "BODY_GRACE_S", 0.2)
    intake = Intake(per_key=4, body_timeout=60, body_min_rate=1000, send_timeout=5)

    async def trickle():
        async def receive():
            await asyncio.sleep(0.05)
            return {"type": "http.request", "body": b"x", "more_body": True}  # 20 bytes a second

        guard = intake.enter(7)
        guarded = guard.receive(receive)
        began = time.monotonic()
        with pytest.raises(HttpError) as refused:
            while True:
                await guarded()
        return refused.value, time.monotonic() - began

    error, took = asyncio.run(trickle())
    assert error.status == 408 and error.headers == {"connection": "close"}
    assert took < 1.0
    assert intake.arriving == {}  # the key's count dropped with it


def test_a_body_at_a_fair_rate_is_read_whole(monkeypatch):
    monkeypatch.setattr(intake_module, "BODY_GRACE_S", 0.2)
    intake = Intake(per_key=4, body_timeout=60, body_min_rate=1000, send_timeout=5)

    async def steady():
        sent = 0

        async def receive():
            nonlocal sent
            await asyncio.sleep(0.05)
            sent += 1
            return {"type": "http.request", "body": b"x" * 500, "more_body": sent < 20}  # 10 kB a second

        guard = intake.enter(7)
        guarded = guard.receive(receive)
        while (await guarded()).get("more_body"):
            assert intake.arriving == {7: 1}
        return guard

    guard = asyncio.run(steady())
    assert guard.body_done and intake.arriving == {}


# --- a client that never reads ----------------------------------------------------------------------------


def test_a_stalled_send_ends_the_request_as_a_hang_up(monkeypatch):
    monkeypatch.setattr(intake_module, "HANG_UP_WAIT_S", 5)
    intake = Intake(per_key=4, body_timeout=60, body_min_rate=1000, send_timeout=0.2)

    async def exchange():
        bodies = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive():  # the body, then nothing: the client is still there
            if bodies:
                return bodies.pop()
            await asyncio.Event().wait()

        async def never_taken(message):
            await asyncio.Event().wait()

        guard = intake.enter(7)
        guarded_receive, guarded_send = guard.receive(receive), guard.send(never_taken)
        await guarded_receive()  # the body

        async def serve():
            await guarded_send({"type": "http.response.start", "status": 200, "headers": []})

        task = asyncio.ensure_future(serve())

        async def watch():  # as routing/server/exchange.py watches for the client leaving
            message = await guarded_receive()
            task.cancel()
            return message

        watcher = asyncio.ensure_future(watch())
        began = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await watcher, time.monotonic() - began

    message, took = asyncio.run(exchange())
    assert message == {"type": "http.disconnect"} and took < 2


def test_a_stalled_send_with_no_watcher_raises():
    intake = Intake(per_key=4, body_timeout=60, body_min_rate=1000, send_timeout=0.1)

    async def stalled():
        async def never_taken(message):
            await asyncio.Event().wait()

        guard = intake.enter(None)
        with pytest.raises(ClientStalled):
            await guard.send(never_taken)({"type": "http.response.body", "body": b"x"})

    intake_module.HANG_UP_WAIT_S, saved = 0.1, intake_module.HANG_UP_WAIT_S
    try:
        asyncio.run(stalled())
    finally:
        intake_module.HANG_UP_WAIT_S = saved


@pytest.fixture
def send_fleet(transactional_db):
    engine = start_engine("sim")
    router = start_router({"ROUTER_SEND_TIMEOUT_SECONDS": "1"})
    try:
        yield make_fleet(router, [engine])
    finally:
        router.stop()
        engine.stop()


def test_a_client_that_never_reads_its_stream_frees_the_engine(send_fleet):
    fleet = send_fleet
    body = orjson.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Write at length."}],
            "max_tokens": 4000,
            "n": 8,
            "stream": True,
        }
    )
    sock = open_request(fleet.router.url, CHAT, fleet.key.secret, len(body), body, rcvbuf=4096)
    try:
        sock.settimeout(10)
        head = sock.recv(2048)  # the response's start, then nothing more is read
        assert status_of(head) == 200, head
        request_id = next(
            line.split(b":", 1)[1].strip().decode()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"x-request-id:")
        )
        (event,) = usage_events([request_id], wait_for=1, timeout=30)
    finally:
        sock.close()
    assert event.status == "cancelled"
    assert 0 < event.output_tokens < 8 * 4000


# --- request headers ---------------------------------------------------------------------------------------


@pytest.fixture
def limited_server(transactional_db):
    """The router as deployed: uvicorn with routing/server/http_server.py's protocol."""
    port = free_port()
    log_path = ROOT / ".local" / "test-engines" / f"router-limited-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "ROUTER_MAX_HEADER_BYTES": "16384",
        "ROUTER_HEADER_TIMEOUT_SECONDS": "1",
    }
    argv = [sys.executable, "-m", "uvicorn", "inference_platform.asgi:application", "--host", "127.0.0.1"]
    argv += [
        "--port",
        str(port),
        "--loop",
        "uvloop",
        "--http",
        "routing.server.http_server:LimitedHttpToolsProtocol",
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    router = RouterProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{router.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, router.log()[-2000:]
                time.sleep(0.2)
        yield router
    finally:
        router.stop()


def raw(url: str, data: bytes) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(data)
    return sock


def test_headers_over_the_limit_are_answered_431(limited_server):
    sock = raw(
        limited_server.url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * 100_000 + b"\r\n\r\n"
    )
    reply = read_reply(sock, timeout=10)
    sock.close()
    assert status_of(reply) == 431 and b"connection: close" in reply
    assert httpx.get(f"{limited_server.url}/health", headers={"x-fine": "a" * 4000}).status_code == 200


def test_headers_that_never_end_are_answered_408(limited_server):
    sock = raw(limited_server.url, b"GET /health HTTP/1.1\r\nHost: x\r\n")
    began = time.monotonic()
    reply = read_reply(sock, timeout=10)
    sock.close()
    assert status_of(reply) == 408 and time.monotonic() - began < 5


def read_response(sock: socket.socket) -> bytes:
    """One whole response on a kept-alive connection: its headers, then its body by Content-Length or to its last
    chunk (it can come in several reads, its body after its headers: the next read would be this body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
    chunked = fields.get(b"transfer-encoding", b"").strip() == b"chunked"
    length = int(fields.get(b"content-length", b"0"))
    while not (body.endswith(b"0\r\n\r\n") if chunked else len(body) >= length):
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_keep_alive_requests_each_get_the_header_deadline(limited_server):
    sock = raw(limited_server.url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(5)
    assert status_of(read_response(sock)) == 200
    time.sleep(1.5)  # idle between requests: the keep-alive timeout's business, not the header deadline's
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_of(read_response(sock)) == 200
    sock.close()


# --- session ids ------------------------------------------------------------------------------------------


def test_a_session_id_is_hashed_per_tenant_and_a_long_one_names_no_session():
    scope = {"headers": [(b"x-session-id", b"abc")]}
    mine, theirs = session_key(scope, {}, 1), session_key(scope, {}, 2)
    assert mine and theirs and mine != theirs and len(mine) == 32
    long = {"headers": [(b"x-session-id", b"s" * (MAX_SESSION_CHARS + 1))]}
    assert session_key(long, {}, 1) is None
    assert session_key({"headers": []}, {"prompt_cache_key": "k" * 100_000}, 1) is None
    assert session_key({"headers": []}, {"prompt_cache_key": "k" * MAX_SESSION_CHARS}, 1) is not None
