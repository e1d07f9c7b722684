"""The router's OpenTelemetry traces (routing/server/tracing.py), exported to a real OTLP/HTTP receiver run here.

A real router process in front of the simulator engines; the receiver decodes each export with
opentelemetry-proto's classes. Checked: the span tree of a streamed and of an unstreamed request (names, parents,
the GenAI attributes, token counts equal to the usage event's), the traceparent the engine receives (the simulator
records it) and the one the client gets back, the operator's sampling whatever a client's traceparent asks (unless
the operator follows clients), and nothing at all when off.
"""

from __future__ import annotations

import gzip
import http.server
import os
import threading
import time

import httpx
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from routing.models import RoutingPolicy
from serving.engine_command import EnginePorts, render_engine_command
from serving.models import ModelDeployment, Pool
from serving.orchestrators.kube_render import engine_args

from ..serving.engines import MODEL_NAME
from .conftest import make_fleet, start_router
from .test_engine_errors import HostileEngine
from .usage import usage_events

CHAT = [{"role": "system", "content": "You review code. " * 40}, {"role": "user", "content": "Review f()."}]
# A client's own trace context.
CLIENT_TRACE = "5f1c0a9e3b7d4c2a8e6f0b1d3c5a7e9f"
CLIENT_PARENT = "a1b2c3d4e5f60718"


