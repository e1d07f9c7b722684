"""The arguments a scripted model gives a tool call: its schema's required properties, each with a simple value.

Shared by the simulator and by the logits processor that makes vLLM on random weights call tools
(serving/engine_plugins/tool_calls.py), so both call a tool the same way; `planned_call` is that processor's rule,
on the prompt as the tiny model's template renders it. Standard library only: it runs in the engine's own
environment too.
"""

from __future__ import annotations

import json


def example_arguments(schema) -> dict:
    """A deterministic arguments object for a tool's parameter schema: its required properties, each with a
    simple value of its type (an enum's first value, a const, an array's least number of items)."""
    value = _example(schema if isinstance(schema, dict) else {}, schema, 0)
    return value if isinstance(value, dict) else {}


def _example(schema: dict, root, depth: int):
    if not isinstance(schema, dict) or depth > 16:
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/") and isinstance(root, dict):
        target = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        return _example(target, root, depth + 1) if isinstance(target, dict) else None
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return _example(options[0], root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else None
    if kind == "object":
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        return {
            name: _example(properties.get(name, {}), root, depth + 1)
            for name in required
            if isinstance(name, str)
        }
    if kind == "array":
        count = schema.get("minItems") if isinstance(schema.get("minItems"), int) else 0
        return [_example(schema.get("items", {}), root, depth + 1) for _ in range(count)]
    if kind == "string":
        return "example"
    if kind in ("integer", "number"):
        low = schema.get("minimum")
        return low if isinstance(low, int | float) and not isinstance(low, bool) else 0
    if kind == "boolean":
        return False
    return None


TURN = "<|im_start|>"
TOOLS = "<tools>\n"
# A call the conversation already holds, as the template writes it (its instructions write `{"name": <...`).
CALL_MADE = '<tool_call>\n{"name": "'


def planned_call(prompt: str, limit: int) -> str | None:
    """The text of the call the answer to this rendered prompt makes, or None (the rule at the top)."""
    tools_at = prompt.find(TOOLS)
    if tools_at < 0 or prompt.count(CALL_MADE) >= limit:
        return None
    head = prompt[: prompt.rfind(TURN + "assistant")]
    last = head[head.rfind(TURN) + len(TURN) :]
    if not last.startswith("user\n") or "<tool_response>" in last:
        return None
    line = prompt[tools_at + len(TOOLS) :].split("\n", 1)[0]
    try:
        tool = json.loads(line)
    except json.JSONDecodeError:
        return None
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    call = {"name": function["name"], "arguments": example_arguments(function.get("parameters"))}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
