"""The usage stream: the router emits one event per request; Celery writes them to the ledger in batches.

The contract
------------
- Stream: `settings.USAGE_STREAM` (default `usage:events`); consumer group `usage-ingest`.
- Each entry has one field, `e`: the event as compact JSON (no spaces), for example

      {"request_id":"req-1","tenant_id":1,"team_id":2,"api_key_id":3,"deployment_id":4,"model":"tiny-qwen",
       "endpoint":"10.0.0.7:8000","prompt_tokens":1000,"cached_prompt_tokens":600,"output_tokens":50,
       "ttft_ms":120,"latency_ms":900,"status":"completed","created_at":"2025-01-01T12:00:00.123456+00:00"}

  `deployment_id`, `ttft_ms` and `latency_ms` may be null; `status` is completed, failed, cancelled or
  rejected (it waited in the router's queue past its class's limit); `created_at` is ISO 8601 in UTC. Optional:
  `priority_class` (interactive, standard or batch) and `queued_ms` (its wait in the router's queue). Unknown keys are ignored, so fields can be added without breaking readers.
- Emission never trims: an entry leaves the stream only once the consumer group has acknowledged it (its row
  is committed). Ingestion deletes entries as it acknowledges them, and the ingestion task also trims whatever
  lies before the group's oldest unacknowledged entry (`usage_stream_trim`), so the stream holds exactly the
  entries no worker has written yet. If ingestion stalls the stream grows; its length and the age of its oldest
  entry are the ingestion lag, on the router's /metrics (`usage_stream_lag_entries`,
  `usage_stream_oldest_age_seconds`). When Redis refuses to grow it further (maxmemory), the routers journal
  usage locally (routing/metering/journal.py) rather than lose it.

Ingestion is at-least-once from Redis and exactly-once in Postgres: rows are inserted with ON CONFLICT
(request_id) DO NOTHING in one transaction, and entries are acknowledged only after that commits. Entries a
consumer read but never acknowledged (it died) are claimed by another after `USAGE_VISIBILITY_TIMEOUT_MS`.
An entry that can never be written goes to the dead-letter stream (`USAGE_DEAD_LETTER_STREAM`, default
`usage:dead`, trimmed at `USAGE_STREAM_MAXLEN`) with its reason, and is acknowledged, so it cannot block the
stream.

Each batch also moves its keys' `ApiKey.last_used_at` forward to the newest `created_at` among their events, so
the request path never writes to the database for it.

Over 400 lines: the event's encoding, the stream's contract and its ingestion into the ledger are one contract
between the router and the worker, and change together.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import redis
import redis.asyncio
from django.conf import settings
from django.db import DatabaseError, DataError, IntegrityError, connection, transaction

from serving.models import ModelDeployment

from .models import ApiKey, PriceSheet, PriorityClass, UsageRecord, UsageStatus
from .pricing import cost_of, price_sheets_for, sheet_in_force

logger = logging.getLogger(__name__)

GROUP = "usage-ingest"
FIELD = "e"
MAX_INT = 2_147_483_647  # PositiveIntegerField's upper bound in PostgreSQL


# The USAGE_* settings and their defaults: inference_platform/settings.py.
def stream_key() -> str:
    return settings.USAGE_STREAM


def dead_letter_key() -> str:
    return settings.USAGE_DEAD_LETTER_STREAM


def stream_maxlen() -> int:
    return settings.USAGE_STREAM_MAXLEN


def consumer_name() -> str:
    """This process's name in the consumer group: host and pid, so a dead worker's entries are traceable."""
    return f"{socket.gethostname()}-{os.getpid()}"


class MalformedEvent(ValueError):
    """An entry that can never become a ledger row; the message says why."""


@dataclass(frozen=True, slots=True)
class UsageEvent:
    request_id: str
    tenant_id: int
    team_id: int
    api_key_id: int
    deployment_id: int | None
    model: str
    endpoint: str
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    ttft_ms: int | None
    latency_ms: int | None
    status: str
    created_at: datetime
    priority_class: str = ""  # the class it was served in (tenants.models.PriorityClass)
    queued_ms: int | None = None  # how long it waited in the router for a saturated deployment

    def encode(self) -> str:
        if self.created_at.tzinfo is None:
            raise ValueError("created_at must be an aware datetime")
        data = {name: getattr(self, name) for name in self.__slots__}  # flat: no deep copy as asdict makes
        data["created_at"] = self.created_at.astimezone(UTC).isoformat()
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> UsageEvent:
        try:
            data = json.loads(raw)
        except (TypeError, ValueError) as exc:
            raise MalformedEvent(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise MalformedEvent("not a JSON object")
        values = {name: _checked(name, data) for name in _FIELD_RULES}
        if values["cached_prompt_tokens"] > values["prompt_tokens"]:
            raise MalformedEvent("cached_prompt_tokens exceeds prompt_tokens")
        return cls(**values)


def _int(value: Any, *, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= MAX_INT:
        raise ValueError(f"expected an integer from {minimum} to {MAX_INT}")
    return value


def _text(value: Any, *, max_length: int, blank: bool = False) -> str:
    if not isinstance(value, str) or len(value) > max_length or (not blank and not value):
        raise ValueError(f"expected a string of at most {max_length} characters")
    return value


def _timestamp(value: Any) -> datetime:
    at = datetime.fromisoformat(value) if isinstance(value, str) else None
    if at is None or at.tzinfo is None:
        raise ValueError("expected an ISO 8601 time with a UTC offset")
    return at.astimezone(UTC)


def _status(value: Any) -> str:
    if value not in UsageStatus.values:
        raise ValueError(f"expected one of {', '.join(UsageStatus.values)}")
    return value


def _bad_class():
    raise ValueError(f"expected one of {', '.join(PriorityClass.values)}, or empty")


def _optional(check):
    return lambda value: None if value is None else check(value)


_FIELD_RULES = {
    "request_id": functools.partial(_text, max_length=64),
    "tenant_id": functools.partial(_int, minimum=1),
    "team_id": functools.partial(_int, minimum=1),
    "api_key_id": functools.partial(_int, minimum=1),
    "deployment_id": _optional(functools.partial(_int, minimum=1)),
    "model": functools.partial(_text, max_length=200),
    "endpoint": functools.partial(_text, max_length=255, blank=True),
    "prompt_tokens": functools.partial(_int, minimum=0),
    "cached_prompt_tokens": functools.partial(_int, minimum=0),
    "output_tokens": functools.partial(_int, minimum=0),
    "ttft_ms": _optional(functools.partial(_int, minimum=0)),
    "latency_ms": _optional(functools.partial(_int, minimum=0)),
    "status": _status,
    "created_at": _timestamp,
    "priority_class": lambda value: value if value in ("", *PriorityClass.values) else _bad_class(),
    "queued_ms": _optional(functools.partial(_int, minimum=0)),
}
# Fields added after the first events were written: an event without them (in a router's journal) takes these.
_OPTIONAL_DEFAULTS = {"priority_class": "", "queued_ms": None}


def _checked(name: str, data: dict[str, Any]) -> Any:
    if name not in data:
        if name in _OPTIONAL_DEFAULTS:
            return _OPTIONAL_DEFAULTS[name]
        raise MalformedEvent(f"{name} is missing")
    try:
        return _FIELD_RULES[name](data[name])
    except (TypeError, ValueError) as exc:
        raise MalformedEvent(f"{name}: {exc}") from None


# Emission ---------------------------------------------------------------------------------------------


async def usage_event_emit(redis_client: redis.asyncio.Redis, event: UsageEvent) -> None:
    """Append one event to the usage stream (the router's side)."""
    await redis_client.xadd(stream_key(), {FIELD: event.encode()})


def usage_event_emit_sync(redis_client: redis.Redis, event: UsageEvent) -> None:
    redis_client.xadd(stream_key(), {FIELD: event.encode()})


async def usage_stream_lag(redis_client: redis.asyncio.Redis) -> tuple[int, float]:
    """The ingestion lag: entries no worker has acknowledged yet, and the age in seconds of the oldest of them.
    The stream holds exactly those (acknowledged entries are deleted), and an entry's id starts with the
    millisecond it was added."""
    async with redis_client.pipeline(transaction=False) as pipe:
        pipe.xlen(stream_key())
        pipe.xrange(stream_key(), count=1)
        length, first = await pipe.execute()
    if not length or not first:
        return 0, 0.0
    entry_id = first[0][0]
    added_ms = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])
    return int(length), max(0.0, time.time() - added_ms / 1000)


