"""The rule by which vLLM on random weights calls tools (serving/engine_plugins/tool_calls.py), on prompts as the
tiny model's template renders them: the simulator's rule, so the agents' sessions make the same calls on both."""

from __future__ import annotations

import json

from routing.rendering.tokenize import RouterTokenizer
from serving.engine_plugins.tool_arguments import planned_call

from .engines import MODEL_DIR

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Run a command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
                "required": ["command"],
            },
        },
    },
    {"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}},
]


def prompt(messages: list[dict], tools: list | None = TOOLS) -> str:
    payload: dict = {"messages": messages}
    if tools:
        payload["tools"] = tools
    tokenizer = RouterTokenizer(MODEL_DIR)
    return tokenizer.render(tokenizer.chat_inputs(payload))


def call(number: int) -> list[dict]:
    """An assistant turn that called Bash, and the tool's result."""
    made = {
        "id": f"c{number}",
        "type": "function",
        "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
    }
    return [
        {"role": "assistant", "content": None, "tool_calls": [made]},
        {"role": "tool", "tool_call_id": f"c{number}", "content": "main.py"},
    ]


def test_a_users_turn_with_tools_gets_a_call_of_the_first_tool_with_its_required_arguments():
    text = planned_call(prompt([{"role": "user", "content": "List the files."}]), limit=2)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    assert json.loads(text.split("\n")[1]) == {"name": "Bash", "arguments": {"command": "example"}}


def test_a_tool_result_a_conversation_without_tools_or_at_its_limit_gets_no_call():
    user = {"role": "user", "content": "List the files."}
    assert planned_call(prompt([user, *call(1)]), limit=2) is None  # the model answers the result
    assert planned_call(prompt([user], tools=None), limit=2) is None
    again = [user, *call(1), {"role": "user", "content": "Again."}]
    assert planned_call(prompt(again), limit=2) is not None
    assert (
        planned_call(prompt([*again, *call(2), {"role": "user", "content": "Once more."}]), limit=2) is None
    )
