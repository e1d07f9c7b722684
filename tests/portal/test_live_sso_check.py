"""The live page's WebSocket does not pass through the middleware that sends a single sign-on session to the
identity provider when its check is due, so it closes with 4401 instead, on which the page reloads (and the page
load makes the provider's round trip). Sessions signed in with a password are never checked. Time passing is
played by moving the session's next check into the past."""

from __future__ import annotations

import asyncio
import json
import time
from importlib import import_module

import pytest
from asgiref.testing import ApplicationCommunicator
from channels.db import database_sync_to_async
from django.conf import settings as django_settings
from django.db import connections
from django.test import Client

from sso.refresh import CHECK_DUE_KEY
from tenants.models import Role
from tenants.usage_stream import stream_key, usage_redis

from ..conftest import make_user
from .test_live_reauth import _watch_then

SSO = "sso.backends.OidcBackend"
PASSWORD = "django.contrib.auth.backends.ModelBackend"


@pytest.fixture
def stream(settings):
    settings.USAGE_STREAM = "usage:test-live-sso-check"
    usage_redis().delete(stream_key())
    yield
    usage_redis().delete(stream_key())


@pytest.fixture
def sso_on(settings):
    """Single sign-on switched on, as settings.py does when OIDC_RP_CLIENT_ID is set."""
    settings.OIDC_RP_CLIENT_ID = "inference-platform"
    settings.AUTHENTICATION_BACKENDS = [*settings.AUTHENTICATION_BACKENDS, SSO]
    settings.ALLOWED_HOSTS = ["localhost"]


def _signed_in(backend: str) -> str:
    """An operator's session key, signed in through `backend`, its next check where the callback puts it."""
    client = Client()
    client.force_login(make_user("live-op", Role.OPERATOR), backend=backend)
    key = client.cookies[django_settings.SESSION_COOKIE_NAME].value
    if backend == SSO:
        _check_due_at(key, time.time() + django_settings.OIDC_RENEW_ID_TOKEN_EXPIRY_SECONDS)
    return key


def _check_due_at(session_key: str, when: float) -> None:
    store = import_module(django_settings.SESSION_ENGINE).SessionStore(session_key=session_key)
    store[CHECK_DUE_KEY] = when
    store.save()


def _socket(session_key: str) -> ApplicationCommunicator:
    from inference_platform.web_asgi import web_application

    scope = {
        "type": "websocket",
        "path": "/ws/portal/live/",
        "headers": [
            (b"cookie", f"{django_settings.SESSION_COOKIE_NAME}={session_key}".encode()),
            (b"origin", b"http://localhost:8000"),
        ],
        "query_string": b"",
        "client": ("127.0.0.1", 50000),
        "server": ("localhost", 8000),
        "subprotocols": [],
    }
    return ApplicationCommunicator(web_application(), scope)


@pytest.mark.django_db(transaction=True)
def test_it_closes_a_single_sign_on_session_whose_check_comes_due_while_watching(stream, sso_on):
    key = _signed_in(SSO)
    message = asyncio.run(_watch_then(_socket(key), lambda: _check_due_at(key, time.time() - 1)))
    assert message == {"type": "websocket.close", "code": 4401}


@pytest.mark.django_db(transaction=True)
def test_it_keeps_sending_to_a_password_session(stream, sso_on):
    key = _signed_in(PASSWORD)
    message = asyncio.run(_watch_then(_socket(key), lambda: _check_due_at(key, time.time() - 1)))
    assert message["type"] == "websocket.send" and "deployments" in json.loads(message["text"])


@pytest.mark.django_db(transaction=True)
def test_it_opens_then_closes_a_single_sign_on_session_already_due_so_the_page_reloads(stream, sso_on):
    key = _signed_in(SSO)
    _check_due_at(key, time.time() - 1)

    async def connect() -> list[dict]:
        communicator = _socket(key)
        await communicator.send_input({"type": "websocket.connect"})
        answers = [await communicator.receive_output(5), await communicator.receive_output(5)]
        await communicator.wait(2)
        await database_sync_to_async(connections.close_all)()  # the consumer's thread's connection
        return answers

    # A handshake refused outright reaches the browser without a code; the page would only reconnect.
    accepted, closed = asyncio.run(connect())
    assert accepted["type"] == "websocket.accept"
    assert closed == {"type": "websocket.close", "code": 4401}
