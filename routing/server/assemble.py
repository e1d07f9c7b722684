"""A whole answer put together from the engine's stream, for a client that did not ask for a stream.

The router always streams from the engine (routing/server/exchange.py): vLLM sends a non-streamed answer's headers only
when the answer is over, so a long answer would look like an engine that never started, and one that fails midway
would leave nothing to bill. Streamed, the first token is seen when it comes, a stall is caught between tokens, and
the running usage bills a request cut short. The client still gets the JSON body of the route's non-streamed answer,
in the shape vLLM gives it.

What cannot be streamed is not assembled (`assembles`): vLLM refuses `prompt_logprobs` in a stream, and a
completion's `echo` with `logprobs` returns the prompt's logprobs only in the whole answer.
"""

from __future__ import annotations

import orjson

from routing.rendering.routes import ANTHROPIC_MESSAGES, CHAT_MESSAGES, PROMPT_TEXT, RESPONSES_INPUT, ROUTES


def assembles(payload: dict, path: str) -> bool:
    """Whether a request its client did not stream is streamed from the engine and assembled here."""
    if payload.get("prompt_logprobs") is not None:
        return False
    completion = ROUTES[path].renders == PROMPT_TEXT
    return not (completion and payload.get("echo") and payload.get("logprobs") is not None)


def assembler_for(path: str) -> Assembler:
    """A new assembler of the answer's shape on this route (routing/rendering/routes.py: it follows from how it renders)."""
    return ASSEMBLERS[ROUTES[path].renders]()


class EngineStreamError(Exception):
    """The engine's stream carried an error (vLLM's error event midway): the answer is not whole."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _data(event: bytes):
    """The JSON of an event's `data:` line; None for `[DONE]`, a comment or a line that is not JSON."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return None
            try:
                return orjson.loads(payload)
            except orjson.JSONDecodeError:
                return None
    return None


def _error_of(data: dict) -> EngineStreamError:
    error = data.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        return EngineStreamError(status, str(error.get("message") or "the engine failed"))
    return EngineStreamError(500, str(error or "the engine failed"))


class Assembler:
    """Fed each event of the engine's stream (without its closing blank line); `body()` is the answer's JSON.
    Raises EngineStreamError when the stream reports an error."""

    def feed_events(self, events: bytes) -> None:
        """A run of whole events, each ending with a blank line."""
        for event in events.split(b"\n\n"):
            if event:
                self.feed(event)

    def feed(self, event: bytes) -> None:
        raise NotImplementedError

    def body(self) -> bytes:
        raise NotImplementedError


class _Chunks(Assembler):
    """OpenAI's chunks (chat and text completions): the answer's id, time and model from the first, the usage and
    fingerprint from the last that carries them, each choice's piece handed to `_choice`."""

    def __init__(self):
        self.head: dict = {}
        self.choices: dict = {}
        self.usage = None
        self.fingerprint = None

    def feed(self, event: bytes) -> None:
        data = _data(event)
        if not isinstance(data, dict):
            return
        if "error" in data and "choices" not in data:
            raise _error_of(data)
        if not self.head:
            self.head = {k: data.get(k) for k in ("id", "created", "model")}
        if data.get("usage"):
            self.usage = data["usage"]
        if data.get("system_fingerprint"):
            self.fingerprint = data["system_fingerprint"]
        for raw in data.get("choices") or ():
            self._choice(raw)

    def _choice(self, raw: dict) -> None:
        raise NotImplementedError

    def _answer(self, kind: str, choices: list[dict], **extra) -> bytes:
        return orjson.dumps(
            {
                **self.head,
                "object": kind,
                "choices": choices,
                "service_tier": None,
                "system_fingerprint": self.fingerprint,
                "usage": _final_usage(self.usage),
                **extra,
                "kv_transfer_params": None,
            }
        )


def _joined_logprobs(kept: dict | None, logprobs) -> dict | None:
    """A choice's logprobs so far with this piece's lists appended."""
    if not isinstance(logprobs, dict):
        return kept
    kept = {} if kept is None else kept
    for name, items in logprobs.items():
        if isinstance(items, list):
            kept.setdefault(name, []).extend(items)
    return kept


