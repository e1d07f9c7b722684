"""The generation routes' handler, in four steps, each a function of what the one before gave it:

1. `check`: the key, the body and every field the router acts on (routing/server/checks.py), with the request's token
   bounds; any refusal that needs no quota and no tokenizer is decided here.
2. `admit`: the bounds reserved against the tenant's, team's and key's quotas (routing/metering/admission.py).
3. `place`: the prompt tokenized and scored for routing (routing/kvindex/prefix.py); the refusals that need its count.
4. `serve`: an Exchange (routing/server/exchange.py), given the replica's `Services`, takes it to an engine and back;
   the reservation is settled once, by `Exchange.settle`, whatever way it ends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from array import array
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING

from django.conf import settings
from redis.exceptions import RedisError

from routing.info import DeploymentInfo, KeyInfo, Prices
from routing.kvindex.prefix import needs_prompt, read_outcome
from routing.metering.admission import Decision, cost_units, quota_scopes
from routing.metering.finisher import InFlight
from routing.rendering.dialects import OPENAI, Dialect
from routing.rendering.tokenize import token_ids
from routing.scheduling.pipeline import RequestContext
from routing.server import metrics, tracing
from routing.server.assemble import assembles
from routing.server.checks import (
    ClientGone,
    HttpError,
    check_stop,
    deployment_for,
    dumps,
    engine_fields,
    over_context,
    over_logprob_limit,
    parse,
    priority_for,
    read_body,
    validate,
)
from routing.server.exchange import Exchange, RequestInfo
from routing.server.sessions import session_key
from routing.server.wire import JSON_HEADERS, Receive, Send, encode_headers, respond
from tenants.usage_stream import UsageEvent

if TYPE_CHECKING:
    from routing.server.app import Router

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Checked:
    """A request that passed `check`: what admission reserves and the exchange serves."""

    key: KeyInfo
    deployment: DeploymentInfo
    payload: dict  # the fields sent on to the engine
    body: bytes  # `payload` as JSON
    prompt_ids: array | None  # a prompt sent as token ids
    input_bound: int
    output_bound: int
    stream: bool
    client_wants_usage: bool
    client_wants_running_usage: bool
    assemble: bool
    priority: str
    session: str | None


async def generate(
    router: Router, scope: dict, receive: Receive, send: Send, dialect: Dialect, key: KeyInfo | None = None
) -> None:
    """A generation route: check, admit, place, serve. `key`: the request's key when the caller already
    authenticated it."""
    started = time.perf_counter()
    request_id = os.urandom(16).hex()
    try:
        checked = await check(router, scope, receive, dialect, key)
    except HttpError as exc:
        return await respond(
            send,
            exc.status,
            dialect.error_body(exc.status, exc.message, exc.param),
            JSON_HEADERS + encode_headers(exc.headers),
        )
    except ClientGone:
        return
    model = checked.deployment.served_model_name
    if tracing.ON:
        tracing.checked(checked, request_id)
    if not router.finisher.accepting:
        metrics.of(metrics.errors, model, "usage_unrecordable").inc()
        return await respond(
            send,
            503,
            dialect.error_body(
                503,
                "Usage cannot be recorded right now (Redis and the local usage journal are both "
                "unavailable). Retry shortly.",
            ),
            JSON_HEADERS + [(b"retry-after", b"5")],
        )

    try:
        with tracing.span("router.admit"):
            decision, prices = await admit(router, checked, request_id)
    except RedisError:
        log.exception("admission failed")
        metrics.of(metrics.errors, model, "admission").inc()
        return await respond(
            send,
            503,
            dialect.error_body(503, "Quota checks are unavailable right now. Retry shortly."),
            JSON_HEADERS + [(b"retry-after", b"1")],
        )
    if not decision.admitted:
        metrics.of(metrics.requests, model, "", "429").inc()
        return await respond(
            send,
            429,
            dialect.error_body(429, decision.message, code=decision.limit),
            JSON_HEADERS + encode_headers(decision.headers),
        )

    try:
        with tracing.span("router.place"):
            ctx = await place(router, checked, scope["path"], request_id)
    except BaseException:
        router.admission.release(decision.reservation)  # its slot lease runs out instead of being renewed
        raise
    request = RequestInfo(
        scope=scope,
        dialect=dialect,
        deployment=checked.deployment,
        key=checked.key,
        request_id=request_id,
        payload=checked.payload,
        body=checked.body,
        stream=checked.stream,
        client_wants_usage=checked.client_wants_usage,
        running_usage=checked.client_wants_running_usage,
        input_bound=checked.input_bound,
        started=started,
        headers=decision.headers or {},
        ctx=ctx,
        prices=prices,
        reservation=decision.reservation,
        priority=checked.priority,
        output_bound=checked.output_bound,
        assemble=checked.assemble,
    )
    await serve(router, request, receive, send)


async def check(
    router: Router, scope: dict, receive: Receive, dialect: Dialect, key: KeyInfo | None
) -> Checked:
    """Step 1: the key, the body, the deployment and every field the router acts on; HttpError for a refusal."""
    path = scope["path"]
    if key is None:
        key = router.authenticate(scope, dialect)
    body = await read_body(receive, router.max_body)
    payload = parse(body)
    deployment = deployment_for(router.snapshot, payload, key)
    priority = priority_for(scope, key)
    session = session_key(scope, payload, key.tenant_id)
    payload = engine_fields(payload, path, key)
    prompt_ids = token_ids(payload.get("prompt"))  # a prompt of token ids, converted once
    input_bound, output_bound = validate(
        payload,
        deployment,
        dialect,
        prompt_ids,
        path,
        router.max_messages,
        router.max_choices,
        router.prefix,
    )
    check_stop(payload, settings.ROUTER_MAX_STOP_SEQUENCES, settings.ROUTER_MAX_STOP_BYTES)
    stream = bool(payload.get("stream"))
    options = payload.get("stream_options") or {}
    if options and not stream:
        # As vLLM refuses it; the router streams from the engine all the same (below).
        raise HttpError(400, "`stream_options` can only be set when `stream` is true.", "stream_options")
    client_wants_usage = bool(options.get("include_usage"))
    client_wants_running_usage = bool(options.get("continuous_usage_stats"))
    # A client that does not stream gets its answer assembled from the engine's stream (routing/server/assemble.py):
    # a long answer is not mistaken for an engine that never started, and one cut short is billed.
    assemble = not stream and assembles(payload, path)
    if assemble:
        payload["stream"] = True
        client_wants_usage = client_wants_running_usage = True  # the assembler reads every event
    if payload.get("stream") and dialect is OPENAI:
        # The engine reports usage in every chunk, so a stream cut short still bills the prompt it read.
        payload["stream_options"] = {**options, "include_usage": True, "continuous_usage_stats": True}
    return Checked(
        key=key,
        deployment=deployment,
        payload=payload,
        body=dumps(payload),
        prompt_ids=prompt_ids,
        input_bound=input_bound,
        output_bound=output_bound,
        stream=stream,
        client_wants_usage=client_wants_usage,
        client_wants_running_usage=client_wants_running_usage,
        assemble=assemble,
        priority=priority,
        session=session,
    )


async def admit(router: Router, checked: Checked, request_id: str) -> tuple[Decision, Prices | None]:
    """Step 2: the request's bounds reserved against every quota over it, with the prices its spend is counted
    at (under a quota only: the ledger prices every request when it ingests it). RedisError when Redis fails."""
    key, deployment = checked.key, checked.deployment
    scopes = quota_scopes(router.snapshot, key)
    under_quota = any(quota is not None for _, _, quota in scopes)
    prices = (
        router.snapshot.prices_for(deployment.served_model_name, key.tenant_id, datetime.now(UTC))
        if under_quota
        else None
    )
    decision = await router.admission.admit(
        request_id=request_id,
        scopes=scopes,
        input_reserve=checked.input_bound,
        output_reserve=checked.output_bound,
        spend_reserve=cost_units(prices, checked.input_bound, 0, checked.output_bound),
        orphan_event=orphan_event(checked.key, checked.deployment, checked.priority, request_id)
        if under_quota
        else None,
    )
    return decision, prices


def orphan_event(
    key: KeyInfo, deployment: DeploymentInfo, priority: str, request_id: str, prompt_tokens: int = 0
) -> str:
    """The usage event a request gets if its replica dies before it ends (routing/metering/admission.py, REAP): failed,
    with its prompt as the router counted it once it goes to an engine (else none) and no output, since what the
    engine did is known only to the replica that died."""
    return UsageEvent(
        request_id=request_id,
        tenant_id=key.tenant_id,
        team_id=key.team_id,
        api_key_id=key.id,
        deployment_id=deployment.id,
        model=deployment.served_model_name,
        endpoint="",
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=0,
        output_tokens=0,
        ttft_ms=None,
        latency_ms=None,
        status="failed",
        created_at=datetime.now(UTC),
        priority_class=priority,
    ).encode()


def in_flight_event(exchange: Exchange) -> InFlight:
    """`orphan_event` for a request on its way to an engine, and what it bills: its prompt as the engine counted
    it if it said so yet, else as the router did (none when the router did not tokenize it)."""
    request = exchange.request
    prompt = exchange.usage.prompt_tokens or request.ctx.prompt_tokens_estimate
    event = orphan_event(request.key, request.deployment, request.priority, request.request_id, prompt)
    return InFlight(event, prompt, cost_units(request.prices, prompt, 0, 0))


async def place(router: Router, checked: Checked, path: str, request_id: str) -> RequestContext:
    """Step 3: the prompt's tokens and where they are cached, and its session. Only an admitted request is
    tokenized (a refused one costs the router no tokenizer time); a fault in scoring routes it on load alone."""
    deployment = checked.deployment
    try:
        return await _context(router, deployment, checked.payload, checked.prompt_ids, path, checked.session)
    except Exception as exc:
        # Never lose an admitted request to a fault in prefix scoring: it is routed on load alone.
        log.exception("prefix scoring failed for request %s", request_id)
        router.prefix.render_failed(deployment, "error", repr(exc))
        return RequestContext(model=deployment.served_model_name, session_id=checked.session)


async def serve(router: Router, request: RequestInfo, receive: Receive, send: Send) -> None:
    """Step 4: the refusals that need the prompt's count, else the exchange; the reservation settled once."""
    deployment, payload, path = request.deployment, request.payload, request.scope["path"]
    exchange = Exchange(router.services, request, receive, send)
    too_long = over_context(deployment, payload, request.ctx, path) or over_logprob_limit(
        payload, request.ctx, path, request.input_bound, settings.ROUTER_MAX_PROMPT_LOGPROB_ENTRIES
    )
    try:
        if too_long is not None:
            # Refused before any speculative index entry is written; the reservation is settled to nothing.
            exchange.http_status = 400
            metrics.of(metrics.requests, deployment.served_model_name, "", "400").inc()
            await respond(
                send, 400, request.dialect.error_body(400, too_long.message, too_long.param), JSON_HEADERS
            )
        else:
            if request.reservation is not None:  # billed from Redis if this process dies before it ends
                router.finisher.opened(request.reservation, partial(in_flight_event, exchange))
            await exchange.run()
    finally:
        await asyncio.shield(exchange.settle())


async def _context(
    router: Router,
    deployment: DeploymentInfo,
    payload: dict,
    prompt_ids: array | None,
    path: str,
    session: str | None,
) -> RequestContext:
    """The prompt's tokens and where they are cached, and its session (routing/server/sessions.py). Tokenizing waits in
    a bounded queue for a bounded time: past either bound the request is routed on load alone (counted as a
    render failure)."""
    if prompt_ids is None and needs_prompt(deployment):
        if router.tokenizing >= router.tokenize_queue:
            router.prefix.render_failed(deployment, "queue_full", "the tokenizing queue is full")
            return RequestContext(model=deployment.served_model_name, session_id=session)
        router.tokenizing += 1
        work = asyncio.ensure_future(router.prefix.context(deployment, payload, None, path, session))
        try:
            return await asyncio.wait_for(asyncio.shield(work), router.tokenize_wait)
        except TimeoutError:
            work.add_done_callback(read_outcome)
            router.prefix.render_failed(deployment, "queue_wait", "tokenizing took too long")
            return RequestContext(model=deployment.served_model_name, session_id=session)
        finally:
            router.tokenizing -= 1
    return await router.prefix.context(deployment, payload, prompt_ids, path, session)
