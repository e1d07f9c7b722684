"""The Responses API (/v1/responses) as vLLM 0.32 serves it: its request checks (entrypoints/openai/responses/
protocol.py, ResponsesRequest's validators; serving.py, _create_responses), the request as the chat request it
renders as (utils.py, construct_input_messages and construct_tool_dicts; tool_parsers/utils.py,
get_function_tools), and the Response object and stream events it answers with (protocol.py,
ResponsesResponse.from_request; streaming_events.py, the simple streaming processor).

Over 400 lines: one API as vLLM serves it: its checks, its conversion and its events follow the same
source files and change together."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from routing.rendering.conversion import CUSTOM_TOOL_INPUT, flat_tool_name, responses_tool_names

from .errors import ApiError, invalid, literal_problem, problem, validation_error

INCLUDABLE = (
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
)
NO_STORE = (
    "This vLLM engine does not support `store=True` and therefore does not support the background mode. To "
    "enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching "
    "the vLLM server."
)
# The fields vLLM's Response echoes for the tools it parsed (the OpenAI SDK's models, dumped with their nulls).
TOOL_FIELDS = {
    "function": (
        "name",
        "parameters",
        "strict",
        "type",
        "allowed_callers",
        "async",
        "defer_loading",
        "description",
        "output_schema",
    ),
    "namespace": ("description", "name", "tools", "type"),
    "web_search": ("type", "external_web_access", "filters", "search_context_size", "user_location"),
}
REASONING_FIELDS = ("context", "effort", "generate_summary", "mode", "summary")
# The tool types the request model knows (the OpenAI SDK's Tool union, as vLLM 0.32 pins it).
TOOL_TYPES = frozenset(
    {
        "function",
        "file_search",
        "computer",
        "computer_use_preview",
        "web_search",
        "web_search_2025_08_26",
        "mcp",
        "code_interpreter",
        "programmatic_tool_calling",
        "image_generation",
        "local_shell",
        "shell",
        "custom",
        "namespace",
        "tool_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "apply_patch",
    }
)
# The input item types the simulator renders (those vLLM's conversion takes, besides plain messages).
ITEM_TYPES = frozenset(
    {
        "message",
        "function_call",
        "function_call_output",
        "custom_tool_call",
        "custom_tool_call_output",
        "reasoning",
    }
)


@dataclass
class ResponsesCall:
    """A checked Responses request: the chat request it renders as, and what its answer needs."""

    body: dict  # rendered by routing.rendering.conversion.responses_chat_request, as the router renders it
    tool_choice: object  # as the Response echoes it
    plan_choice: object  # the same in chat-completions form, for the simulator's tool-call rule
    tool_names: dict[str, tuple[str, str | None]] = field(
        default_factory=dict
    )  # flat name: (name, namespace)
    custom_tools: frozenset[str] = frozenset()

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def check_request(body: dict) -> ResponsesCall:
    """The request model's checks, in their words; the request as the chat request it renders as."""
    if body.get("background") and not body.get("store", True):
        raise invalid("background can only be used when `store` is true", "background")
    if body.get("prompt") is not None:
        raise invalid("prompt template is not supported", "prompt")
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else []:
        fmt = tool.get("format") if isinstance(tool, dict) else None
        if tool.get("type") == "custom" and isinstance(fmt, dict) and fmt.get("type") == "grammar":
            raise invalid(
                "Custom tools with a grammar format are not supported; only free-form text custom tools are "
                "accepted.",
                "tools",
            )
    choice = _tool_choice(body)
    # The request model's validators run on the body as the one before them left it (tool_choice set).
    _check_fields({**body, "tool_choice": choice} if "tool_choice" in body or choice == "none" else body)
    return ResponsesCall(
        body=body,
        tool_choice=choice,
        plan_choice=_plan_choice(choice),
        tool_names=responses_tool_names(body.get("tools")),
        custom_tools=frozenset(
            tool["name"] for tool in body.get("tools") or [] if tool.get("type") == "custom"
        ),
    )