class _Choice:
    __slots__ = ("index", "role", "content", "reasoning", "refusal", "tools", "logprobs", "finish", "stop")

    def __init__(self, index: int):
        self.index = index
        self.role = "assistant"
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        self.tools: dict[int, dict] = {}
        self.logprobs: dict[str, list] | None = None
        self.finish = None
        self.stop = None


class ChatAssembler(_Chunks):
    """OpenAI chat completions: `chat.completion.chunk` deltas into one `chat.completion`."""

    def _choice(self, raw: dict) -> None:
        index = raw.get("index", 0)
        choice = self.choices.get(index)
        if choice is None:
            choice = self.choices[index] = _Choice(index)
        delta = raw.get("delta") or {}
        if delta.get("role"):
            choice.role = delta["role"]
        if delta.get("content"):
            choice.content.append(delta["content"])
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            choice.reasoning.append(reasoning)
        if delta.get("refusal"):
            choice.refusal.append(delta["refusal"])
        for call in delta.get("tool_calls") or ():
            self._tool_delta(choice, call)
        choice.logprobs = _joined_logprobs(choice.logprobs, raw.get("logprobs"))
        if raw.get("finish_reason") is not None:
            choice.finish = raw["finish_reason"]
            choice.stop = raw.get("stop_reason")

    @staticmethod
    def _tool_delta(choice: _Choice, call: dict) -> None:
        index = call.get("index", len(choice.tools))
        tool = choice.tools.get(index)
        if tool is None:
            tool = choice.tools[index] = {"id": None, "type": "function", "name": None, "arguments": []}
        if call.get("id"):
            tool["id"] = call["id"]
        if call.get("type"):
            tool["type"] = call["type"]
        function = call.get("function") or {}
        if function.get("name"):
            tool["name"] = function["name"]
        if function.get("arguments"):
            tool["arguments"].append(function["arguments"])

    def body(self) -> bytes:
        choices = []
        for index in sorted(self.choices):
            choice = self.choices[index]
            message = {
                "role": choice.role,
                "content": "".join(choice.content) if choice.content else None,
                "refusal": "".join(choice.refusal) if choice.refusal else None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": "".join(choice.reasoning) if choice.reasoning else None,
            }
            if choice.tools:  # vLLM leaves the list out when there is no call
                message["tool_calls"] = [
                    {
                        "id": tool["id"],
                        "type": tool["type"],
                        "function": {"name": tool["name"], "arguments": "".join(tool["arguments"])},
                    }
                    for _, tool in sorted(choice.tools.items())
                ]
            choices.append(
                {
                    "index": choice.index,
                    "message": message,
                    "logprobs": choice.logprobs,
                    "finish_reason": choice.finish,
                    "stop_reason": choice.stop,
                }
            )
        return self._answer("chat.completion", choices, prompt_logprobs=None)


class CompletionAssembler(_Chunks):
    """OpenAI text completions: `text_completion` chunks into one answer, texts and logprobs joined."""

    def _choice(self, raw: dict) -> None:
        index = raw.get("index", 0)
        choice = self.choices.setdefault(
            index, {"text": [], "logprobs": None, "finish_reason": None, "stop_reason": None}
        )
        if raw.get("text"):
            choice["text"].append(raw["text"])
        choice["logprobs"] = _joined_logprobs(choice["logprobs"], raw.get("logprobs"))
        if raw.get("finish_reason") is not None:
            choice["finish_reason"] = raw["finish_reason"]
            choice["stop_reason"] = raw.get("stop_reason")

    def body(self) -> bytes:
        choices = [
            {
                "index": index,
                "text": "".join(choice["text"]),
                "logprobs": choice["logprobs"],
                "finish_reason": choice["finish_reason"],
                "stop_reason": choice["stop_reason"],
                "prompt_logprobs": None,
            }
            for index, choice in sorted(self.choices.items())
        ]
        return self._answer("text_completion", choices)


