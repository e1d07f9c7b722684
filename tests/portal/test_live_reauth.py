"""The live page's WebSocket checks who is watching before every snapshot, not only at connect: an operator
demoted, a person deactivated or a session ended stops receiving at once, the socket closed."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.testing import ApplicationCommunicator
from channels.db import database_sync_to_async
from django.contrib.auth import get_user_model
from django.contrib.sessions.models import Session
from django.db import connections
from django.test import Client

from portal.websockets import websocket_urlpatterns
from tenants.models import Membership, Role
from tenants.usage_stream import stream_key, usage_redis

from ..conftest import make_user


@pytest.fixture
def stream(settings):
    settings.USAGE_STREAM = "usage:test-live-reauth"
    usage_redis().delete(stream_key())
    yield
    usage_redis().delete(stream_key())


def _communicator(user) -> ApplicationCommunicator:
    from channels.routing import URLRouter

    scope = {
        "type": "websocket",
        "path": "/ws/portal/live/",
        "headers": [],
        "query_string": b"",
        "user": user,
    }
    return ApplicationCommunicator(URLRouter(websocket_urlpatterns), scope)


async def _watch_then(communicator, change) -> dict:
    """Open the socket, take one snapshot, make `change`, and return what the socket sends next."""
    await communicator.send_input({"type": "websocket.connect"})
    assert (await communicator.receive_output(5))["type"] == "websocket.accept"
    assert "deployments" in json.loads((await communicator.receive_output(5))["text"])
    await database_sync_to_async(change)()
    message = await communicator.receive_output(5)
    await communicator.wait(2)
    await database_sync_to_async(connections.close_all)()  # the consumer's thread's connection
    return message


@pytest.mark.django_db(transaction=True)
def test_an_operator_demoted_while_watching_is_closed_out(stream):
    operator = make_user("live-op", Role.OPERATOR)
    demote = Membership.objects.filter(user=operator, role=Role.OPERATOR).delete
    message = asyncio.run(_watch_then(_communicator(operator), demote))
    assert message == {"type": "websocket.close", "code": 4403}


@pytest.mark.django_db(transaction=True)
def test_an_operator_deactivated_while_watching_is_closed_out(stream):
    operator = make_user("live-op", Role.OPERATOR)
    deactivate = get_user_model().objects.filter(pk=operator.pk).update
    message = asyncio.run(_watch_then(_communicator(operator), lambda: deactivate(is_active=False)))
    assert message == {"type": "websocket.close", "code": 4401}


@pytest.mark.django_db(transaction=True)
def test_an_operator_whose_session_ends_while_watching_is_closed_out(stream, settings):
    from inference_platform.web_asgi import web_application

    settings.ALLOWED_HOSTS = ["localhost"]
    web = web_application()
    client = Client()
    client.force_login(make_user("live-op", Role.OPERATOR))
    session_key = client.cookies[settings.SESSION_COOKIE_NAME].value
    headers = [
        (b"cookie", f"{settings.SESSION_COOKIE_NAME}={session_key}".encode()),
        (b"origin", b"http://localhost:8000"),
    ]
    scope = {
        "type": "websocket",
        "path": "/ws/portal/live/",
        "headers": headers,
        "query_string": b"",
        "client": ("127.0.0.1", 50000),
        "server": ("localhost", 8000),
        "subprotocols": [],
    }
    # Signing out (on this browser or by an operator clearing sessions) deletes the session.
    sign_out = Session.objects.filter(session_key=session_key).delete
    message = asyncio.run(_watch_then(ApplicationCommunicator(web, scope), sign_out))
    assert message == {"type": "websocket.close", "code": 4401}


@pytest.mark.django_db(transaction=True)
def test_an_operator_still_an_operator_keeps_receiving(stream):
    operator = make_user("live-op", Role.OPERATOR)
    unrelated = make_user("someone-else", Role.OPERATOR)
    demote_another = Membership.objects.filter(user=unrelated).delete
    message = asyncio.run(_watch_then(_communicator(operator), demote_another))
    assert message["type"] == "websocket.send" and "deployments" in json.loads(message["text"])
