"""The data plane: an ASGI app serving /v1 for agents.

authenticate the key -> admit (quotas, budgets) -> pick an endpoint -> stream the engine's answer through
-> settle the reservation and emit one usage event. Django's request machinery stays off this path; the only
state it reads per request is in memory (the snapshot) and in Redis (admission).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import os
import time
from array import array
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import NamedTuple

import orjson
from asgiref.sync import sync_to_async
from django.conf import settings
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from . import metrics
from .admission import Admission, cost_units
from .dialects import ANTHROPIC, OPENAI, RESPONSES, Dialect, RenderError, Usage, first_media_part
from .disagg import decode_body, plan_disaggregated, plan_peer_pull, prefill_body, uncached_tokens
from .finisher import Finisher
from .load_scraper import LOAD_KEY
from .pipeline import (
    PREFILL_ROLES,
    RECENT_WINDOW_S,
    Candidate,
    EndpointLoad,
    Pipeline,
    Prefill,
    RequestContext,
    request_weight,
)
from .prefix import PrefixRouting, needs_prompt, read_outcome
from .redis_pool import router_redis
from .state import DeploymentInfo, EndpointInfo, KeyInfo, Snapshot, load_snapshot
from .tokenize import token_ids
from .upstream import Response, UpstreamError, UpstreamPool

log = logging.getLogger(__name__)

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]

# path -> (dialect, whether the engine path is the same)
GENERATION_ROUTES: dict[str, Dialect] = {
    "/v1/chat/completions": OPENAI,
    "/v1/completions": OPENAI,
    "/v1/messages": ANTHROPIC,
    "/v1/responses": RESPONSES,
}
CONFIG_VERSION_KEY = "platform:config:version"
DISAGG_PATHS = ("/v1/completions", "/v1/chat/completions")
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


REPLICA_LOAD_KEY = "endpoint:replica-load:{}"
REPLICA_LOAD_TTL_S = 10
REPLICA_LOAD_MAX_AGE_S = 3.0


class OthersLoad(NamedTuple):
    load: float  # their weighted load (EndpointLoad.own) there
    active: int  # their requests in flight there
    prefill: float  # their prefill backlog there, in uncached prompt tokens
    # Fields to delete: older than REPLICA_LOAD_MAX_AGE_S (a replica that died) or unreadable.
    stale: list[bytes]


def others_load(published: dict, replica_id: str, now: float) -> OthersLoad:
    """What the other replicas have at an endpoint, from their fields in its hash
    (`"<load> <in flight> <unix time> <prefill backlog>"`)."""
    load, active, prefill, stale = 0.0, 0, 0.0, []
    mine = replica_id.encode()
    for field, value in published.items():
        if field == mine:
            continue
        try:
            weighted, in_flight, at, backlog = value.split()
            if now - float(at) <= REPLICA_LOAD_MAX_AGE_S:
                load += float(weighted)
                active += int(in_flight)
                prefill += float(backlog)
                continue
        except ValueError:
            pass
        stale.append(field)
    return OthersLoad(load, active, prefill, stale)


class ClientGone(Exception):
    pass


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


class Router:
    """One replica's state: the snapshot, a Redis client, an HTTP client pool and the pipeline."""

    def __init__(self):
        self.snapshot = Snapshot()
        self.loads: dict[int, EndpointLoad] = {}
        self.pipeline = Pipeline()
        self.prefix: PrefixRouting | None = None
        self.redis = None
        self.admission: Admission | None = None
        self.upstream: UpstreamPool | None = None
        self._started: asyncio.Future | None = None
        self._refresher: asyncio.Task | None = None
        self._snapshot_at = 0.0
        self.max_body = settings.ROUTER_MAX_BODY_BYTES
        self.max_messages = settings.ROUTER_MAX_MESSAGES
        self.max_attempts = settings.ROUTER_MAX_ATTEMPTS
        self.poll_interval = settings.ROUTER_CONFIG_POLL_SECONDS
        self.load_share_interval = min(settings.ROUTER_LOAD_SHARE_SECONDS, self.poll_interval)
        # Replica-load fields of replicas that died, per key: deleted at the next trade.
        self._stale_loads: dict[str, list[bytes]] = {}
        self.snapshot_max_age = settings.ROUTER_SNAPSHOT_MAX_AGE
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
                self.prefix = PrefixRouting(self.redis)
                self.finisher = Finisher(self.redis, self.admission)
                self.upstream = UpstreamPool(self.connect_timeout)
                await self.refresh(force=True)
                # The long-lived objects made at start-up stay out of every later collection, and collections
                # come less often: fewer pauses in the middle of streams.
                gc.collect()
                gc.freeze()
                gc.set_threshold(settings.ROUTER_GC_THRESHOLD, 20, 20)
                self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
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
        if self.upstream:
            self.upstream.close()
        if self.redis:
            await self.redis.aclose()

    async def refresh(self, force: bool = False) -> None:
        version = await self.redis.get(CONFIG_VERSION_KEY)
        version = (version or b"0").decode()
        stale = time.monotonic() - self._snapshot_at > self.snapshot_max_age
        if force or stale or version != self.snapshot.version:
            self.snapshot = await sync_to_async(load_snapshot, thread_sensitive=False)(version)
            self._snapshot_at = time.monotonic()
        await self._refresh_loads()

    async def _refresh_loads(self) -> None:
        """Read the engines' scraped load, and trade this replica's own load per endpoint with the other
        replicas' (a hash per endpoint, a field per replica), so each one's load guard sees all of it. A replica
        with nothing there withdraws its field; fields of replicas that died are deleted by whoever sees them."""
        endpoints = [e for d in self.snapshot.deployments.values() for e in d.endpoints]
        if not endpoints:
            return
        now, wall = time.monotonic(), time.time()
        stale, self._stale_loads = self._stale_loads, {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for endpoint in endpoints:
                pipe.hgetall(LOAD_KEY.format(endpoint.id))
                key = REPLICA_LOAD_KEY.format(endpoint.id)
                load = self.loads.get(endpoint.id)
                own = load.own(now) if load is not None else 0.0
                if load is not None and (load.active or own > 0.01):
                    pipe.hset(
                        key,
                        self.replica_id,
                        f"{own:.3f} {load.active} {wall:.3f} {load.prefill_left(now):.0f}",
                    )
                else:
                    pipe.hdel(key, self.replica_id)
                pipe.expire(key, REPLICA_LOAD_TTL_S)
                pipe.hgetall(key)
            for key, fields in stale.items():
                pipe.hdel(key, *fields)
            replies = await pipe.execute()
        for index, endpoint in enumerate(endpoints):
            row, published = replies[4 * index], replies[4 * index + 3]
            load = self.loads.setdefault(endpoint.id, EndpointLoad())
            load.running = float(row.get(b"running", 0))
            load.waiting = float(row.get(b"waiting", 0))
            load.kv_usage = float(row.get(b"kv_usage", 0))
            others = others_load(published, self.replica_id, wall)
            load.others, load.others_active, load.others_prefill = others.load, others.active, others.prefill
            if others.stale:
                self._stale_loads[REPLICA_LOAD_KEY.format(endpoint.id)] = others.stale

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
        if scope["type"] != "http":
            return
        await self.start()
        path, method = scope["path"], scope["method"]
        dialect = GENERATION_ROUTES.get(path)
        if dialect is not None:
            if method != "POST":
                return await _respond(send, 405, OPENAI.error_body(405, "Use POST."), JSON_HEADERS)
            return await self.generate(scope, receive, send, dialect)
        if path == "/v1/models" and method == "GET":
            return await self.models(scope, send)
        if path.startswith("/v1/models/") and method == "GET":
            return await self.models(scope, send, path.removeprefix("/v1/models/"))
        if path == "/v1/messages/count_tokens":
            if method != "POST":
                return await _respond(send, 405, ANTHROPIC.error_body(405, "Use POST."), JSON_HEADERS)
            return await self.count_tokens(scope, receive, send)
        if path == "/metrics":
            return await _respond(
                send,
                200,
                generate_latest(metrics.registry),
                [(b"content-type", CONTENT_TYPE_LATEST.encode())],
            )
        if path in ("/health", "/healthz"):
            body = orjson.dumps({"status": "ok", "config_version": self.snapshot.version})
            return await _respond(send, 200, body, JSON_HEADERS)
        if path.startswith("/v1/responses/"):
            message = (
                "This gateway keeps no stored responses (each request may be served by another engine): send the "
                "whole conversation in `input` with `store: false`, as Codex does."
            )
            return await _respond(send, 404, OPENAI.error_body(404, message), JSON_HEADERS)
        message = (
            f"No route {method} {path}. This router serves POST /v1/chat/completions, /v1/completions, "
            "/v1/messages, /v1/messages/count_tokens and /v1/responses, and GET /v1/models."
        )
        await _respond(send, 404, OPENAI.error_body(404, message), JSON_HEADERS)

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
        anthropic = _header(scope, b"anthropic-version") is not None
        dialect = ANTHROPIC if anthropic else OPENAI
        try:
            self.authenticate(scope, dialect)
        except HttpError as exc:
            return await _respond(send, exc.status, dialect.error_body(exc.status, exc.message), JSON_HEADERS)
        if name is not None:
            deployment = self.snapshot.deployments.get(name)
            if deployment is None:
                message = f"The model `{name}` does not exist. GET /v1/models lists the models served."
                return await _respond(send, 404, dialect.error_body(404, message, "model"), JSON_HEADERS)
            return await _respond(send, 200, orjson.dumps(_model_entry(deployment, anthropic)), JSON_HEADERS)
        data = [_model_entry(d, anthropic) for _, d in sorted(self.snapshot.deployments.items())]
        if anthropic:
            ids = [entry["id"] for entry in data]
            body = {"data": data, "has_more": False, "first_id": ids[0] if ids else None}
            body["last_id"] = ids[-1] if ids else None
        else:
            body = {"object": "list", "data": data}
        await _respond(send, 200, orjson.dumps(body), JSON_HEADERS)

    async def count_tokens(self, scope: dict, receive: Receive, send: Send) -> None:
        """Anthropic's /v1/messages/count_tokens, as Claude Code calls it: the prompt's tokens as the engine
        renders them, counted here with the deployment's tokenizer (or by one of its engines when the router has
        none). Key authentication as for generation; no quota is taken and nothing is billed."""
        try:
            self.authenticate(scope, ANTHROPIC)
            body = await _read_body(receive, self.max_body)
            payload = _parse(body)
            deployment = self._deployment(payload)
            if not isinstance(payload.get("messages"), list) or not payload["messages"]:
                raise HttpError(400, "`messages` must be a non-empty list.", "messages")
            tokenizer = self.prefix.tokenizer_for(deployment)
            if tokenizer is None:
                return await self._count_upstream(deployment, body, send)
            media = first_media_part(payload["messages"])
            if media is not None and not tokenizer.multimodal:
                raise HttpError(
                    400,
                    f"The model `{deployment.served_model_name}` takes text only: remove the `{media}` part.",
                    "messages",
                )
            try:
                ids = await self.prefix.encode(tokenizer, payload, "/v1/messages")
            except RenderError as exc:
                raise HttpError(
                    400, f"The request cannot be rendered for this model: {exc}", exc.param
                ) from exc
        except HttpError as exc:
            return await _respond(
                send, exc.status, ANTHROPIC.error_body(exc.status, exc.message, exc.param), JSON_HEADERS
            )
        except ClientGone:
            return
        count = len(ids)
        body = {"input_tokens": count, "context_management": {"original_input_tokens": count}}
        await _respond(send, 200, orjson.dumps(body), JSON_HEADERS)

    async def _count_upstream(self, deployment: DeploymentInfo, body: bytes, send: Send) -> None:
        endpoints = [e for e in deployment.endpoints if e.role != "prefill"] or list(deployment.endpoints)
        if not endpoints:
            message = (
                f"No engine of `{deployment.served_model_name}` is ready to count tokens. Retry shortly."
            )
            return await _respond(send, 503, ANTHROPIC.error_body(503, message), JSON_HEADERS)
        endpoint = min(
            endpoints, key=lambda e: self.loads[e.id].own(time.monotonic()) if e.id in self.loads else 0
        )
        try:
            async with self.upstream.post(
                f"{endpoint.url}/v1/messages/count_tokens", body, [("content-type", "application/json")]
            ) as resp:
                answer = await resp.read()
                status = resp.status
        except (UpstreamError, OSError) as exc:
            log.warning("count_tokens on %s failed: %s", endpoint.name, exc)
            message = "The engine could not count the tokens. Retry shortly."
            return await _respond(send, 502, ANTHROPIC.error_body(502, message), JSON_HEADERS)
        await _respond(send, status, answer, JSON_HEADERS)

    # --- authentication ---------------------------------------------------------------------------------
    def authenticate(self, scope: dict, dialect: Dialect) -> KeyInfo:
        raw = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                parts = value.split(None, 1)
                if len(parts) == 2 and parts[0].lower() == b"bearer":
                    raw = parts[1].strip()
            elif name == b"x-api-key":
                raw = value.strip()
        if not raw:
            raise HttpError(401, "Missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`.")
        digest = hmac.new(self.pepper, raw, "sha256").hexdigest()
        key = self.snapshot.keys.get(digest)
        if key is None:
            raise HttpError(401, "Invalid, expired or revoked API key.")
        if key.expires_at is not None and key.expires_at <= datetime.now(UTC):
            raise HttpError(401, "This API key has expired.")
        if "inference" not in key.scopes:
            raise HttpError(403, "This API key lacks the inference scope.")
        return key

    # --- generation -------------------------------------------------------------------------------------
    async def generate(self, scope: dict, receive: Receive, send: Send, dialect: Dialect) -> None:
        started = time.perf_counter()
        request_id = os.urandom(16).hex()
        try:
            key = self.authenticate(scope, dialect)
            body = await _read_body(receive, self.max_body)
            payload = _parse(body)
            deployment = self._deployment(payload)
            prompt_ids = token_ids(payload.get("prompt"))  # a prompt of token ids, converted once
            input_bound, output_bound = self._validate(payload, deployment, dialect, prompt_ids)
        except HttpError as exc:
            return await _respond(
                send,
                exc.status,
                dialect.error_body(exc.status, exc.message, exc.param),
                JSON_HEADERS + _headers(exc.headers),
            )
        except ClientGone:
            return
        stream = bool(payload.get("stream"))
        client_wants_usage = bool((payload.get("stream_options") or {}).get("include_usage"))
        if stream and dialect is OPENAI and not client_wants_usage:
            payload["stream_options"] = {**(payload.get("stream_options") or {}), "include_usage": True}
            try:
                body = _dumps(payload)
            except HttpError as exc:
                return await _respond(send, 400, dialect.error_body(400, exc.message), JSON_HEADERS)

        snapshot = self.snapshot
        team_quota, key_quota = snapshot.team_quotas.get(key.team_id), snapshot.key_quotas.get(key.id)
        under_quota = team_quota is not None or key_quota is not None
        # Priced here only under a quota (for spend budgets); the ledger prices every request when it ingests it.
        prices = (
            snapshot.prices_for(deployment.served_model_name, key.tenant_id, datetime.now(UTC))
            if under_quota
            else None
        )
        # Under a quota, the prompt's tokens and the prefix index are worked out while the quota check is in
        # Redis, not after it: two round trips in parallel instead of one after the other. A refused request's
        # lookup is discarded (it recorded nothing).
        context = self.prefix.context(
            deployment, payload, prompt_ids, scope["path"], _header(scope, b"x-session-id")
        )
        if under_quota and needs_prompt(deployment):
            context = asyncio.ensure_future(context)
        try:
            decision = await self.admission.admit(
                request_id=request_id,
                team_id=key.team_id,
                key_id=key.id,
                team_quota=team_quota,
                key_quota=key_quota,
                input_reserve=input_bound,
                output_reserve=output_bound,
                spend_reserve=cost_units(prices, input_bound, 0, output_bound),
            )
        except RedisError:
            _discard(context)
            log.exception("admission failed")
            metrics.of(metrics.errors, deployment.served_model_name, "admission").inc()
            return await _respond(
                send,
                503,
                dialect.error_body(503, "Quota checks are unavailable right now. Retry shortly."),
                JSON_HEADERS + [(b"retry-after", b"1")],
            )
        if not decision.admitted:
            _discard(context)
            metrics.of(metrics.requests, deployment.served_model_name, "", "429").inc()
            return await _respond(
                send,
                429,
                dialect.error_body(429, decision.message, code=decision.limit),
                JSON_HEADERS + _headers(decision.headers),
            )

        ctx = await context
        exchange = Exchange(
            self,
            scope,
            receive,
            send,
            dialect,
            deployment,
            key,
            request_id,
            body,
            stream,
            client_wants_usage,
            started,
            decision.headers or {},
            ctx,
        )
        finished = False

        async def complete() -> None:
            """Settle and meter once, before the client can see the end of the answer, so a concurrency slot
            is free again by the time the client could send its next request."""
            nonlocal finished
            if not finished:
                finished = True
                exchange.finalize_usage()
                usage = exchange.usage
                spend = cost_units(prices, usage.prompt_tokens, usage.cached_tokens, usage.output_tokens)
                await self._finish(exchange, decision.reservation, usage, spend)

        exchange.complete = complete
        exchange.payload = payload
        try:
            await exchange.run()
        finally:
            try:
                await asyncio.shield(complete())
            finally:
                # Break the exchange <-> closure cycle, so the request's objects go by reference counting
                # rather than in a garbage collection that stalls every stream in flight.
                exchange.complete = _nothing

    async def _finish(self, exchange: Exchange, reservation, usage: Usage, spend: int) -> None:
        try:
            await self.finisher.finish(
                reservation,
                input_tokens=usage.prompt_tokens,
                output_tokens=usage.output_tokens,
                spend=spend,
                event=exchange.usage_event(),
            )
            if exchange.ctx.block_count and usage.reported:
                self.prefix.observe(
                    exchange.deployment,
                    exchange.endpoint_name,
                    exchange.predicted_cached,
                    usage.prompt_tokens,
                    usage.cached_tokens,
                )
        except Exception:
            log.exception("could not settle or meter request %s", exchange.request_id)

    def _deployment(self, payload: dict) -> DeploymentInfo:
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise HttpError(400, "Name the model: `model` is required.", "model")
        deployment = self.snapshot.deployments.get(model)
        if deployment is None:
            raise HttpError(
                404, f"The model `{model}` does not exist. GET /v1/models lists the models served.", "model"
            )
        return deployment

    def _validate(
        self, payload: dict, deployment: DeploymentInfo, dialect: Dialect, prompt_ids: array | None
    ) -> tuple[int, int]:
        """Check limits and return upper bounds of the prompt's and the answer's tokens, for reservations."""
        options = payload.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise HttpError(
                400, '`stream_options` must be an object, e.g. {"include_usage": true}.', "stream_options"
            )
        messages = payload.get("messages")
        if messages is not None:
            if not isinstance(messages, list) or not messages:
                raise HttpError(400, "`messages` must be a non-empty list.", "messages")
            if len(messages) > self.max_messages:
                raise HttpError(
                    400, f"Too many messages: {len(messages)}; the limit is {self.max_messages}.", "messages"
                )
            media = first_media_part(messages)
            if media is not None:
                tokenizer = self.prefix.tokenizer_for(deployment)
                if tokenizer is not None and not tokenizer.multimodal:
                    raise HttpError(
                        400,
                        f"The model `{deployment.served_model_name}` takes text only, and this request has "
                        f"a `{media}` part. Send the content as text, or use a model that takes {media} input.",
                        "messages",
                    )
        limit = deployment.max_model_len
        max_tokens = payload.get(
            "max_completion_tokens", payload.get("max_tokens", payload.get("max_output_tokens"))
        )
        if max_tokens is not None:
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise HttpError(400, "`max_tokens` must be a positive integer.", "max_tokens")
            if max_tokens > limit:
                raise HttpError(
                    400,
                    f"`max_tokens` is {max_tokens}, but the model's context is {limit} tokens. "
                    "Ask for fewer output tokens.",
                    "max_tokens",
                )
        elif dialect is ANTHROPIC:
            raise HttpError(400, "`max_tokens` is required.", "max_tokens")
        prompt_bound = len(prompt_ids) if prompt_ids is not None else _prompt_token_bound(payload)
        return min(prompt_bound, limit), (max_tokens or limit)


class Exchange:
    """One request's trip to an engine and back, with retries, streaming and accounting."""

    def __init__(
        self,
        router: Router,
        scope,
        receive,
        send,
        dialect: Dialect,
        deployment: DeploymentInfo,
        key: KeyInfo,
        request_id: str,
        body: bytes,
        stream: bool,
        client_wants_usage: bool,
        started: float,
        extra_headers: dict,
        ctx: RequestContext,
    ):
        self.router, self.scope, self.receive, self.send = router, scope, receive, send
        self.dialect, self.deployment, self.key = dialect, deployment, key
        self.request_id, self.body, self.stream = request_id, body, stream
        self.client_wants_usage, self.started, self.extra_headers = client_wants_usage, started, extra_headers
        self.usage = Usage()
        self.status = "failed"
        self.http_status = 502
        self.endpoint_url = ""
        self.endpoint_name = ""
        self.first_byte_at: float | None = None
        # While the chosen engine prefills this prompt: its load, and the tokens added to its prefill backlog.
        self._prefilling: tuple[EndpointLoad, Prefill] | None = None
        # True once a prefill engine computed the prompt and the decode engine is to pull its KV.
        self.prefilled_remotely = False
        self.streamed_events = 0
        self.ctx = ctx
        self.predicted_cached = 0
        self.complete = _nothing  # set by the router: settle and meter, once
        self.payload: dict = {}
        self.pd_done = False
        self.prefill_usage: Usage | None = None
        self.prefill_endpoint = ""

    @property
    def model(self) -> str:
        return self.deployment.served_model_name

    async def run(self) -> None:
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(asyncio.current_task()))
        try:
            await self._attempts()
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled() and watcher.result():
                self.status = "cancelled"
                self.http_status = 499
                return  # the client went away: nothing left to send
            raise
        finally:
            watcher.cancel()
            self.finalize_usage()
            metrics.of(metrics.requests, self.model, self.endpoint_name, str(self.http_status)).inc()
            metrics.of(metrics.latency, self.model, self.endpoint_name).observe(
                time.perf_counter() - self.started
            )
            for kind, value in (
                ("prompt", self.usage.prompt_tokens),
                ("cached_prompt", self.usage.cached_tokens),
                ("output", self.usage.output_tokens),
            ):
                if value:
                    metrics.of(metrics.tokens, self.model, self.endpoint_name, kind).inc(value)

    async def _watch_disconnect(self, task: asyncio.Task) -> bool:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return True

    async def _attempts(self) -> None:
        tried: set[int] = set()
        last_error = "no healthy endpoint serves this model"
        for _ in range(self.router.max_attempts):
            self.ctx.exclude = frozenset(tried)
            candidate, candidates = self.router.pipeline.choose(self.deployment, self.ctx, self.router.loads)
            if candidate is None:
                break
            self.predicted_cached = self.router.prefix.chosen(
                self.deployment, self.ctx, candidate, candidates, self.request_id
            )
            endpoint = candidate.endpoint
            tried.add(endpoint.id)
            self.endpoint_url, self.endpoint_name = endpoint.url, endpoint.name
            body = await self._prefill_elsewhere(candidate, candidates)
            load = self.router.loads.setdefault(endpoint.id, EndpointLoad())
            weight = request_weight(self.ctx.prompt_tokens_estimate, self.predicted_cached)
            load.begin(weight)
            load.assigned(time.monotonic(), RECENT_WINDOW_S, weight)
            # The engine's prefill backlog grows by what it must compute of this prompt (nothing when a prefill
            # engine computed it), until the first token streams back; an answer not streamed holds it to its end.
            uncached = (
                0 if self.prefilled_remotely else self.ctx.prompt_tokens_estimate - self.predicted_cached
            )
            self._prefilling = load, load.prefill_began(float(max(0, uncached)), time.monotonic())
            try:
                if await self._try(endpoint.url, body):
                    return
                last_error = f"engine {endpoint.name} answered {self.http_status}"
            except UpstreamError as exc:
                last_error = f"could not reach engine {endpoint.name}: {exc.__class__.__name__}"
                log.warning("request %s: %s (%s)", self.request_id, last_error, exc)
                metrics.of(metrics.errors, self.model, "connect").inc()
            finally:
                load.end(weight)
                self._prefill_done()
        self.http_status = 503 if not tried else 502
        metrics.of(metrics.errors, self.model, "unavailable").inc()
        await _respond(
            self.send,
            self.http_status,
            self.dialect.error_body(
                self.http_status, f"The model is unavailable right now ({last_error}). Retry shortly."
            ),
            JSON_HEADERS,
        )

    async def _prefill_elsewhere(self, decode: Candidate, candidates: list[Candidate]) -> bytes:
        """Run the prefill leg on another engine when the plan says so; the body for the decode engine."""
        self.prefilled_remotely = False
        if self.dialect is not OPENAI or self.scope["path"] not in DISAGG_PATHS or self.pd_done:
            return self.body

        def prefill_choice():
            chosen, _ = self.router.pipeline.choose(
                self.deployment, self.ctx, self.router.loads, PREFILL_ROLES
            )
            return chosen

        plan = plan_disaggregated(self.deployment, self.ctx, decode, prefill_choice)
        if plan.kind == "aggregated":
            plan = plan_peer_pull(self.deployment, self.ctx, decode, candidates)
        metrics.of(metrics.plans, self.model, plan.kind).inc()
        if plan.prefill is None:
            return self.body
        self.pd_done = True  # a retry of the decode leg recomputes rather than prefilling twice
        params = await self._prefill_leg(plan.prefill)
        if params is None:
            metrics.of(metrics.errors, self.model, "prefill_leg").inc()
            return self.body  # the decode engine prefills itself
        self.prefilled_remotely = True
        return decode_body(self.payload, params)

    async def _prefill_leg(self, endpoint: EndpointInfo) -> dict | None:
        load = self.router.loads.setdefault(endpoint.id, EndpointLoad())
        load.begin()
        lane = load.prefill_began(
            float(uncached_tokens(self.deployment, self.ctx, endpoint.id)), time.monotonic()
        )
        answered = False
        try:
            async with self.router.upstream.post(
                endpoint.url + self.scope["path"], prefill_body(self.payload), self._upstream_headers()
            ) as resp:
                if resp.status != 200:
                    await resp.read()
                    return None
                answer = orjson.loads(await resp.read())
                answered = True  # the leg's one token: its prefill is over
        except (UpstreamError, orjson.JSONDecodeError) as exc:
            log.info("prefill leg on %s failed (%s); the decode engine prefills itself", endpoint.name, exc)
            return None
        finally:
            load.end()
            load.prefill_ended(lane, time.monotonic(), answered)
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        self.prefill_usage = OPENAI.usage_from_body(answer)
        self.prefill_endpoint = endpoint.name
        return params

    async def _try(self, base_url: str, body: bytes) -> bool:
        """One attempt. False means: failed before anything reached the client, so another engine may serve it."""
        sent_at = time.perf_counter()
        async with self.router.upstream.post(
            base_url + self.scope["path"], body, self._upstream_headers()
        ) as resp:
            metrics.of(metrics.added, self.model).observe(sent_at - self.started)
            if resp.status >= 500:
                self.http_status = resp.status
                await resp.read()
                metrics.of(metrics.errors, self.model, "upstream_5xx").inc()
                return False
            self.http_status = resp.status
            if self.stream and resp.status == 200:
                await self._relay_stream(resp)
            else:
                await self._relay_body(resp)
        return True

    def _upstream_headers(self) -> list[tuple[str, str]]:
        return [("content-type", "application/json"), ("x-request-id", self.request_id)]

    async def _relay_body(self, resp: Response) -> None:
        body = await resp.read()
        self._first_byte()
        if resp.status == 200:
            try:
                self.usage = self.dialect.usage_from_body(orjson.loads(body))
            except orjson.JSONDecodeError:
                pass
            self.status = "completed"
        await self.complete()
        await _respond(self.send, resp.status, body, self._response_headers(resp))

    async def _relay_stream(self, resp: Response) -> None:
        await self.send(
            {"type": "http.response.start", "status": 200, "headers": self._response_headers(resp)}
        )
        buffer = b""
        try:
            async for chunk in resp.chunks():
                buffer += chunk
                end = buffer.rfind(b"\n\n") + 2
                if end < 2:
                    continue
                whole, buffer = buffer[:end], buffer[end:]
                plain = self.dialect.plain_prefix(whole)
                out = []
                if plain:
                    self.streamed_events += whole.count(self.dialect.CONTENT_MARKER, 0, plain)
                    out.append(whole[:plain])
                for event in whole[plain:-2].split(b"\n\n") if plain < end else ():
                    usage = self.dialect.usage_from_event(event)
                    if usage is not None:
                        self.usage = usage
                        if not self.client_wants_usage and self.dialect.is_usage_only_event(event):
                            continue
                    elif self.dialect.is_content_event(event):
                        self.streamed_events += 1
                    if self.dialect.is_terminal_event(event):
                        if out:  # what came before the end goes out now, not after the settlement
                            self._first_byte()
                            await self.send(
                                {"type": "http.response.body", "body": b"".join(out), "more_body": True}
                            )
                            out = []
                        self.status = "completed"
                        await self.complete()
                    out.append(event + b"\n\n")
                if out:
                    self._first_byte()
                    await self.send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                if self.streamed_events and self._prefilling is not None:
                    self._prefill_done(first_token=True)  # the engine's prefill of this prompt is over
        except UpstreamError as exc:
            # The engine died mid-stream: tell the client in its dialect, bill what was streamed.
            metrics.of(metrics.errors, self.model, "midstream").inc()
            self.usage.output_tokens = max(self.usage.output_tokens, self.streamed_events)
            self.status = "failed"
            self.http_status = 502
            await self.complete()
            await self.send(
                {
                    "type": "http.response.body",
                    "more_body": False,
                    "body": self.dialect.stream_error_event(
                        502,
                        f"The engine stopped in the middle of the answer ({exc.__class__.__name__}). "
                        "The tokens received so far are billed; retry to get a full answer.",
                    ),
                }
            )
            return
        if buffer.strip():
            await self.send({"type": "http.response.body", "body": buffer, "more_body": True})
        self.status = "completed"
        await self.complete()
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    def _prefill_done(self, first_token: bool = False) -> None:
        if self._prefilling is not None:
            load, lane = self._prefilling
            load.prefill_ended(lane, time.monotonic(), first_token)
            self._prefilling = None

    def _first_byte(self) -> None:
        if self.first_byte_at is None:
            self.first_byte_at = time.perf_counter()
            metrics.of(metrics.ttft, self.model, self.endpoint_name).observe(
                self.first_byte_at - self.started
            )

    def _response_headers(self, resp: Response) -> list[tuple[bytes, bytes]]:
        content_type = resp.header(b"content-type", b"application/json")
        headers = [(b"content-type", content_type), (b"x-request-id", self.request_id.encode())]
        if self.stream:
            headers.append((b"cache-control", b"no-cache"))
        return headers + _headers(self.extra_headers)

    def finalize_usage(self) -> None:
        """The usage to bill, once the answer is over or has failed. Safe to call more than once."""
        if self.prefill_usage is not None and self.usage.reported:
            # The prompt counts once, with the cached tokens of the leg that did the prefill.
            self.usage.cached_tokens = min(self.prefill_usage.cached_tokens, self.usage.prompt_tokens)
        if self.status == "cancelled" or (self.status == "failed" and not self.usage.reported):
            # The engine never reported usage: bill what reached the client.
            self.usage.output_tokens = max(self.usage.output_tokens, self.streamed_events)

    def usage_event(self):
        from tenants.usage_stream import UsageEvent

        return UsageEvent(
            request_id=self.request_id,
            tenant_id=self.key.tenant_id,
            team_id=self.key.team_id,
            api_key_id=self.key.id,
            deployment_id=self.deployment.id,
            model=self.model,
            endpoint=self.endpoint_url,
            prompt_tokens=self.usage.prompt_tokens,
            cached_prompt_tokens=min(self.usage.cached_tokens, self.usage.prompt_tokens),
            output_tokens=self.usage.output_tokens,
            ttft_ms=round((self.first_byte_at - self.started) * 1000) if self.first_byte_at else None,
            latency_ms=round((time.perf_counter() - self.started) * 1000),
            status=self.status,
            created_at=datetime.now(UTC),
        )


