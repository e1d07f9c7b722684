"""How each API dialect's request renders as a chat template's inputs, as vLLM 0.32 converts it: chat
completions' messages, Anthropic's messages (its conversion in entrypoints/anthropic/serving.py) and Responses'
input items, with their tools. The router renders these to predict the engine's prompt token ids exactly, and the
simulator renders through the same functions, so there is one implementation of each conversion.

Over 400 lines: the three APIs' conversions share their message, part and tool rules, and change together when
vLLM's do."""

from __future__ import annotations

import json
from dataclasses import dataclass
from operator import itemgetter

# --- Chat rendering inputs --------------------------------------------------------------------------------
# What the engine's chat template sees for a request, worked out as vLLM 0.32 works it out (its Anthropic
# conversion in entrypoints/anthropic/serving.py, its message parsing in renderers/chat_utils.py and
# renderers/hf.py). The router renders these to predict the engine's prompt token ids exactly, and the
# simulator renders the same, so one implementation serves both.

BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request attribution line; vLLM drops it
TEXT_ONLY_PARTS = frozenset({"text", "input_text", "output_text", "refusal"})


class RenderError(ValueError):
    """The request cannot be rendered for a text-only model; `reason` is a short label for metrics."""

    def __init__(self, reason: str, message: str, param: str | None = "messages"):
        super().__init__(message)
        self.reason, self.param = reason, param


@dataclass(frozen=True)
class TemplateTraits:
    """What vLLM learns from a chat template before it renders with it."""

    content_format: str = "string"  # "openai" when the template loops over a message's content parts
    developer_role: bool = False  # whether the template names the developer role itself


@dataclass
class ChatInputs:
    messages: list[dict]
    tools: list[dict] | None
    kwargs: dict  # the template's other variables: add_generation_prompt, enable_thinking, ...


def each(items: list, convert) -> list:
    """`convert` applied to each item: the conversions take it as `each`, so that a caller may reuse what earlier
    items converted to (the router does, for a conversation's next turn)."""
    return [convert(item) for item in items]