def check_serving(body: dict) -> None:
    """The endpoint's own checks, after the model's: this engine stores nothing (vLLM's default, without
    VLLM_ENABLE_RESPONSES_API_STORE), so background mode is refused and no previous response is ever found."""
    if body.get("store", True) and body.get("background"):
        raise ApiError(400, NO_STORE, "invalid_request_error", "background")
    previous = body.get("previous_response_id")
    if previous is not None:
        raise not_found(previous)


def not_found(response_id: str) -> ApiError:
    return ApiError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id"
    )


def _check_fields(body: dict) -> None:
    """The field types the request model checks that an agent is likely to get wrong."""
    problems = []
    source = body.get("input")
    if "input" not in body:
        problems.append(problem("missing", "body.input", "Field required", body))
    elif not isinstance(source, str | list):
        problems.append(problem("string_type", "body.input", "Input should be a valid string", source))
        problems.append(problem("list_type", "body.input", "Input should be a valid list", source))
    elif isinstance(source, list) and any(
        not isinstance(item, dict) or ("role" not in item and item.get("type") not in ITEM_TYPES)
        for item in source
    ):
        # pydantic tries each item type of the union and reports every miss; the first is the string's.
        problems.append(problem("string_type", "body.input", "Input should be a valid string", source))
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if isinstance(value, str):
            message = "Input should be a valid number, unable to parse string as a number"
            problems.append(problem("float_parsing", f"body.{name}", message, value))
        elif value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            problems.append(problem("float_type", f"body.{name}", "Input should be a valid number", value))
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            problems.append(problem("list_type", "body.include", "Input should be a valid list", include))
        else:
            problems += [
                literal_problem(f"body.include.{i}", item, INCLUDABLE)
                for i, item in enumerate(include)
                if item not in INCLUDABLE
            ]
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        problems.append(problem("list_type", "body.tools", "Input should be a valid list", tools))
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if not isinstance(tool, dict) or tool.get("type") not in TOOL_TYPES:
            kind = tool.get("type") if isinstance(tool, dict) else None
            expected = ", ".join(f"'{t}'" for t in sorted(TOOL_TYPES))
            message = (
                f"Input tag '{kind}' found using 'type' does not match any of the expected tags: {expected}"
            )
            problems.append(problem("union_tag_invalid", f"body.tools.{i}", message, tool))
        elif tool["type"] in ("function", "custom", "namespace") and not isinstance(tool.get("name"), str):
            problems.append(problem("missing", f"body.tools.{i}.name", "Field required", tool))
    choice = body.get("tool_choice")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        problems.append(literal_problem("body.tool_choice", choice, ("none", "auto", "required")))
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        problems.append(problem("dict_type", "body.metadata", "Input should be a valid dictionary", metadata))
    if problems:
        raise validation_error(problems)


