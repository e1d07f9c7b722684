"""The generation routes' handler: a request is checked (routing/requests.py), admitted against its quotas, its
prompt tokenized and scored for routing, and an Exchange (routing/exchange.py) serves it; the reservation is
settled once, whatever way the exchange ends."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from array import array
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from django.conf import settings
from redis.exceptions import RedisError

from . import metrics
from .admission import cost_units, quota_scopes
from .assemble import assembles
from .dialects import OPENAI, Dialect
from .exchange import Exchange, RequestInfo
from .pipeline import RequestContext
from .prefix import needs_prompt, read_outcome
from .requests import (
    ClientGone,
    HttpError,
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
from .sessions import session_key
from .state import DeploymentInfo
from .tokenize import token_ids
from .wire import JSON_HEADERS, Receive, Send, encode_headers, respond

if TYPE_CHECKING:
    from .app import Router

log = logging.getLogger(__name__)


async def generate(router: Router, scope: dict, receive: Receive, send: Send, dialect: Dialect) -> None:
    """A generation route: check the request, admit it, score its prompt, and serve it with an Exchange."""
    started = time.perf_counter()
    request_id = os.urandom(16).hex()
    path = scope["path"]
    try:
        key = router.authenticate(scope, dialect)
        body = await read_body(receive, router.max_body)
        payload = parse(body)
        deployment = deployment_for(router.snapshot, payload, key)
        priority = priority_for(scope, key)
        session = session_key(scope, payload, key.tenant_id)
        payload = engine_fields(payload, path, key, body)
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
        stream = bool(payload.get("stream"))
        options = payload.get("stream_options") or {}
        if options and not stream:
            # As vLLM refuses it; the router streams from the engine all the same (below).
            raise HttpError(400, "`stream_options` can only be set when `stream` is true.", "stream_options")
        client_wants_usage = bool(options.get("include_usage"))
        client_wants_running_usage = bool(options.get("continuous_usage_stats"))
        # A client that does not stream gets its answer assembled from the engine's stream (routing/assemble.py):
        # a long answer is not mistaken for an engine that never started, and one cut short is billed.
        assemble = not stream and assembles(payload, path)
        if assemble:
            payload["stream"] = True
            client_wants_usage = client_wants_running_usage = True  # the assembler reads every event
        if payload.get("stream") and dialect is OPENAI:
            # The engine reports usage in every chunk, so a stream cut short still bills the prompt it read.
            payload["stream_options"] = {**options, "include_usage": True, "continuous_usage_stats": True}
        body = dumps(payload)
    except HttpError as exc:
        return await respond(
            send,
            exc.status,
            dialect.error_body(exc.status, exc.message, exc.param),
            JSON_HEADERS + encode_headers(exc.headers),
        )
    except ClientGone:
        return

    if not router.finisher.accepting:
        metrics.of(metrics.errors, deployment.served_model_name, "usage_unrecordable").inc()
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

    snapshot = router.snapshot
    scopes = quota_scopes(snapshot, key)
    under_quota = any(quota is not None for _, _, quota in scopes)
    # Priced here only under a quota (for spend budgets); the ledger prices every request when it ingests it.
    prices = (
        snapshot.prices_for(deployment.served_model_name, key.tenant_id, datetime.now(UTC))
        if under_quota
        else None
    )
    try:
        decision = await router.admission.admit(
            request_id=request_id,
            scopes=scopes,
            input_reserve=input_bound,
            output_reserve=output_bound,
            spend_reserve=cost_units(prices, input_bound, 0, output_bound),
        )
    except RedisError:
        log.exception("admission failed")
        metrics.of(metrics.errors, deployment.served_model_name, "admission").inc()
        return await respond(
            send,
            503,
            dialect.error_body(503, "Quota checks are unavailable right now. Retry shortly."),
            JSON_HEADERS + [(b"retry-after", b"1")],
        )
    if not decision.admitted:
        metrics.of(metrics.requests, deployment.served_model_name, "", "429").inc()
        return await respond(
            send,
            429,
            dialect.error_body(429, decision.message, code=decision.limit),
            JSON_HEADERS + encode_headers(decision.headers),
        )

    # Only an admitted request is tokenized (a refused one costs the router no tokenizer time).
    try:
        ctx = await _context(router, deployment, payload, prompt_ids, path, session)
    except Exception as exc:
        # Never lose an admitted request to a fault in prefix scoring: it is routed on load alone.
        log.exception("prefix scoring failed for request %s", request_id)
        router.prefix.render_failed(deployment, "error", repr(exc))
        ctx = RequestContext(model=deployment.served_model_name, session_id=session)
    except BaseException:
        router.admission.release(decision.reservation)  # its slot lease runs out instead of being renewed
        raise
    request = RequestInfo(
        scope,
        dialect,
        deployment,
        key,
        request_id,
        payload,
        body,
        stream,
        client_wants_usage,
        client_wants_running_usage,
        input_bound,
        started,
        decision.headers or {},
        ctx,
        prices,
        decision.reservation,
        priority,
        output_bound,
        assemble,
    )
    exchange = Exchange(router, request, receive, send)
    too_long = over_context(deployment, payload, ctx, path) or over_logprob_limit(
        payload, ctx, path, input_bound, settings.ROUTER_MAX_PROMPT_LOGPROB_ENTRIES
    )
    try:
        if too_long is not None:
            # Refused before any speculative index entry is written; the reservation is settled to nothing.
            exchange.http_status = 400
            metrics.of(metrics.requests, deployment.served_model_name, "", "400").inc()
            await respond(send, 400, dialect.error_body(400, too_long.message, too_long.param), JSON_HEADERS)
        else:
            await exchange.run()
    finally:
        await asyncio.shield(exchange.complete())


async def _context(
    router: Router,
    deployment: DeploymentInfo,
    payload: dict,
    prompt_ids: array | None,
    path: str,
    session: str | None,
) -> RequestContext:
    """The prompt's tokens and where they are cached, and its session (routing/sessions.py). Tokenizing waits in
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
