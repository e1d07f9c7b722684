"""Traces of our own traffic, for the fleet planner (docs/planner.md#traces-of-our-own-traffic).

A share of requests (ROUTER_TRAFFIC_TRACE_RATIO; at 0, the default, nothing is recorded and the exchange's hook
costs one comparison) leave one entry each, at their end, on a capped Redis stream: when it arrived, whose it was
(tenant, team, key, priority class), its session and its prompt's block keys as keyed hashes under a platform
secret, its prompt, cached and output tokens, and the deployment and engine that served it. No text, no token ids,
no raw block key. The worker drains the stream into `TrafficTraceEntry` rows (`traffic_trace_drain`) and prunes
them after ROUTER_TRAFFIC_TRACE_KEEP_DAYS; `manage.py export_trace` writes a period as Mooncake-style JSON lines
(`export_rows`), which `planner.trace.load_trace` reads as it reads the public traces.

The router's block keys are chained (a key stands for its block and everything before it), so hashing each one
alone keeps what a replay needs: equal prefixes give equal hashes, and a key every 512 tokens is a key per
Mooncake block.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from django.conf import settings

from routing.kvindex.blocks import block_keys, chain_seed, hex_keys
from routing.rendering.tokenize import token_ids

if TYPE_CHECKING:
    from routing.kvindex.prefix import PrefixRouting
    from routing.server.exchange import Exchange, RequestInfo

log = logging.getLogger(__name__)

RATIO = settings.ROUTER_TRAFFIC_TRACE_RATIO
HASH_BYTES = 8
FIELD = b"e"  # the entry's scalars as compact JSON
BLOCKS = b"b"  # the prompt's block hashes, HASH_BYTES each, in order
MAX_PENDING = 256  # writes in flight at once on a replica; past it entries are dropped, not queued
_pending: set[asyncio.Task] = set()
_secret: bytes | None = None


def trace_secret() -> bytes:
    """The key of the trace's hashes: ROUTER_TRAFFIC_TRACE_SECRET, else one derived from SECRET_KEY."""
    global _secret
    if _secret is None:
        given = settings.ROUTER_TRAFFIC_TRACE_SECRET or f"traffic-trace\x00{settings.SECRET_KEY}"
        _secret = hashlib.sha256(given.encode()).digest()
    return _secret


def hashed_blocks(block_keys: list[str], secret: bytes) -> bytes:
    """Each of the router's block keys (hex) hashed alone under `secret`, HASH_BYTES each, in order. About 0.4 us
    a key: copying a keyed hash's state costs less than keying a new one."""
    keyed = hashlib.blake2b(key=secret, digest_size=HASH_BYTES)
    raw = bytes.fromhex("".join(block_keys))
    out = bytearray()
    for at in range(0, len(raw), 8):
        h = keyed.copy()
        h.update(raw[at : at + 8])
        out += h.digest()
    return bytes(out)


def hashed_session(session: str | None, secret: bytes) -> str:
    if not session:
        return ""
    return hashlib.blake2b(session.encode(), key=secret, digest_size=HASH_BYTES).hexdigest()


def entry_fields(exchange: Exchange, secret: bytes) -> dict[bytes, bytes]:
    """The stream entry of one finished request."""
    request, usage = exchange.request, exchange.usage
    ctx, key = request.ctx, request.key
    arrived = time.time() - (time.perf_counter() - request.started)
    prompt = usage.prompt_tokens or ctx.prompt_tokens_estimate
    scalars = {
        "request_id": request.request_id,
        "arrived": round(arrived, 3),
        "deployment": request.deployment.id,
        "endpoint": exchange.endpoint_name,
        "tenant": key.tenant_id,
        "team": key.team_id,
        "key": key.id,
        "priority": request.priority,
        "session": hashed_session(ctx.session_id, secret),
        "prompt": prompt,
        "cached": min(usage.cached_tokens, prompt),
        "output": usage.output_tokens,
        "unseen": output_before_visible(exchange, usage.output_tokens, time.perf_counter()),
        "block_size": request.deployment.block_size,
    }
    return {
        FIELD: json.dumps(scalars, separators=(",", ":")).encode(),
        BLOCKS: hashed_blocks(ctx.block_keys, secret),
    }