def _tool_choice(body: dict):
    """tool_choice after the request model's check_tool_usage: "none" when there are no tools, a named tool
    found by its flat name or by its name inside one namespace."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto")
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not (isinstance(tools, list) and tools):
        if choice in ("auto", "none"):
            return "none"
        if choice == "required":
            raise invalid("Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice")
        if named:
            raise invalid("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
        return choice
    if not named:
        return choice
    name = choice.get("name")
    if not name:
        raise invalid("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
    exact, local = set(), {}
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        if tool.get("type") == "namespace":
            for inner in tool.get("tools") or []:
                if isinstance(inner, dict) and isinstance(inner.get("name"), str):
                    flat = flat_tool_name(tool.get("name", ""), inner["name"])
                    exact.add(flat)
                    local.setdefault(inner["name"], []).append(flat)
        elif isinstance(tool.get("name"), str):
            exact.add(tool["name"])
    if name in exact:
        return choice
    candidates = local.get(name, [])
    if len(candidates) == 1:
        return {**choice, "name": candidates[0]}
    if candidates:
        raise invalid(
            f"Tool choice '{name}' is ambiguous: it is defined in more than one namespace "
            f"({', '.join(candidates)}). Select it by its full '<namespace>__<name>' name.",
            "tool_choice",
        )
    raise invalid("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")


def _plan_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") in ("function", "custom"):
            return {"type": "function", "function": {"name": choice["name"]}}
        return None  # allowed tools, a hosted tool: vLLM's parser looks for no call
    return choice


# --- the answer ----------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


def response_object(
    call: ResponsesCall,
    *,
    response_id: str,
    model: str,
    created: int,
    max_tokens: int,
    output: list[dict],
    status: str,
    usage: dict | None,
    kv_transfer_params: dict | None = None,
) -> dict:
    """The Response object in vLLM's field order (ResponsesResponse.from_request)."""
    body = call.body
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict):
        reasoning = {name: reasoning.get(name) for name in REASONING_FIELDS}
    logprobs = "message.output_text.logprobs" in (body.get("include") or [])
    parallel = body.get("parallel_tool_calls")
    return {
        "id": response_id,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": True if parallel is None else parallel,
        "temperature": _number(body.get("temperature"), 1.0),
        "tool_choice": call.tool_choice,
        "tools": [_echoed_tool(tool) for tool in body.get("tools") or []],
        "top_p": _number(body.get("top_p"), 1.0),
        "background": bool(body.get("background")),
        "max_output_tokens": max_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": body.get("previous_response_id"),
        "prompt": None,
        "reasoning": reasoning,
        "service_tier": body.get("service_tier", "auto"),
        "status": status,
        "text": body.get("text"),
        "top_logprobs": body.get("top_logprobs", 0) if logprobs else None,
        "truncation": body.get("truncation") or "disabled",
        "usage": usage,
        "user": body.get("user"),
        "presence_penalty": _number(body.get("presence_penalty"), 0.0),
        "frequency_penalty": _number(body.get("frequency_penalty"), 0.0),
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def _number(value, default: float) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def _echoed_tool(tool):
    fields = TOOL_FIELDS.get(tool.get("type")) if isinstance(tool, dict) else None
    if fields is None:
        return tool
    echoed = {name: tool.get(name) for name in fields}
    if tool.get("type") == "namespace":
        echoed["tools"] = [_echoed_tool(inner) for inner in tool.get("tools") or []]
    return echoed


def usage(prompt: int, cached: int, written: int, output: int, reasoning: int = 0) -> dict:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": written,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": reasoning,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + output,
    }


def text_part(text: str, logprobs) -> dict:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [text_part(text, None)] if text else []
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def reasoning_part(text: str) -> dict:
    return {"text": text, "type": "reasoning_text"}


def reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = None if text is None else [reasoning_part(text)]
    return {
        "id": item_id,
        "summary": [],
        "type": "reasoning",
        "content": content,
        "encrypted_content": None,
        "status": status,
    }