def chat_inputs(payload: dict, traits: TemplateTraits = TemplateTraits(), *, each=each) -> ChatInputs:
    """A chat-completions request body as its chat template sees it."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RenderError("bad_messages", "`messages` must be a non-empty list.")
    conversation = each(messages, lambda message: _chat_message(message, traits))
    if not traits.developer_role and "developer" in map(itemgetter("role"), conversation):
        conversation = _developer_as_system(conversation)
    tools = payload.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RenderError("bad_tools", "`tools` must be a list.", "tools")
        tools = [_tool(tool) for tool in tools]
    user_kwargs = payload.get("chat_template_kwargs") or {}
    if not isinstance(user_kwargs, dict):
        raise RenderError("bad_kwargs", "`chat_template_kwargs` must be an object.", "chat_template_kwargs")
    # As vLLM merges them: the request's own fields, where set, over `chat_template_kwargs`.
    kwargs = {
        **user_kwargs,
        "add_generation_prompt": payload.get("add_generation_prompt", True),
        "continue_final_message": payload.get("continue_final_message", False),
    }
    if payload.get("documents") is not None:
        kwargs["documents"] = payload["documents"]
    effort = payload.get("reasoning_effort")
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        if "enable_thinking" not in user_kwargs:
            kwargs["enable_thinking"] = effort != "none"
    if kwargs["continue_final_message"]:
        kwargs["add_generation_prompt"] = False
    return ChatInputs(conversation, tools, kwargs)


def _text_parts(content, role: str) -> list:
    """The text of a message's content parts; anything a text-only model cannot take is refused. A tool
    reference part stays a part (`{"type": "tool_reference", "name": ...}`)."""
    if isinstance(content, str):
        parts = [content]
    elif content is None:
        parts = []
    elif isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                if part:  # the engine drops empty texts before joining the rest
                    parts.append(part)
                continue
            if not isinstance(part, dict):
                raise RenderError("bad_content", "A content part must be an object with a `type`.")
            kind = part.get("type")
            if kind in TEXT_ONLY_PARTS:
                text = part.get(kind if kind == "refusal" else "text")
                if text:
                    parts.append(text)
            elif kind == "tool_reference":  # a deferred tool named for the template to expand
                parts.append({"type": "tool_reference", "name": part.get("name")})
            elif kind in (
                "image_url",
                "input_image",
                "image",
                "audio_url",
                "input_audio",
                "video_url",
                "file",
            ):
                raise RenderError(
                    "image",
                    f"This model takes text only: remove the `{kind}` content part "
                    "(or deploy a multimodal model for it).",
                )
            else:
                raise RenderError("bad_content", f"Unsupported chat content part type: {kind!r}.")
    else:
        raise RenderError("bad_content", "Message content must be a string, a list of parts or null.")
    if role == "system":
        parts = _without_billing_header(parts)
    return parts


def _named(part) -> bool:
    return isinstance(part, str) or bool(part["name"])


def _without_billing_header(parts: list) -> list:
    out = []
    for text in parts:
        if isinstance(text, str) and text.startswith(BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        out.append(text)
    return out


def _chat_message(message, traits: TemplateTraits) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RenderError("bad_messages", "Each message must be an object with a `role`.")
    role = message["role"]
    texts = _text_parts(message.get("content"), role)
    if traits.content_format == "openai":
        content = [{"type": "text", "text": t} if isinstance(t, str) else t for t in texts]
        if role == "tool" and all(isinstance(t, str) for t in texts):
            content = "\n".join(texts)  # a tool reference keeps a tool message's parts, for the template
    else:
        content = "\n".join(t if isinstance(t, str) else t["name"] for t in texts if _named(t))
    result: dict = {"role": role, "content": content}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            result["tool_calls"] = _tool_calls(calls)
            if not result["tool_calls"]:
                del result["tool_calls"]
        reasoning = message.get("reasoning")
        if reasoning is None:  # the older name, which the engine takes too
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            result["reasoning"] = result["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        result["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def _tool_calls(calls) -> list[dict]:
    """Assistant tool calls with their JSON-string arguments parsed into objects, as templates expect them."""
    if not isinstance(calls, list):
        raise RenderError("bad_tool_calls", "`tool_calls` must be a list.")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise RenderError("bad_tool_calls", "Each tool call must be an object with a `function`.")
        arguments = function.get("arguments")
        if not arguments:
            parsed = {}
        elif isinstance(arguments, dict):
            parsed = arguments
        else:
            try:
                parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                parsed = {}  # the engine carries on with an empty object rather than fail every later turn
            if not isinstance(parsed, dict):
                parsed = {}
        out.append({**call, "function": {**function, "arguments": parsed}})
    return out


def _developer_as_system(conversation: list[dict]) -> list[dict]:
    """For a template that does not know the developer role: developer messages become system ones, and all
    system messages are merged into one at the start."""
    converted = []
    for message in conversation:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"} | {"role": "system"}
        converted.append(message)
    system, rest, merge = [], [], False
    for i, message in enumerate(converted):
        if message["role"] != "system":
            rest.append(message)
            continue
        merge |= i > 0 or bool(system)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            system.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system)}, *rest]


def _tool(tool) -> dict:
    """A tool definition as the engine hands it to the template (its request model, dumped)."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RenderError("bad_tools", "Each tool must be {type: function, function: {name, ...}}.", "tools")
    defer = tool.get("defer_loading")
    dumped = {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    if function.get("strict") is not None:
        dumped["strict"] = function["strict"]
    function_defer = function.get("defer_loading", defer)
    if function_defer is not None:
        dumped["defer_loading"] = function_defer
    out = {"type": "function", "function": dumped}
    if defer is not None:
        out["defer_loading"] = defer
    return out


# --- Anthropic Messages as a chat-completions request ---------------------------------------------------


def anthropic_chat_request(payload: dict, *, merge_inline_system: bool = False, each=each) -> dict:
    """The chat-completions request an Anthropic Messages request becomes in the engine: system blocks joined,
    tool_use as assistant tool_calls, tool_result as tool messages, thinking as reasoning, tools as functions."""
    messages: list[dict] = []
    system = _anthropic_system(payload.get("system"))
    inline = payload.get("messages")
    if not isinstance(inline, list) or not inline:
        raise RenderError("bad_messages", "`messages` must be a non-empty list.")
    if merge_inline_system:
        for message in inline:
            if isinstance(message, dict) and message.get("role") == "system":
                text = _anthropic_system(message.get("content"))
                if text:
                    system.append("".join(text))
    if system:
        messages.append({"role": "system", "content": "".join(system)})
    for converted in each(inline, lambda message: _anthropic_message(message, merge_inline_system)):
        messages.extend(converted)
    request: dict = {"messages": messages}
    if payload.get("chat_template_kwargs") is not None:
        request["chat_template_kwargs"] = payload["chat_template_kwargs"]
    output_config = payload.get("output_config") or {}
    if isinstance(output_config, dict) and output_config.get("effort") is not None:
        request["reasoning_effort"] = output_config["effort"]
    thinking = payload.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        request["reasoning_effort"] = "none"
    choice = payload.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        request["tool_choice"] = (
            {"type": "function", "function": {"name": choice.get("name")}}
            if kind == "tool"
            else {"auto": "auto", "any": "required", "none": "none"}.get(kind, kind)
        )
    tools = payload.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RenderError("bad_tools", "`tools` must be a list.", "tools")
    tools = _anthropic_tools_in_effect(tools, inline)
    if tools is not None:
        request["tools"] = [_anthropic_tool(tool) for tool in tools]
        request.setdefault("tool_choice", "auto")
    return request


def _anthropic_tools_in_effect(tools: list | None, messages: list) -> list | None:
    """`tools` as the `tool_addition` and `tool_removal` blocks of system messages leave them at the end of the
    conversation (the template sees one list): a tool added by name is no longer deferred, one added by value
    is declared (in the place of one of its name), a removed one is dropped."""
    changes = [
        block
        for message in messages
        if isinstance(message, dict)
        and message.get("role") == "system"
        and isinstance(message.get("content"), list)
        for block in message["content"]
        if isinstance(block, dict) and block.get("type") in ("tool_addition", "tool_removal")
    ]
    if not changes:
        return tools
    by_name = {tool.get("name"): tool for tool in tools or () if isinstance(tool, dict)}
    removed = set()
    for block in changes:
        change = block.get("tool") if isinstance(block.get("tool"), dict) else {}
        if change.get("type") == "tool_definition" and isinstance(change.get("definition"), dict):
            name = change["definition"].get("name")
            by_name[name] = change["definition"]
        else:
            name = change.get("name")
            if name not in by_name:
                raise RenderError(
                    "bad_tools", f"{block['type']} references tool {name!r}, which is not declared in tools"
                )
            if block["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in by_name.items() if name not in removed]


def _anthropic_system(system) -> list[str]:
    if not system:
        return []
    if isinstance(system, str):
        return [] if system.startswith(BILLING_HEADER) else [system]
    if not isinstance(system, list):
        raise RenderError("bad_system", "`system` must be a string or a list of text blocks.", "system")
    parts = []
    for block in system:
        if not isinstance(block, dict):
            raise RenderError("bad_system", "`system` blocks must be objects.", "system")
        text = block.get("text")
        if block.get("type") == "text" and text and not text.startswith(BILLING_HEADER):
            parts.append(text)
    return parts


def _anthropic_message(message, merge_inline_system: bool) -> list[dict]:
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
        raise RenderError("bad_messages", "Each message needs a role of user or assistant.")
    role, content = message["role"], message.get("content")
    if role == "system":
        if merge_inline_system:
            return []
        text = "".join(_anthropic_system(content))
        return [{"role": "system", "content": text}] if text else []
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RenderError("bad_content", "Message content must be a string or a list of content blocks.")
    out: list[dict] = []  # tool results come out before the message itself
    parts: list[dict] = []
    calls: list[dict] = []
    reasoning: list[str] = []
    for block in content:
        if not isinstance(block, dict):
            raise RenderError("bad_content", "Each content block must be an object with a `type`.")
        kind = block.get("type")
        if kind == "text":
            if block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
        elif kind in ("image", "document"):
            raise RenderError(
                "image",
                f"This model takes text only: remove the `{kind}` block (or deploy a multimodal model).",
            )
        elif kind == "thinking":
            if block.get("thinking") is not None:
                reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id") or "",
                    "type": "function",
                    # The engine sends the input through json.dumps and back (json.loads) before rendering: a
                    # round trip that gives back an equal object for anything JSON parsed, so it is skipped.
                    "function": {"name": block.get("name") or "", "arguments": block.get("input") or {}},
                }
            )
        elif kind == "tool_result":
            if role == "user":
                out.extend(_tool_result_messages(block))
            else:
                parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
        elif kind not in ("redacted_thinking", "tool_reference", "tool_addition", "tool_removal"):
            raise RenderError("bad_content", f"Unsupported content block type: {kind!r}.")
    converted: dict = {"role": role}
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if parts:
        converted["content"] = parts[0]["text"] if len(parts) == 1 else parts
    if role == "user" and "content" not in converted:
        return out
    return [*out, converted]