def output_before_visible(exchange: Exchange, output: int, ended: float) -> int:
    """How many of the answer's first output tokens the client saw nothing of, so that a replay times its first
    token as the client saw it: none where the first event came with the first token; all but the last for an
    answer not streamed (it comes whole); on a stream whose first content came later (a tool call, which the
    engine's parser holds back until the call's name is complete, opens no Messages content block before), the
    tokens made by then, taking them as evenly spaced between the first event and the end."""
    if output <= 1:
        return 0
    if not exchange.request.stream:
        return output - 1
    first, content = exchange.first_byte_at, exchange.first_content_at
    if first is None or content is None or content <= first or ended <= first:
        return 0
    return min(output - 1, round((content - first) / (ended - first) * (output - 1)))


def record(exchange: Exchange) -> None:
    """The exchange's hook at a request's end: the sampling decision, once, and for a request sampled its entry,
    written in the background so that the request waits for nothing."""
    if random.random() >= RATIO or len(_pending) >= MAX_PENDING:
        return
    services, request = exchange.services, exchange.request
    if services.redis is None:
        return
    fields = entry_fields(exchange, trace_secret())
    # Routed without the prompt's keys (a mode that reads no prompt): keyed after its end, off its path.
    unkeyed = request if not request.ctx.block_keys else None
    task = asyncio.get_running_loop().create_task(_write(services, fields, unkeyed))
    _pending.add(task)
    task.add_done_callback(_pending.discard)


async def _write(services, fields: dict[bytes, bytes], unkeyed: RequestInfo | None) -> None:
    try:
        if unkeyed is not None:
            fields[BLOCKS] = hashed_blocks(await prompt_keys(services.prefix, unkeyed), trace_secret())
        await services.redis.xadd(
            settings.ROUTER_TRAFFIC_TRACE_STREAM,
            fields,
            maxlen=settings.ROUTER_TRAFFIC_TRACE_STREAM_MAXLEN,
            approximate=True,
        )
    except Exception as exc:  # a trace is a sample: an entry lost costs nothing else
        log.warning("traffic trace entry not written: %r", exc)


async def prompt_keys(prefix: PrefixRouting, request: RequestInfo) -> list[str]:
    """The prompt's block keys as routing/kvindex/prefix.py makes them (the same seed, tokenizer and rendering), for a
    request routed without them; none where the deployment has no tokenizer."""
    deployment = request.deployment
    tokens = token_ids(request.payload.get("prompt"))  # a completions prompt sent as token ids
    if tokens is None:
        loop = asyncio.get_running_loop()
        tokenizer = await loop.run_in_executor(None, prefix.tokenizer_for, deployment)  # loaded once
        if tokenizer is None:
            return []
        tokens = await prefix.encode(tokenizer, request.payload, request.scope["path"])
        if tokens is None:
            return []
    seed = chain_seed(deployment.served_model_name, cache_salt=request.payload.get("cache_salt"))
    return hex_keys(block_keys(tokens, deployment.block_size, seed))


