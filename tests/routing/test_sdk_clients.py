"""The official OpenAI and Anthropic SDKs, unchanged, against the running router."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from ..serving.engines import MODEL_NAME


def openai_client(fleet, key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.router.url}/v1", api_key=key or fleet.key.secret, max_retries=0)


def anthropic_client(fleet, key=None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fleet.router.url, api_key=key or fleet.key.secret, max_retries=0)


def test_it_answers_openai_chat_completions(fleet):
    reply = openai_client(fleet).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Refactor this function."}], max_tokens=6
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6 and reply.usage.prompt_tokens > 5


def test_it_streams_openai_chat_completions_without_the_usage_chunk_unless_asked(fleet):
    client = openai_client(fleet)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
    )
    assert all(chunk.usage is None for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []


def test_it_answers_openai_completions_and_lists_models(fleet):
    client = openai_client(fleet)
    completion = client.completions.create(model=MODEL_NAME, prompt="def add(a, b):", max_tokens=4)
    assert completion.usage.completion_tokens == 4
    assert [m.id for m in client.models.list()] == [MODEL_NAME]


def test_it_answers_anthropic_messages_streaming_and_not(fleet):
    client = anthropic_client(fleet)
    message = client.messages.create(
        model=MODEL_NAME, max_tokens=5, messages=[{"role": "user", "content": "Explain this stack trace."}]
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
    with client.messages.stream(
        model=MODEL_NAME, max_tokens=5, system="You are terse.", messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.output_tokens == 5


def test_it_refuses_a_bad_key_in_each_dialect(fleet):
    with pytest.raises(openai.AuthenticationError) as caught:
        openai_client(fleet, key="ipk_nope_nope").chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    assert caught.value.status_code == 401 and "Invalid" in caught.value.message
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic_client(fleet, key="ipk_nope_nope").messages.create(
            model=MODEL_NAME, max_tokens=1, messages=[{"role": "user", "content": "hi"}]
        )
    assert (
        caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "authentication_error"
    )


def test_it_reports_bad_requests_clearly(fleet):
    client = openai_client(fleet)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=100_000
        )
    assert "context" in caught.value.message
    headers = {"authorization": f"Bearer {fleet.key.secret}", "content-type": "application/json"}
    response = httpx.post(f"{fleet.router.url}/v1/chat/completions", content=b"{not json", headers=headers)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    too_many = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}] * 10_001}
    response = httpx.post(f"{fleet.router.url}/v1/chat/completions", json=too_many, headers=headers)
    assert response.status_code == 400 and "Too many messages" in response.json()["error"]["message"]
