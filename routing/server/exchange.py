"""One admitted request's trip to an engine and back: choosing the engine (with retries), relaying the answer as
it streams, and settling and metering it once. Over 400 lines: the relay and the billing of a request cut short
read each other's state, and stay together."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, NamedTuple

from django.conf import settings

from routing.info import DeploymentInfo, KeyInfo
from routing.metering import traffic_trace
from routing.metering.admission import cost_units
from routing.rendering.dialects import OPENAI, USAGE_KEY, Dialect, Usage, last_usage
from routing.scheduling.disagg import prefill_elsewhere
from routing.scheduling.flow import QueueTimeout, Ticket
from routing.scheduling.load import RECENT_WINDOW_S, EndpointLoad, Prefill
from routing.scheduling.pipeline import RequestContext
from routing.scheduling.steps import request_weight
from routing.server import metrics, tracing
from routing.server.assemble import Assembler, EngineStreamError, assembler_for
from routing.server.engine_errors import refusal, route_missing_body
from routing.server.upstream import (
    AnswerTooLarge,
    Response,
    StallWatch,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from routing.server.wire import JSON_HEADERS, Receive, Send, encode_headers, respond

if TYPE_CHECKING:
    from routing.kvindex.prefix import PrefixRouting
    from routing.metering.finisher import Finisher
    from routing.scheduling.flow import FlowControl
    from routing.scheduling.pipeline import Pipeline
    from routing.server.upstream import UpstreamPool

log = logging.getLogger(__name__)

# An answer over the limit is read on for its usage: this many bytes from the usage key on are kept.
USAGE_BYTES = 4096
USAGE_START = re.compile(rb'"usage"\s*:\s*\{')
# An engine's error answer is read up to this much (it is a message, not an answer).
ERROR_BODY_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Services:
    """What an exchange uses of its replica, and nothing more: the pipeline that picks an engine and the loads it
    reads, flow control, the engines' connection pool, the settlement of usage and the prefix index it reports
    to. The router makes it once, at its start."""

    pipeline: Pipeline
    loads: dict[int, EndpointLoad]
    flow: FlowControl
    upstream: UpstreamPool
    finisher: Finisher
    prefix: PrefixRouting
    redis: object  # the replica's client, for the traffic trace's entries
    max_attempts: int


class RequestInfo(NamedTuple):
    """An admitted request, as the exchange serves it: fixed once admission took its reservation."""

    scope: dict
    dialect: Dialect
    deployment: DeploymentInfo
    key: KeyInfo
    request_id: str
    payload: dict  # the fields sent on to the engine
    body: bytes  # `payload` as JSON
    stream: bool
    client_wants_usage: bool  # the client asked for a usage chunk at the end of the stream
    running_usage: bool  # the client asked for usage in every chunk itself
    input_bound: int  # the prompt's tokens at most, as reserved
    started: float  # perf_counter at arrival
    headers: dict  # admission's rate-limit headers, for the response
    ctx: RequestContext
    prices: object  # the price sheet spend is counted with, under a spend budget (else None)
    reservation: object  # admission's, settled by `settle`
    priority: str = "standard"  # its class under flow control (routing/scheduling/flow.py)
    output_bound: int = 0  # its output tokens at most, as reserved
    assemble: bool = False  # the client did not stream, the engine streams: the answer is assembled here


class Exchange:
    """One request's trip to an engine and back, with retries, streaming and accounting."""

    def __init__(self, services: Services, request: RequestInfo, receive: Receive, send: Send):
        self.services, self.request, self.receive, self.send = services, request, receive, send
        self.usage = Usage()
        self.status = "failed"
        self.http_status = 502
        self.endpoint_url = ""
        self.endpoint_name = ""
        self.first_byte_at: float | None = None
        # When the first of the answer a client sees came (a chat stream's role chunk, a Messages content block):
        # later than the first byte where a tool-call parser holds the call back until its name is complete.
        self.first_content_at: float | None = None
        # While the chosen engine prefills this prompt: its load, and the tokens added to its prefill backlog.
        self._prefilling: tuple[EndpointLoad, Prefill] | None = None
        self.streamed_events = 0
        self.running_output = 0  # the engine's running count of output tokens (OpenAI's continuous usage)
        # With several choices, each one's running count (vLLM counts each choice on its own).
        n = request.payload.get("n")
        self.choice_outputs: dict[int, int] | None = {} if isinstance(n, int) and n > 1 else None
        self.predicted_cached = 0
        self.pd_done = False  # a prefill leg ran (routing/scheduling/disagg.py)
        self.prefill_usage: Usage | None = None  # the leg's, when a prefill engine computed the prompt
        # Billing a request cut short: whether an engine took the prompt, and its count of the prompt's tokens
        # from the first chunk; before that, the router's count (or `input_bound` when it did not tokenize).
        self.dispatched = False
        self.engine_prompt: int | None = None
        self.first_token_timeout = request.deployment.first_token_timeout
        self.response_started = False
        self.stall_timeout = request.deployment.stall_timeout
        self._settled = False
        self.ticket: Ticket | None = None  # its turn under flow control, once let through
        self.queued_s: float | None = None  # how long it waited for that turn
        # A client that did not ask for a stream gets the engine's stream assembled (routing/server/assemble.py).
        self.assembler: Assembler | None = None
        self.max_answer_bytes = settings.ROUTER_MAX_ANSWER_BYTES
        self.max_event_bytes = settings.ROUTER_MAX_EVENT_BYTES

    @property
    def model(self) -> str:
        return self.request.deployment.served_model_name

    async def settle(self) -> None:
        """Settle the reservation and meter the request, once, before the client can see the end of the answer,
        so a concurrency slot is free again by the time the client could send its next request. The router also
        calls it (shielded) once the exchange is over, for a request that ended any other way."""
        if self._settled:
            return
        self._settled = True
        self._final_usage()
        request, usage = self.request, self.usage
        spend = cost_units(request.prices, usage.prompt_tokens, usage.cached_tokens, usage.output_tokens)
        services = self.services
        if tracing.ON:
            tracing.settled(self)
        try:
            with tracing.span("router.settle"):
                await services.finisher.settle(
                    request.reservation,
                    input_tokens=usage.prompt_tokens,
                    output_tokens=usage.output_tokens,
                    spend=spend,
                    event=self.usage_event(),
                )
            if request.ctx.block_count and usage.reported:
                services.prefix.observe(
                    request.deployment,
                    self.endpoint_name,
                    self.predicted_cached,
                    usage.prompt_tokens,
                    usage.cached_tokens,
                )
            if traffic_trace.RATIO:
                traffic_trace.record(self)
        except Exception:
            log.exception("could not settle or meter request %s", request.request_id)

    async def run(self) -> None:
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(asyncio.current_task()))
        try:
            if await self._wait_turn():
                await self._attempts()
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled() and watcher.result():
                # The client went away: nothing left to send. One that hangs up once the answer's end reached it
                # (Codex closes the stream at `response.completed`) was served whole: that stays completed.
                if self.status != "completed":
                    self.status = "cancelled"
                    self.http_status = 499
                return
            raise
        finally:
            watcher.cancel()
            self._final_usage()
            if self.ticket is not None:
                usage = self.usage
                work = max(0, usage.prompt_tokens - usage.cached_tokens) + usage.output_tokens
                self.ticket.finish(work, usage.output_tokens if self.status == "completed" else None)
            metrics.of(metrics.requests, self.model, self.endpoint_name, str(self.http_status)).inc()
            metrics.of(metrics.latency, self.model, self.endpoint_name).observe(
                time.perf_counter() - self.request.started
            )
            for kind, value in (
                ("prompt", self.usage.prompt_tokens),
                ("cached_prompt", self.usage.cached_tokens),
                ("output", self.usage.output_tokens),
            ):
                if value:
                    metrics.of(metrics.tokens, self.model, self.endpoint_name, kind).inc(value)

    async def _wait_turn(self) -> bool:
        """Wait in the router while the deployment is saturated (routing/scheduling/flow.py). False: it waited past its
        class's limit and was refused (429, or Anthropic's overloaded error), nothing billed. A client that goes
        away meanwhile cancels the wait, and it leaves the queue."""
        request, flow = self.request, self.services.flow
        ctx = request.ctx
        blocks = {e: h.blocks for e, h in ctx.held.items()} if ctx.held else ctx.approx_held
        held = max(blocks.values(), default=0) * request.deployment.block_size
        uncached = (ctx.prompt_tokens_estimate or request.input_bound) - held
        work = flow.estimate(flow.flow(request.deployment), uncached, request.output_bound)
        try:
            with tracing.span("router.flow_wait"):
                self.ticket = await flow.enter(
                    request.deployment, request.key, request.priority, work, request.started, blocks
                )
        except QueueTimeout as exc:
            self.queued_s = exc.waited
            self.status = "rejected"
            self.http_status = request.dialect.overloaded_status
            message = (
                f"The model `{self.model}` is saturated: this `{request.priority}` request waited "
                f"{exc.waited:.0f} s for its turn. Retry after {exc.retry_after} s."
            )
            await respond(
                self.send,
                self.http_status,
                request.dialect.error_body(self.http_status, message, code="overloaded"),
                JSON_HEADERS + [(b"retry-after", str(exc.retry_after).encode())],
            )
            return False
        self.queued_s = self.ticket.queued_s
        return True

    async def _watch_disconnect(self, task: asyncio.Task) -> bool:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return True

    async def _attempts(self) -> None:
        """Try engines until one answers, up to ROUTER_MAX_ATTEMPTS. An engine that fails before anything reached
        the client (a 5xx, no connection, no first token in time, a route it lacks: see routing/server/engine_errors.py)
        is left for another; when none answers, the client gets an error in its dialect (`_give_up`)."""
        request, services = self.request, self.services
        ctx = request.ctx
        tried: set[int] = set()
        failures: list[str] = []  # what went wrong with each engine tried, in order
        policy = request.deployment.policy
        ticket = self.ticket
        if policy.flow_control and ticket is not None:
            # Only where it can start now (filters.with_room): its reserved slot, or a free one that is not spare
            # when its tenant is ahead of its share.
            ctx.room_beyond = policy.saturation_waiting_per_engine
            ctx.spare_slots = policy.saturation_spare_slots_per_engine if ticket.ahead else 0.0
            ctx.reserved_endpoint = ticket.endpoint
        for attempt in range(services.max_attempts):
            ctx.exclude = frozenset(tried)
            with tracing.span("router.pick") as pick:
                candidate, candidates = services.pipeline.choose(request.deployment, ctx, services.loads)
                if candidate is None:
                    break
                self.predicted_cached = services.prefix.chosen(
                    request.deployment, ctx, candidate, candidates, request.request_id
                )
                if pick is not None:
                    tracing.picked(pick, candidate, len(candidates), self.predicted_cached)
            endpoint = candidate.endpoint
            tried.add(endpoint.id)
            self.endpoint_url, self.endpoint_name = endpoint.url, endpoint.name
            prefilled = await prefill_elsewhere(self, candidate, candidates, self.pd_done)
            self.pd_done = prefilled.tried
            if prefilled.remotely:
                self.prefill_usage = prefilled.usage
            load = services.loads.setdefault(endpoint.id, EndpointLoad())
            weight = request_weight(ctx.prompt_tokens_estimate, self.predicted_cached)
            load.begin(weight)
            if self.ticket is not None:
                self.ticket.started()
            load.assigned(time.monotonic(), RECENT_WINDOW_S, weight)
            # The engine's prefill backlog grows by what it must compute of this prompt (nothing when a prefill
            # engine computed it), until the first token streams back; an answer not streamed holds it to its end.
            uncached = 0 if prefilled.remotely else ctx.prompt_tokens_estimate - self.predicted_cached
            self._prefilling = load, load.prefill_began(float(max(0, uncached)), time.monotonic())
            try:
                with tracing.attempt(self, endpoint, attempt + 1):
                    failure = await self._try(endpoint.url, prefilled.body)
                if failure is None:
                    return
                failures.append(failure)
                log.warning("request %s: engine %s: %s", request.request_id, endpoint.name, failure)
            except UpstreamError as exc:
                self.dispatched = False  # it answered nothing: the prompt is not billed
                failures.append("timeout" if isinstance(exc, UpstreamTimeout) else "connect")
                log.warning("request %s: engine %s: %r", request.request_id, endpoint.name, exc)
                metrics.of(metrics.errors, self.model, "connect").inc()
            finally:
                load.end(weight)
                self._prefill_done()
        await self._give_up(failures)

    async def _give_up(self, failures: list[str]) -> None:
        """No engine answered: the client's error, in its dialect, naming no engine. No engine to try: 503. Every
        engine tried lacks the route: 404 (routing/server/engine_errors.py). Otherwise 502, or 504 when the engines
        only timed out."""
        request = self.request
        dialect = request.dialect
        if not failures:
            self.http_status = 503
            message = f"The model `{self.model}` is unavailable right now (no engine of it is ready). Retry shortly."
        elif all(failure == "route_missing" for failure in failures):
            self.http_status = 404
            metrics.of(metrics.errors, self.model, "route_missing").inc()
            body = route_missing_body(dialect, self.model, request.scope["path"])
            return await respond(self.send, 404, body, self._error_headers())
        elif all(failure in ("timeout", "route_missing") for failure in failures):
            self.http_status = 504
            message = (
                f"The model `{self.model}` is unavailable right now: no engine started the answer within "
                f"{self.first_token_timeout:g} s. Retry shortly."
            )
        else:
            self.http_status = 502
            message = (
                f"The model `{self.model}` is unavailable right now: its engines failed or could not be "
                "reached. Retry shortly."
            )
        metrics.of(metrics.errors, self.model, "unavailable").inc()
        await respond(
            self.send, self.http_status, dialect.error_body(self.http_status, message), self._error_headers()
        )

    async def _try(self, base_url: str, body: bytes) -> str | None:
        """One attempt. None: answered (the client has the engine's answer, or its refusal in the client's
        dialect). Otherwise what failed before anything reached the client, so that another engine may serve it:
        "engine_5xx" or "route_missing"."""
        sent_at = time.perf_counter()
        self.dispatched = True
        request = self.request
        whole_answer = not request.stream and not request.assemble
        try:
            async with asyncio.timeout(self._headers_timeout(whole_answer)) as deadline:
                async with self.services.upstream.post(
                    base_url + self.request.scope["path"], body, self.upstream_headers()
                ) as resp:
                    metrics.of(metrics.added, self.model).observe(sent_at - self.request.started)
                    self.http_status = resp.status
                    if resp.status >= 500:
                        self.dispatched = False
                        await resp.read(ERROR_BODY_BYTES)
                        metrics.of(metrics.errors, self.model, "upstream_5xx").inc()
                        return "engine_5xx"
                    if resp.status in (401, 403):
                        # The engine refused the router's own key (a rotation not everywhere yet): the router's
                        # fault, not the client's key. Another engine is tried, then the client gets a 502.
                        self.dispatched = False
                        await resp.read(ERROR_BODY_BYTES)
                        metrics.of(metrics.errors, self.model, "engine_auth").inc()
                        log.error(
                            "an engine of %s refused the router's engine key (%s)", self.model, resp.status
                        )
                        return "engine_5xx"
                    if resp.status != 200:
                        self.dispatched = False  # the engine refused it: nothing was computed
                        return await self._relay_refusal(resp, base_url)
                    # What the engine sent decides, not what was asked: a JSON answer to a request the router
                    # took for a stream is read (and billed) as the answer it is.
                    if b"text/event-stream" in (resp.header(b"content-type") or b""):
                        if request.assemble:
                            self.assembler = assembler_for(request.scope["path"])
                        await self._relay_stream(resp, deadline)
                    else:
                        await self._relay_body(resp)
        except UpstreamConnectError:
            self.dispatched = False
            raise
        except AnswerTooLarge:
            # An error answer over ERROR_BODY_BYTES: not an engine's message, a broken engine.
            self.dispatched = False
            metrics.of(metrics.errors, self.model, "upstream_5xx").inc()
            return "engine_5xx"
        except TimeoutError:
            if self.first_byte_at is not None:
                raise  # handled in the relay; not reached
            if whole_answer:
                # An answer that cannot be streamed (prompt logprobs) and did not come within its whole time:
                # the engine took it, so it is billed its prompt, and not tried again elsewhere.
                metrics.of(metrics.errors, self.model, "whole_answer_timeout").inc()
                self.http_status = 504
                await self.settle()
                message = (
                    f"The model `{self.model}` did not finish this answer, which cannot be streamed, within "
                    f"{self._headers_timeout(True):g} s. Ask for fewer tokens or fewer prompt logprobs."
                )
                error = request.dialect.error_body(504, message)
                await respond(self.send, 504, error, self._error_headers())
                return None
            # Nothing reached the client: another engine may serve it (this one drops the request as the
            # connection closes).
            self.dispatched = False
            metrics.of(metrics.errors, self.model, "first_token_timeout").inc()
            raise UpstreamTimeout(f"no first token within {self.first_token_timeout:g} s") from None
        return None

    def _headers_timeout(self, whole_answer: bool) -> float:
        """How long the engine may take to start its answer: the first-token limit for a stream; for an answer
        the engine sends whole (its headers come at its end), as long as a stream of its largest answer could
        take, a token per stall limit."""
        if not whole_answer:
            return self.first_token_timeout
        return self.first_token_timeout + self.request.output_bound * self.stall_timeout

    def upstream_headers(self) -> list[tuple[str, str]]:
        """Only the router's own headers: never the client's key. The engine key proves the call comes from
        the router (engines on Kubernetes require it)."""
        headers = [
            ("content-type", "application/json"),
            ("x-request-id", self.request.request_id),
            ("authorization", f"Bearer {self.request.deployment.engine_key}"),
        ]
        if tracing.ON:
            tracing.inject(headers)  # W3C trace context: the engine's spans join the request's trace
        return headers

    async def _relay_body(self, resp: Response) -> None:
        """An answer the engine sent whole: relayed as it came, its usage read from its last bytes (a body of
        prompt logprobs can be a hundred megabytes: it is neither parsed whole nor held past
        ROUTER_MAX_ANSWER_BYTES)."""
        body, tail = await self._read_answer(resp)
        self._first_byte()
        dialect = self.request.dialect
        if body is None:
            # The engine did the work: billed by its own count, and the client told to ask for less.
            metrics.of(metrics.errors, self.model, "answer_too_large").inc()
            self.usage = dialect.usage_from_tail(tail)
            self.status = "failed"
            self.http_status = 502
            await self.settle()
            message = (
                f"The answer is over {self.max_answer_bytes} bytes, more than this gateway relays. Ask for fewer "
                "logprobs or fewer tokens, or stream it."
            )
            return await respond(self.send, 502, dialect.error_body(502, message), self._error_headers())
        stripped = body.strip()
        if not (stripped.startswith(b"{") and stripped.endswith(b"}")):
            # Not an answer any client can read: the engine (or something in front of it) is broken.
            self.dispatched = False
            self.http_status = 502
            metrics.of(metrics.errors, self.model, "upstream_not_json").inc()
            await self.settle()
            message = f"The model `{self.model}`'s engine gave an answer that is not JSON. Retry shortly."
            error = self.request.dialect.error_body(502, message)
            return await respond(self.send, 502, error, self._error_headers())
        self.usage = dialect.usage_from_tail(body)
        if tracing.ON:
            tracing.saw(body[: tracing.HEAD_BYTES])  # its id and model
            tracing.saw(body[-65536:])  # how it ended
        self.status = "completed"
        await self.settle()
        await respond(self.send, resp.status, body, self._response_headers(resp))

    async def _read_answer(self, resp: Response) -> tuple[bytes | None, bytes]:
        """The engine's whole answer, or None past ROUTER_MAX_ANSWER_BYTES with the bytes from its last usage key
        on (the answer read to its end either way, held no further than the limit)."""
        chunks: list[bytes] = []
        size, limit = 0, self.max_answer_bytes
        finder: UsageFinder | None = None
        async for chunk in resp.chunks():
            size += len(chunk)
            if finder is None and size <= limit:
                chunks.append(chunk)
                continue
            if finder is None:  # the limit is crossed: from now on only the usage is looked for
                finder = UsageFinder()
                held, chunks = b"".join(chunks), []
                match = last_usage(held)
                if match is not None:
                    finder.found = held[match.start() : match.start() + USAGE_BYTES]
                finder.recent = held[-UsageFinder.OVERLAP :]
            finder.feed(chunk)
        if finder is not None:
            return None, finder.found
        return b"".join(chunks), b""

    async def _relay_refusal(self, resp: Response, base_url: str) -> str | None:
        """An engine's answer below 500 other than 200, passed on in the client's dialect
        (routing/server/engine_errors.py); "route_missing" when the engine lacks the route, for another to try."""
        answer = refusal(self.request.dialect, resp.status, await resp.read(ERROR_BODY_BYTES), base_url)
        if answer.route_missing:
            return "route_missing"
        self._first_byte()
        await self.settle()
        await respond(self.send, answer.status, answer.body, self._error_headers())
        return None

    async def _relay_stream(self, resp: Response, deadline: asyncio.Timeout) -> None:
        """Pass the engine's events on as they come. The response starts with the first event, so an engine that
        sends nothing within the first-token limit can be given up for another; then each piece must follow the
        last within the stall limit. Running usage the router asked for is taken out of the client's events."""
        stall = StallWatch(self.stall_timeout)
        try:
            await self._relay_events(resp, deadline, stall)
        finally:
            stall.close()

    async def _relay_events(self, resp: Response, deadline: asyncio.Timeout, stall: StallWatch) -> None:
        dialect = self.request.dialect
        strip = dialect is OPENAI and not self.request.running_usage
        client_wants_usage = self.request.client_wants_usage
        # The bytes of an event not yet whole: kept as the pieces that came, each searched once for the end of
        # an event (a 30 MB event in small pieces is not searched and copied again with every piece).
        pending: list[bytes] = []
        pending_size = 0
        max_event = self.max_event_bytes
        chunks = resp.chunks().__aiter__()
        try:
            while True:
                try:
                    if self.first_byte_at is None and not pending:
                        chunk = await anext(chunks)  # under the first-token deadline
                        deadline.reschedule(None)
                    else:
                        stall.waiting()
                        try:
                            chunk = await anext(chunks)
                        finally:
                            stall.done()
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    if stall.fired:
                        metrics.of(metrics.errors, self.model, "stall_timeout").inc()
                    stall.check()
                    raise
                # An event's end may straddle two pieces: the last byte before this piece is searched with it.
                tail = pending[-1][-1:] if pending else b""
                end = (tail + chunk if tail else chunk).rfind(b"\n\n") + 2 - len(tail)
                if end < 2 - len(tail):
                    pending.append(chunk)
                    pending_size += len(chunk)
                    if pending_size > max_event:
                        raise AnswerTooLarge(max_event)
                    continue
                whole = b"".join((*pending, chunk[:end])) if pending else chunk[:end]
                rest = chunk[end:]
                pending, pending_size = ([rest], len(rest)) if rest else ([], 0)
                if self.first_content_at is None and dialect.seen_marker in whole:
                    self.first_content_at = time.perf_counter()
                plain = dialect.plain_prefix(whole)
                out = []
                if plain:
                    run = whole[:plain]
                    self.streamed_events += run.count(dialect.CONTENT_MARKER)
                    if self.engine_prompt is None:
                        self.engine_prompt = dialect.prompt_from_event(run)
                    if self.choice_outputs is None:
                        self.running_output = max(self.running_output, dialect.running_output(run))
                    else:
                        dialect.running_outputs(run, self.choice_outputs)
                        self.running_output = sum(self.choice_outputs.values())
                    out.append(dialect.without_running_usage(run) if strip else run)
                for event in whole[plain:-2].split(b"\n\n") if plain < end else ():
                    usage = dialect.usage_from_event(event)
                    if usage is not None:
                        self.usage = usage
                        if not client_wants_usage and dialect.is_usage_only_event(event):
                            continue
                    else:
                        if self.engine_prompt is None:
                            self.engine_prompt = dialect.prompt_from_event(event)
                        if dialect.is_content_event(event):
                            self.streamed_events += 1
                            if strip:
                                event = dialect.without_running_usage(event)
                    if dialect.is_terminal_event(event):
                        if out:  # what came before the end goes out now, not after the settlement
                            await self._send_events(resp, b"".join(out))
                            out = []
                        self.status = "completed"
                        await self.settle()
                    out.append(event + b"\n\n")
                if out:
                    await self._send_events(resp, b"".join(out))
                if self.streamed_events and self._prefilling is not None:
                    self._prefill_done(first_token=True)  # the engine's prefill of this prompt is over
        except EngineStreamError as exc:
            return await self._assembly_failed(
                exc.status, f"The engine failed in the middle of the answer: {exc}"
            )
        except AnswerTooLarge as exc:
            # The engine took the request and is answering: not tried elsewhere, billed what it did.
            metrics.of(metrics.errors, self.model, "answer_too_large").inc()
            message = f"The answer has an event {exc}, more than this gateway relays. Ask for fewer logprobs"
            if self.assembler is not None or not self.response_started:
                self.assembler = self.assembler or assembler_for(self.request.scope["path"])
                return await self._assembly_failed(502, message)
            return await self._stream_failed(resp, message)
        except UpstreamError as exc:
            if self.assembler is not None:
                if self.first_byte_at is None:
                    raise  # the engine sent nothing: another engine may serve it
                return await self._assembly_failed(
                    502, f"The engine stopped in the middle of the answer ({exc})"
                )
            if self.status == "completed":
                return  # the answer's end reached the client; what the engine does after it is its own
            if not self.response_started:
                raise  # nothing reached the client: another engine may serve it
            # The engine died or stalled mid-stream: tell the client in its dialect, bill what was streamed.
            return await self._stream_failed(resp, f"The engine stopped in the middle of the answer ({exc})")
        rest = b"".join(pending)
        if self.assembler is not None:
            return await self._assembled(rest)
        if rest.strip():
            await self._send_events(resp, rest)
        self.status = "completed"
        await self.settle()
        await self._start_response(resp)
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream_failed(self, resp: Response, message: str) -> None:
        """A stream the client is reading failed midway: an error event in its dialect ends it, and what was
        streamed is billed."""
        metrics.of(metrics.errors, self.model, "midstream").inc()
        self.usage.output_tokens = max(self.usage.output_tokens, self.streamed_events)
        self.status = "failed"
        self.http_status = 502
        await self.settle()
        await self._start_response(resp)
        message += ". The tokens received so far are billed; retry to get a full answer."
        body = self.request.dialect.stream_error_event(502, message)
        await self.send({"type": "http.response.body", "more_body": False, "body": body})

    async def _assembled(self, rest: bytes) -> None:
        """The stream is over: the client gets the whole answer as one JSON body, once it is settled."""
        try:
            if rest.strip():
                self.assembler.feed_events(rest)
            if self.status != "completed":
                raise EngineStreamError(502, "the engine's stream ended before the answer was complete")
            body = self.assembler.body()
        except EngineStreamError as exc:
            return await self._assembly_failed(
                exc.status, f"The engine failed in the middle of the answer: {exc}"
            )
        self.http_status = 200
        await self.settle()
        headers = [
            (b"content-type", b"application/json"),
            (b"x-request-id", self.request.request_id.encode()),
        ]
        await respond(self.send, 200, body, headers + encode_headers(self.request.headers))

    async def _assembly_failed(self, status: int, message: str) -> None:
        """An answer being assembled failed midway: the client gets an error in its dialect, and the work the
        engine did is billed (its running counts, routing/exchange._final_usage)."""
        metrics.of(metrics.errors, self.model, "midstream").inc()
        self.status = "failed"
        self.http_status = 502 if status >= 500 else status
        self.usage.output_tokens = max(self.usage.output_tokens, self.streamed_events)
        await self.settle()
        body = self.request.dialect.error_body(
            self.http_status, f"{message}. The tokens computed so far are billed; retry to get a full answer."
        )
        await respond(self.send, self.http_status, body, self._error_headers())

    async def _start_response(self, resp: Response) -> None:
        if not self.response_started:
            self.response_started = True
            await self.send(
                {"type": "http.response.start", "status": 200, "headers": self._response_headers(resp)}
            )

    async def _send_events(self, resp: Response, data: bytes) -> None:
        self._first_byte()
        if tracing.ON:
            tracing.saw(data)
        if self.assembler is not None:
            self.assembler.feed_events(data)
            return
        if not self.response_started:
            await self._start_response(resp)
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    def _prefill_done(self, first_token: bool = False) -> None:
        if self._prefilling is not None:
            load, lane = self._prefilling
            load.prefill_ended(lane, time.monotonic(), first_token)
            self._prefilling = None

    def _first_byte(self) -> None:
        if self.first_byte_at is None:
            self.first_byte_at = time.perf_counter()
            metrics.of(metrics.ttft, self.model, self.endpoint_name).observe(
                self.first_byte_at - self.request.started
            )
            if tracing.ON:
                tracing.first_token()

    def _error_headers(self) -> list[tuple[bytes, bytes]]:
        request_id = (b"x-request-id", self.request.request_id.encode())
        return [*JSON_HEADERS, request_id, *encode_headers(self.request.headers)]

    def _response_headers(self, resp: Response) -> list[tuple[bytes, bytes]]:
        content_type = resp.header(b"content-type", b"application/json")
        headers = [(b"content-type", content_type), (b"x-request-id", self.request.request_id.encode())]
        if self.request.stream:
            headers.append((b"cache-control", b"no-cache"))
        return headers + encode_headers(self.request.headers)

    def _final_usage(self) -> None:
        """The usage to bill, once the answer is over or has failed. Safe to call more than once.

        The engine's final usage when it sent one. A request cut short (the client went away, the engine died or
        stalled), or whose stream ended without its usage, after an engine took it pays for its prompt all the
        same: the engine's count of the prompt from its first chunk, or before that the router's own count (its
        bound when it did not tokenize), with the cached part the router predicted; and for its output, the
        engine's last running count (several tokens may come in one chunk) or what reached the client."""
        if self.prefill_usage is not None and self.usage.reported:
            # The prompt counts once, with the cached tokens of the leg that did the prefill.
            self.usage.cached_tokens = min(self.prefill_usage.cached_tokens, self.usage.prompt_tokens)
        if self.usage.reported:
            return
        # No final usage, whether the answer was cut short or ended without one (vLLM ends a stream that failed
        # midway with an error event and `[DONE]`): never billed 0 for what the engine did.
        self.usage.output_tokens = max(self.usage.output_tokens, self.streamed_events, self.running_output)
        if self.prefill_usage is not None and self.prefill_usage.reported:
            # A prefill engine computed the prompt and said so.
            self.usage.prompt_tokens = max(self.usage.prompt_tokens, self.prefill_usage.prompt_tokens)
            self.usage.cached_tokens = min(self.prefill_usage.cached_tokens, self.usage.prompt_tokens)
        elif self.dispatched:
            if self.engine_prompt is not None:
                prompt = self.engine_prompt
            else:
                prompt = self.request.ctx.prompt_tokens_estimate or self.request.input_bound
            self.usage.prompt_tokens = max(self.usage.prompt_tokens, prompt)
            self.usage.cached_tokens = min(self.predicted_cached, self.usage.prompt_tokens)

    def usage_event(self):
        from tenants.usage_stream import UsageEvent

        request = self.request
        key = request.key
        return UsageEvent(
            request_id=request.request_id,
            tenant_id=key.tenant_id,
            team_id=key.team_id,
            api_key_id=key.id,
            deployment_id=request.deployment.id,
            model=self.model,
            endpoint=self.endpoint_url,
            prompt_tokens=self.usage.prompt_tokens,
            cached_prompt_tokens=min(self.usage.cached_tokens, self.usage.prompt_tokens),
            output_tokens=self.usage.output_tokens,
            ttft_ms=round((self.first_byte_at - request.started) * 1000) if self.first_byte_at else None,
            latency_ms=round((time.perf_counter() - request.started) * 1000),
            status=self.status,
            created_at=datetime.now(UTC),
            priority_class=request.priority,
            queued_ms=round(self.queued_s * 1000) if self.queued_s is not None else None,
        )


class UsageFinder:
    """The bytes from the last `"usage": {` of an answer read piece by piece and not kept (up to USAGE_BYTES), for
    `Dialect.usage_from_tail`: a key that straddles two pieces is found, and a `"usage"` that is not the key of an
    object (a token's text in logprobs) is passed over."""

    OVERLAP = 32  # bytes of the previous piece looked at again: the key, a colon and some spaces

    def __init__(self):
        self.found = b""
        self.recent = b""

    def feed(self, piece: bytes) -> None:
        joined = self.recent + piece
        at = len(joined)
        while (at := joined.rfind(USAGE_KEY, 0, at)) >= 0:
            if USAGE_START.match(joined, at):
                self.found = joined[at : at + USAGE_BYTES]
                break
        else:
            if self.found and len(self.found) < USAGE_BYTES:
                self.found += piece[: USAGE_BYTES - len(self.found)]
        self.recent = joined[-self.OVERLAP :]