def _row(fields: dict[bytes, bytes]):
    from routing.models import TrafficTraceEntry

    data = json.loads(fields[FIELD])
    blocks = fields.get(BLOCKS, b"")
    return TrafficTraceEntry(
        request_id=str(data["request_id"])[:64],
        arrived_at=datetime.fromtimestamp(float(data["arrived"]), UTC),
        deployment_id=int(data["deployment"]),
        endpoint=str(data.get("endpoint") or "")[:255],
        tenant_id=int(data["tenant"]),
        team_id=int(data["team"]),
        api_key_id=int(data["key"]),
        priority_class=str(data.get("priority") or "")[:16],
        session=str(data.get("session") or "")[:32],
        prompt_tokens=max(0, int(data["prompt"])),
        cached_tokens=max(0, int(data["cached"])),
        output_tokens=max(0, int(data["output"])),
        output_before_visible=max(0, int(data.get("unseen", 0))),
        block_size=max(1, int(data["block_size"])),
        block_hashes=blocks[: len(blocks) // HASH_BYTES * HASH_BYTES],
    )


def traffic_trace_drain(client, *, batch: int = 500, max_batches: int = 20) -> int:
    """Move the stream's entries into the database, oldest first; returns the rows written. An entry is deleted
    from the stream once its batch is committed; written twice (two drains at once, or a drain that died before
    deleting) it is one row. An entry that cannot be read is dropped."""
    from routing.models import TrafficTraceEntry

    stream = settings.ROUTER_TRAFFIC_TRACE_STREAM
    written = 0
    for _ in range(max_batches):
        entries = client.xrange(stream, "-", "+", count=batch)
        if not entries:
            break
        rows = []
        for entry_id, fields in entries:
            try:
                rows.append(_row(fields))
            except (KeyError, TypeError, ValueError, OverflowError) as exc:
                log.warning("traffic trace entry %s dropped: %r", entry_id, exc)
        TrafficTraceEntry.objects.bulk_create(rows, ignore_conflicts=True)
        client.xdel(stream, *[entry_id for entry_id, _ in entries])
        written += len(rows)
        if len(entries) < batch:
            break
    return written


def traffic_trace_prune(*, now: datetime | None = None) -> int:
    from routing.models import TrafficTraceEntry

    cutoff = (now or datetime.now(UTC)) - timedelta(days=settings.ROUTER_TRAFFIC_TRACE_KEEP_DAYS)
    deleted, _ = TrafficTraceEntry.objects.filter(arrived_at__lt=cutoff).delete()
    return deleted


def export_rows(
    *, deployment_id: int, since: datetime, until: datetime, block_tokens: int = 512
) -> Iterator[dict]:
    """The period's entries as Mooncake trace lines, in order of arrival: `timestamp` (ms from the first),
    `input_length`, `output_length`, `hash_ids` (one per `block_tokens` of the prompt, numbered from 0 in order
    of first appearance: equal prefixes, equal ids), then ours: `cached_length`, `output_before_visible` (the
    output tokens made before the client saw any of the answer), `tenant`, `team`, `key`, `priority`,
    `session` (numbered as the hash ids; null where none), `endpoint` (the engine that served it, numbered in
    order of first appearance, not named; null where none). A block the router did not key (the
    prompt's partial last block, a prompt it did not tokenize) gets an id of its own."""
    from routing.models import TrafficTraceEntry

    entries = (
        TrafficTraceEntry.objects.filter(
            deployment_id=deployment_id, arrived_at__gte=since, arrived_at__lt=until
        )
        .order_by("arrived_at", "id")
        .iterator(chunk_size=1000)
    )
    ids: dict[bytes, int] = {}
    sessions: dict[str, int] = {}
    endpoints: dict[str, int] = {}
    fresh = 0
    start = None
    for entry in entries:
        if block_tokens % entry.block_size:
            raise ValueError(
                f"block_tokens {block_tokens} is not a multiple of the deployment's block size {entry.block_size}"
            )
        start = start or entry.arrived_at
        step = block_tokens // entry.block_size * HASH_BYTES
        blocks = bytes(entry.block_hashes)
        hash_ids = []
        for at in range(step - HASH_BYTES, len(blocks), step):
            # The key ending each group of blocks stands for the whole prefix up to it (the keys are chained).
            hash_ids.append(ids.setdefault(blocks[at : at + HASH_BYTES], len(ids)))
        wanted = -(-entry.prompt_tokens // block_tokens)
        del hash_ids[wanted:]
        while len(hash_ids) < wanted:
            fresh += 1
            hash_ids.append(ids.setdefault(fresh.to_bytes(HASH_BYTES + 1, "big"), len(ids)))
        yield {
            "timestamp": round((entry.arrived_at - start).total_seconds() * 1000),
            "input_length": entry.prompt_tokens,
            "output_length": entry.output_tokens,
            "hash_ids": hash_ids,
            "cached_length": entry.cached_tokens,
            "output_before_visible": entry.output_before_visible,
            "tenant": entry.tenant_id,
            "team": entry.team_id,
            "key": entry.api_key_id,
            "priority": entry.priority_class,
            "session": sessions.setdefault(entry.session, len(sessions)) if entry.session else None,
            "endpoint": endpoints.setdefault(entry.endpoint, len(endpoints)) if entry.endpoint else None,
        }