# Consumption ------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    """One stream entry on its way to the ledger."""

    id: str
    fields: dict[str, str]
    event: UsageEvent | None = None
    record: UsageRecord | None = None


@dataclass
class BatchResult:
    seen: int = 0
    written: int = 0
    dead: int = 0


@functools.cache
def _redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


def usage_redis() -> redis.Redis:
    return _redis(settings.REDIS_URL)


def usage_ingest_batch(*, consumer: str, count: int = 500, block_ms: int = 0) -> int:
    """Write one batch of usage events to the ledger; return how many records were written.

    `block_ms` waits that long for new entries when there are none; 0 does not wait.
    """
    return ingest_once(consumer=consumer, count=count, block_ms=block_ms).written


def usage_ingest_until_empty(
    *, consumer: str | None = None, count: int | None = None, max_seconds: float | None = None
) -> int:
    """Ingest batches until the stream has nothing new (or `max_seconds` passed); return records written."""
    consumer = consumer or consumer_name()
    count = count or settings.USAGE_INGEST_BATCH_SIZE
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    written = 0
    while True:
        result = ingest_once(consumer=consumer, count=count)
        written += result.written
        if result.seen < count or (deadline is not None and time.monotonic() >= deadline):
            return written


def usage_stream_trim() -> int:
    """Delete the entries every consumer group has acknowledged: those before the oldest entry a group still
    has pending or has not delivered yet. Returns how many were deleted; without a group, none."""
    client, stream = usage_redis(), stream_key()
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no stream yet
        return 0
    floors = []
    for group in groups:
        ms, seq = (int(part) for part in group["last-delivered-id"].split("-"))
        floor = (ms, seq + 1)  # the first id the group has not been delivered
        if group["pending"]:
            oldest = client.xpending(stream, group["name"])["min"]
            floor = min(floor, tuple(int(part) for part in oldest.split("-")))
        floors.append(floor)
    if not floors:
        return 0
    ms, seq = min(floors)
    return client.xtrim(stream, minid=f"{ms}-{seq}", approximate=False)


