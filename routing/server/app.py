"""The data plane: an ASGI app serving /v1 for agents.

check the request -> admit it (quotas, budgets) -> place it (tokenise, score, pick an engine) -> serve it
(stream the engine's answer through, settle the reservation and emit one usage event). Django's request machinery
stays off this path; the only state it reads per request is in memory (the snapshot) and in Redis (admission).

This module is the app: the routes, the life cycle and the snapshot refresh. A generation request's four steps are
routing/server/generation.py, with the checks of routing/server/checks.py and the exchange of
routing/server/exchange.py; endpoint load is kept in routing/scheduling/load.py. See
docs/routing.md#the-request-path.

Over 400 lines: the routes other than generation (models, count_tokens, metrics, health) and the replica's life
cycle share the Router's state."""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import os
import time
from concurrent.futures.process import BrokenProcessPool
from datetime import UTC, datetime

import orjson
from asgiref.sync import sync_to_async
from django.conf import settings
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from inference_platform.config_version import CONFIG_VERSION_KEY
from routing.info import DeploymentInfo, KeyInfo
from routing.kvindex.prefix import PrefixRouting
from routing.metering.admission import Admission, quota_scopes
from routing.metering.finisher import Finisher
from routing.rendering.conversion import RenderError, first_media_part
from routing.rendering.dialects import ANTHROPIC, OPENAI, Dialect
from routing.rendering.routes import MESSAGES, RESPONSES, ROUTES, listed
from routing.scheduling.flow import FlowControl
from routing.scheduling.load import EndpointLoad, LoadTrade
from routing.scheduling.load_scraper import LOAD_KEY
from routing.scheduling.pipeline import Pipeline
from routing.server import metrics, tracing
from routing.server.checks import (
    ClientGone,
    HttpError,
    authenticate,
    body_limit,
    deployment_for,
    parse,
    read_body,
    refuse_remote_media,
)
from routing.server.engine_errors import refusal, route_missing_body
from routing.server.exchange import Services
from routing.server.generation import generate
from routing.server.intake import ClientStalled, Intake
from routing.server.loop_lag import LoopLag
from routing.server.redis_pool import router_redis
from routing.server.upstream import UpstreamError, UpstreamPool
from routing.server.wire import JSON_HEADERS, Receive, Send, encode_headers, header, respond
from routing.snapshot import Snapshot, load_snapshot

log = logging.getLogger(__name__)

COUNT_TOKENS = "/v1/messages/count_tokens"


