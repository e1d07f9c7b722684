"""The live traffic WebSocket: operators get a snapshot of the last seconds' traffic every second.

Who is asking is checked again before every snapshot, not only at connect: the socket closes once the person is
no longer an operator, is deactivated, or their session ends (signed out, expired, or their password changed). A
single sign-on session due for its check with the identity provider also closes it with SIGNED_OUT: the page reloads
on that code, and only a page load can make the provider's round trip (sso/refresh.py).
"""

from __future__ import annotations

import asyncio
from importlib import import_module

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, get_user_model
from django.utils.crypto import constant_time_compare

from sso.refresh import check_due
from tenants.access import Access

from .live import live_traffic

INTERVAL_S = 1.0
# Close codes: not (or no longer) an operator; the session behind the socket has ended.
FORBIDDEN = 4403
SIGNED_OUT = 4401


def _session_ended(scope: dict, user) -> bool:
    """Whether the session the socket was opened with no longer signs this user in: gone from the store
    (signed out, expired, flushed), made for an older password, or due for its single sign-on check."""
    session = scope.get("session")
    key = getattr(session, "session_key", None)
    if session is None or key is None:
        return False  # opened without a session cookie (a test's scope): only the user is checked
    fresh = import_module(settings.SESSION_ENGINE).SessionStore(session_key=key)
    if str(fresh.get(SESSION_KEY)) != str(user.pk) or not fresh.get(BACKEND_SESSION_KEY):
        return True
    if not constant_time_compare(fresh.get(HASH_SESSION_KEY, ""), user.get_session_auth_hash()):
        return True
    return check_due(fresh)


def still_allowed(scope: dict) -> int | None:
    """None while the socket's user may still watch; otherwise the code to close it with."""
    user = scope.get("user")
    if user is None or not user.is_authenticated:
        return SIGNED_OUT
    current = get_user_model().objects.filter(pk=user.pk, is_active=True).first()
    if current is None or _session_ended(scope, current):
        return SIGNED_OUT
    return None if Access.for_user(current).is_operator else FORBIDDEN


class LiveTrafficConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        refused = await database_sync_to_async(still_allowed)(self.scope)
        if refused == SIGNED_OUT and getattr(self.scope.get("user"), "is_authenticated", False):
            # Signed in by the cookie yet refused: mostly a single sign-on check that came due while the socket was
            # down (a laptop asleep). A refused handshake reaches the page without a code and it would reconnect
            # for ever, so open and close with the code it reloads on; the reload goes to the provider.
            await self.accept()
            await self.close(code=SIGNED_OUT)
            return
        if refused is not None:
            await self.close(code=FORBIDDEN)
            return
        await self.accept()
        self._task = asyncio.create_task(self._push())

    async def disconnect(self, code) -> None:
        task = getattr(self, "_task", None)
        if task:
            task.cancel()

    async def _push(self) -> None:
        while True:
            refused = await database_sync_to_async(still_allowed)(self.scope)
            if refused is not None:
                await self.close(code=refused)
                return
            await self.send_json(await database_sync_to_async(live_traffic)())
            await asyncio.sleep(INTERVAL_S)
