"""Work a request makes before admission, bounded: its body's arrival, the requests each key has arriving at
once, and a client that stops reading its answer.

Admission (routing/admission.py) counts a request only once its body is read and checked; until then only this
replica knows of it. So, per replica:
- a body must arrive whole within ROUTER_BODY_TIMEOUT_SECONDS and, past its first BODY_GRACE_S seconds, at
  ROUTER_BODY_MIN_BYTES_PER_SECOND on average; else a 408, and the connection is closed;
- one key may have at most ROUTER_INTAKE_PER_KEY requests whose bodies are still arriving (a count_tokens call
  counts until it is answered: it is never admitted); past it, a 429;
- a send the client does not take within ROUTER_SEND_TIMEOUT_SECONDS ends the request as if the client had hung
  up: what was streamed is billed, and its engine slot is freed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .requests import HttpError
from .wire import Receive, Send

log = logging.getLogger(__name__)

BODY_GRACE_S = 5.0  # seconds a body may take before its average rate is judged
HANG_UP_WAIT_S = 1.0  # after a stalled send, how long the request's own watcher has to end it


class ClientStalled(Exception):
    """The client took nothing of its answer for the send timeout; the request was ended."""


class Intake:
    """One replica's requests before admission, per key."""

    def __init__(self, per_key: int, body_timeout: float, body_min_rate: int, send_timeout: float):
        self.per_key = per_key
        self.body_timeout = body_timeout
        self.body_min_rate = max(1, body_min_rate)
        self.send_timeout = send_timeout
        self.arriving: dict[int, int] = {}  # key id -> its requests not yet past intake

    def enter(self, key_id: int | None, hold_until_done: bool = False) -> Guarded:
        """A request's guarded receive and send. HttpError(429) when its key has too many arriving."""
        if key_id is not None:
            if self.arriving.get(key_id, 0) >= self.per_key:
                raise HttpError(
                    429,
                    f"This key has {self.per_key} requests still being received by this gateway: send the next "
                    "once one of them has been sent whole.",
                    headers={"retry-after": "1"},
                )
            self.arriving[key_id] = self.arriving.get(key_id, 0) + 1
        return Guarded(self, key_id, hold_until_done)

    def _leave(self, key_id: int) -> None:
        left = self.arriving.get(key_id, 0) - 1
        if left > 0:
            self.arriving[key_id] = left
        else:
            self.arriving.pop(key_id, None)


class Guarded:
    """A request's ASGI receive and send under the intake's limits (wrap the server's with `receive`/`send`)."""

    def __init__(self, intake: Intake, key_id: int | None, hold_until_done: bool):
        self.intake = intake
        self.key_id = key_id
        self.hold_until_done = hold_until_done
        self.started = time.monotonic()
        self.received = 0
        self.body_done = False
        self.stalled = False
        self._counted = key_id is not None
        self._hang_up: asyncio.Future | None = None

    def release(self) -> None:
        """The request is past intake (or over): its key's count drops. Safe to call more than once."""
        if self._counted:
            self._counted = False
            self.intake._leave(self.key_id)

    def receive(self, receive: Receive) -> Receive:
        async def guarded() -> dict:
            if self.body_done:
                return await self._after_body(receive)
            try:
                async with asyncio.timeout(self._body_deadline() - time.monotonic()):
                    message = await receive()
            except TimeoutError:
                self.release()
                raise HttpError(
                    408,
                    f"The request body came too slowly: it must arrive within {self.intake.body_timeout:g} s, at "
                    f"{self.intake.body_min_rate} bytes a second or more after its first {BODY_GRACE_S:g} s.",
                    headers={"connection": "close"},
                ) from None
            if message["type"] == "http.request":
                self.received += len(message.get("body", b""))
                if not message.get("more_body"):
                    self.body_done = True
                    if not self.hold_until_done:
                        self.release()
            else:
                self.release()
            return message

        return guarded

    def _body_deadline(self) -> float:
        intake = self.intake
        by_rate = BODY_GRACE_S + self.received / intake.body_min_rate
        return self.started + min(intake.body_timeout, by_rate)

    async def _after_body(self, receive: Receive) -> dict:
        """The server's next message (the client hanging up), or a hang-up of our own after a stalled send."""
        if self.stalled:
            return {"type": "http.disconnect"}
        if self._hang_up is None:
            self._hang_up = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(receive())
        try:
            await asyncio.wait((waiting, self._hang_up), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiting.done():
                waiting.cancel()
        if waiting.done() and not waiting.cancelled():
            return waiting.result()
        return {"type": "http.disconnect"}

    def send(self, send: Send) -> Send:
        timeout = self.intake.send_timeout

        async def guarded(message: dict) -> None:
            if self.stalled:
                raise ClientStalled()
            try:
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                await self._stalled()

        return guarded

    async def _stalled(self) -> None:
        """End the request as one whose client hung up: its watcher (routing/exchange.py) hears a disconnect and
        cancels it, so it is settled as cut short. A request with no watcher gets ClientStalled instead."""
        self.stalled = True
        log.info("a client took nothing of its answer for %g s: ending its request", self.intake.send_timeout)
        if self._hang_up is not None and not self._hang_up.done():
            self._hang_up.set_result(None)
        await asyncio.sleep(HANG_UP_WAIT_S)
        raise ClientStalled()