def _model_entry(deployment: DeploymentInfo, anthropic: bool) -> dict:
    name = deployment.served_model_name
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


def _prompt_token_bound(payload: dict) -> int:
    """An upper bound of the prompt's tokens without tokenising (a prompt not given as token ids): byte-level BPE
    tokens cover at least one byte each, plus a few template tokens per message."""
    prompt = payload.get("prompt")
    total = 0
    for part in (
        prompt,
        payload.get("messages"),
        payload.get("system"),
        payload.get("input"),
        payload.get("tools"),
    ):
        if part is not None:
            total += len(_dumps(part)) if not isinstance(part, str) else len(part.encode())
    messages = payload.get("messages")
    return total + 8 * (len(messages) if isinstance(messages, list) else 1) + 16


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HttpError(
                413, f"The request body is over the limit of {limit} bytes. Send a shorter prompt."
            )
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _parse(body: bytes) -> dict:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HttpError(400, f"The request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise HttpError(400, "The request body must be a JSON object.")
    return payload


def _dumps(value) -> bytes:
    """JSON of a parsed request, or a 400: orjson parses nesting up to 1,024 levels deep but writes only 254."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise HttpError(400, f"The request cannot be forwarded: {exc}. Nest its JSON less deeply.") from None


def _discard(work: Awaitable) -> None:
    """Drop work whose result is no longer wanted: a coroutine never started is closed, a task is left to
    finish (cancelling a Redis command midway would cost its connection) and its outcome read when it does."""
    if asyncio.iscoroutine(work):
        work.close()
    else:
        work.add_done_callback(read_outcome)


async def _nothing() -> None:
    return None


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode(errors="replace")
    return None


def _headers(extra: dict | None) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), str(v).encode()) for k, v in (extra or {}).items()]


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
