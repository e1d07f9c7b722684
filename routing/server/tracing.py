"""OpenTelemetry traces of the generation requests through the router, exported over OTLP/HTTP.

Off unless ROUTER_TRACES_ENDPOINT is set (it defaults to the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or
OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces). Off, every hook in the request path reads one module flag (`ON`) and
does nothing else: OpenTelemetry is not even imported.

On, a request's trace is one SERVER span named as the GenAI semantic conventions name an inference call
(`chat <model>`, `text_completion <model>`) with their attributes (gen_ai.operation.name, gen_ai.request.*,
gen_ai.usage.*, gen_ai.response.finish_reasons), and a child span per step of routing/server/generation.py:

    router.authenticate   router.admit   router.place (router.render_tokenize, router.index_lookup)
    router.flow_wait      router.pick    <operation> <model> (CLIENT, one per engine attempt; router.first_token)
    router.settle

Sampling is the operator's: ROUTER_TRACES_SAMPLE_RATIO of the requests are kept, whatever a client's `traceparent`
asks. Its trace id is continued, but neither its sampled flag nor its trace id (the client chose both) decides:
a request that comes with one is kept on a draw of the router's own. Only with ROUTER_TRACES_FOLLOW_CLIENT_SAMPLING
does a client's flag decide for its request. A client's `tracestate` is not taken (its entries would ride on every
span). An unsampled request gets no child spans at all. Either way the engine is sent the W3C `traceparent` of the
attempt (vLLM started with --otlp-traces-endpoint exports its own spans under it) and the client gets the request's
`traceparent` back in the answer's headers.

What a span holds is bounded, as spans wait in the exporter's queue (up to OTEL_BSP_MAX_QUEUE_SIZE, 2,048): the
provider's SpanLimits cap the attributes per span and the characters of each string value, and only small values
are recorded, never a request's content: numbers, names from the router's own tables, the count of the stop
sequences and not the sequences. Before the key is authenticated, the root span holds only the method, the route
and the trace context; the request's fields are recorded once `check` has passed (its key, and the bounds on the
fields, such as ROUTER_MAX_STOP_SEQUENCES). Settings: README, "Traces".
"""

from __future__ import annotations

import random
import re
from contextlib import nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from routing.server.exchange import Exchange
    from routing.server.wire import Send

ON = False  # set once by `configure`, at the router's start

_NOOP = nullcontext()
_tracer = None
_provider = None
_otel = None  # opentelemetry's trace, context and propagator modules' names this module uses, once on
_current: ContextVar = ContextVar("router_trace", default=None)  # the request's RequestTrace

OPERATIONS = {"/v1/completions": "text_completion"}  # every other generation route is a chat
# The reasons an answer ended, as the engines write them: OpenAI's `finish_reason`, Anthropic's `stop_reason`.
FINISH_REASON = re.compile(rb'"(?:finish|stop)_reason"\s*:\s*"([A-Za-z_]+)"')
# The answer's id and model, in its first event or at the top of its JSON (OpenAI's chunk, Anthropic's
# message_start, Responses' response.created): the first `"id"` and `"model"` keys (a string in the JSON cannot
# hold them, its quotes being escaped there).
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,200})"')
RESPONSE_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,200})"')
HEAD_BYTES = 4096
MAX_FINISH_REASONS = 8  # distinct reasons kept (an answer has at most ROUTER_MAX_CHOICES choices)
# Request fields recorded as the GenAI conventions name them.
REQUEST_FIELDS = (
    ("max_tokens", "gen_ai.request.max_tokens"),
    ("max_completion_tokens", "gen_ai.request.max_tokens"),
    ("max_output_tokens", "gen_ai.request.max_tokens"),
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("top_k", "gen_ai.request.top_k"),
    ("seed", "gen_ai.request.seed"),
    ("frequency_penalty", "gen_ai.request.frequency_penalty"),
    ("presence_penalty", "gen_ai.request.presence_penalty"),
)


def configure(
    endpoint: str,
    ratio: float,
    service_name: str,
    *,
    follow_client: bool = False,
    max_attributes: int = 64,
    max_attribute_length: int = 256,
) -> None:
    """Export spans to `endpoint` (OTLP/HTTP, protobuf) in batches, keeping `ratio` of the requests (see
    `tracer_provider`). An empty endpoint leaves tracing off."""
    global ON, _tracer, _provider, _otel
    if not endpoint or ON:
        return
    from types import SimpleNamespace

    from opentelemetry import context, trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _provider = tracer_provider(
        ratio,
        service_name,
        follow_client=follow_client,
        max_attributes=max_attributes,
        max_attribute_length=max_attribute_length,
    )
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _tracer = _provider.get_tracer("inference_platform.routing")
    _otel = SimpleNamespace(
        attach=context.attach,
        detach=context.detach,
        in_context=trace.set_span_in_context,
        use_span=trace.use_span,
        SERVER=trace.SpanKind.SERVER,
        CLIENT=trace.SpanKind.CLIENT,
        propagator=TraceContextTextMapPropagator(),
    )
    ON = True


