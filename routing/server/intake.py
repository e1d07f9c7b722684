"""Work a request makes before admission, bounded: its body's arrival, the requests each key has arriving at
once, and a client that stops reading its answer.

Admission (routing/metering/admission.py) counts a request only once its body is read and checked; until then only this
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

from routing.server.checks import HttpError
from routing.server.wire import Receive, Send

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
    """A request's ASGI receive and send under the intake's limits (wrap the server's with `receive`/`send`).

    Cheap on the hot path: no timeout context per message. One timer per request watches the body's deadline (moved
    later as bytes come) and then the send in progress, re-armed only when it fires early; what it finds late it
    cancels (the receive: a 408; the send: the request's watcher hears a disconnect, or the send raises
    ClientStalled)."""

    def __init__(self, intake: Intake, key_id: int | None, hold_until_done: bool):
        self.intake = intake
        self.key_id = key_id
        self.hold_until_done = hold_until_done
        self.started = time.monotonic()
        self.received = 0
        self.body_done = False
        self.stalled = False
        self._counted = key_id is not None
        self._body_late = False
        self._receiving: asyncio.Task | None = None  # the task awaiting the body's next piece
        self._listening: asyncio.Task | None = None  # the task awaiting the client's hang-up, after the body
        self._sending: asyncio.Task | None = None  # the task whose send is under way
        self._send_began = 0.0
        self._send_cancelled = False  # the intake cancelled the stalled send itself
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def release(self) -> None:
        """The request is past intake (or over): its key's count drops. Safe to call more than once."""
        if self._counted:
            self._counted = False
            self.intake._leave(self.key_id)

    # --- the body ----------------------------------------------------------------------------------------
    def receive(self, receive: Receive) -> Receive:
        async def guarded() -> dict:
            if self.body_done:
                return await self._after_body(receive)
            if self._body_late:
                self._refuse_body()
            if self._timer is None:
                self._arm(self._body_deadline())
            self._receiving = asyncio.current_task()
            try:
                message = await receive()
            except asyncio.CancelledError:
                if not self._body_late:
                    raise
                self._receiving.uncancel()
                self._refuse_body()
            finally:
                self._receiving = None
            if message["type"] == "http.request":
                self.received += len(message.get("body", b""))
                if not message.get("more_body"):
                    self.body_done = True
                    self._disarm()
                    if not self.hold_until_done:
                        self.release()
            else:
                self._disarm()
                self.release()
            return message

        return guarded

    def _refuse_body(self):
        self._disarm()
        self.release()
        intake = self.intake
        raise HttpError(
            408,
            f"The request body came too slowly: it must arrive within {intake.body_timeout:g} s, at "
            f"{intake.body_min_rate} bytes a second or more after its first {BODY_GRACE_S:g} s.",
            headers={"connection": "close"},
        )

    def _body_deadline(self) -> float:
        intake = self.intake
        by_rate = BODY_GRACE_S + self.received / intake.body_min_rate
        return self.started + min(intake.body_timeout, by_rate)

    async def _after_body(self, receive: Receive) -> dict:
        """The server's next message (the client hanging up), or a hang-up of our own after a stalled send."""
        if self.stalled:
            return {"type": "http.disconnect"}
        self._listening = asyncio.current_task()
        try:
            return await receive()
        except asyncio.CancelledError:
            if not self.stalled:
                raise
            self._listening.uncancel()
            return {"type": "http.disconnect"}
        finally:
            self._listening = None

    # --- the answer --------------------------------------------------------------------------------------
    def send(self, send: Send) -> Send:
        async def guarded(message: dict) -> None:
            if self.stalled:
                raise ClientStalled()
            task = self._sending = asyncio.current_task()
            self._send_began = time.monotonic()
            if self._timer is None:
                self._arm(self._send_began + self.intake.send_timeout)
            elif not self.body_done:  # armed for the body's deadline, maybe later than this send's
                self._arm_by(self._send_began + self.intake.send_timeout)
            try:
                await send(message)
            except asyncio.CancelledError:
                if not self._send_cancelled:  # cancelled by another (the request's watcher): as it was
                    raise
                task.uncancel()
                raise ClientStalled() from None
            finally:
                self._sending = None

        return guarded

    # --- the one timer -----------------------------------------------------------------------------------
    def _arm(self, at: float) -> None:
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        self._timer = loop.call_at(loop.time() + max(0.0, at - time.monotonic()), self._fire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm_by(self, at: float) -> None:
        """The timer fires by `at` at the latest."""
        loop = self._loop
        if self._timer.when() > loop.time() + (at - time.monotonic()):
            self._timer.cancel()
            self._arm(at)

    def _fire(self) -> None:
        self._timer = None
        now = time.monotonic()
        next_at = []
        if self._sending is not None and not self.stalled:
            at = self._send_began + self.intake.send_timeout
            if now >= at:
                return self._stall()
            next_at.append(at)
        if not self.body_done and not self._body_late:
            at = self._body_deadline()
            if now >= at:
                self._body_late = True
                if self._receiving is not None:
                    self._receiving.cancel()
            else:
                next_at.append(at)
        if next_at:  # else the next send arms it again
            self._arm(min(next_at))

    def _stall(self) -> None:
        """End the request as one whose client hung up: its watcher (routing/server/exchange.py) hears a disconnect and
        cancels it, so it is settled as cut short. Without a watcher, the send raises ClientStalled after
        HANG_UP_WAIT_S."""
        self.stalled = True
        log.info("a client took nothing of its answer for %g s: ending its request", self.intake.send_timeout)
        if self._listening is not None:
            self._listening.cancel()
        self._loop.call_later(HANG_UP_WAIT_S, self._cancel_send, self._sending)

    def _cancel_send(self, sending: asyncio.Task) -> None:
        """No watcher ended the request: its stalled send raises ClientStalled."""
        if self._sending is sending and not sending.done():
            self._send_cancelled = True
            sending.cancel()
