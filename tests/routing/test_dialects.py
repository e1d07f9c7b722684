"""The stream relay's fast path: the leading run of ordinary events is passed on whole (less the running usage
the router asked for), and what it counts and keeps matches looking at every event one by one. Then how each
dialect's request becomes a chat template's inputs, as vLLM 0.32 converts it (tests/routing/test_render_parity.py
checks the rendered token ids against vLLM itself)."""

from __future__ import annotations

import orjson
import pytest

from routing.rendering.conversion import (
    RenderError,
    TemplateTraits,
    anthropic_chat_request,
    chat_inputs,
    custom_tool_parameters,
    responses_chat_request,
    responses_function_tools,
    responses_tool_names,
)
from routing.rendering.dialects import ANTHROPIC, OPENAI, RESPONSES

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)


def event(data: dict | str) -> bytes:
    return b"data: " + (data.encode() if isinstance(data, str) else orjson.dumps(data)) + b"\n\n"


def content(text: str) -> bytes:
    return event({"id": "c", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})


USAGE = event({"id": "c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
DONE = event("[DONE]")


def events_of(stream: bytes) -> list[bytes]:
    return [piece for piece in stream[:-2].split(b"\n\n")] if stream else []


def special(dialect, piece: bytes) -> bool:
    return dialect.usage_from_event(piece) is not None or dialect.is_terminal_event(piece)


def running(text: str, prompt: int = 9, completion: int = 1) -> bytes:
    """A content chunk as vLLM streams it with `continuous_usage_stats`: the running usage after `choices`."""
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    if completion % 2:
        usage["prompt_tokens_details"] = {"cached_tokens": prompt - 1}
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return event({**chunk, "usage": usage})


PLAIN = content("a") + content("b") + content("c")
RUNNING = running("a", completion=1) + running('b "usage":{}}', completion=2) + running("}{c", completion=3)
ROLE = event({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})


@pytest.mark.parametrize(
    "events, expected",
    [
        (PLAIN, len(PLAIN)),
        (PLAIN + USAGE + DONE, len(PLAIN)),
        (USAGE + DONE, 0),
        (DONE, 0),
        (ROLE + content("x") + USAGE, len(ROLE + content("x"))),
        # Text that reads like a marker is escaped inside the JSON, so it does not cut the run short...
        (content('"usage" and "choices":[{') + USAGE + DONE, len(content('"usage" and "choices":[{'))),
        # ...except a bare [DONE], which only makes the relay look at the rest one by one.
        (content("a") + content("[DONE]") + USAGE + DONE, len(content("a"))),
        # Chunks with the running usage the router asks for are ordinary: only the final usage is special.
        (RUNNING + USAGE + DONE, len(RUNNING)),
        (ROLE + RUNNING, len(ROLE + RUNNING)),
    ],
)
def test_the_plain_prefix_is_whole_ordinary_events_counted_as_one_by_one(events, expected):
    plain = OPENAI.plain_prefix(events)
    assert plain == expected
    head = events_of(events[:plain])
    assert b"\n\n".join(head) + (b"\n\n" if head else b"") == events[:plain]  # whole events
    assert not any(special(OPENAI, piece) for piece in head)
    assert events[:plain].count(OPENAI.CONTENT_MARKER) == sum(OPENAI.is_content_event(p) for p in head)


def test_the_usage_event_and_the_end_are_never_in_the_plain_prefix():
    events = content("a") + USAGE + DONE
    assert events[OPENAI.plain_prefix(events) :] == USAGE + DONE


def named(name: str, data: dict) -> bytes:
    """An Anthropic or Responses stream event as vLLM writes it."""
    return f"event: {name}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"


def delta(text: str) -> bytes:
    return named(
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
    )


START = named(
    "message_start",
    {"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 40, "output_tokens": 0}}},
)
BLOCK = named(
    "content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}}
)
DELTAS = delta("a") + delta("event: content_block_delta\n and }") + delta("c")
STOP = named("content_block_stop", {"type": "content_block_stop", "index": 0})
ENDING = named("message_delta", {"type": "message_delta", "usage": {"output_tokens": 3}}) + named(
    "message_stop", {"type": "message_stop"}
)


def anthropic_special(piece: bytes) -> bool:
    return (
        ANTHROPIC.usage_from_event(piece) is not None
        or ANTHROPIC.prompt_from_event(piece) is not None
        or ANTHROPIC.is_terminal_event(piece)
    )


@pytest.mark.parametrize(
    "events, expected",
    [
        (START + BLOCK + DELTAS, 0),  # message_start carries the prompt's count
        (BLOCK + DELTAS, len(BLOCK + DELTAS)),
        (DELTAS + STOP + ENDING, len(DELTAS + STOP)),  # message_delta carries the usage, message_stop ends
        (ENDING, 0),
        # Text that reads like the special marker only makes the relay look at the rest one by one.
        (delta("a") + delta("event: message_stop") + DELTAS, len(delta("a"))),
    ],
)
def test_anthropic_events_before_the_message_events_pass_whole_counted_as_one_by_one(events, expected):
    plain = ANTHROPIC.plain_prefix(events)
    assert plain == expected
    head = events_of(events[:plain])
    assert not any(anthropic_special(piece) for piece in head)
    assert events[:plain].count(ANTHROPIC.CONTENT_MARKER) == sum(ANTHROPIC.is_content_event(p) for p in head)
    rest = events_of(events[plain:])
    assert not rest or anthropic_special(rest[0]) or b"event: message_" in rest[0]


@pytest.mark.parametrize(
    "event, stripped",
    [
        (
            b'data: {"choices":[{"delta":{"content":"a}"}}],"usage":{"prompt_tokens":5,"completion_tokens":1}}',
            b'data: {"choices":[{"delta":{"content":"a}"}}]}',
        ),
        (  # counts nested in objects of counts
            b'data: {"choices":[{}],"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":4},'
            b'"completion_tokens":1},"extra":1}',
            b'data: {"choices":[{}],"extra":1}',
        ),
        (b'data: {"choices":[{"delta":{}}]}', b'data: {"choices":[{"delta":{}}]}'),  # none to take out
        (
            b'data: {"choices":[{}],"usage":{"prompt_tokens":5',
            b'data: {"choices":[{}],"usage":{"prompt_tokens":5',
        ),
    ],
)
def test_the_running_usage_the_router_asked_for_is_taken_out_of_a_chunk(event, stripped):
    assert OPENAI.without_running_usage(event) == stripped


@pytest.mark.parametrize("run", [RUNNING, ROLE + RUNNING + PLAIN, PLAIN, running("x" * 3000, 200_000, 317)])
def test_the_running_usage_is_taken_out_of_a_whole_run_as_out_of_each_chunk(run):
    assert OPENAI.plain_prefix(run) == len(run)
    each = [OPENAI.without_running_usage(piece) for piece in events_of(run)]
    assert OPENAI.without_running_usage(run) == b"\n\n".join(each) + b"\n\n"
    assert b'"usage"' not in b"".join(each).replace(
        b'\\"usage\\"', b""
    )  # only the text's escaped one is left
    # The engine's count of the prompt, read from the run as from the first chunk that carries it.
    counts = [OPENAI.prompt_from_event(piece) for piece in events_of(run)]
    assert OPENAI.prompt_from_event(run) == next((c for c in counts if c is not None), None)


def test_responses_events_before_the_completed_response_pass_whole_counted_as_one_by_one():
    text = [
        named("response.output_text.delta", {"type": "response.output_text.delta", "delta": d})
        for d in ("a", "response.completed", "c")
    ]
    created = named("response.created", {"type": "response.created", "response": {"id": "r"}})
    completed = named(
        "response.completed",
        {"type": "response.completed", "response": {"usage": {"input_tokens": 5, "output_tokens": 3}}},
    )
    events = created + text[0] + text[2] + completed
    plain = RESPONSES.plain_prefix(events)
    assert events[plain:] == completed and RESPONSES.usage_from_event(completed[:-2]).output_tokens == 3
    head = events_of(events[:plain])
    assert (
        events[:plain].count(RESPONSES.CONTENT_MARKER)
        == sum(RESPONSES.is_content_event(p) for p in head)
        == 2
    )
    # A text that reads like the marker only makes the relay look at the rest one by one.
    assert RESPONSES.plain_prefix(text[0] + text[1] + completed) == len(text[0])


# --- Request conversion: what the agents send, as vLLM 0.32 converts it ------------------------------------

CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "parameters": {"type": "object"}, "strict": False},
    {
        "type": "namespace",
        "name": "mcp__docs",
        "description": "Tools of the docs server.",
        "tools": [
            {"type": "function", "name": "search", "description": "Search.", "defer_loading": True},
            {"type": "custom", "name": "raw"},
        ],
    },
    {"type": "custom", "name": "apply_patch", "description": "Edit files.", "format": {"type": "text"}},
    {"type": "web_search", "external_web_access": False},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
]


def test_namespace_functions_are_shown_by_flat_names_and_hosted_tools_not_at_all():
    tools = responses_function_tools(CODEX_TOOLS)
    assert [tool["function"]["name"] for tool in tools] == [
        "exec_command",
        "mcp__docs__search",
        "apply_patch",
    ]
    assert tools[1]["function"] == {
        "name": "mcp__docs__search",
        "description": "Search.",
        "parameters": None,
        "defer_loading": True,
    }
    # A custom tool is a function of one string; the namespace's own description is not shown.
    assert tools[2]["function"]["parameters"] == custom_tool_parameters()
    assert "Tools of the docs server." not in orjson.dumps(tools).decode()


def test_a_request_with_only_hosted_tools_shows_an_empty_list_of_tools():
    request = responses_chat_request({"input": "hi", "tools": [{"type": "web_search"}]})
    assert request["tools"] == []
    assert "tools" not in responses_chat_request({"input": "hi", "tools": []})


def test_namespaced_and_custom_tool_calls_join_the_assistant_turn_of_their_reasoning():
    request = responses_chat_request(
        {
            "input": [
                {"role": "user", "content": "go"},
                {"type": "reasoning", "summary": [], "encrypted_content": None},
                {
                    "type": "function_call",
                    "namespace": "mcp__docs",
                    "name": "search",
                    "arguments": "{}",
                    "call_id": "a",
                },
                {
                    "type": "custom_tool_call",
                    "name": "apply_patch",
                    "input": "*** Begin Patch é",
                    "call_id": "b",
                },
                {"type": "function_call_output", "call_id": "a", "output": "found"},
                {"type": "custom_tool_call_output", "call_id": "b", "output": "done"},
            ]
        }
    )
    user, assistant, *results = request["messages"]
    assert assistant["reasoning"] == ""
    assert [call["function"]["name"] for call in assistant["tool_calls"]] == [
        "mcp__docs__search",
        "apply_patch",
    ]
    assert assistant["tool_calls"][1]["function"]["arguments"] == '{"input": "*** Begin Patch é"}'
    assert results == [
        {"role": "tool", "content": "found", "tool_call_id": "a"},
        {"role": "tool", "content": "done", "tool_call_id": "b"},
    ]


def test_the_flat_names_lead_back_to_name_and_namespace():
    assert responses_tool_names(CODEX_TOOLS) == {"mcp__docs__search": ("search", "mcp__docs")}
    assert responses_tool_names(None) == {}


@pytest.mark.parametrize(
    "reasoning, text",
    [
        ({"summary": [{"type": "summary_text", "text": "s"}], "encrypted_content": None}, "s"),
        ({"summary": [{"type": "summary_text", "text": "s"}], "encrypted_content": ""}, "s"),
        (
            {
                "summary": [{"type": "summary_text", "text": "s"}],
                "content": [{"type": "reasoning_text", "text": "c"}],
            },
            "c",
        ),
        ({"summary": []}, ""),
    ],
)
def test_reasoning_items_without_encrypted_content_render_their_content_else_their_summary(reasoning, text):
    request = responses_chat_request(
        {"input": [{"role": "user", "content": "hi"}, {"type": "reasoning", **reasoning}]}
    )
    assert request["messages"][-1] == {"role": "assistant", "reasoning": text}


@pytest.mark.parametrize(
    "payload, reason, param",
    [
        # vLLM answers 400 to both; the router's refusal says the same thing.
        (
            {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}]},
            "encrypted_reasoning",
            "input",
        ),
        (
            {
                "input": "x",
                "tools": [{"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "lark"}}],
            },
            "custom_tool_grammar",
            "tools",
        ),
    ],
)
def test_what_the_engine_refuses_is_refused_with_its_reason(payload, reason, param):
    with pytest.raises(RenderError) as caught:
        responses_chat_request(payload)
    assert (caught.value.reason, caught.value.param) == (reason, param)


def test_the_engines_own_template_variables_override_the_requests_in_the_responses_api():
    request = responses_chat_request(
        {
            "input": [{"type": "message", "role": "user", "content": "a", "status": "in_progress"}],
            "reasoning": {"effort": "low"},
            "chat_template_kwargs": {"reasoning_effort": "high", "add_generation_prompt": True, "x": 1},
        }
    )
    inputs = chat_inputs(request)
    assert inputs.kwargs == {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "reasoning_effort": "low",
        "enable_thinking": True,
        "x": 1,
    }


def test_anthropic_tool_changes_in_system_messages_leave_the_tools_in_effect_at_the_end():
    request = anthropic_chat_request(
        {
            "tools": [
                {"name": "a", "input_schema": {"type": "object"}, "defer_loading": True},
                {"name": "b", "input_schema": {"properties": {}}},
            ],
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "system",
                    "content": [
                        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}},
                        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "b"}},
                        {
                            "type": "tool_addition",
                            "tool": {
                                "type": "tool_definition",
                                "definition": {"name": "c", "input_schema": {}},
                            },
                        },
                    ],
                },
            ],
        }
    )
    assert [tool["function"] for tool in request["tools"]] == [
        {"name": "a", "description": None, "parameters": {"type": "object"}},  # no longer deferred
        {"name": "c", "description": None, "parameters": {"type": "object"}},  # a schema's default type
    ]
    with pytest.raises(RenderError):
        anthropic_chat_request(
            {
                "messages": [
                    {
                        "role": "system",
                        "content": [
                            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "z"}}
                        ],
                    }
                ]
            }
        )


def test_a_tool_result_naming_deferred_tools_adds_a_tool_message_of_references():
    request = anthropic_chat_request(
        {
            "messages": [
                {"role": "user", "content": "find"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "ToolSearch", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [
                                {"type": "text", "text": "found"},
                                {"type": "tool_reference", "tool_name": "Grep"},
                            ],
                        }
                    ],
                },
            ]
        }
    )
    assert request["messages"][-2:] == [
        {"role": "tool", "tool_call_id": "t", "content": "found"},
        {"role": "tool", "tool_call_id": "t", "content": [{"type": "tool_reference", "name": "Grep"}]},
    ]
    # A template that takes content as a string sees the names; one that loops over parts, the parts.
    assert chat_inputs(request).messages[-1]["content"] == "Grep"
    parts = chat_inputs(request, TemplateTraits(content_format="openai")).messages[-1]["content"]
    assert parts == [{"type": "tool_reference", "name": "Grep"}]


def test_empty_text_parts_are_dropped_before_the_rest_are_joined():
    request = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, "b"]}
        ]
    }
    assert chat_inputs(request).messages[0]["content"] == "a\nb"
