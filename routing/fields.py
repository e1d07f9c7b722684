"""Which request fields reach an engine: those the public APIs define, per route, and nothing else.

An engine trusts its caller: vLLM reads engine-internal fields (`kv_transfer_params`, `cache_salt`, `priority`,
a whole `chat_template`, custom logits processors) from the same JSON body as the sampling parameters. A client's
body is therefore cut down to its route's public fields (routing/routes.py, listed in docs/request-fields.md)
before it is forwarded; the router then sets the internal ones itself. A field that would change how the prompt
is rendered, or that makes the engine fetch a URL, is refused with a 400 rather than dropped, so the client learns
why its request would not mean what it asked.
"""

from __future__ import annotations

from .dialects import RESPONSES
from .routes import ROUTES

# Fields a client may not set, with what to do instead: each would change what the engine renders or runs.
REFUSED = {
    "chat_template": "The chat template is the deployment's: ask the operator to change it, or remove "
    "`chat_template` from the request.",
    "logits_processors": "Custom logits processors are not available through this gateway: remove "
    "`logits_processors`.",
}


class FieldError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def public_fields(payload: dict, path: str) -> tuple[dict, list[str]]:
    """The request as the engine may see it, and the names of the fields dropped (for the log and a header).
    Raises FieldError for a field that must not be silently dropped."""
    route = ROUTES[path]
    allowed = route.fields
    for name, reason in REFUSED.items():
        if name in payload:
            raise FieldError(reason, name)
    template_options = payload.get("chat_template_kwargs")
    if isinstance(template_options, dict) and "chat_template" in template_options:
        raise FieldError(REFUSED["chat_template"], "chat_template_kwargs")
    if route.dialect is RESPONSES and payload.get("background"):
        raise FieldError(
            "Background responses are not available: this gateway keeps no stored responses. Remove "
            "`background`, and stream the answer or wait for it.",
            "background",
        )
    if payload.keys() <= allowed:
        return payload, []
    kept = {name: value for name, value in payload.items() if name in allowed}
    return kept, sorted(name for name in payload if name not in allowed)


# A media part names its media by key, whether or not it has a `type` (vLLM reads `{"image_url": ...}` without
# one as an image): a URL under one of these keys, or an Anthropic `source` of type `url`, is fetched by the engine.
MEDIA_URL_KEYS = ("image_url", "audio_url", "video_url", "file_url")
# In a request's JSON, a key or a `type` value that may name a URL to fetch (inside a string the quotes are
# escaped, so a text cannot hold these): a request without any is not walked.
MEDIA_URL_MARKERS = (b'_url"', b'"type":"url"', b'"type": "url"')
# A model's tool call carries its arguments under `input`: what they name is not media for the engine.
TOOL_CALLS = frozenset({"tool_use", "server_tool_use"})


def remote_media(payload: dict, path: str, body: bytes | None = None) -> str | None:
    """Where the first media part that names a URL for the engine to fetch (rather than carrying its data) is,
    as `messages[i].content[j]`, or None. Every part at any depth of the conversation counts (tool results and
    Responses tool outputs too), typed or not. `body`: the request's JSON, to skip the walk when it holds no
    marker of a URL. An engine fetching a client's URL would reach whatever the engine's network reaches."""
    if body is not None and not any(marker in body for marker in MEDIA_URL_MARKERS):
        return None
    route = ROUTES[path]
    if not route.templated:
        return None  # a text prompt or token ids: no parts
    return _fetching_part(payload.get(route.prompt), route.prompt)


def _fetching_part(value, where: str) -> str | None:
    if isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, dict | list):
                found = _fetching_part(item, f"{where}[{index}]")
                if found is not None:
                    return found
        return None
    if not isinstance(value, dict):
        return None
    if _fetches(value):
        return where
    call = value.get("type") in TOOL_CALLS
    for name, item in value.items():
        if isinstance(item, dict | list) and not (call and name == "input"):
            found = _fetching_part(item, f"{where}.{name}")
            if found is not None:
                return found
    return None


def _fetches(part: dict) -> bool:
    for name in MEDIA_URL_KEYS:
        value = part.get(name)
        if value is not None:
            url = value.get("url") if isinstance(value, dict) else value
            if isinstance(url, str) and not url.startswith("data:"):
                return True
    source = part.get("source")
    return isinstance(source, dict) and source.get("type") == "url"
