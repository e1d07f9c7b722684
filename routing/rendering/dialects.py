"""The API dialects agents speak, on the wire: OpenAI's (chat and text completions, Responses) and Anthropic's.
Errors, usage and stream events in each one's own shapes. How each one's request renders as a chat template's
inputs is routing/rendering/conversion.py."""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
    529: "overloaded_error",
}


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reported: bool = False  # the engine said so (rather than the router counting streamed chunks)


class Dialect:
    """One public API's wire format, as the relay and metering read it: its errors, where its usage is, which
    stream events carry content, usage or the end. Each API is a subclass; this base holds what they read alike."""

    name = ""
    # The status of a request refused because the model is saturated (it waited past its class's limit).
    overloaded_status = 429
    # Events that carry the final usage or end the stream contain one of these; a run of events before the first
    # of them is passed on whole (less the running usage the router asked for), its content events counted with
    # CONTENT_MARKER. None: look at every event.
    SPECIAL_MARKERS: tuple[bytes, ...] | None = None
    CONTENT_MARKER = b""
    # The first event holding this is the first of the answer a client sees (traffic traces time it): the first
    # content event, unless the API opens its content in an event of its own.
    SEEN_MARKER: bytes | None = None

    @property
    def seen_marker(self) -> bytes:
        return self.SEEN_MARKER or self.CONTENT_MARKER

    def error_body(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> bytes:
        raise NotImplementedError

    def stream_error_event(self, status: int, message: str) -> bytes:
        raise NotImplementedError

    def usage_from_body(self, body: dict) -> Usage:
        raise NotImplementedError

    def carries_usage(self, event: bytes) -> bool:
        """Whether this stream event is the one with the final usage: a byte test, cheap for every event."""
        raise NotImplementedError

    def prompt_from_event(self, event: bytes) -> int | None:
        """The engine's count of prompt tokens, from a stream event that carries it before the end, else None."""
        raise NotImplementedError

    def is_content_event(self, event: bytes) -> bool:
        raise NotImplementedError

    def is_terminal_event(self, event: bytes) -> bool:
        raise NotImplementedError

    def without_running_usage(self, events: bytes) -> bytes:
        """Events less the running usage the router asked for and the client did not (an API without any: as
        they are)."""
        return events

    def is_usage_only_event(self, event: bytes) -> bool:
        return False

    def usage_from_tail(self, body: bytes) -> Usage:
        """The usage of an answer sent whole, read from its bytes without parsing the rest: the last `"usage"`
        key whose value is an object (a string in the JSON cannot hold the key, its quotes being escaped there;
        vLLM writes the usage after the choices and output, before prompt logprobs, whose keys are token ids)."""
        match = last_usage(body)
        if match is None:
            return Usage()
        try:
            usage = orjson.loads(match.group(1))
        except orjson.JSONDecodeError:
            return Usage()
        return self.usage_from_body({"usage": usage})

    def usage_from_event(self, event: bytes) -> Usage | None:
        """Usage if this stream event carries the final usage, else None."""
        if not self.carries_usage(event):
            return None
        data = _data_of(event)
        return self.usage_from_body(data) if data else None

    def running_output(self, events: bytes) -> int:
        """The engine's running count of output tokens in the last of these events that carries one (vLLM's
        `continuous_usage_stats`), else 0."""
        at = events.rfind(b'"completion_tokens":')
        if at < 0:
            return 0
        return _int_after(events[at:], b'"completion_tokens":') or 0

    def running_outputs(self, events: bytes, counts: dict[int, int]) -> None:
        """With several choices (`n`), vLLM's running count is each choice's own: the last count of each choice
        in these events, into `counts` (choice index -> tokens)."""
        for event in events.split(b"\n\n"):
            count = _int_after(event, b'"completion_tokens":')
            if count is not None:
                index = _int_after(event, b'"choices":[{"index":') or 0
                counts[index] = max(counts.get(index, 0), count)

    def plain_prefix(self, events: bytes) -> int:
        """The length of the leading run of whole events (`events` ends with one) that carry neither usage nor
        the end of the stream, so they can be relayed without looking at each one."""
        if self.SPECIAL_MARKERS is None:
            return 0
        cut = len(events)
        for marker in self.SPECIAL_MARKERS:
            at = events.find(marker, 0, cut)
            if at >= 0:
                cut = at
        if cut == len(events):
            return cut
        boundary = events.rfind(b"\n\n", 0, cut)
        return boundary + 2 if boundary >= 0 else 0


class OpenAIDialect(Dialect):
    """OpenAI's chat and text completions: usage in a last chunk of no choices (asked for by the router, and
    running in every chunk), `data: [DONE]` at the end."""

    name = "openai"
    # The content marker is found once in each content event's JSON (a string inside the JSON cannot hold it,
    # since its quotes are escaped there).
    SPECIAL_MARKERS = (b'"choices":[]', b"[DONE]")
    CONTENT_MARKER = b'"choices":[{'

    def error_body(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": message,
                    "type": OPENAI_ERROR_TYPES.get(status, "error"),
                    "param": param,
                    "code": code,
                }
            }
        )

    def stream_error_event(self, status: int, message: str) -> bytes:
        return b"data: " + self.error_body(status, message) + b"\n\ndata: [DONE]\n\n"

    def usage_from_body(self, body: dict) -> Usage:
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return Usage(
            usage.get("prompt_tokens", 0),
            details.get("cached_tokens") or 0,
            usage.get("completion_tokens", 0),
            bool(usage),
        )

    def carries_usage(self, event: bytes) -> bool:
        return b'"usage"' in event and b'"choices":[]' in event

    def is_usage_only_event(self, event: bytes) -> bool:
        return b'"choices":[]' in event and b'"usage"' in event

    def prompt_from_event(self, event: bytes) -> int | None:
        """From a chunk that carries running usage (vLLM's `continuous_usage_stats`: from the first chunk on,
        before the answer is over)."""
        return _int_after(event, b'"prompt_tokens":')

    def without_running_usage(self, events: bytes) -> bytes:
        """Content chunks (one, or a run of them) without the running usage: vLLM writes `"usage"` after
        `"choices"`, an object of counts and objects of counts. One pass in C over the run; a usage object cut
        off or nested deeper is left as it is."""
        return RUNNING_USAGE.sub(b"", events) if b',"usage":{' in events else events

    def is_content_event(self, event: bytes) -> bool:
        return event.startswith(b"data: {") and self.CONTENT_MARKER in event

    def is_terminal_event(self, event: bytes) -> bool:
        return event.startswith(b"data: [DONE]")