class Router:
    """One replica's state: the snapshot, a Redis client, an HTTP client pool and the pipeline."""

    def __init__(self):
        self.snapshot = Snapshot()
        self.loads: dict[int, EndpointLoad] = {}
        self.flow = FlowControl(self.loads, settings.ROUTER_FAIR_SHARE_WINDOW_S)
        self.pipeline = Pipeline()
        self.prefix: PrefixRouting | None = None
        self.redis = None
        self.admission: Admission | None = None
        self.trade_loads: LoadTrade | None = None
        self.upstream: UpstreamPool | None = None
        self.finisher: Finisher | None = None
        self.services: Services | None = None  # what each exchange is given, made at the start
        self._started: asyncio.Future | None = None
        self._refresher: asyncio.Task | None = None
        self._warming: asyncio.Task | None = None  # tokenizers loaded ahead of requests (PrefixRouting.warm)
        self.loop_lag = LoopLag()
        self._snapshot_at = 0.0
        self.max_body = settings.ROUTER_MAX_BODY_BYTES
        self.max_messages = settings.ROUTER_MAX_MESSAGES
        self.max_attempts = settings.ROUTER_MAX_ATTEMPTS
        self.poll_interval = settings.ROUTER_CONFIG_POLL_SECONDS
        self.load_share_interval = min(settings.ROUTER_LOAD_SHARE_SECONDS, self.poll_interval)
        # Replica-load fields of replicas that died, per key: deleted at the next trade.
        self._stale_loads: dict[str, list[bytes]] = {}
        self.snapshot_max_age = settings.ROUTER_SNAPSHOT_MAX_AGE
        # Past this age (nothing could be loaded: Postgres down too) keys are refused rather than trusted.
        self.snapshot_fail_closed = settings.ROUTER_SNAPSHOT_FAIL_CLOSED_SECONDS
        self.max_connections = settings.ROUTER_MAX_CONNECTIONS
        self.connections = 0
        self.max_choices = settings.ROUTER_MAX_CHOICES
        # Tokenizing waits in a bounded queue; a request that would wait longer is routed on load alone.
        self.tokenize_queue = settings.ROUTER_TOKENIZE_QUEUE
        self.tokenize_wait = settings.ROUTER_TOKENIZE_WAIT_SECONDS
        self.tokenizing = 0
        self.counting = 0  # count_tokens calls waiting for their count (bounded by the same queue size)
        self.count_tokens_max_bytes = settings.ROUTER_COUNT_TOKENS_MAX_BYTES
        self.count_tokens_wait = settings.ROUTER_COUNT_TOKENS_WAIT_SECONDS
        self.intake = Intake(
            settings.ROUTER_INTAKE_PER_KEY,
            settings.ROUTER_BODY_TIMEOUT_SECONDS,
            settings.ROUTER_BODY_MIN_BYTES_PER_SECOND,
            settings.ROUTER_SEND_TIMEOUT_SECONDS,
        )
        self.metrics_token = settings.ROUTER_METRICS_TOKEN.encode()
        self.connect_timeout = settings.ROUTER_CONNECT_TIMEOUT
        self.pepper = settings.API_KEY_PEPPER.encode()
        self.replica_id = os.urandom(6).hex()  # names this replica's field in the shared load hashes

    # --- life cycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            try:
                self.redis = router_redis(settings.REDIS_URL, settings.ROUTER_REDIS_MAX_CONNECTIONS)
                self.admission = Admission(self.redis)
                self.trade_loads = LoadTrade(self.redis)
                self.prefix = PrefixRouting(self.redis)
                self.finisher = Finisher(self.redis, self.admission)
                self.upstream = UpstreamPool(self.connect_timeout)
                self.services = Services(
                    pipeline=self.pipeline,
                    loads=self.loads,
                    flow=self.flow,
                    upstream=self.upstream,
                    finisher=self.finisher,
                    prefix=self.prefix,
                    redis=self.redis,
                    max_attempts=self.max_attempts,
                )
                tracing.configure(
                    settings.ROUTER_TRACES_ENDPOINT,
                    settings.ROUTER_TRACES_SAMPLE_RATIO,
                    settings.ROUTER_TRACES_SERVICE_NAME,
                    follow_client=settings.ROUTER_TRACES_FOLLOW_CLIENT_SAMPLING,
                    max_attributes=settings.ROUTER_TRACES_MAX_ATTRIBUTES,
                    max_attribute_length=settings.ROUTER_TRACES_MAX_ATTRIBUTE_LENGTH,
                )
                if tracing.ON:
                    tracing.instrument(self)
                await self.refresh(force=True)
                # The long-lived objects made at start-up stay out of every later collection, and collections
                # come less often: fewer pauses in the middle of streams.
                gc.collect()
                gc.freeze()
                gc.set_threshold(settings.ROUTER_GC_THRESHOLD, 20, 20)
                self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
                self.loop_lag.start()
                self._started.set_result(True)
            except BaseException as exc:
                self._started.set_exception(exc)
                self._started = None
                raise
        else:
            await self._started

    async def stop(self) -> None:
        if self._refresher:
            self._refresher.cancel()
        if self._warming:
            self._warming.cancel()
        self.loop_lag.stop()
        if self.upstream:
            self.upstream.close()
        if self.prefix and self.prefix.pool:
            self.prefix.pool.close()
        if self.finisher:
            await self.finisher.stop()  # replays the usage journal while Redis is still open
        if self.redis:
            await self.redis.aclose()
        tracing.shutdown()

    async def refresh(self, force: bool = False) -> None:
        """Reload the snapshot when the configuration version in Redis moved, or when it is older than
        ROUTER_SNAPSHOT_MAX_AGE. Without Redis the snapshot is reloaded from Postgres at every poll instead (a
        revoked key stops working within the poll interval all the same), and when it cannot be reloaded at all
        for ROUTER_SNAPSHOT_FAIL_CLOSED_SECONDS, keys are refused (see `authenticate`)."""
        try:
            version = await self.redis.get(CONFIG_VERSION_KEY)
            version = (version or b"0").decode()
            redis_failed = None
        except RedisError as exc:
            version, redis_failed = self.snapshot.version, exc
        age = time.monotonic() - self._snapshot_at
        if (
            force
            or redis_failed is not None
            or age > self.snapshot_max_age
            or version != self.snapshot.version
        ):
            self.snapshot = await sync_to_async(load_snapshot, thread_sensitive=False)(version)
            self._snapshot_at = time.monotonic()
            if self.prefix is not None:
                self._warming = asyncio.get_running_loop().create_task(
                    self.prefix.warm(list(self.snapshot.deployments.values()))
                )
        if redis_failed is not None:
            raise redis_failed
        await self._refresh_loads()
        self.max_body = body_limit(self.snapshot, settings.ROUTER_MAX_BODY_BYTES)

    async def _refresh_loads(self) -> None:
        """The engines' scraped load and the other replicas' own load, traded through Redis (routing/scheduling/load.py)."""
        endpoints = [e for d in self.snapshot.deployments.values() for e in d.endpoints]
        if not endpoints:
            return
        stale, self._stale_loads = self._stale_loads, {}
        self._stale_loads = await self.trade_loads(LOAD_KEY, endpoints, self.loads, self.replica_id, stale)
        # The fair shares across replicas, and the queues, which the new loads may let through.
        await self.flow.share(self.redis, self.replica_id)
        self.flow.wake_all()

    async def _refresh_forever(self) -> None:
        """Loads every ROUTER_LOAD_SHARE_SECONDS; the configuration version every ROUTER_CONFIG_POLL_SECONDS."""
        config_due = time.monotonic() + self.poll_interval
        while True:
            await asyncio.sleep(self.load_share_interval)
            try:
                if time.monotonic() >= config_due:
                    config_due = time.monotonic() + self.poll_interval
                    await self.refresh()
                else:
                    await self._refresh_loads()
                await self.prefix.health.flush(
                    self.redis, {d.id: name for name, d in self.snapshot.deployments.items()}
                )
            except Exception:
                log.exception("could not refresh the router's snapshot or loads; keeping the last ones")

    # --- the ASGI entry point ---------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] == "websocket":
            # The data plane serves no sockets (the portal's is on the web side): refused before it opens,
            # which the server answers with a 403.
            await receive()
            return await send({"type": "websocket.close", "code": 1008})
        if scope["type"] != "http":
            return
        await self.start()
        if self.connections >= self.max_connections:
            metrics.of(metrics.errors, "", "overloaded").inc()
            message = "This router replica is at its limit of concurrent requests. Retry shortly."
            return await respond(
                send, 503, OPENAI.error_body(503, message), JSON_HEADERS + [(b"retry-after", b"1")]
            )
        self.connections += 1
        try:
            await self._serve(scope, receive, send)
        finally:
            self.connections -= 1

    async def _serve(self, scope: dict, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        route = ROUTES.get(path)
        if route is not None:
            if method != "POST":
                return await respond(send, 405, route.dialect.error_body(405, "Use POST."), JSON_HEADERS)
            if tracing.ON:
                return await self._take_in_traced(scope, receive, send, route.dialect)
            return await self._take_in(scope, receive, send, route.dialect)
        if path == "/v1/models" and method == "GET":
            return await self.models(scope, send)
        if path.startswith("/v1/models/") and method == "GET":
            return await self.models(scope, send, path.removeprefix("/v1/models/"))
        if path == COUNT_TOKENS:
            if method != "POST":
                return await respond(send, 405, ANTHROPIC.error_body(405, "Use POST."), JSON_HEADERS)
            return await self._take_in(scope, receive, send, ANTHROPIC, counting=True)
        if path == "/metrics":
            return await self.serve_metrics(scope, send)
        if path in ("/health", "/healthz"):
            body = orjson.dumps({"status": "ok", "config_version": self.snapshot.version})
            return await respond(send, 200, body, JSON_HEADERS)
        if path.startswith(RESPONSES.path + "/"):
            message = (
                "This gateway keeps no stored responses (each request may be served by another engine): send the "
                "whole conversation in `input` with `store: false`, as Codex does."
            )
            return await respond(send, 404, OPENAI.error_body(404, message), JSON_HEADERS)
        message = (
            f"No route {method} {path}. This router serves POST {listed([*ROUTES, COUNT_TOKENS], 'and')}, "
            "and GET /v1/models."
        )
        # In Anthropic's shape for Anthropic's clients (they send `anthropic-version`, or call below an Anthropic
        # route), else in OpenAI's.
        anthropic = header(scope, b"anthropic-version") is not None or any(
            path.startswith(route.path) for route in ROUTES.values() if route.dialect is ANTHROPIC
        )
        await respond(send, 404, (ANTHROPIC if anthropic else OPENAI).error_body(404, message), JSON_HEADERS)

    async def _take_in(
        self, scope: dict, receive: Receive, send: Send, dialect: Dialect, counting: bool = False
    ) -> None:
        """A request with a body, under the limits of routing/server/intake.py: its key's requests still arriving, its
        body's deadline and rate, and a send timeout for a client that stops reading."""
        try:
            with tracing.span("router.authenticate"):
                key = self.authenticate(scope, dialect)
        except HttpError:
            key = None  # its handler refuses it before reading any of its body
        try:
            guard = self.intake.enter(key.id if key else None, hold_until_done=counting)
        except HttpError as exc:
            metrics.of(metrics.errors, "", "intake_per_key").inc()
            return await respond(
                send,
                exc.status,
                dialect.error_body(exc.status, exc.message, code="too_many_arriving"),
                JSON_HEADERS + encode_headers(exc.headers),
            )
        try:
            if counting:
                await self.count_tokens(scope, guard.receive(receive), guard.send(send))
            else:
                await generate(self, scope, guard.receive(receive), guard.send(send), dialect, key)
        except ClientStalled:
            metrics.of(metrics.errors, "", "client_stalled").inc()
        finally:
            guard.release()

    async def _take_in_traced(self, scope: dict, receive: Receive, send: Send, dialect: Dialect) -> None:
        """A generation request under its trace's root span (routing/server/tracing.py), its traceparent in the answer."""
        trace = tracing.begin(scope)
        try:
            await self._take_in(scope, receive, trace.wrap(send), dialect)
        finally:
            tracing.end(trace)

    async def serve_metrics(self, scope: dict, send: Send) -> None:
        """The router's own metrics, for the operator's scraper only: `Authorization: Bearer
        <ROUTER_METRICS_TOKEN>` (they name models, engines and per-tenant queues)."""
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                parts = value.split(None, 1)
                if len(parts) == 2 and parts[0].lower() == b"bearer":
                    given = parts[1].strip()
        if not self.metrics_token or not hmac.compare_digest(given, self.metrics_token):
            message = "The router's metrics are for its operator: send `Authorization: Bearer <ROUTER_METRICS_TOKEN>`."
            headers = JSON_HEADERS + [(b"www-authenticate", b'Bearer realm="metrics"')]
            return await respond(send, 401, OPENAI.error_body(401, message), headers)
        body = generate_latest(metrics.registry)
        await respond(send, 200, body, [(b"content-type", CONTENT_TYPE_LATEST.encode())])

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:  # report, so the server refuses to start
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- /v1/models -----------------------------------------------------------------------------------
    async def models(self, scope: dict, send: Send, name: str | None = None) -> None:
        """The served models (or the one named), as the OpenAI and Anthropic SDKs read them: Anthropic's shapes
        when the client sends `anthropic-version`."""
        anthropic = header(scope, b"anthropic-version") is not None
        dialect = ANTHROPIC if anthropic else OPENAI
        try:
            key = self.authenticate(scope, dialect)
        except HttpError as exc:
            return await respond(send, exc.status, dialect.error_body(exc.status, exc.message), JSON_HEADERS)
        if name is not None:
            deployment = self.snapshot.deployment_for_key(key, name)
            if deployment is None:
                message = f"The model `{name}` does not exist. GET /v1/models lists the models served."
                return await respond(send, 404, dialect.error_body(404, message, "model"), JSON_HEADERS)
            entry = _model_entry(deployment, anthropic, name)
            return await respond(send, 200, orjson.dumps(entry), JSON_HEADERS)
        # Only what this key may call: the served models it is entitled to and its tenant's aliases of them.
        data = [_model_entry(d, anthropic, n) for n, d in self.snapshot.models_for_key(key)]
        if anthropic:
            ids = [entry["id"] for entry in data]
            body = {"data": data, "has_more": False, "first_id": ids[0] if ids else None}
            body["last_id"] = ids[-1] if ids else None
        else:
            body = {"object": "list", "data": data}
        await respond(send, 200, orjson.dumps(body), JSON_HEADERS)

    async def count_tokens(self, scope: dict, receive: Receive, send: Send) -> None:
        """Anthropic's /v1/messages/count_tokens, as Claude Code calls it: the prompt's tokens as the engine
        renders them, counted here with the deployment's tokenizer (or by one of its engines when the router has
        none). Key authentication as for generation; each call counts against the key's and its team's requests
        per minute (nothing else is taken, nothing billed); its body is bounded by ROUTER_COUNT_TOKENS_MAX_BYTES,
        and a large one is tokenized in a worker process (routing/rendering/tokenize_pool.py)."""
        try:
            key = self.authenticate(scope, ANTHROPIC)
            decision = await self._count_request(key)
            if not decision.admitted:
                metrics.of(metrics.requests, "", "", "429").inc()
                return await respond(
                    send,
                    429,
                    ANTHROPIC.error_body(429, decision.message, code=decision.limit),
                    JSON_HEADERS + encode_headers(decision.headers),
                )
            limit = min(self.max_body, self.count_tokens_max_bytes)
            try:
                body = await read_body(receive, limit)
            except HttpError as exc:
                if exc.status != 413:
                    raise
                raise HttpError(
                    413,
                    f"A count_tokens request takes at most {limit} bytes of JSON. Count a shorter prompt, or "
                    "count its parts separately.",
                ) from None
            payload = parse(body)
            deployment = deployment_for(self.snapshot, payload, key)
            if not isinstance(payload.get("messages"), list) or not payload["messages"]:
                raise HttpError(400, "`messages` must be a non-empty list.", "messages")
            refuse_remote_media(payload, MESSAGES.path)  # an engine may count it
            tokenizer = self.prefix.tokenizer_for(deployment)
            if tokenizer is None:
                return await self._count_upstream(deployment, orjson.dumps(payload), send)
            media = first_media_part(payload["messages"])
            if media is not None and not tokenizer.multimodal:
                raise HttpError(
                    400,
                    f"The model `{deployment.served_model_name}` takes text only: remove the `{media}` part.",
                    "messages",
                )
            ids = await self._count(tokenizer, payload)
        except HttpError as exc:
            return await respond(
                send,
                exc.status,
                ANTHROPIC.error_body(exc.status, exc.message, exc.param),
                JSON_HEADERS + encode_headers(exc.headers),
            )
        except ClientGone:
            return
        count = len(ids)
        body = {"input_tokens": count, "context_management": {"original_input_tokens": count}}
        await respond(send, 200, orjson.dumps(body), JSON_HEADERS)

    async def _count_request(self, key: KeyInfo):
        """Count a count_tokens call against its key's and team's requests per minute (routing/metering/admission.py)."""
        try:
            return await self.admission.count_request(quota_scopes(self.snapshot, key))
        except RedisError:
            log.exception("could not count a count_tokens request against its quota")
            raise HttpError(
                503, "Quota checks are unavailable right now. Retry shortly.", headers={"retry-after": "1"}
            ) from None

    async def _count(self, tokenizer, payload: dict):
        """The request's prompt ids, waiting at most ROUTER_COUNT_TOKENS_WAIT_SECONDS, among at most
        ROUTER_TOKENIZE_QUEUE calls waiting at once."""
        busy = HttpError(
            503, "The gateway is busy counting tokens. Retry shortly.", headers={"retry-after": "1"}
        )
        if self.counting >= self.tokenize_queue:
            raise busy
        self.counting += 1
        try:
            async with asyncio.timeout(self.count_tokens_wait):
                ids = await self.prefix.encode(tokenizer, payload, MESSAGES.path)
        except RenderError as exc:
            raise HttpError(400, f"The request cannot be rendered for this model: {exc}", exc.param) from exc
        except (TimeoutError, BrokenProcessPool):
            raise busy from None
        finally:
            self.counting -= 1
        if ids is None:
            raise HttpError(400, "`messages` must be a non-empty list.", "messages")
        return ids

    async def _count_upstream(self, deployment: DeploymentInfo, body: bytes, send: Send) -> None:
        endpoints = [e for e in deployment.endpoints if e.role != "prefill"] or list(deployment.endpoints)
        if not endpoints:
            message = (
                f"No engine of `{deployment.served_model_name}` is ready to count tokens. Retry shortly."
            )
            return await respond(send, 503, ANTHROPIC.error_body(503, message), JSON_HEADERS)
        endpoint = min(
            endpoints, key=lambda e: self.loads[e.id].own(time.monotonic()) if e.id in self.loads else 0
        )
        try:
            async with self.upstream.post(
                f"{endpoint.url}{COUNT_TOKENS}",
                body,
                [("content-type", "application/json"), ("authorization", f"Bearer {deployment.engine_key}")],
            ) as resp:
                answer = await resp.read()
                status = resp.status
        except (UpstreamError, OSError) as exc:
            log.warning("count_tokens on %s failed: %s", endpoint.name, exc)
            message = "The engine could not count the tokens. Retry shortly."
            return await respond(send, 502, ANTHROPIC.error_body(502, message), JSON_HEADERS)
        if status >= 500:
            log.warning("count_tokens on %s failed: the engine answered %s", endpoint.name, status)
            message = "The engine could not count the tokens. Retry shortly."
            return await respond(send, 502, ANTHROPIC.error_body(502, message), JSON_HEADERS)
        if status != 200:
            refused = refusal(ANTHROPIC, status, answer, endpoint.url)
            if refused.route_missing:
                body = route_missing_body(ANTHROPIC, deployment.served_model_name, COUNT_TOKENS)
                return await respond(send, 404, body, JSON_HEADERS)
            status, answer = refused.status, refused.body
        await respond(send, status, answer, JSON_HEADERS)

    # --- authentication ---------------------------------------------------------------------------------
    def authenticate(self, scope: dict, dialect: Dialect) -> KeyInfo:
        """The request's key; refused once revocations could not be read for ROUTER_SNAPSHOT_FAIL_CLOSED_SECONDS."""
        unconfirmed = time.monotonic() - self._snapshot_at > self.snapshot_fail_closed
        return authenticate(self.snapshot, scope["headers"], self.pepper, unconfirmed)


def _model_entry(deployment: DeploymentInfo, anthropic: bool, name: str) -> dict:
    """`name`: the served model's own, or a tenant's alias of it."""
    if anthropic:
        created = datetime.fromtimestamp(deployment.created, UTC).isoformat().replace("+00:00", "Z")
        return {"type": "model", "id": name, "display_name": name, "created_at": created}
    return {
        "id": name,
        "object": "model",
        "created": deployment.created,
        "owned_by": "inference-platform",
        "max_model_len": deployment.max_model_len,
    }
