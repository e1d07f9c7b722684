"""The live traffic WebSocket: operators get a snapshot of the last seconds' traffic every second."""

from __future__ import annotations

import asyncio

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from tenants.access import Access

from .live import live_traffic

INTERVAL_S = 1.0


class LiveTrafficConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        if not await database_sync_to_async(lambda: Access.for_user(user).is_operator)():
            await self.close(code=4403)
            return
        await self.accept()
        self._task = asyncio.create_task(self._push())

    async def disconnect(self, code) -> None:
        task = getattr(self, "_task", None)
        if task:
            task.cancel()

    async def _push(self) -> None:
        while True:
            await self.send_json(await database_sync_to_async(live_traffic)())
            await asyncio.sleep(INTERVAL_S)