class AnthropicDialect(Dialect):
    name = "anthropic"
    overloaded_status = 529  # Anthropic's `overloaded_error`
    # message_start (the prompt's count), message_delta (the usage) and message_stop (the end) are looked at one
    # by one. Each event names itself on a line of its own (`event: ...\n`, as vLLM writes it); the JSON of its
    # data holds no raw newline, so the content marker is found once in each content event and nowhere else (a
    # text that reads like the special marker only makes the relay look at the rest one by one).
    SPECIAL_MARKERS = (b"event: message_",)
    CONTENT_MARKER = b"event: content_block_delta\n"
    SEEN_MARKER = b"event: content_block_start\n"  # a block opens (a tool call's once its name is parsed)

    def error_body(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> bytes:
        return orjson.dumps(
            {
                "type": "error",
                "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message},
            }
        )

    def stream_error_event(self, status: int, message: str) -> bytes:
        return b"event: error\ndata: " + self.error_body(status, message) + b"\n\n"

    def usage_from_body(self, body: dict) -> Usage:
        usage = body.get("usage") or {}
        cached = usage.get("cache_read_input_tokens") or 0
        created = usage.get("cache_creation_input_tokens") or 0
        prompt = usage.get("input_tokens", 0) + cached + created
        return Usage(prompt, cached, usage.get("output_tokens", 0), bool(usage))

    def carries_usage(self, event: bytes) -> bool:
        return b"message_delta" in event and b'"usage"' in event

    def prompt_from_event(self, event: bytes) -> int | None:
        """`message_start` carries the prompt's tokens (vLLM: all of them in `input_tokens`, nothing cached yet)."""
        if not event.startswith(b"event: message_start"):
            return None
        data = _data_of(event)
        usage = ((data or {}).get("message") or {}).get("usage") or {}
        counts = [
            usage.get(name)
            for name in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        ]
        if not isinstance(counts[0], int):
            return None
        return sum(count for count in counts if isinstance(count, int))

    def is_content_event(self, event: bytes) -> bool:
        return event.startswith(self.CONTENT_MARKER)

    def is_terminal_event(self, event: bytes) -> bool:
        return event.startswith(b"event: message_stop")


class ResponsesDialect(OpenAIDialect):
    """OpenAI's Responses API (its errors as OpenAI's): usage arrives in `response.completed`."""

    name = "responses"
    SPECIAL_MARKERS = (b"response.completed",)
    # Every event that carries output is a `.delta` (text, reasoning, a function call's or a custom tool's input),
    # each named on its own line before its data (a newline inside the data's JSON is escaped).
    CONTENT_MARKER = b".delta\ndata:"

    def stream_error_event(self, status: int, message: str) -> bytes:
        """`response.failed`, which Responses clients such as Codex read (they take a stream that ends without
        `response.completed` or `response.failed` for a dropped connection, and retry it), its `error` also at
        the top, where the OpenAI SDKs look for a stream's error."""
        error = orjson.loads(self.error_body(status, message))["error"]
        failed = {"code": "server_error" if status >= 500 else error["type"], "message": message}
        event = {
            "type": "response.failed",
            "response": {"object": "response", "status": "failed", "error": failed, "output": []},
            "error": error,
        }
        return b"event: response.failed\ndata: " + orjson.dumps(event) + b"\n\n"

    def usage_from_body(self, body: dict) -> Usage:
        usage = (body.get("response") or body).get("usage") or {}
        details = usage.get("input_tokens_details") or {}
        return Usage(
            usage.get("input_tokens", 0),
            details.get("cached_tokens") or 0,
            usage.get("output_tokens", 0),
            bool(usage),
        )

    def carries_usage(self, event: bytes) -> bool:
        return b"response.completed" in event

    def prompt_from_event(self, event: bytes) -> int | None:
        return None  # usage comes only with `response.completed`

    def without_running_usage(self, events: bytes) -> bytes:
        return events

    def is_usage_only_event(self, event: bytes) -> bool:
        return False

    def is_content_event(self, event: bytes) -> bool:
        return event.startswith(b"event: response.") and self.CONTENT_MARKER in event

    def is_terminal_event(self, event: bytes) -> bool:
        return b"response.completed" in event.split(b"\n", 1)[0]


# `,"usage":{...}`: counts, nulls and objects of them, on one line (an event's JSON holds no raw newline). A
# string in the JSON cannot hold the marker, its quotes being escaped there; the usage object holds no string
# but its keys.
RUNNING_USAGE = re.compile(rb',"usage":\{[^{}\n]*(?:\{[^{}\n]*\}[^{}\n]*)*\}')
# `"usage": {...}` of an answer (compact or not): counts, nulls, lists and objects of them, two levels deep at most.
USAGE_KEY = b'"usage"'
USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*(\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})')


def last_usage(body: bytes, end: int | None = None) -> re.Match | None:
    """The last `"usage"` key of `body` whose value is a whole object; None when there is none."""
    end = len(body) if end is None else end
    while (at := body.rfind(USAGE_KEY, 0, end)) >= 0:
        match = USAGE_OBJECT.match(body, at)
        if match is not None:
            return match
        end = at
    return None


def _int_after(data: bytes, marker: bytes) -> int | None:
    at = data.find(marker)
    if at < 0:
        return None
    start = end = at + len(marker)
    while end < len(data) and 0x30 <= data[end] <= 0x39:
        end += 1
    return int(data[start:end]) if end > start else None


def _data_of(event: bytes) -> dict | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                value = orjson.loads(line[5:].strip())
            except orjson.JSONDecodeError:
                return None
            return value if isinstance(value, dict) else None
    return None


OPENAI = OpenAIDialect()
ANTHROPIC = AnthropicDialect()
RESPONSES = ResponsesDialect()