def _tool_result_messages(block: dict) -> list[dict]:
    """A user's tool_result block as the tool message of its text, then one of the deferred tools it names
    (`tool_reference` items), if any, for the template to expand."""
    content, call_id = block.get("content"), block.get("tool_use_id") or ""
    texts, references = [], []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image":
                raise RenderError(
                    "image", "This model takes text only: remove the image from the tool result."
                )
            elif kind == "tool_reference" and (item.get("tool_name") or item.get("name")):
                references.append({"type": "tool_reference", "name": item.get("tool_name") or item["name"]})
    out = [{"role": "tool", "tool_call_id": call_id, "content": "\n".join(texts)}]
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return out


def _anthropic_tool(tool) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise RenderError("bad_tools", "Each tool needs a `name` and an `input_schema`.", "tools")
    schema = tool.get("input_schema")
    if isinstance(schema, dict) and "type" not in schema:
        schema = {**schema, "type": "object"}  # the engine's default for a schema without one
    function = {"name": tool["name"], "description": tool.get("description"), "parameters": schema}
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


MEDIA_PARTS = frozenset(
    {"image_url", "input_image", "image", "audio_url", "input_audio", "video_url", "file", "document"}
)


def first_media_part(messages: list) -> str | None:
    """The type of the first image, audio, video or document part in a chat or Anthropic conversation (tool
    results included), or None: a text-only model cannot take them."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind in MEDIA_PARTS:
                return kind
            if kind == "tool_result" and isinstance(part.get("content"), list):
                for item in part["content"]:
                    if isinstance(item, dict) and item.get("type") in MEDIA_PARTS:
                        return item["type"]
    return None


# --- The Responses API's input as a chat-completions request --------------------------------------------
# As vLLM 0.32 turns it into one (entrypoints/openai/responses/utils.py: construct_input_messages and
# construct_tool_dicts; protocol.py: ResponsesRequest's input parsing and build_chat_params;
# tool_parsers/utils.py: get_function_tools).

NAMESPACE_SEPARATOR = "__"  # a namespaced function is shown to the model as `<namespace>__<name>`
CUSTOM_TOOL_INPUT = "input"  # a custom (freeform) tool is shown as a function of one string argument
RESPONSES_ENGINE_KWARGS = ("add_generation_prompt", "continue_final_message")


def responses_chat_request(payload: dict) -> dict:
    """The chat-completions request a Responses API request becomes in the engine: `instructions` as a system
    message, a string `input` as the user's, input items as chat messages (a function call joins the assistant
    message before it, its output becomes a tool message, reasoning and assistant text join the assistant
    message too; a namespaced call is named `<namespace>__<name>`), the function tools the model is shown as
    chat tools (namespaces flattened, custom tools as one-string functions, hosted tools such as web_search
    dropped)."""
    if payload.get("previous_response_id") is not None:
        raise RenderError(
            "previous_response",
            "`previous_response_id` refers to history held by one engine: send the conversation in `input`.",
            "previous_response_id",
        )
    items: list[dict] = []
    source = payload.get("input")
    if isinstance(source, str):
        items.append({"role": "user", "content": source})
    elif isinstance(source, list) and source:
        for item in source:
            _responses_item(item, items)
    else:
        raise RenderError("bad_input", "`input` must be a string or a non-empty list of items.", "input")
    messages = [{"role": "system", "content": payload["instructions"]}] if payload.get("instructions") else []
    request: dict = {"messages": messages + items}
    tools = payload.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise RenderError("bad_tools", "`tools` must be a list.", "tools")
        request["tools"] = responses_function_tools(tools)
    reasoning = payload.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if effort is not None:
        request["reasoning_effort"] = effort
    user_kwargs = payload.get("chat_template_kwargs")
    if isinstance(user_kwargs, dict):
        # The engine's own variables override the request's here (they do not for chat completions).
        overridden = RESPONSES_ENGINE_KWARGS + (("reasoning_effort",) if effort is not None else ())
        request["chat_template_kwargs"] = {k: v for k, v in user_kwargs.items() if k not in overridden}
    elif user_kwargs is not None:
        request["chat_template_kwargs"] = user_kwargs  # refused by chat_inputs, as the engine refuses it
    if _continues_final_item(source):
        request["continue_final_message"] = True
        request["add_generation_prompt"] = False
    return request


def _continues_final_item(source) -> bool:
    """Whether the last input item is a message or reasoning item still in progress (the engine then continues
    it rather than starting a new turn), whatever its role."""
    last = source[-1] if isinstance(source, list) and source else None
    return (
        isinstance(last, dict)
        and last.get("type", "message") in ("message", "reasoning")
        and last.get("status") in ("in_progress", "incomplete")
    )


def _responses_item(item, messages: list[dict]) -> None:
    if not isinstance(item, dict):
        raise RenderError("bad_input", "Each input item must be an object.", "input")
    kind = item.get("type")
    previous = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if kind in ("function_call", "custom_tool_call"):
        _join_tool_call(_responses_call(item), previous, messages)
    elif kind == "reasoning":
        if item.get("encrypted_content"):
            # vLLM refuses it too (400, param `input`): it cannot read another provider's encrypted reasoning.
            raise RenderError("encrypted_reasoning", "Encrypted content is not supported.", "input")
        parts = item.get("content") or item.get("summary") or []
        text = parts[0].get("text", "") if parts and isinstance(parts[0], dict) else ""
        if previous is not None and previous.get("reasoning") is None:
            previous["reasoning"] = text
        else:
            messages.append({"role": "assistant", "reasoning": text})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        messages.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
    elif item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else None
        if isinstance(content, list) and content and isinstance(content[0], dict):
            text = content[0].get("text")
        if text is None:
            messages.append(dict(item))
        elif previous is not None and previous.get("content") is None:
            previous["content"] = text
        else:
            messages.append({"role": "assistant", "content": text})
    elif "role" in item:
        messages.append(dict(item))
    else:
        raise RenderError("bad_input", f"Unsupported input item type: {kind}", "input")


def _responses_call(item: dict) -> dict:
    """A function or custom tool call item as an assistant tool call: a namespaced function by its flat name,
    a custom tool's text input as the one argument of its function."""
    name = item.get("name")
    if item.get("type") == "custom_tool_call":
        payload = item.get("input") or ""
        arguments = json.dumps({CUSTOM_TOOL_INPUT: payload}, ensure_ascii=False)
    else:
        arguments = item.get("arguments")
        if item.get("namespace"):
            name = flat_tool_name(item["namespace"], name)
    return {"id": item.get("call_id"), "function": {"name": name, "arguments": arguments}, "type": "function"}


