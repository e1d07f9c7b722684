"""The end of every request in one Redis round trip shared by all requests ending together (group commit):
settle each admission reservation and append each usage event, then let each request return."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tenants.usage_stream import FIELD, UsageEvent, stream_key, stream_maxlen

from .admission import Admission, Reservation


@dataclass
class _Ending:
    reservation: Reservation | None
    deltas: tuple[int, int, int]
    event: UsageEvent
    done: asyncio.Future


class Finisher:
    def __init__(self, redis, admission: Admission):
        self.redis = redis
        self.admission = admission
        self._pending: list[_Ending] = []
        self._scheduled = False

    async def finish(
        self,
        reservation: Reservation | None,
        *,
        input_tokens: int,
        output_tokens: int,
        spend: int,
        event: UsageEvent,
    ) -> None:
        """Returns once the settlement and the usage event are in Redis."""
        loop = asyncio.get_running_loop()
        deltas = (0, 0, 0)
        if reservation is not None and reservation.scopes:
            deltas = (
                input_tokens - reservation.input_tokens,
                output_tokens - reservation.output_tokens,
                spend - reservation.spend,
            )
        ending = _Ending(reservation, deltas, event, loop.create_future())
        self._pending.append(ending)
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush_soon)
        await ending.done

    def _flush_soon(self) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        asyncio.get_running_loop().create_task(self._flush(batch))

    async def _flush(self, batch: list[_Ending]) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for ending in batch:
                    reservation = ending.reservation
                    if reservation is not None and reservation.scopes:
                        await self.admission.settle_in(pipe, reservation, *ending.deltas)
                    pipe.xadd(
                        stream_key(), {FIELD: ending.event.encode()}, maxlen=stream_maxlen(), approximate=True
                    )
                await pipe.execute()
        except Exception as exc:
            for ending in batch:
                if not ending.done.done():
                    ending.done.set_exception(exc)
            return
        for ending in batch:
            if not ending.done.done():
                ending.done.set_result(None)