def tracer_provider(
    ratio: float, service_name: str, *, follow_client: bool, max_attributes: int, max_attribute_length: int
):
    """The router's TracerProvider, with no span processor yet: the operator's sampling (`sampler`), and SpanLimits
    on what any span, event or link may hold (the SDK's own default bounds the count but not a string's length)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider

    limits = SpanLimits(
        max_attributes=max_attributes,
        max_attribute_length=max_attribute_length,
        max_events=16,  # an attempt's exception, at most
        max_links=16,  # none are made
    )
    return TracerProvider(
        sampler=sampler(ratio, follow_client),
        resource=Resource.create({"service.name": service_name}),
        span_limits=limits,
    )


def sampler(ratio: float, follow_client: bool):
    """`ratio` of the requests, parent-based within the router (a request's spans share its root's decision). A
    client's remote parent decides only with `follow_client`; else its request is kept on a draw of the router's:
    an anonymous client could otherwise have its requests exported at ratio 0, a tenant keep its own out of the
    operator's traces, or either choose a trace id that `TraceIdRatioBased` keeps or drops."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if follow_client:
        return ParentBased(TraceIdRatioBased(ratio))

    class Drawn(TraceIdRatioBased):
        """TraceIdRatioBased on a random number instead of the (client's) trace id."""

        def should_sample(self, parent_context, trace_id, *args, **kwargs):
            return super().should_sample(parent_context, random.getrandbits(64), *args, **kwargs)

        def get_description(self) -> str:
            return f"Drawn{{{self.rate}}}"

    drawn = Drawn(ratio)
    return ParentBased(TraceIdRatioBased(ratio), remote_parent_sampled=drawn, remote_parent_not_sampled=drawn)


def shutdown() -> None:
    """Export what is left (at the router's stop)."""
    if _provider is not None:
        _provider.shutdown()


def instrument(router) -> None:
    """Spans for the tokenising and the index lookup of routing/kvindex/prefix.py, wrapped around the router's own
    instances (so nothing there changes, and nothing at all when tracing is off)."""
    prefix = router.prefix
    prefix.encode = _traced(prefix.encode, "router.render_tokenize")
    prefix.index.lookup = _traced(prefix.index.lookup, "router.index_lookup")


def _traced(method, name: str):
    async def traced(*args, **kwargs):
        with span(name):
            return await method(*args, **kwargs)

    return traced


class RequestTrace:
    """One request's root span, and what the answer said about how it ended."""

    def __init__(self, root, path: str):
        self.root = root
        self.recording = root.is_recording()
        self.operation = OPERATIONS.get(path, "chat")
        self.finish_reasons: list[str] = []
        self.response_id: str | None = None  # gen_ai.response.id and .model, from the answer's head
        self.response_model: str | None = None
        self.attempt = None  # the engine attempt's span, while it runs
        self.attempt_started = 0
        self.tokens = None  # what `end` resets
        ids = root.get_span_context()
        self.traceparent = f"00-{ids.trace_id:032x}-{ids.span_id:016x}-{ids.trace_flags:02x}".encode()

    def wrap(self, send: Send) -> Send:
        """`send`, with the request's traceparent added to the answer's headers and its status recorded."""

        async def traced_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (b"traceparent", self.traceparent)],
                }
                status = message["status"]
                self.root.set_attribute("http.response.status_code", status)
                if status >= 500:
                    _error(self.root, str(status))
            await send(message)

        return traced_send


def begin(scope: dict) -> RequestTrace:
    """The root span of a generation request, made current; the caller ends it with `end`. The key is not checked
    yet: only the method, the route (one of the router's own) and the client's trace id, of fixed size, are
    recorded."""
    carrier = {}
    for name, value in scope["headers"]:
        if name == b"traceparent":
            carrier["traceparent"] = value.decode("latin-1")
    parent = _otel.propagator.extract(carrier) if carrier else None
    path = scope["path"]
    root = _tracer.start_span(
        f"POST {path}",
        context=parent,
        kind=_otel.SERVER,
        attributes={"http.request.method": "POST", "url.path": path},
    )
    request = RequestTrace(root, path)
    request.root.set_attribute("gen_ai.operation.name", request.operation)
    request.tokens = _current.set(request), _otel.attach(_otel.in_context(root, parent))
    return request


def end(request: RequestTrace) -> None:
    request.root.end()
    mine, token = request.tokens
    _otel.detach(token)
    _current.reset(mine)


def span(name: str):
    """A child span of the current request's (a context manager yielding it), or nothing when tracing is off or
    the request is not sampled."""
    if not ON:
        return _NOOP
    request = _current.get()
    if request is None or not request.recording:
        return _NOOP
    return _tracer.start_as_current_span(name)