def _join_tool_call(call: dict, previous: dict | None, messages: list[dict]) -> None:
    if previous is not None:
        previous["tool_calls"] = [*(previous.get("tool_calls") or []), call]
    else:
        messages.append({"role": "assistant", "tool_calls": [call]})


def flat_tool_name(namespace: str, name) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def responses_function_tools(tools: list) -> list[dict]:
    """The Responses tools the model is shown, in request order, as chat tools: functions as they are, each
    function of a namespace as `<namespace>__<name>` (the namespace's description and its custom tools are not
    shown), a custom tool as a function taking one string; hosted tools (web_search, file_search, mcp, ...)
    are not shown to the model at all."""
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise RenderError("bad_tools", "Each tool must be an object with a `type`.", "tools")
        kind = tool.get("type")
        if kind == "function":
            out.append(_responses_tool(tool))
        elif kind == "namespace":
            namespace, members = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not isinstance(members, list):
                raise RenderError(
                    "bad_tools", "A namespace tool needs a `name` and a list of `tools`.", "tools"
                )
            for member in members:
                if isinstance(member, dict) and member.get("type") == "function":
                    flat = flat_tool_name(namespace, _tool_name(member))
                    out.append(_responses_tool({**member, "name": flat}))
        elif kind == "custom":
            tool_format = tool.get("format")
            if isinstance(tool_format, dict) and tool_format.get("type") == "grammar":
                raise RenderError(
                    "custom_tool_grammar",
                    "Custom tools with a grammar format are not supported; "
                    "only free-form text custom tools are accepted.",
                    "tools",
                )
            out.append(
                _responses_tool(
                    {
                        "name": _tool_name(tool),
                        "description": tool.get("description"),
                        "parameters": custom_tool_parameters(),
                    }
                )
            )
    return out


