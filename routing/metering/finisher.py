"""The end of every request in one Redis round trip shared by all requests ending together (group commit):
settle each admission reservation and append each usage event, then let each request return.

Every request on its way to an engine also leaves an orphan record in Redis (`opened`): what a live replica bills
it from (routing/metering/admission.py, REAP) if this process dies before it ends. The record rides the next such round
trip once the request has been in flight for OPEN_RECORD_AFTER_S (a timer sends it when none comes), so a request
that ends sooner costs no Redis command at all. A replica SIGKILLed within that time of a request's start leaves
that request without a record (under a quota: with admission's, which bills no tokens).

A batch Redis cannot take goes to the usage journal (routing/metering/journal.py); a background task replays it, renews
the concurrency leases and reads the usage stream's lag. If neither Redis nor the journal takes usage,
`accepting` is False: the router must refuse new work, since it could not bill it. See
docs/routing.md#failures-timeouts-and-metering.

Over 400 lines: the group commit, the journal's replay and the orphan records share one batch and one idea of
what Redis holds, and change together.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import orjson
from django.conf import settings
from prometheus_client import Counter, Gauge
from redis.exceptions import ConnectionError, NoScriptError, RedisError

from routing.contracts import USAGE_EPOCH_KEY
from routing.metering.admission import CONCURRENCY_MAX_HOLD_S, Admission, Reservation, orphan_record
from routing.metering.journal import Journal, JournalError, journal_line, read_lines
from routing.server import metrics
from tenants.usage_stream import FIELD, UsageEvent, stream_key, usage_stream_lag

log = logging.getLogger(__name__)

KEEP_EVERY_S = 1.0
RECENT_S = 120.0
RECENT_MAX = 50_000
LAG_EVERY_S = 5.0
ORPHANS_EVERY_S = 10.0
REPLAY_CHUNK = 500
# A request in flight this long has its orphan record written (see the module's docstring).
OPEN_RECORD_AFTER_S = 0.05

lag_entries = Gauge(
    "usage_stream_lag_entries",
    "Usage events in the Redis stream that no worker has acknowledged (written to the ledger) yet.",
    registry=metrics.registry,
)
lag_age = Gauge(
    "usage_stream_oldest_age_seconds",
    "Age of the oldest usage event in the Redis stream not yet acknowledged (0 when none).",
    registry=metrics.registry,
)
journal_bytes = Gauge(
    "router_usage_journal_bytes",
    "Bytes of usage in this replica's local journal, waiting for Redis to take them.",
    registry=metrics.registry,
)
orphans_reaped = Counter(
    "router_orphaned_requests_settled",
    "Requests admitted by a replica that died before settling them, settled and billed (failed, no tokens) by "
    "this replica.",
    registry=metrics.registry,
)
reappended = Counter(
    "router_usage_events_reappended",
    "Usage events appended to the stream again because Redis lost its data after taking them.",
    registry=metrics.registry,
)
accepting_gauge = Gauge(
    "router_usage_accepting",
    "1 while this replica can record usage (in Redis or in its journal), 0 while it refuses new work.",
    registry=metrics.registry,
)


class InFlight(NamedTuple):
    """What a request in flight is billed if its replica dies: its usage event (encoded), and the prompt tokens
    and spend (1e-8 units) that event bills, which its quota counters keep."""

    event: str
    input_used: int = 0
    spend_used: int = 0


@dataclass(slots=True)
class _Open:
    """A request on its way to an engine, and its orphan record: `sent` once it went into a round trip."""

    reservation: Reservation
    event: Callable[[], InFlight]
    at: float
    sent: bool = False


@dataclass
class _Ending:
    reservation: Reservation | None
    deltas: tuple[int, int, int]
    event: UsageEvent
    done: asyncio.Future
    # Its orphan record went to Redis and, without a quota, is removed with the ending (under a quota the
    # settlement removes it).
    forget: bool = False

    def journal_line(self) -> str:
        settlement = None
        if self.reservation is not None and self.reservation.scopes:
            args = Admission.settlement_args(self.reservation, *self.deltas)
            settlement = {"keys": self.reservation.keys, "args": args}
        return journal_line(self.event.encode(), settlement)


class Finisher:
    def __init__(self, redis, admission: Admission, journal: Journal | None = None):
        self.redis = redis
        self.admission = admission
        self.journal = journal if journal is not None else Journal()
        self.redis_timeout = settings.ROUTER_USAGE_REDIS_TIMEOUT
        # Set when a batch could not be written to Redis; cleared once the journal is replayed. While set,
        # batches go straight to the journal rather than each waiting for Redis to fail.
        self.redis_down = False
        self._pending: list[_Ending] = []
        # (monotonic time, encoded event) of what Redis took in the last RECENT_S seconds, and the epoch it
        # had then (see USAGE_EPOCH_KEY).
        self._recent: deque[tuple[float, str]] = deque(maxlen=RECENT_MAX)
        self._epoch: bytes | None = None
        self._scheduled = False
        self._keeper: asyncio.Task | None = None
        # The requests on their way to an engine (`opened`), by id, and the timer that writes their records.
        self._open: dict[str, _Open] = {}
        self._open_timer: asyncio.TimerHandle | None = None
        self.start()

    @property
    def accepting(self) -> bool:
        """Whether the router may admit new work: False while usage can be written neither to Redis nor to the
        journal (full, or the disk refuses it)."""
        return not (self.redis_down and self.journal.failed)

    def start(self) -> None:
        """Start the background task (replay, leases, lag) if an event loop runs; idempotent."""
        if self._keeper is None:
            try:
                self._keeper = asyncio.get_running_loop().create_task(self._keep())
            except RuntimeError:
                pass

    async def stop(self) -> None:
        """Stop the background task, and replay what the journal holds if Redis takes it now; what it does not
        take stays on disk for the next router process to start in the same directory."""
        if self._open_timer is not None:
            self._open_timer.cancel()
            self._open_timer = None
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
            self._keeper = None
        if self.redis_down or self.journal.waiting():
            await self._quietly("replay the usage journal before stopping", self.replay())
        self.journal.close()

    def opened(self, reservation: Reservation, event: Callable[[], InFlight]) -> None:
        """A request goes to an engine: write its orphan record, with the usage event `event()` makes (failed,
        its prompt as counted so far) and what that bills, if it is still in flight after OPEN_RECORD_AFTER_S;
        `settle` removes it. The event is made only then: most requests end sooner."""
        self._open[reservation.request_id] = _Open(reservation, event, time.monotonic())
        if self._open_timer is None:
            self._open_timer = asyncio.get_running_loop().call_later(OPEN_RECORD_AFTER_S, self._records_due)

    def _records_due(self) -> None:
        """The timer: flush the records that are due unless a round trip about to go takes them; again for the
        next one due."""
        self._open_timer = None
        now = time.monotonic()
        waiting = [o.at for o in self._open.values() if not o.sent]
        if not waiting:
            return
        if not self._scheduled and not self.redis_down and min(waiting) <= now - OPEN_RECORD_AFTER_S:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_soon)
        later = [at for at in waiting if at > now - OPEN_RECORD_AFTER_S]
        if later:
            delay = min(later) + OPEN_RECORD_AFTER_S - now
            self._open_timer = asyncio.get_running_loop().call_later(delay, self._records_due)

    def _records_to_send(self) -> list[tuple[_Open, str]]:
        """The requests whose records are due and not yet sent, with their records, marked sent: an ending from
        now on removes them. A record that cannot be made is logged and left out, never failing the batch."""
        horizon = time.monotonic() - OPEN_RECORD_AFTER_S
        due = []
        for request_id, request in list(self._open.items()):
            if request.sent or request.at > horizon:
                continue
            request.sent = True
            try:
                due.append((request, orphan_record(request.reservation, *request.event())))
            except Exception:
                log.exception("usage: no orphan record for request %s", request_id)
        return due

    def open_records(self) -> list[str]:
        """The ids of the requests without a quota whose records this replica keeps alive (their leases renewed
        with the slots, routing/metering/admission.py); under a quota the slot's renewal covers it."""
        oldest = time.monotonic() - CONCURRENCY_MAX_HOLD_S
        return [
            rid for rid, o in self._open.items() if o.sent and not o.reservation.scopes and o.at >= oldest
        ]

    async def settle(
        self,
        reservation: Reservation | None,
        *,
        input_tokens: int,
        output_tokens: int,
        spend: int,
        event: UsageEvent,
    ) -> None:
        """Returns once the settlement and the usage event are in Redis, or durably in the journal. Raises when
        they are in neither (the event is then in the log, at error level)."""
        self.start()
        loop = asyncio.get_running_loop()
        deltas = (0, 0, 0)
        if reservation is not None and reservation.scopes:
            deltas = (
                input_tokens - reservation.input_tokens,
                output_tokens - reservation.output_tokens,
                spend - reservation.spend,
            )
        ending = _Ending(reservation, deltas, event, loop.create_future())
        record = self._open.pop(event.request_id, None)
        ending.forget = record is not None and record.sent and not record.reservation.scopes
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
        error = None
        try:
            if not self.redis_down:
                records = self._records_to_send()
                try:
                    await asyncio.wait_for(self._to_redis_retried(batch, records), self.redis_timeout)
                    now = time.monotonic()
                    self._recent.extend((now, ending.event.encode()) for ending in batch)
                    return
                except (RedisError, OSError, TimeoutError) as exc:
                    log.warning("usage: Redis did not take a batch (%r); journaling until it does", exc)
                    self.redis_down = True
                    for request, _ in records:  # sent again by a later round trip
                        request.sent = False
            if not batch:
                return
            try:
                await asyncio.to_thread(self.journal.append, [ending.journal_line() for ending in batch])
            except JournalError as exc:
                error = exc
                for ending in batch:
                    log.error(
                        "usage: request %s is NOT recorded (%s): %s",
                        ending.event.request_id,
                        exc,
                        ending.event.encode(),
                    )
        except BaseException as exc:
            error = exc
            raise
        finally:
            for ending in batch:
                self.admission.release(ending.reservation)
                if not ending.done.done():
                    if error is None:
                        ending.done.set_result(None)
                    else:
                        ending.done.set_exception(error)
            accepting_gauge.set(1 if self.accepting else 0)

    async def _to_redis_retried(self, batch: list[_Ending], records: list[tuple[_Open, str]]) -> None:
        """Once more on a connection error: after Redis restarts, each pooled connection fails once (and is
        dropped) before a fresh one works. Once more too when Redis lost the settlement script (NOSCRIPT: it
        restarted, or its scripts were flushed), the second try loading it. The first try may have been applied
        in part, or with its reply lost, so the second settles as a replay does (only what still holds its
        slot) and the ledger dedupes the events."""
        if not batch and not records:
            return
        try:
            await self._to_redis(batch, records)
        except (ConnectionError, OSError, NoScriptError):
            await self._to_redis(batch, records, again=True)

    async def _to_redis(
        self, batch: list[_Ending], records: list[tuple[_Open, str]], again: bool = False
    ) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for request, record in records:
                self.admission.record_in(pipe, request.reservation, record)
            for ending in batch:
                reservation = ending.reservation
                if reservation is not None and reservation.scopes:
                    if again:
                        args = Admission.settlement_args(reservation, *ending.deltas)
                        await self.admission.settle_replayed_in(pipe, reservation.keys, args)
                    else:
                        self.admission.settle_in(pipe, reservation, *ending.deltas)
                pipe.xadd(stream_key(), {FIELD: ending.event.encode()})
                if ending.forget:
                    self.admission.forget_in(pipe, ending.event.request_id)
            await pipe.execute()

    # --- the background task ----------------------------------------------------------------------------
    async def replay(self) -> int:
        """Replay the journal (this process's, and any a dead router process left in the directory) into Redis;
        return how many requests were replayed. Raises when Redis fails part-way: what was not confirmed stays
        in the journal, and replaying it again is harmless."""
        if self.redis_down or self.journal.waiting():
            await asyncio.wait_for(self.redis.ping(), self.redis_timeout)
        segments = await asyncio.to_thread(self.journal.sealed)
        replayed = 0
        for segment in segments:
            pairs = await asyncio.to_thread(read_lines, segment.path)
            for start in range(0, len(pairs), REPLAY_CHUNK):
                async with self.redis.pipeline(transaction=False) as pipe:
                    for event, settlement in pairs[start : start + REPLAY_CHUNK]:
                        if settlement:
                            await self.admission.settle_replayed_in(
                                pipe, settlement["keys"], settlement["args"]
                            )
                        pipe.xadd(stream_key(), {FIELD: event})
                        if not settlement:  # its orphan record, if one was written, is not reaped on top
                            self.admission.forget_in(pipe, orjson.loads(event)["request_id"])
                    await asyncio.wait_for(pipe.execute(), self.redis_timeout)
            await asyncio.to_thread(self.journal.done, segment)
            replayed += len(pairs)
            log.warning("usage: replayed %d requests from the journal (%s)", len(pairs), segment.path.name)
        if self.redis_down:
            log.warning("usage: Redis takes writes again; the journal is replayed")
        self.redis_down = False
        if self.journal.failed:
            await asyncio.to_thread(self.journal.probe)
        return replayed

    async def _keep(self) -> None:
        renew_every = self.admission.lease_s / 3
        tick = min(KEEP_EVERY_S, renew_every)
        renew_at = lag_at = orphans_at = 0.0
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if (self.admission.held or self._open) and now >= renew_at:
                renew_at = now + renew_every
                renewed = self.admission.renew_leases(self.open_records())
                await self._quietly("renew concurrency leases", renewed)
            if self.redis_down or self.journal.waiting() or now >= orphans_at:
                orphans_at = now + ORPHANS_EVERY_S
                await self._quietly("replay the usage journal", self.replay())
                if not (self.redis_down or self.journal.waiting()):
                    await self._quietly("settle the requests of dead replicas", self._reap())
            while self._recent and self._recent[0][0] < now - RECENT_S:
                self._recent.popleft()
            if not self.redis_down:
                await self._quietly("check that Redis kept its data", self._check_epoch())
            if not self.redis_down and self._open_timer is None and self._open:
                self._records_due()  # records that waited out an outage
            if self.journal.failed:
                # Room again, or the disk back: work is accepted again even while Redis is still down.
                await asyncio.to_thread(self.journal.probe)
            if now >= lag_at:
                lag_at = now + LAG_EVERY_S
                await self._quietly("read the usage stream's lag", self._read_lag())
            journal_bytes.set(self.journal.bytes)
            accepting_gauge.set(1 if self.accepting else 0)

    async def _reap(self) -> None:
        """Settle and bill the requests a dead replica admitted and never settled (routing/metering/admission.py, REAP).
        Not while Redis has been up for less than two leases: after a restart (with its data) the live
        replicas' leases have not been renewed yet."""
        info = await asyncio.wait_for(self.redis.info("server"), self.redis_timeout)
        if float(info.get("uptime_in_seconds", 0)) < 2 * self.admission.lease_s:
            return
        reaped = await asyncio.wait_for(self.admission.reap_orphans(), self.redis_timeout)
        if reaped:
            orphans_reaped.inc(reaped)
            log.warning("usage: settled %d requests a dead replica admitted and never settled", reaped)

    async def _check_epoch(self) -> None:
        """Append again the events of the last RECENT_S seconds when Redis lost its data (USAGE_EPOCH_KEY)."""
        epoch = await asyncio.wait_for(self.redis.get(USAGE_EPOCH_KEY), self.redis_timeout)
        if epoch is None:
            await asyncio.wait_for(
                self.redis.set(USAGE_EPOCH_KEY, uuid.uuid4().hex, nx=True), self.redis_timeout
            )
            epoch = await asyncio.wait_for(self.redis.get(USAGE_EPOCH_KEY), self.redis_timeout)
        if self._epoch is not None and epoch != self._epoch:
            horizon = time.monotonic() - RECENT_S
            events = [event for at, event in self._recent if at >= horizon]
            log.warning(
                "usage: Redis lost its data; appending again the %d events of the last %.0f s",
                len(events),
                RECENT_S,
            )
            for start in range(0, len(events), REPLAY_CHUNK):
                async with self.redis.pipeline(transaction=False) as pipe:
                    for event in events[start : start + REPLAY_CHUNK]:
                        pipe.xadd(stream_key(), {FIELD: event})
                    await asyncio.wait_for(pipe.execute(), self.redis_timeout)
            reappended.inc(len(events))
        self._epoch = epoch

    async def _read_lag(self) -> None:
        entries, age = await asyncio.wait_for(usage_stream_lag(self.redis), self.redis_timeout)
        lag_entries.set(entries)
        lag_age.set(age)

    async def _quietly(self, what: str, work) -> None:
        try:
            await work
        except (RedisError, OSError, TimeoutError) as exc:
            log.info("usage: could not %s: %r", what, exc)
        except Exception:
            log.exception("usage: could not %s", what)