def call_item(
    call: ResponsesCall, item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict:
    """A function call (or a custom tool's call) as vLLM returns it, a namespaced one under its own name."""
    if name in call.custom_tools:
        payload = custom_input(arguments)
        return {"call_id": call_id, "input": payload, "name": name, "type": "custom_tool_call", "id": item_id}
    local, namespace = call.tool_names.get(name, (name, None))
    return {
        "arguments": arguments,
        "call_id": call_id,
        "name": local,
        "type": "function_call",
        "id": item_id,
        "async": None,
        "caller": None,
        "namespace": namespace,
        "status": status,
    }


def custom_input(arguments: str) -> str:
    """A custom tool's payload from its function-shim arguments (bare text passes through)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    payload = parsed.get(CUSTOM_TOOL_INPUT) if isinstance(parsed, dict) else None
    return payload if isinstance(payload, str) else arguments


def sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


class EventWriter:
    """The stream's events in vLLM's order, numbered from 0: one output item open at a time (a message with one
    text part, a reasoning item, a function call), closed with its done events before the next opens."""

    def __init__(self, call: ResponsesCall):
        self.call = call
        self.sequence = 0
        self.index = 0  # the output index of the item open now (or next)
        self.kind: str | None = None  # "message", "reasoning" or "call" while one is open
        self.item_id = ""
        self.text = ""
        self.call_id = ""
        self.name = ""
        self.items: list[dict] = []  # the items done so far: the completed Response's output

    def event(self, kind: str, **fields) -> dict:
        event = {**fields, "sequence_number": self.sequence, "type": kind}
        self.sequence += 1
        return event

    def response(self, kind: str, response: dict) -> bytes:
        return sse(self.event(kind, response=response))

    def text_delta(self, delta: str) -> list[bytes]:
        out = self._switch("message")
        self.text += delta
        out.append(
            sse(
                self.event(
                    "response.output_text.delta",
                    content_index=0,
                    delta=delta,
                    item_id=self.item_id,
                    logprobs=[],
                    output_index=self.index,
                )
            )
        )
        return out

    def reasoning_delta(self, delta: str) -> list[bytes]:
        out = self._switch("reasoning")
        self.text += delta
        out.append(
            sse(
                self.event(
                    "response.reasoning_text.delta",
                    content_index=0,
                    delta=delta,
                    item_id=self.item_id,
                    output_index=self.index,
                )
            )
        )
        return out

    def call_start(self, call_id: str, name: str) -> list[bytes]:
        out = self.close()
        self.kind, self.item_id, self.text = "call", new_id("fc"), ""
        self.call_id, self.name = call_id, name
        if name in self.call.custom_tools:
            self.item_id = new_id("ctc")
        item = call_item(self.call, self.item_id, call_id, name, "", "in_progress")
        if item["type"] == "custom_tool_call":
            item["input"] = ""
        out.append(sse(self.event("response.output_item.added", item=item, output_index=self.index)))
        return out

    def call_arguments(self, delta: str) -> list[bytes]:
        self.text += delta
        if self.name in self.call.custom_tools:
            return []  # sent whole when the call is done (vLLM sends the payload as its JSON becomes readable)
        return [
            sse(
                self.event(
                    "response.function_call_arguments.delta",
                    delta=delta,
                    item_id=self.item_id,
                    output_index=self.index,
                )
            )
        ]

    def close(self) -> list[bytes]:
        """The done events of the item open now, if any."""
        kind, index, item_id, text = self.kind, self.index, self.item_id, self.text
        if kind is None:
            return []
        out = []
        if kind in ("message", "reasoning"):
            # A text item ends alike: its text's done event, then its one content part's.
            if kind == "message":
                done, extra, part = "response.output_text.done", {"logprobs": []}, text_part(text, None)
                item = message_item(item_id, text)
            else:
                done, extra, part = "response.reasoning_text.done", {}, reasoning_part(text)
                item = reasoning_item(item_id, text)
            fields = {"content_index": 0, "item_id": item_id, **extra, "output_index": index}
            out.append(self.event(done, **fields, text=text))
            part_fields = {"content_index": 0, "item_id": item_id, "output_index": index, "part": part}
            out.append(self.event("response.content_part.done", **part_fields))
        else:
            item = call_item(self.call, item_id, self.call_id, self.name, text, "completed")
            if item["type"] == "custom_tool_call":
                payload = item["input"]
                if payload:
                    out.append(
                        self.event(
                            "response.custom_tool_call_input.delta",
                            delta=payload,
                            item_id=item_id,
                            output_index=index,
                        )
                    )
                out.append(
                    self.event(
                        "response.custom_tool_call_input.done",
                        input=payload,
                        item_id=item_id,
                        output_index=index,
                    )
                )
            else:
                done = self.event(
                    "response.function_call_arguments.done",
                    arguments=text,
                    item_id=item_id,
                    output_index=index,
                )
                done["name"] = item["name"]  # after the event's own fields, as vLLM's model writes it
                out.append(done)
        out.append(self.event("response.output_item.done", item=item, output_index=index))
        self.items.append(item)
        self.kind, self.text = None, ""
        self.index += 1
        return [sse(event) for event in out]

    def _switch(self, kind: str) -> list[bytes]:
        if self.kind == kind:
            return []
        out = self.close()
        self.kind, self.text = kind, ""
        if kind == "message":
            self.item_id = new_id("msg")
            item = message_item(self.item_id, "", "in_progress")
            part = {**text_part("", []), "logprobs": []}
        else:
            self.item_id = new_id("rs")
            item = reasoning_item(self.item_id, None, "in_progress")
            part = reasoning_part("")
        out.append(sse(self.event("response.output_item.added", item=item, output_index=self.index)))
        out.append(
            sse(
                self.event(
                    "response.content_part.added",
                    content_index=0,
                    item_id=self.item_id,
                    output_index=self.index,
                    part=part,
                )
            )
        )
        return out


def now() -> int:
    return int(time.time())