def checked(checked, request_id: str) -> None:
    """The request's model and sampling fields, and who sent it, once `check` passed (the key authenticated, the
    fields within their bounds): numbers and names, never the request's text."""
    request = _current.get()
    if request is None or not request.recording:
        return
    root, payload = request.root, checked.payload
    root.set_attribute("router.request_id", request_id)
    model = checked.deployment.served_model_name
    root.update_name(f"{request.operation} {model}")
    root.set_attribute("gen_ai.request.model", model)
    for field, attribute in REQUEST_FIELDS:
        value = payload.get(field)
        if isinstance(value, int | float) and not isinstance(value, bool):
            root.set_attribute(attribute, value)
    stop = payload.get("stop") or payload.get("stop_sequences")
    if stop:  # how many, not what they say (a request's content, and up to ROUTER_MAX_STOP_BYTES)
        root.set_attribute("router.stop_sequences", 1 if isinstance(stop, str) else len(stop))
    n = payload.get("n")
    if isinstance(n, int) and n > 1:
        root.set_attribute("gen_ai.request.choice.count", n)
    root.set_attribute("router.stream", checked.stream)
    root.set_attribute("router.priority", checked.priority)
    root.set_attribute("router.tenant_id", checked.key.tenant_id)
    root.set_attribute("router.team_id", checked.key.team_id)


def picked(pick, candidate, candidates: int, predicted_cached: int) -> None:
    """What the pick chose among how many, and the prompt tokens it expects the engine to hold."""
    if pick is None or not pick.is_recording():
        return
    pick.set_attribute("router.endpoint", candidate.endpoint.name)
    pick.set_attribute("router.candidates", candidates)
    pick.set_attribute("router.predicted_cached_tokens", predicted_cached)


def attempt(exchange: Exchange, endpoint, number: int):
    """One engine attempt: a CLIENT span as the GenAI conventions describe a call to a model server, current
    while it runs so that the engine's traceparent names it."""
    request = _current.get() if ON else None
    if request is None or not request.recording:
        return _NOOP
    return _Attempt(request, exchange, endpoint, number)


class _Attempt:
    def __init__(self, request: RequestTrace, exchange: Exchange, endpoint, number: int):
        self.request, self.exchange, self.endpoint, self.number = request, exchange, endpoint, number

    def __enter__(self):
        url = urlsplit(self.endpoint.url)
        attributes = {
            "gen_ai.operation.name": self.request.operation,
            "gen_ai.request.model": self.exchange.model,
            "server.address": url.hostname or "",
            "server.port": url.port or 80,
            "router.endpoint": self.endpoint.name,
            "router.attempt": self.number,
        }
        name = f"{self.request.operation} {self.exchange.model}"
        self.span = _tracer.start_span(name, kind=_otel.CLIENT, attributes=attributes)
        self.manager = _otel.use_span(self.span, end_on_exit=True)
        self.manager.__enter__()
        self.request.attempt, self.request.attempt_started = self.span, self.span.start_time
        return self.span

    def __exit__(self, kind, exc, tb):
        if exc is None:  # else the engine answered nothing, and use_span records the exception
            status = self.exchange.http_status
            self.span.set_attribute("http.response.status_code", status)
            if status >= 500 or status == 404:
                _error(self.span, str(status))
        self.request.attempt = None
        return self.manager.__exit__(kind, exc, tb)


def inject(headers: list[tuple[str, str]]) -> None:
    """The W3C trace context for an engine call: the current span's (the attempt's), else the request's."""
    if _current.get() is None:
        return
    carrier: dict[str, str] = {}
    _otel.propagator.inject(carrier)
    headers.extend(carrier.items())


def first_token() -> None:
    """The first piece of the answer came: a span from the attempt's start to now."""
    request = _current.get()
    if request is None or request.attempt is None:
        return
    first = _tracer.start_span("router.first_token", start_time=request.attempt_started)
    first.end()


def saw(data: bytes) -> None:
    """Answer bytes on their way to the client: its id and model (from its head), the reasons its choices
    ended."""
    request = _current.get()
    if request is None or not request.recording:
        return
    if request.response_id is None:
        head = data[:HEAD_BYTES]
        found, model = RESPONSE_ID.search(head), RESPONSE_MODEL.search(head)
        if found is not None:
            request.response_id = found.group(1).decode(errors="replace")
        if model is not None:
            request.response_model = model.group(1).decode(errors="replace")
    for match in FINISH_REASON.finditer(data):
        reason = match.group(1).decode()
        if reason not in request.finish_reasons and len(request.finish_reasons) < MAX_FINISH_REASONS:
            request.finish_reasons.append(reason)


def settled(exchange: Exchange) -> None:
    """The usage the request was metered with, as the usage event records it."""
    request = _current.get()
    if request is None or not request.recording:
        return
    root, usage = request.root, exchange.usage
    root.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
    root.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)
    root.set_attribute("gen_ai.usage.cache_read.input_tokens", min(usage.cached_tokens, usage.prompt_tokens))
    root.set_attribute("router.status", exchange.status)
    if exchange.endpoint_name:
        root.set_attribute("router.endpoint", exchange.endpoint_name)
    if request.finish_reasons:
        root.set_attribute("gen_ai.response.finish_reasons", request.finish_reasons)
    if request.response_id is not None:
        root.set_attribute("gen_ai.response.id", request.response_id)
    if request.response_model is not None:
        root.set_attribute("gen_ai.response.model", request.response_model)
    if exchange.status == "failed":
        _error(root, "failed")


def _error(span, kind: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR))