def ingest_once(*, consumer: str, count: int, block_ms: int = 0) -> BatchResult:
    client, stream = usage_redis(), stream_key()
    _ensure_group(client, stream)
    entries = _reclaim(client, stream, consumer, count)
    if len(entries) < count:
        entries += _read_new(client, stream, consumer, count - len(entries), block_ms)
    if not entries:
        return BatchResult()
    good, bad = _prepare(entries)
    _dead_letter(client, stream, consumer, bad)
    written, failed = _write(good)
    _dead_letter(client, stream, consumer, failed)
    failed_ids = {entry.id for entry, _ in failed}
    recorded = [entry for entry in good if entry.id not in failed_ids]
    _touch_keys(recorded)
    _ack(client, stream, [entry.id for entry in recorded])
    result = BatchResult(seen=len(entries), written=written, dead=len(bad) + len(failed))
    logger.info(
        "usage ingest %s: %d entries, %d written, %d already recorded, %d dead-lettered",
        consumer,
        result.seen,
        result.written,
        len(good) - len(failed) - written,
        result.dead,
    )
    return result


def _ensure_group(client: redis.Redis, stream: str) -> None:
    # From id 0, so events emitted before the group existed are ingested too.
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _reclaim(client: redis.Redis, stream: str, consumer: str, count: int) -> list[_Entry]:
    """Entries another consumer read but did not acknowledge within the visibility timeout."""
    reply = client.xautoclaim(
        stream,
        GROUP,
        consumer,
        min_idle_time=settings.USAGE_VISIBILITY_TIMEOUT_MS,
        start_id="0-0",
        count=count,
    )
    entries = _entries(client, stream, reply[1])
    if entries:
        logger.warning("usage ingest %s: reclaimed %d unacknowledged entries", consumer, len(entries))
    return entries


