"""The two API dialects agents speak: OpenAI's and Anthropic's. Errors and usage in each one's own shapes."""

from __future__ import annotations

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
}


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reported: bool = False  # the engine said so (rather than the router counting streamed chunks)


class Dialect:
    name = "openai"
    # Events that carry usage or end the stream contain one of these; a run of events before the first of them
    # is passed on whole, its content events counted with CONTENT_MARKER (once in each content event's JSON; a
    # string inside the JSON cannot hold it, since its quotes are escaped there). None: look at every event.
    SPECIAL_MARKERS: tuple[bytes, ...] | None = (b'"usage"', b"[DONE]")
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
        """Whether this stream event is the one with the final usage: a byte test, cheap for every event."""
        return b'"usage"' in event and b'"choices":[]' in event

    def usage_from_event(self, event: bytes) -> Usage | None:
        """Usage if this stream event carries the final usage, else None."""
        if not self.carries_usage(event):
            return None
        data = _data_of(event)
        return self.usage_from_body(data) if data else None

    def is_usage_only_event(self, event: bytes) -> bool:
        return b'"choices":[]' in event and b'"usage"' in event

    def is_content_event(self, event: bytes) -> bool:
        return event.startswith(b"data: {") and b'"choices":[{' in event

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

    def is_terminal_event(self, event: bytes) -> bool:
        return event.startswith(b"data: [DONE]")


class AnthropicDialect(Dialect):
    name = "anthropic"
    SPECIAL_MARKERS = None

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

    def is_usage_only_event(self, event: bytes) -> bool:
        return False

    def is_content_event(self, event: bytes) -> bool:
        return b"content_block_delta" in event

    def is_terminal_event(self, event: bytes) -> bool:
        return event.startswith(b"event: message_stop")


class ResponsesDialect(Dialect):
    """OpenAI's Responses API: usage arrives in `response.completed`."""

    name = "responses"
    SPECIAL_MARKERS = None

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

    def is_usage_only_event(self, event: bytes) -> bool:
        return False

    def is_content_event(self, event: bytes) -> bool:
        return b"output_text.delta" in event

    def is_terminal_event(self, event: bytes) -> bool:
        return b"response.completed" in event.split(b"\n", 1)[0]


def _data_of(event: bytes) -> dict | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                value = orjson.loads(line[5:].strip())
            except orjson.JSONDecodeError:
                return None
            return value if isinstance(value, dict) else None
    return None


OPENAI = Dialect()
ANTHROPIC = AnthropicDialect()
RESPONSES = ResponsesDialect()