class Receiver:
    """An OTLP/HTTP collector: POST /v1/traces, protobuf bodies, every span kept."""

    def __init__(self):
        self.spans: list[Span] = []
        self.posts = 0
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                export = ExportTraceServiceRequest()
                export.ParseFromString(body)
                receiver.posts += 1
                assert self.path == "/v1/traces"
                for resource in export.resource_spans:
                    for scope in resource.scope_spans:
                        receiver.spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def trace(self, trace_id: str, timeout: float = 10) -> dict[str, list[Span]]:
        """The spans of one trace by name, once its root (the last to end) has come."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = [s for s in self.spans if s.trace_id.hex() == trace_id]
            if any(s.kind == Span.SPAN_KIND_SERVER for s in spans):
                time.sleep(0.3)  # a settlement shielded from the client's end may come in the next batch
                by_name: dict[str, list[Span]] = {}
                for span in (s for s in self.spans if s.trace_id.hex() == trace_id):
                    by_name.setdefault(span.name, []).append(span)
                return by_name
            time.sleep(0.05)
        raise AssertionError(f"no root span of trace {trace_id}; got {[s.name for s in self.spans]}")

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.close()


def traced_fleet(sim_pair, env: dict, precise: bool = True):
    router = start_router({"OTEL_BSP_SCHEDULE_DELAY": "50", **env})
    fleet = make_fleet(router, sim_pair)
    if precise:
        RoutingPolicy.objects.create(deployment=fleet.deployment, mode="precise")
        fleet.sync()
    return fleet


def chat(fleet, stream: bool, headers: dict | None = None) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 6, "temperature": 0.5}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    response = httpx.post(
        f"{fleet.router.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {fleet.key.secret}", **(headers or {})},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response


def sampled(flags: str) -> bool:
    """W3C trace flags: bit 0 says sampled (bit 1, the trace id's randomness, is set by the SDK too)."""
    return bool(int(flags, 16) & 1)


def attributes(span: Span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = (
            list(v.string_value for v in value.array_value.values)
            if kind == "array_value"
            else (getattr(value, kind))
        )
    return out


def engine_traceparents(fleet) -> list[dict]:
    seen = []
    for engine in fleet.engines:
        seen += httpx.get(f"{engine.url}/debug/traceparents", timeout=5).json()
    return seen


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unstreamed"])
def test_it_traces_a_request_through_the_router_into_the_engine(transactional_db, sim_pair, receiver, stream):
    fleet = traced_fleet(sim_pair, {"ROUTER_TRACES_ENDPOINT": f"{receiver.url}/v1/traces"})
    try:
        response = chat(fleet, stream)
        version, trace_id, root_id, flags = response.headers["traceparent"].split("-")
        assert version == "00" and sampled(flags)
        spans = receiver.trace(trace_id)
    finally:
        fleet.router.stop()

    (root,) = [s for s in spans[f"chat {MODEL_NAME}"] if s.kind == Span.SPAN_KIND_SERVER]
    assert root.span_id.hex() == root_id and root.parent_span_id == b""
    (attempt,) = [s for s in spans[f"chat {MODEL_NAME}"] if s.kind == Span.SPAN_KIND_CLIENT]
    for name in ("router.authenticate", "router.admit", "router.place", "router.flow_wait", "router.pick"):
        (span,) = spans[name]
        assert span.parent_span_id == root.span_id, name
    assert attempt.parent_span_id == root.span_id
    (place,) = spans["router.place"]
    (tokenize,) = spans["router.render_tokenize"]
    (lookup,) = spans["router.index_lookup"]
    assert tokenize.parent_span_id == place.span_id and lookup.parent_span_id == place.span_id
    (first,) = spans["router.first_token"]
    assert first.parent_span_id == attempt.span_id
    assert first.start_time_unix_nano == attempt.start_time_unix_nano <= first.end_time_unix_nano
    (settle,) = spans["router.settle"]
    assert settle.parent_span_id in (root.span_id, attempt.span_id)
    for span in (s for group in spans.values() for s in group if s is not root):
        assert root.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
        assert span.end_time_unix_nano <= root.end_time_unix_nano

    # The GenAI conventions' attributes, the usage exactly as metered.
    (event,) = usage_events([response.headers["x-request-id"]], wait_for=1)
    got = attributes(root)
    assert got["gen_ai.operation.name"] == "chat"
    assert got["gen_ai.request.model"] == MODEL_NAME
    assert got["gen_ai.request.max_tokens"] == 6 and got["gen_ai.request.temperature"] == 0.5
    assert got["gen_ai.usage.input_tokens"] == event.prompt_tokens > 100
    assert got["gen_ai.usage.output_tokens"] == event.output_tokens > 0
    assert got["gen_ai.usage.cache_read.input_tokens"] == event.cached_prompt_tokens
    assert got["gen_ai.response.finish_reasons"] in (["length"], ["stop"])
    assert got["gen_ai.response.id"].startswith("chatcmpl-") and got["gen_ai.response.model"] == MODEL_NAME
    assert got["http.response.status_code"] == 200
    assert got["router.request_id"] == response.headers["x-request-id"]
    assert got["router.stream"] is stream
    engine_attrs = attributes(attempt)
    assert engine_attrs["gen_ai.request.model"] == MODEL_NAME
    assert engine_attrs["server.address"] == "127.0.0.1"
    assert engine_attrs["http.response.status_code"] == 200
    assert f"http://127.0.0.1:{engine_attrs['server.port']}" == event.endpoint

    # The engine was sent the attempt's context: the same trace, the attempt as parent, sampled.
    (sent,) = [t for t in engine_traceparents(fleet) if t["request_id"] == response.headers["x-request-id"]]
    _, sent_trace, sent_parent, sent_flags = sent["traceparent"].split("-")
    assert (sent_trace, sent_parent) == (trace_id, attempt.span_id.hex()) and sampled(sent_flags)


def test_it_samples_nothing_at_ratio_zero_even_for_a_client_that_asks(transactional_db, sim_pair, receiver):
    fleet = traced_fleet(
        sim_pair,
        {"ROUTER_TRACES_ENDPOINT": f"{receiver.url}/v1/traces", "ROUTER_TRACES_SAMPLE_RATIO": "0"},
        precise=False,
    )
    try:
        unsampled = [chat(fleet, stream) for stream in (True, False)]
        # A client's sampled flag does not decide (an anonymous one could otherwise have traces exported).
        asked = chat(fleet, True, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"})
        time.sleep(1.0)  # five export periods
        assert receiver.spans == [] and receiver.posts == 0
        # Not sampled, still propagated: the client and the engine get the same trace id, flagged unsampled.
        for response in [*unsampled, asked]:
            _, trace_id, _, flags = response.headers["traceparent"].split("-")
            assert not sampled(flags)
            (sent,) = [
                t for t in engine_traceparents(fleet) if t["request_id"] == response.headers["x-request-id"]
            ]
            _, sent_trace, _, sent_flags = sent["traceparent"].split("-")
            assert sent_trace == trace_id and not sampled(sent_flags)
        assert asked.headers["traceparent"].split("-")[1] == CLIENT_TRACE  # the client's trace, continued
    finally:
        fleet.router.stop()


def test_it_traces_a_client_that_asks_not_to_be_at_ratio_one(transactional_db, sim_pair, receiver):
    fleet = traced_fleet(sim_pair, {"ROUTER_TRACES_ENDPOINT": f"{receiver.url}/v1/traces"}, precise=False)
    try:
        response = chat(fleet, True, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-00"})
        _, trace_id, _, flags = response.headers["traceparent"].split("-")
        assert trace_id == CLIENT_TRACE and sampled(flags)
        spans = receiver.trace(CLIENT_TRACE)
    finally:
        fleet.router.stop()
    (root,) = [s for s in spans[f"chat {MODEL_NAME}"] if s.kind == Span.SPAN_KIND_SERVER]
    assert root.parent_span_id.hex() == CLIENT_PARENT  # under the client's own span
    assert "router.admit" in spans and "router.pick" in spans


def traced_with(fleet, trace_id: str, flag: str) -> bool:
    """Whether the router sampled a request sent under the client's `trace_id` with its sampled `flag`."""
    parent = os.urandom(8).hex()
    response = chat(fleet, False, {"traceparent": f"00-{trace_id}-{parent}-{flag}"})
    _, continued, _, flags = response.headers["traceparent"].split("-")
    assert continued == trace_id
    return sampled(flags)


def test_a_client_s_trace_id_does_not_choose_its_sampling(transactional_db, sim_pair, receiver):
    """At ratio 0.5, the trace ids whose low half TraceIdRatioBased would always keep (0), or always drop (all
    ones), are kept about half the time each: the router draws for them."""
    fleet = traced_fleet(
        sim_pair,
        {"ROUTER_TRACES_ENDPOINT": f"{receiver.url}/v1/traces", "ROUTER_TRACES_SAMPLE_RATIO": "0.5"},
        precise=False,
    )
    try:
        kept_low = [traced_with(fleet, f"{n + 1:016x}{0:016x}", "01") for n in range(16)]
        kept_high = [traced_with(fleet, f"{n + 1:016x}{'f' * 16}", "00") for n in range(16)]
    finally:
        fleet.router.stop()
    # Each fails by chance once in 65,536 runs.
    assert not all(kept_low) and any(kept_high), (kept_low, kept_high)


def test_it_follows_a_client_s_flag_where_the_operator_says_so(transactional_db, sim_pair, receiver):
    fleet = traced_fleet(
        sim_pair,
        {
            "ROUTER_TRACES_ENDPOINT": f"{receiver.url}/v1/traces",
            "ROUTER_TRACES_SAMPLE_RATIO": "0.5",
            "ROUTER_TRACES_FOLLOW_CLIENT_SAMPLING": "true",
        },
        precise=False,
    )
    try:
        asked = [traced_with(fleet, f"{n + 1:016x}{'f' * 16}", "01") for n in range(8)]
        declined = [traced_with(fleet, f"{n + 1:016x}{0:016x}", "00") for n in range(8)]
        response = chat(fleet, True, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"})
        spans = receiver.trace(CLIENT_TRACE)
    finally:
        fleet.router.stop()
    assert all(asked) and not any(declined)
    assert sampled(response.headers["traceparent"].split("-")[3])
    (root,) = [s for s in spans[f"chat {MODEL_NAME}"] if s.kind == Span.SPAN_KIND_SERVER]
    assert root.parent_span_id.hex() == CLIENT_PARENT


def test_it_exports_and_propagates_nothing_when_off(transactional_db, sim_pair, receiver):
    # The standard endpoint variable is set, and the standard switch turns the SDK off.
    fleet = traced_fleet(
        sim_pair, {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_SDK_DISABLED": "true"}, precise=False
    )
    try:
        responses = [
            chat(fleet, stream, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"})
            for stream in (True, False)
        ]
        time.sleep(1.0)
    finally:
        fleet.router.stop()
    assert receiver.posts == 0 and receiver.spans == []
    for response in responses:
        assert "traceparent" not in response.headers
        ids = {t["request_id"] for t in engine_traceparents(fleet)}
        assert response.headers["x-request-id"] not in ids  # the client's own context is not passed on either


def test_it_names_each_route_s_operation_and_reads_its_dialect_s_finish_reason(
    transactional_db, sim_pair, receiver
):
    fleet = traced_fleet(sim_pair, {"ROUTER_TRACES_ENDPOINT": f"{receiver.url}/v1/traces"}, precise=False)
    auth = {"authorization": f"Bearer {fleet.key.secret}"}
    try:
        messages = httpx.post(
            f"{fleet.router.url}/v1/messages",
            json={"model": MODEL_NAME, "messages": CHAT[1:], "max_tokens": 3, "stream": True},
            headers={**auth, "anthropic-version": "2023-06-01"},
            timeout=60,
        )
        completion = httpx.post(
            f"{fleet.router.url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": "def f():", "max_tokens": 3},
            headers=auth,
            timeout=60,
        )
        assert messages.status_code == completion.status_code == 200
        traces = [receiver.trace(r.headers["traceparent"].split("-")[1]) for r in (messages, completion)]
    finally:
        fleet.router.stop()
    for response, spans, operation in zip(
        (messages, completion), traces, ("chat", "text_completion"), strict=True
    ):
        (root,) = [s for s in spans[f"{operation} {MODEL_NAME}"] if s.kind == Span.SPAN_KIND_SERVER]
        (event,) = usage_events([response.headers["x-request-id"]], wait_for=1)
        got = attributes(root)
        assert got["gen_ai.operation.name"] == operation
        assert (got["gen_ai.usage.input_tokens"], got["gen_ai.usage.output_tokens"]) == (
            event.prompt_tokens,
            event.output_tokens,
        )
        assert got["gen_ai.request.max_tokens"] == 3
    (root,) = [s for s in traces[0][f"chat {MODEL_NAME}"] if s.kind == Span.SPAN_KIND_SERVER]
    got = attributes(root)
    assert got["gen_ai.response.finish_reasons"] == ["max_tokens"]  # Anthropic's stop_reason
    assert got["gen_ai.response.id"] and got["gen_ai.response.model"] == MODEL_NAME


def test_vllm_engines_export_their_spans_where_the_settings_say(settings):
    """vLLM's --otlp-traces-endpoint, locally and in the pods, before the pool's own extra args; the simulator
    takes no such flag."""
    settings.ENGINE_TRACES_ENDPOINT = "http://otel-collector.monitoring:4317"
    pool = Pool(name="main", max_num_seqs=8, extra_engine_args=["--seed", "7"])
    ports = EnginePorts(http=8100, kv_events=5557)
    vllm = ModelDeployment(name="m", served_model_name="m", model_source="org/m", engine_kind="vllm")
    for argv in (
        render_engine_command(deployment=vllm, pool=pool, ports=ports).argv,
        engine_args(vllm, pool)[0],
    ):
        at = argv.index("--otlp-traces-endpoint")
        assert argv[at + 1] == "http://otel-collector.monitoring:4317" and argv[-2:] == ["--seed", "7"]
    sim = ModelDeployment(name="s", served_model_name="s", model_source="org/s", engine_kind="sim")
    assert "--otlp-traces-endpoint" not in render_engine_command(deployment=sim, pool=pool, ports=ports).argv
    settings.ENGINE_TRACES_ENDPOINT = ""
    assert "--otlp-traces-endpoint" not in render_engine_command(deployment=vllm, pool=pool, ports=ports).argv


def test_each_engine_attempt_is_a_span_of_its_own(transactional_db, sim_pair, receiver):
    """An engine that answers 503 is left for another: two client spans, the first in error, each engine sent
    its own attempt's context."""
    sent_to_broken: list[str] = []

    async def unavailable(request):
        sent_to_broken.append(request.headers["traceparent"])
        return web.json_response({"error": {"message": "busy"}}, status=503)

    broken = HostileEngine({"/v1/chat/completions": unavailable})
    router = start_router(
        {"OTEL_BSP_SCHEDULE_DELAY": "50", "ROUTER_TRACES_ENDPOINT": f"{receiver.url}/v1/traces"}
    )
    try:
        fleet = make_fleet(router, [broken, sim_pair[0]])
        for _ in range(4):  # round-robin: one of the first two starts on the broken engine
            response = chat(fleet, stream=True)
            spans = receiver.trace(response.headers["traceparent"].split("-")[1])
            attempts = [s for s in spans[f"chat {MODEL_NAME}"] if s.kind == Span.SPAN_KIND_CLIENT]
            if len(attempts) == 2:
                break
    finally:
        router.stop()
    first, second = sorted(attempts, key=lambda s: s.start_time_unix_nano)
    assert [attributes(s)["router.attempt"] for s in (first, second)] == [1, 2]
    assert attributes(first)["http.response.status_code"] == 503
    assert first.status.code == Status.STATUS_CODE_ERROR and second.status.code != Status.STATUS_CODE_ERROR
    assert sent_to_broken[-1].split("-")[2] == first.span_id.hex()
    seen = httpx.get(f"{sim_pair[0].url}/debug/traceparents", timeout=5).json()
    (sent,) = [t for t in seen if t["request_id"] == response.headers["x-request-id"]]
    assert sent["traceparent"].split("-")[2] == second.span_id.hex()
    assert len(spans["router.pick"]) == 2
    (root,) = [s for s in spans[f"chat {MODEL_NAME}"] if s.kind == Span.SPAN_KIND_SERVER]
    assert attributes(root)["http.response.status_code"] == 200
