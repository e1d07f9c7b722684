"""What a trace may hold (routing/server/tracing.py): spans wait in the exporter's queue, so none may grow with what
a client sends. The provider's SpanLimits bound every span's attributes and each string's length; a request's
stop sequences are recorded by their count, never their text; and a request refused at authentication leaves only
the route and its status (not the client's `tracestate`, not a field of its body).
"""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from routing.server import tracing

from ..serving.engines import MODEL_NAME
from .test_tracing import CLIENT_PARENT, CLIENT_TRACE, Receiver, attributes, traced_fleet

# The stop sequences a request may send at most: ROUTER_MAX_STOP_SEQUENCES of them, ROUTER_MAX_STOP_BYTES in all.
STOP = [f"{n:02d}" + "x" * 62 for n in range(64)]


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.close()


def root_of(spans: dict[str, list[Span]]) -> Span:
    (root,) = [s for group in spans.values() for s in group if s.kind == Span.SPAN_KIND_SERVER]
    return root


def assert_small(got: dict, limit: int) -> None:
    """No attribute holds more than `limit` characters, nor a list of more than a few values."""
    for name, value in got.items():
        if isinstance(value, str):
            assert len(value) <= limit, name
        elif isinstance(value, list):
            assert len(value) <= tracing.MAX_FINISH_REASONS, name


def test_the_provider_bounds_what_any_span_holds(settings):
    provider = tracing.tracer_provider(
        1.0,
        "inference-router",
        follow_client=False,
        max_attributes=settings.ROUTER_TRACES_MAX_ATTRIBUTES,
        max_attribute_length=settings.ROUTER_TRACES_MAX_ATTRIBUTE_LENGTH,
    )
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("test").start_as_current_span("chat") as span:
        for n in range(1000):
            span.set_attribute(f"router.field_{n}", "x" * 100_000)
        span.record_exception(ValueError("y" * 100_000))
    provider.shutdown()
    (done,) = exporter.get_finished_spans()
    assert len(done.attributes) == settings.ROUTER_TRACES_MAX_ATTRIBUTES == 64
    assert {len(value) for value in done.attributes.values()} == {settings.ROUTER_TRACES_MAX_ATTRIBUTE_LENGTH}
    (event,) = done.events
    assert max(len(str(value)) for value in event.attributes.values()) <= 256


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": STOP}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "stop_sequences": STOP}),
    ],
    ids=["stop", "stop_sequences"],
)
def test_a_request_s_stop_sequences_are_counted_not_recorded(
    transactional_db, sim_pair, receiver, path, body
):
    fleet = traced_fleet(sim_pair, {"ROUTER_TRACES_ENDPOINT": f"{receiver.url}/v1/traces"}, precise=False)
    try:
        response = httpx.post(
            f"{fleet.router.url}{path}",
            json={"model": MODEL_NAME, "max_tokens": 4, **body},
            headers={"authorization": f"Bearer {fleet.key.secret}", "anthropic-version": "2023-06-01"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        spans = receiver.trace(response.headers["traceparent"].split("-")[1])
    finally:
        fleet.router.stop()
    got = attributes(root_of(spans))
    assert got["router.stop_sequences"] == 64
    assert "gen_ai.request.stop_sequences" not in got
    assert not any(
        "xxxx" in str(value) for group in spans.values() for s in group for value in attributes(s).values()
    )
    assert_small(got, 256)


def test_a_request_refused_at_authentication_leaves_only_its_route_and_status(
    transactional_db, sim_pair, receiver
):
    fleet = traced_fleet(sim_pair, {"ROUTER_TRACES_ENDPOINT": f"{receiver.url}/v1/traces"}, precise=False)
    vendor_state = "vendor=" + "s" * 240
    try:
        response = httpx.post(
            f"{fleet.router.url}/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "stop": STOP},
            headers={
                "authorization": "Bearer ipk_nope_nope",
                "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01",
                "tracestate": vendor_state,
            },
            timeout=60,
        )
        assert response.status_code == 401
        spans = receiver.trace(CLIENT_TRACE)
    finally:
        fleet.router.stop()
    root = root_of(spans)
    assert attributes(root) == {
        "http.request.method": "POST",
        "url.path": "/v1/chat/completions",
        "gen_ai.operation.name": "chat",
        "http.response.status_code": 401,
    }
    assert root.parent_span_id.hex() == CLIENT_PARENT  # the client's trace id and parent, of fixed size
    assert all(s.trace_state == "" for group in spans.values() for s in group)  # not the client's tracestate
