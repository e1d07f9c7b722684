"""A real HTTP receiver (http.server in a thread), a hostile one that never finishes its answer, and a real SMTP
server (aiosmtpd) for the alert tests."""

from __future__ import annotations

import json
import socketserver
import threading
import time
from dataclasses import dataclass, field
from email import message_from_bytes
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from aiosmtpd.controller import Controller

from alerts.models import AlertRule, Destination, DestinationKind
from inference_platform.ports import free_port


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> dict:
        return json.loads(self.body)


@dataclass
class Receiver:
    """Records every POST; answers with the statuses queued in `answers` (then 200)."""

    url: str
    base: str = ""
    requests: list[Received] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)
    metrics_text: str = ""  # what GET answers: a router's /metrics


@pytest.fixture
def receiver():
    state = Receiver(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            state.requests.append(Received(self.path, dict(self.headers.items()), body))
            status = state.answers.pop(0) if state.answers else 200
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(b"ok" if status < 400 else b"no")

        def do_GET(self):
            body = state.metrics_text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.base = f"http://127.0.0.1:{server.server_address[1]}"
    state.url = f"{state.base}/hooks/alerts"
    yield state
    server.shutdown()
    server.server_close()


@dataclass
class Hostile:
    """A receiver that never finishes its answer. `url` + "/drip": one byte of its headers every 0.1 s;
    "/endless/<status>": that status, then a body without end (64 KiB every 10 ms). Either gives up after
    GIVE_UP_S, so that a client that waits for it ends, late, rather than hanging the test run."""

    base: str = ""
    requests: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    GIVE_UP_S = 8.0


@pytest.fixture
def hostile():
    state = Hostile()

    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            path = self.request.recv(65536).split(b" ", 2)[1].decode()
            state.requests.append(path)
            until = time.monotonic() + Hostile.GIVE_UP_S
            try:
                if path == "/drip":
                    self._drip(until)
                else:
                    self._endless(int(path.rsplit("/", 1)[1]), until)
            except OSError:  # the client hung up: what the tests want
                pass

        def _drip(self, until: float) -> None:
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Slow: " + b"z" * 10_000
            for byte in head:
                if time.monotonic() > until or state.stop.is_set():
                    return
                self.request.sendall(bytes([byte]))
                time.sleep(0.1)

        def _endless(self, status: int, until: float) -> None:
            self.request.sendall(f"HTTP/1.1 {status} Whatever\r\nContent-Type: text/plain\r\n\r\n".encode())
            chunk = b"x" * 65536
            while time.monotonic() < until and not state.stop.is_set():
                self.request.sendall(chunk)
                time.sleep(0.01)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state.base = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    state.stop.set()
    server.shutdown()
    server.server_close()


@dataclass
class Mailbox:
    messages: list = field(default_factory=list)

    async def handle_DATA(self, server, session, envelope):
        message = message_from_bytes(envelope.content)
        self.messages.append((envelope.rcpt_tos, message))
        return "250 Message accepted for delivery"


@pytest.fixture
def smtp(settings):
    """A real SMTP server on a free local port, and Django's SMTP backend pointed at it."""
    mailbox = Mailbox()
    controller = Controller(mailbox, hostname="127.0.0.1", port=free_port())
    controller.start()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = "127.0.0.1"
    settings.EMAIL_PORT = controller.port
    settings.EMAIL_USE_TLS = False
    yield mailbox
    controller.stop()


@pytest.fixture
def webhook_to(receiver):
    def make(tenant=None, name="hook") -> Destination:
        return Destination.objects.create(
            tenant=tenant, name=name, kind=DestinationKind.WEBHOOK, url=receiver.url
        )

    return make


def rule_with(destination: Destination, **fields) -> AlertRule:
    rule = AlertRule.objects.create(**fields)
    rule.destinations.set([destination])
    return rule