def _read_new(client: redis.Redis, stream: str, consumer: str, count: int, block_ms: int) -> list[_Entry]:
    reply = client.xreadgroup(GROUP, consumer, {stream: ">"}, count=count, block=block_ms or None)
    return _entries(client, stream, reply[0][1] if reply else [])


def _entries(client: redis.Redis, stream: str, raw: list) -> list[_Entry]:
    entries = []
    for entry_id, fields in raw:
        if entry_id is None:
            continue
        if fields is None:
            # Trimmed away while pending: nothing left to ingest, so only the acknowledgement remains.
            client.xack(stream, GROUP, entry_id)
            continue
        entries.append(_Entry(id=entry_id, fields=fields))
    return entries


def _prepare(entries: list[_Entry]) -> tuple[list[_Entry], list[tuple[_Entry, str]]]:
    """Decode, check against the database and price each entry. Returns the writable and the refused."""
    bad: list[tuple[_Entry, str]] = []
    decoded: list[_Entry] = []
    for entry in entries:
        if FIELD not in entry.fields:
            bad.append((entry, f"no {FIELD!r} field"))
            continue
        try:
            entry.event = UsageEvent.decode(entry.fields[FIELD])
            decoded.append(entry)
        except MalformedEvent as exc:
            bad.append((entry, str(exc)))
    if not decoded:
        return [], bad
    owners = _key_owners({entry.event.api_key_id for entry in decoded})
    deployments = set(
        ModelDeployment.objects.filter(id__in={e.event.deployment_id for e in decoded}).values_list(
            "id", flat=True
        )
    )
    sheets = price_sheets_for(
        models={e.event.model for e in decoded},
        tenant_ids={e.event.tenant_id for e in decoded},
        until=max(e.event.created_at for e in decoded),
    )
    good = []
    for entry in decoded:
        event = entry.event
        owner = owners.get(event.api_key_id)
        if owner != (event.team_id, event.tenant_id):
            bad.append((entry, _owner_mismatch(event, owner)))
            continue
        entry.record = _record(event, sheets, deployments)
        good.append(entry)
    return good, bad


def _key_owners(key_ids: set[int]) -> dict[int, tuple[int, int]]:
    """Each key's (team id, tenant id): an event must name the team and tenant its key belongs to."""
    rows = ApiKey.objects.filter(id__in=key_ids).values_list("id", "team_id", "team__tenant_id")
    return {key_id: (team_id, tenant_id) for key_id, team_id, tenant_id in rows}


def _owner_mismatch(event: UsageEvent, owner: tuple[int, int] | None) -> str:
    if owner is None:
        return f"unknown api_key_id {event.api_key_id}"
    return (
        f"api_key_id {event.api_key_id} belongs to team {owner[0]} of tenant {owner[1]}, "
        f"not team {event.team_id} of tenant {event.tenant_id}"
    )


def _record(event: UsageEvent, sheets: list[PriceSheet], deployments: set[int]) -> UsageRecord:
    sheet = sheet_in_force(sheets, model=event.model, tenant_id=event.tenant_id, at=event.created_at)
    tokens = {
        "prompt_tokens": event.prompt_tokens,
        "cached_prompt_tokens": event.cached_prompt_tokens,
        "output_tokens": event.output_tokens,
    }
    return UsageRecord(
        request_id=event.request_id,
        tenant_id=event.tenant_id,
        team_id=event.team_id,
        api_key_id=event.api_key_id,
        # A deployment deleted since the request: the ledger keeps the row, as SET_NULL would.
        deployment_id=event.deployment_id if event.deployment_id in deployments else None,
        model=event.model,
        endpoint=event.endpoint,
        cost=cost_of(sheet=sheet, **tokens) if sheet else Decimal("0"),
        currency=sheet.currency if sheet else settings.USAGE_DEFAULT_CURRENCY,
        ttft_ms=event.ttft_ms,
        latency_ms=event.latency_ms,
        status=event.status,
        created_at=event.created_at,
        priority_class=event.priority_class,
        queued_ms=event.queued_ms,
        **tokens,
    )