def _final_usage(usage):
    if not isinstance(usage, dict):
        return None
    return {**usage, "completion_tokens_details": usage.get("completion_tokens_details")}


class MessagesAssembler(Assembler):
    """Anthropic messages: `message_start`, the content blocks' starts, deltas and stops, `message_delta`, into
    one `message`."""

    def __init__(self):
        self.message: dict = {}
        self.blocks: dict[int, dict] = {}
        self.json_parts: dict[int, list[str]] = {}

    def feed(self, event: bytes) -> None:
        data = _data(event)
        if not isinstance(data, dict):
            return
        kind = data.get("type")
        if kind == "error" or (kind is None and "error" in data):
            raise _error_of(data)
        if kind == "message_start":
            self.message = dict(data.get("message") or {})
        elif kind == "content_block_start":
            block = dict(data.get("content_block") or {})
            index = data.get("index", len(self.blocks))
            if block.get("type") in ("tool_use", "server_tool_use"):
                self.json_parts[index] = []
            self.blocks[index] = block
        elif kind == "content_block_delta":
            self._delta(data.get("index", 0), data.get("delta") or {})
        elif kind == "content_block_stop":
            index = data.get("index", 0)
            parts = self.json_parts.pop(index, None)
            if parts is not None and index in self.blocks:
                self.blocks[index]["input"] = _json_input("".join(parts))
        elif kind == "message_delta":
            delta = data.get("delta") or {}
            for name in ("stop_reason", "stop_sequence"):
                if name in delta:
                    self.message[name] = delta[name]
            if data.get("usage"):
                self.message["usage"] = {**(self.message.get("usage") or {}), **data["usage"]}

    def _delta(self, index: int, delta: dict) -> None:
        block = self.blocks.setdefault(index, {"type": "text", "text": ""})
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = block.get("text", "") + delta.get("text", "")
        elif kind == "input_json_delta":
            self.json_parts.setdefault(index, []).append(delta.get("partial_json", ""))
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
        elif kind == "signature_delta":
            block["signature"] = block.get("signature", "") + delta.get("signature", "")

    def body(self) -> bytes:
        for index, parts in self.json_parts.items():  # a tool call whose block never closed
            if index in self.blocks:
                self.blocks[index]["input"] = _json_input("".join(parts))
        message = {
            "id": self.message.get("id"),
            "type": "message",
            "role": self.message.get("role", "assistant"),
            "content": [self.blocks[index] for index in sorted(self.blocks)],
            "model": self.message.get("model"),
            "stop_reason": self.message.get("stop_reason"),
            "stop_sequence": self.message.get("stop_sequence"),
            "usage": self.message.get("usage"),
        }
        return orjson.dumps(message)


def _json_input(text: str):
    if not text:
        return {}
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text  # as the engine streamed it: the client sees what the model wrote


class ResponsesAssembler(Assembler):
    """OpenAI Responses: the final event (`response.completed`, or `response.incomplete` / `response.failed`)
    carries the whole response object."""

    FINAL = ("response.completed", "response.incomplete")

    def __init__(self):
        self.response: dict | None = None

    def feed(self, event: bytes) -> None:
        data = _data(event)
        if not isinstance(data, dict):
            return
        kind = data.get("type")
        if kind in self.FINAL and isinstance(data.get("response"), dict):
            self.response = data["response"]
        elif kind == "response.failed":
            error = (data.get("response") or {}).get("error") or data.get("error") or {}
            raise EngineStreamError(500, str(error.get("message") or "the engine failed"))
        elif kind == "error" or (kind is None and "error" in data):
            raise _error_of(data)

    def body(self) -> bytes:
        if self.response is None:
            raise EngineStreamError(502, "the engine's stream ended before the response was complete")
        return orjson.dumps(self.response)


ASSEMBLERS: dict[str, type[Assembler]] = {
    CHAT_MESSAGES: ChatAssembler,
    PROMPT_TEXT: CompletionAssembler,
    ANTHROPIC_MESSAGES: MessagesAssembler,
    RESPONSES_INPUT: ResponsesAssembler,
}
