"""The simulator's /v1/responses with a reasoning parser set: a text answer reasons first, as vLLM's answers do,
with a `reasoning` item before the message, streamed as `response.reasoning_text.delta`/`.done` events in the
item's own output index, and its tokens counted in `output_tokens_details.reasoning_tokens`."""

from __future__ import annotations

import json

import pytest

from .engines import MODEL_NAME, start_engine

REQUEST = {"model": MODEL_NAME, "input": "Why is the sky blue?", "max_output_tokens": 6}
REASONING_KEYS = {"id", "summary", "type", "content", "encrypted_content", "status"}


@pytest.fixture(scope="module")
def reasoning_engine():
    engine = start_engine("sim", "--reasoning-parser", "deepseek_r1", events=False)
    yield engine
    engine.stop()


def events_of(text: str) -> list[dict]:
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]


def test_it_answers_with_a_reasoning_item_before_the_message(reasoning_engine):
    with reasoning_engine.client() as client:
        body = client.post("/v1/responses", json=REQUEST).json()
    reasoning, message = body["output"]
    assert set(reasoning) == REASONING_KEYS
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["summary"] == [] and reasoning["status"] == "completed"
    (part,) = reasoning["content"]
    assert part["type"] == "reasoning_text" and part["text"]
    assert message["type"] == "message" and message["content"][0]["text"]
    usage = body["usage"]
    assert usage["output_tokens"] == 6 and usage["output_tokens_details"]["reasoning_tokens"] == 3
    assert body["status"] == "completed" or body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_it_streams_the_reasoning_before_the_message(reasoning_engine):
    with reasoning_engine.client() as client:
        reply = client.post("/v1/responses", json={**REQUEST, "stream": True})
    events = events_of(reply.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    reasoning_events = [e for e in events if e.get("output_index") == 0]
    message_events = [e for e in events if e.get("output_index") == 1]
    assert [e["type"] for e in reasoning_events][:2] == [
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert reasoning_events[0]["item"] == {
        "id": reasoning_events[0]["item"]["id"],
        "summary": [],
        "type": "reasoning",
        "content": None,
        "encrypted_content": None,
        "status": "in_progress",
    }
    deltas = [e["delta"] for e in reasoning_events if e["type"] == "response.reasoning_text.delta"]
    assert deltas and all(
        set(e) >= {"item_id", "output_index", "content_index", "delta"} for e in reasoning_events[2:-3]
    )
    done = [e["type"] for e in reasoning_events[-3:]]
    assert done == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    assert reasoning_events[-3]["text"] == "".join(deltas)
    assert reasoning_events[-2]["part"] == {"text": "".join(deltas), "type": "reasoning_text"}
    # The message comes after the reasoning item is done.
    assert kinds.index("response.output_text.delta") > kinds.index("response.reasoning_text.done")
    assert message_events[0]["item"]["type"] == "message"
    completed = events[-1]
    assert completed["type"] == "response.completed"
    output = completed["response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0] == reasoning_events[-1]["item"]
    assert output[0]["content"] == [{"text": "".join(deltas), "type": "reasoning_text"}]
    usage = completed["response"]["usage"]
    assert usage["output_tokens"] == 6 and usage["output_tokens_details"]["reasoning_tokens"] == 3


def test_a_forced_tool_call_has_no_reasoning(reasoning_engine):
    """The simulator's tool calls are scripted (the engine has the test engines' tool-call parser too): a call is
    the whole output."""
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {}, "required": []},
    }
    with reasoning_engine.client() as client:
        body = client.post(
            "/v1/responses",
            json={**REQUEST, "max_output_tokens": 200, "tools": [tool], "tool_choice": "required"},
        ).json()
    assert [item["type"] for item in body["output"]] == ["function_call"]
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


def test_without_a_reasoning_parser_there_is_no_reasoning(sim_engine):
    with sim_engine.client() as client:
        body = client.post("/v1/responses", json=REQUEST).json()
    assert [item["type"] for item in body["output"]] == ["message"]
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
