"""Which request fields reach an engine: those the public APIs define, per route, and nothing else.

An engine trusts its caller: vLLM reads engine-internal fields (`kv_transfer_params`, `cache_salt`, `priority`,
a whole `chat_template`, custom logits processors) from the same JSON body as the sampling parameters. A client's
body is therefore cut down to its route's public fields (routing/rendering/routes.py, listed in docs/request-fields.md)
before it is forwarded; the router then sets the internal ones itself. A field that would change how the prompt
is rendered, or that makes the engine fetch a URL, is refused with a 400 rather than dropped, so the client learns
why its request would not mean what it asked.
"""

from __future__ import annotations

from routing.rendering.dialects import RESPONSES
from routing.rendering.routes import ROUTES

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
MEDIA_KEYS = frozenset((*MEDIA_URL_KEYS, "source"))
# A model's tool call carries its arguments under `input`: what they name is not media for the engine.
TOOL_CALLS = frozenset({"tool_use", "server_tool_use"})


def remote_media(payload: dict, path: str) -> str | None:
    """Where the first media part that names a URL for the engine to fetch (rather than carrying its data) is,
    as `messages[i].content[j]`, or None. Every part at any depth of the conversation counts (tool results and
    Responses tool outputs too), typed or not. The parsed request is walked, not its bytes scanned: a key can be
    written with JSON escapes (`"image\\u005furl"`). An engine fetching a client's URL would reach whatever the
    engine's network reaches."""
    route = ROUTES[path]
    if not route.templated:
        return None  # a text prompt or token ids: no parts
    conversation = payload.get(route.prompt)
    if not isinstance(conversation, dict | list) or not _any_fetching(conversation):
        return None
    return _fetching_part(conversation, route.prompt)


def _any_fetching(value: dict | list) -> bool:
    """Whether any part under `value` fetches: the walk every request takes, without building paths (about
    0.5 ms for a 550-message agent conversation, against 3 ms with them)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if not MEDIA_KEYS.isdisjoint(item) and _fetches(item):
                return True
            call = item.get("type") in TOOL_CALLS
            stack.extend(
                child
                for name, child in item.items()
                if isinstance(child, dict | list) and not (call and name == "input")
            )
        else:
            stack.extend(child for child in item if isinstance(child, dict | list))
    return False


def _fetching_part(value, where: str) -> str | None:
    """Where the first fetching part under `value` is (walked once `_any_fetching` found one)."""
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
