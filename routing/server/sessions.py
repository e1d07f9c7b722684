"""Which session a request belongs to, for session affinity (routing/scheduling/affinity.py's SessionMap, the `session`
scorer): the id the client names, or the one its agent sends of its own accord.

In order of precedence:
1. `x-session-id`, the header this gateway documents;
2. Claude Code's `X-Claude-Code-Session-Id` header, then the `session_id` in its `metadata.user_id` (a JSON
   string: {"device_id": ..., "account_uuid": ..., "session_id": ...});
3. Codex's `x-codex-window-id` header, then `prompt_cache_key` (Codex's session id, in the Responses body;
   OpenAI's chat completions take it too; last, since an app may set one key for all its requests).

The id is hashed with the tenant's id, so two tenants naming the same session never share a mapping, and every key
the router keeps has the same bounded length whatever the client sent. An id longer than MAX_SESSION_CHARS is not
one any agent sends: it names no session (and costs no hashing). The map itself holds a bounded number of sessions,
least recently used dropped first (routing/scheduling/affinity.py).
"""

from __future__ import annotations

import hashlib

import orjson

from routing.server.wire import header

MAX_USER_ID = 4096  # characters of `metadata.user_id` worth parsing for a session id
MAX_SESSION_CHARS = 512  # agents send UUIDs and window ids; anything longer is no session id

SESSION_HEADERS = (b"x-session-id", b"x-claude-code-session-id")


def session_key(scope: dict, payload: dict, tenant_id: int) -> str | None:
    """The request's session, hashed and scoped to the tenant, or None when it names none."""
    named = _named_session(scope, payload)
    if not named or len(named) > MAX_SESSION_CHARS:
        return None
    return hashlib.blake2b(f"{tenant_id}\0{named}".encode(), digest_size=16).hexdigest()


def _named_session(scope: dict, payload: dict) -> str | None:
    for name in SESSION_HEADERS:
        value = header(scope, name)
        if value:
            return value
    named = _claude_code_session(payload.get("metadata"))
    if named:
        return named
    window = header(scope, b"x-codex-window-id")
    if window:
        return window
    # Last: OpenAI describes it as a key for requests that share a prefix, which an app may set once for all.
    key = payload.get("prompt_cache_key")
    return key if isinstance(key, str) and key else None


def _claude_code_session(metadata) -> str | None:
    """The `session_id` inside Claude Code's `metadata.user_id`, when it is the JSON string Claude Code sends."""
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user_id, str) or not user_id.startswith("{") or len(user_id) > MAX_USER_ID:
        return None
    try:
        fields = orjson.loads(user_id)
    except orjson.JSONDecodeError:
        return None
    session = fields.get("session_id") if isinstance(fields, dict) else None
    return session if isinstance(session, str) and session else None