def _write(entries: list[_Entry]) -> tuple[int, list[tuple[_Entry, str]]]:
    """Insert the batch in one transaction; if the database refuses it, find and set aside the culprits."""
    if not entries:
        return 0, []
    try:
        with transaction.atomic():
            return _insert([entry.record for entry in entries]), []
    except (IntegrityError, DataError) as exc:
        logger.warning("usage ingest: batch refused (%s); writing its %d rows one by one", exc, len(entries))
    written, failed = 0, []
    for entry in entries:
        try:
            with transaction.atomic():
                written += _insert([entry.record])
        except (IntegrityError, DataError) as exc:
            failed.append((entry, f"refused by the database: {exc}"))
    return written, failed


def _insert(records: list[UsageRecord]) -> int:
    """INSERT ... ON CONFLICT (request_id) DO NOTHING; returns how many rows were new.

    Not bulk_create(ignore_conflicts=True), because that cannot say how many rows it wrote.
    """
    fields = [f for f in UsageRecord._meta.concrete_fields if not f.primary_key]
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    sql = (
        f"INSERT INTO {connection.ops.quote_name(UsageRecord._meta.db_table)} ({columns}) "
        f"VALUES {', '.join([row] * len(records))} ON CONFLICT (request_id) DO NOTHING RETURNING 1"
    )
    params = [f.get_db_prep_save(f.pre_save(r, add=True), connection) for r in records for f in fields]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return len(cursor.fetchall())


def _touch_keys(entries: list[_Entry]) -> None:
    """Move each key's last_used_at forward to its newest event of the batch (never back: batches and
    redeliveries come in any order). Best effort: a failure is logged, and the key's next batch sets it."""
    latest: dict[int, datetime] = {}
    for entry in entries:
        event = entry.event
        if event.api_key_id not in latest or event.created_at > latest[event.api_key_id]:
            latest[event.api_key_id] = event.created_at
    if not latest:
        return
    table = connection.ops.quote_name(ApiKey._meta.db_table)
    rows = sorted(latest.items())
    values = ", ".join(["(%s::bigint, %s::timestamptz)"] * len(rows))
    sql = (
        f"UPDATE {table} AS k SET last_used_at = v.at FROM (VALUES {values}) AS v(id, at) "
        "WHERE k.id = v.id AND (k.last_used_at IS NULL OR k.last_used_at < v.at)"
    )
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql, [value for row in rows for value in row])
    except DatabaseError as exc:
        logger.warning("usage ingest: could not update last_used_at of %d keys: %s", len(rows), exc)


def _ack(client: redis.Redis, stream: str, entry_ids: list[str]) -> None:
    """Acknowledge and delete entries whose rows are committed."""
    if not entry_ids:
        return
    pipe = client.pipeline(transaction=True)
    pipe.xack(stream, GROUP, *entry_ids)
    pipe.xdel(stream, *entry_ids)
    pipe.execute()


def _dead_letter(client: redis.Redis, stream: str, consumer: str, refused: list[tuple[_Entry, str]]) -> None:
    if not refused:
        return
    pipe = client.pipeline(transaction=True)
    for entry, reason in refused:
        logger.error("usage ingest %s: dead-lettering entry %s: %s", consumer, entry.id, reason)
        pipe.xadd(
            dead_letter_key(),
            {"stream": stream, "id": entry.id, "fields": json.dumps(entry.fields), "reason": reason},
            maxlen=stream_maxlen(),
            approximate=True,
        )
    ids = [entry.id for entry, _ in refused]
    pipe.xack(stream, GROUP, *ids)
    pipe.xdel(stream, *ids)
    pipe.execute()
