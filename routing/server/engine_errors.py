"""What an engine's refusal becomes for the client: JSON in the dialect of the route the client called (OpenAI's
chat and text completions, Anthropic's messages, OpenAI's Responses), with the engine's status, and never the
engine's name or address. Agents act on the status and the JSON's shape: the Codex CLI retries a non-JSON answer
five times and gives up, the SDKs raise their typed errors only from their own error shapes.

- A JSON error already in the client's dialect passes through as the engine wrote it.
- A JSON error in another known shape keeps its status and message, rewritten in the client's dialect: vLLM
  answers validation errors on /v1/messages in OpenAI's shape; FastAPI writes `{"detail": ...}`; older vLLM
  writes `{"object": "error", "message": ...}`.
- A 404 or 405 without an error envelope (aiohttp's plain-text `404: Not Found`, FastAPI's `{"detail": "Not
  Found"}`) means the engine lacks the route: `route_missing`. The exchange then tries another engine of the
  deployment (during a rollout of a new engine image some engines may serve the route and others not; the try
  costs one round trip and no compute), and when none serves it the client gets `route_missing_body`: a 404 in
  its dialect saying that the model's engines do not serve that API.
- Any other body (plain text, a proxy's HTML page) becomes a generic message with the engine's status.

An engine's 5xx, a connection that cannot be made and a first token that does not come are the exchange's to
handle (routing/server/exchange.py): another engine is tried, and the client gets a 502 or 504 in its dialect.
"""

from __future__ import annotations

import re
from typing import NamedTuple
from urllib.parse import urlsplit

import orjson

from routing.rendering.dialects import ANTHROPIC, Dialect
from routing.rendering.routes import ROUTES, listed

MAX_MESSAGE = 2000  # characters of an engine's message passed on


class Refusal(NamedTuple):
    status: int
    body: bytes  # JSON, in the client's dialect
    route_missing: bool  # the engine lacks the route: another engine may have it


def refusal(dialect: Dialect, status: int, body: bytes, engine_url: str) -> Refusal:
    """An engine's non-200 answer below 500 (`status`, `body`), as the client is to see it."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    message = _message(data)
    hidden = _hide_engine(message, engine_url) if message is not None else None
    if message is None and status in (404, 405):
        return Refusal(status, b"", True)
    if hidden is not None and hidden == message and _in_dialect(dialect, data):
        return Refusal(status, body, False)
    if hidden is None:
        hidden = f"The model's engine refused the request with status {status}, giving no reason."
    return Refusal(status, dialect.error_body(status, hidden[:MAX_MESSAGE]), False)


def route_missing_body(dialect: Dialect, model: str, path: str) -> bytes:
    message = (
        f"The engines serving `{model}` do not offer POST {path}: call this model through another API this "
        f"gateway serves ({listed(ROUTES, 'or')}), or ask the operator to deploy it on an engine that offers "
        "this one."
    )
    return dialect.error_body(404, message)


def _in_dialect(dialect: Dialect, data) -> bool:
    """Whether `data` is an error body in the dialect's own shape, as its SDK parses it."""
    if not isinstance(data, dict):
        return False
    error = data.get("error")
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return False
    if dialect is ANTHROPIC:
        return data.get("type") == "error" and isinstance(error.get("type"), str)
    return data.get("type") != "error"


def _message(data) -> str | None:
    """The message of an error body in any shape engines write, or None when it is no error envelope."""
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(error, str):
        return error
    if data.get("object") == "error" and isinstance(data.get("message"), str):
        return data["message"]
    detail = data.get("detail")
    if isinstance(detail, list) and detail:
        # FastAPI's validation errors: [{"loc": [...], "msg": ...}, ...]
        parts = []
        for item in detail[:5]:
            if isinstance(item, dict):
                where = ".".join(str(p) for p in item.get("loc") or () if p != "body")
                parts.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
        return "; ".join(parts) or None
    if isinstance(detail, str) and detail not in ("Not Found", "Method Not Allowed"):
        return detail
    return None


def _hide_engine(message: str, engine_url: str) -> str:
    """`message` without the engine's address in it: its URL, host and port, or host name (a Kubernetes service's
    short name such as `engine-a` too), in any case."""
    parts = urlsplit(engine_url)
    for name in (engine_url.rstrip("/"), parts.netloc, parts.hostname):
        if name and len(name) >= 3:
            message = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", "the engine", message, flags=re.I)
    return message