def responses_tool_names(tools) -> dict[str, tuple[str, str | None]]:
    """The flat name the model calls each namespaced function by -> (its name, its namespace): a call the model
    makes by a flat name goes back to the client as `name` and `namespace`; other names stand for themselves."""
    names: dict[str, tuple[str, str | None]] = {}
    for tool in tools or ():
        if not isinstance(tool, dict) or tool.get("type") != "namespace":
            continue
        namespace, members = tool.get("name"), tool.get("tools")
        if not isinstance(namespace, str) or not isinstance(members, list):
            continue
        for member in members:
            if isinstance(member, dict) and member.get("type") == "function":
                name = member.get("name")
                if isinstance(name, str):
                    names[flat_tool_name(namespace, name)] = (name, namespace)
    return names


def custom_tool_parameters() -> dict:
    """The schema of the one-string function a custom tool is shown as."""
    return {
        "type": "object",
        "properties": {
            CUSTOM_TOOL_INPUT: {"type": "string", "description": "The freeform text payload for this tool."}
        },
        "required": [CUSTOM_TOOL_INPUT],
        "additionalProperties": False,
    }


def _tool_name(tool: dict) -> str:
    if not isinstance(tool.get("name"), str):
        raise RenderError("bad_tools", "Each function tool needs a `name`.", "tools")
    return tool["name"]


def _responses_tool(tool: dict) -> dict:
    function = {
        "name": _tool_name(tool),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
    }
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}
