"""A generation request from bytes to checked fields, as pure functions: authentication against the snapshot,
reading and parsing the body, the deployment it names, the fields sent on to the engine, and the limits checked
before admission (with the token bounds the reservation takes). Each refusal is an HttpError.

Over 400 lines: one check per field the router acts on, each with the message that says what to fix; `validate`
reads them in order."""

from __future__ import annotations

import hmac
import logging
from array import array
from datetime import UTC, datetime
from typing import Protocol
from weakref import WeakKeyDictionary

import orjson

from routing.info import DeploymentInfo, KeyInfo
from routing.rendering.conversion import first_media_part
from routing.rendering.dialects import ANTHROPIC, Dialect
from routing.rendering.fields import FieldError, public_fields, remote_media
from routing.rendering.routes import ROUTES
from routing.rendering.tokenize import RouterTokenizer, token_ids
from routing.scheduling.flow import CLASSES as PRIORITY_CLASSES
from routing.scheduling.pipeline import RequestContext
from routing.server import metrics
from routing.server.wire import Receive, header
from routing.snapshot import Snapshot

log = logging.getLogger(__name__)

# A token is a few bytes of text; JSON escapes, per-message structure and inline media take more.
BODY_BYTES_PER_TOKEN = 32
BODY_FLOOR_BYTES = 1024 * 1024


class ClientGone(Exception):
    pass


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


class Tokenizers(Protocol):
    def tokenizer_for(self, deployment: DeploymentInfo) -> RouterTokenizer | None: ...


def authenticate(snapshot: Snapshot, headers: list, pepper: bytes, keys_unconfirmed: bool) -> KeyInfo:
    """The key a request's `Authorization: Bearer` or `x-api-key` header names, from the snapshot.
    `keys_unconfirmed`: revocations could not be read for too long, so every key is refused (503)."""
    raw = None
    for name, value in headers:
        if name == b"authorization":
            parts = value.split(None, 1)
            if len(parts) == 2 and parts[0].lower() == b"bearer":
                raw = parts[1].strip()
        elif name == b"x-api-key":
            raw = value.strip()
    if not raw:
        raise HttpError(401, "Missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`.")
    if keys_unconfirmed:
        # Refuse rather than trust keys that may be revoked.
        raise HttpError(
            503,
            "The gateway cannot confirm API keys right now (its configuration store is unreachable). "
            "Retry shortly.",
            headers={"retry-after": "5"},
        )
    digest = hmac.new(pepper, raw, "sha256").hexdigest()
    key = snapshot.keys.get(digest)
    if key is None:
        raise HttpError(401, "Invalid, expired or revoked API key.")
    if key.expires_at is not None and key.expires_at <= datetime.now(UTC):
        raise HttpError(401, "This API key has expired.")
    if "inference" not in key.scopes:
        raise HttpError(403, "This API key lacks the inference scope.")
    return key


def body_limit(snapshot: Snapshot, ceiling: int) -> int:
    """The largest request body worth reading: what the longest context served could take as JSON (with room
    for inline images), never over ROUTER_MAX_BODY_BYTES."""
    longest = max((d.max_model_len for d in snapshot.deployments.values()), default=0)
    return min(ceiling, max(BODY_FLOOR_BYTES, longest * BODY_BYTES_PER_TOKEN + BODY_FLOOR_BYTES))


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HttpError(
                413, f"The request body is over the limit of {limit} bytes. Send a shorter prompt."
            )
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def parse(body: bytes) -> dict:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HttpError(400, f"The request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise HttpError(400, "The request body must be a JSON object.")
    return payload


def dumps(value) -> bytes:
    """JSON of a parsed request, or a 400: orjson parses nesting up to 1,024 levels deep but writes only 254."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise HttpError(400, f"The request cannot be forwarded: {exc}. Nest its JSON less deeply.") from None


def deployment_for(snapshot: Snapshot, payload: dict, key: KeyInfo) -> DeploymentInfo:
    """The deployment the request's `model` names, for this key: a served model's name or one of its tenant's
    aliases, which it may call. A model the key may not call is answered as one that does not exist. The
    payload's `model` becomes the served name (what the engines know)."""
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise HttpError(400, "Name the model: `model` is required.", "model")
    deployment = snapshot.deployment_for_key(key, model)
    if deployment is None:
        raise HttpError(
            404, f"The model `{model}` does not exist. GET /v1/models lists the models served.", "model"
        )
    payload["model"] = deployment.served_model_name
    return deployment


PRIORITY_HEADER = b"x-priority-class"


def priority_for(scope: dict, key: KeyInfo) -> str:
    """The request's class: its key's, or a lower one it asks for in `X-Priority-Class`."""
    asked = header(scope, PRIORITY_HEADER)
    if asked is None or asked == "":
        return key.priority_class
    asked = asked.strip().lower()
    if asked not in PRIORITY_CLASSES:
        raise HttpError(
            400, f"`X-Priority-Class` must be one of {', '.join(PRIORITY_CLASSES)}; got `{asked}`.", None
        )
    if PRIORITY_CLASSES.index(asked) < PRIORITY_CLASSES.index(key.priority_class):
        raise HttpError(
            403,
            f"This key's requests are `{key.priority_class}` at most: ask for `{key.priority_class}` or a lower "
            "class, or have a team admin raise the key's class.",
            None,
        )
    return asked


def engine_fields(payload: dict, path: str, key: KeyInfo) -> dict:
    """The request cut down to what the public API of its route defines (routing/rendering/fields.py), with the
    engine-internal fields set by the router: the tenant's cache salt."""
    try:
        payload, dropped = public_fields(payload, path)
    except FieldError as exc:
        raise HttpError(400, str(exc), exc.param) from None
    if dropped:
        metrics.dropped_fields.inc(len(dropped))
        log.debug("dropped fields %s from a request to %s", dropped, path)
    refuse_remote_media(payload, path)
    if key.cache_salt:
        payload["cache_salt"] = key.cache_salt
    return payload


def refuse_remote_media(payload: dict, path: str) -> None:
    """A 400 for a media part that names a URL (routing/rendering/fields.py `remote_media`), on every route that reaches an
    engine: engines fetch nothing on a client's behalf."""
    remote = remote_media(payload, path)
    if remote is not None:
        raise HttpError(
            400,
            f"`{remote}` links to media by URL; engines fetch nothing on a client's behalf. Send the data "
            "inline: a base64 `data:` URL, or an Anthropic `base64` source.",
            remote.split("[", 1)[0],
        )


def validate(
    payload: dict,
    deployment: DeploymentInfo,
    dialect: Dialect,
    prompt_ids: array | None,
    path: str,
    max_messages: int,
    max_choices: int,
    tokenizers: Tokenizers,
) -> tuple[int, int]:
    """Check limits and return upper bounds of the prompt's and the answer's tokens, for reservations. A `prompt`
    that is a list of one prompt is replaced in `payload` by that prompt."""
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise HttpError(
            400, '`stream_options` must be an object, e.g. {"include_usage": true}.', "stream_options"
        )
    check_field_types(payload, path)
    messages = payload.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "`messages` must be a non-empty list.", "messages")
        if len(messages) > max_messages:
            raise HttpError(
                400, f"Too many messages: {len(messages)}; the limit is {max_messages}.", "messages"
            )
        media = first_media_part(messages)
        if media is not None:
            tokenizer = tokenizers.tokenizer_for(deployment)
            if tokenizer is not None and not tokenizer.multimodal:
                raise HttpError(
                    400,
                    f"The model `{deployment.served_model_name}` takes text only, and this request has "
                    f"a `{media}` part. Send the content as text, or use a model that takes {media} input.",
                    "messages",
                )
    limit = deployment.max_model_len
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) > 1:
            raise HttpError(
                400,
                f"`prompt` holds {len(prompt)} prompts; this gateway takes one prompt per request (each is "
                "routed to the engine that holds its prefix). Send them as separate requests.",
                "prompt",
            )
        payload["prompt"] = prompt = prompt[0]
        prompt_ids = token_ids(prompt)
    if prompt_ids is not None and len(prompt_ids) >= limit:
        raise HttpError(
            400,
            f"The prompt is {len(prompt_ids)} tokens, but the model's context is {limit} tokens. "
            "Send a shorter prompt.",
            "prompt",
        )
    field, max_tokens = output_limit(payload, path)
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise HttpError(400, f"`{field}` must be a positive integer.", field)
        if max_tokens > limit:
            raise HttpError(
                400,
                f"`{field}` is {max_tokens}, but the model's context is {limit} tokens. "
                "Ask for fewer output tokens.",
                field,
            )
    elif dialect is ANTHROPIC:
        raise HttpError(400, f"`{field}` is required.", field)
    choices = payload.get("n", 1)
    if choices is None:
        choices = 1
    if not isinstance(choices, int) or isinstance(choices, bool) or not 1 <= choices <= max_choices:
        raise HttpError(
            400,
            f"`n` must be an integer from 1 to {max_choices}: the answers this request may have.",
            "n",
        )
    best_of = payload.get("best_of")
    if best_of is not None and best_of != 1:
        raise HttpError(
            400, "`best_of` is not supported: remove it, or use `n` for several answers.", "best_of"
        )
    if prompt_ids is not None:
        prompt_bound = len(prompt_ids)
    else:
        tokenizer = tokenizers.tokenizer_for(deployment)
        overhead = template_overhead(tokenizer, bool(payload.get("tools"))) if tokenizer else 0
        prompt_bound = prompt_token_bound(payload, overhead)
    # Each of the n answers may run to max_tokens, or to the end of the context when none is set.
    return min(prompt_bound, limit), (max_tokens or limit) * choices


# Fields the router acts on (or bounds the answer by), with the JSON type the public API gives each on a route.
# vLLM's models read some other types leniently (the string "false" as false, 5.0 or "5" as 5); a value of another
# type is refused here, so the router and the engine cannot read one request two ways (a stream the router takes
# for a whole answer, an answer it takes for a stream and bills nothing).
BOOLEAN, INTEGER = "boolean", "integer"
FIELD_TYPES = {
    "stream": BOOLEAN,
    "echo": BOOLEAN,
    "n": INTEGER,
    "max_tokens": INTEGER,
    "max_completion_tokens": INTEGER,
    "max_output_tokens": INTEGER,
    "top_logprobs": INTEGER,
    "prompt_logprobs": INTEGER,
}
STREAM_OPTION_TYPES = {"include_usage": BOOLEAN, "continuous_usage_stats": BOOLEAN}


def check_field_types(payload: dict, path: str) -> None:
    """Refuse (400) a field the router acts on whose value is not of its public JSON type (null is the default)."""
    for field, kind in FIELD_TYPES.items():
        _check_type(payload.get(field), kind, field)
    # `logprobs`: whether to return them on chat completions, how many on text completions.
    _check_type(payload.get("logprobs"), BOOLEAN if ROUTES[path].templated else INTEGER, "logprobs")
    options = payload.get("stream_options")
    for field, kind in STREAM_OPTION_TYPES.items() if isinstance(options, dict) else ():
        _check_type(options.get(field), kind, f"stream_options.{field}")


STOP_FIELDS = ("stop", "stop_sequences")  # OpenAI's routes and Responses; Anthropic's messages


def check_stop(payload: dict, max_sequences: int, max_bytes: int) -> None:
    """Refuse (400) stop sequences that are not strings, or more of them than `max_sequences`, or more UTF-8 bytes
    in all than `max_bytes` (ROUTER_MAX_STOP_SEQUENCES, ROUTER_MAX_STOP_BYTES): the engine matches each against
    the answer as it grows, and nothing else bounds them but the body's size."""
    for field in STOP_FIELDS:
        value = payload.get(field)
        if value is None:
            continue
        sequences = [value] if isinstance(value, str) and field == "stop" else value
        if not isinstance(sequences, list):
            kind = "a string or an array of strings" if field == "stop" else "an array of strings"
            raise HttpError(400, f"`{field}` must be {kind}, not {_json_type(value)}.", field)
        for index, sequence in enumerate(sequences):
            if not isinstance(sequence, str):
                raise HttpError(
                    400, f"`{field}[{index}]` must be a string, not {_json_type(sequence)}.", field
                )
        if len(sequences) > max_sequences:
            raise HttpError(
                400,
                f"`{field}` holds {len(sequences)} stop sequences; the limit is {max_sequences}. Send fewer.",
                field,
            )
        size = sum(len(sequence.encode(errors="surrogatepass")) for sequence in sequences)
        if size > max_bytes:
            raise HttpError(
                400,
                f"`{field}` holds {size} bytes of stop sequences (UTF-8); the limit is {max_bytes}. "
                "Send shorter or fewer.",
                field,
            )


def _check_type(value, kind: str, field: str) -> None:
    if value is None:
        return
    if kind == BOOLEAN:
        if isinstance(value, bool):
            return
        example = "true or false"
    else:
        if isinstance(value, int) and not isinstance(value, bool):
            return
        example = "a whole number such as 16"
    shown = dumps(value)[:40].decode(errors="replace")
    raise HttpError(
        400, f"`{field}` must be a JSON {kind} ({example}), not {_json_type(value)} {shown}.", field
    )


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "the boolean"
    if isinstance(value, int | float):
        return "the number"
    if isinstance(value, str):
        return "the string"
    return "the array" if isinstance(value, list) else "the object"


def over_context(
    deployment: DeploymentInfo, payload: dict, ctx: RequestContext, path: str
) -> HttpError | None:
    """As the engine would refuse it: a prompt that fills the context, or leaves less than `max_tokens`."""
    prompt = ctx.prompt_tokens_estimate
    if not prompt:
        return None
    limit = deployment.max_model_len
    field, max_tokens = output_limit(payload, path)
    param = "prompt" if "prompt" in payload else ROUTES[path].prompt
    if prompt >= limit:
        return HttpError(
            400,
            f"The prompt is {prompt} tokens, but the model's context is {limit} tokens. Shorten it.",
            param,
        )
    if isinstance(max_tokens, int) and prompt + max_tokens > limit:
        return HttpError(
            400,
            f"The prompt is {prompt} tokens and `{field}` asks for {max_tokens} more, but the model's context "
            f"is {limit} tokens. Ask for at most {limit - prompt} output tokens, or shorten the prompt.",
            field,
        )
    return None


def over_logprob_limit(
    payload: dict, ctx: RequestContext, path: str, input_bound: int, max_entries: int
) -> HttpError | None:
    """Prompt logprobs make an answer of some 70 bytes per prompt token and logprob, which the engine sends whole
    (they cannot be streamed): `prompt_logprobs`, or a completion's `echo` with `logprobs`. A request may ask
    for ROUTER_MAX_PROMPT_LOGPROB_ENTRIES of them (prompt tokens x (logprobs + 1)), the prompt counted by the
    router (or bounded by its bytes when it was not)."""
    asked, field = payload.get("prompt_logprobs"), "prompt_logprobs"
    if asked is None and not ROUTES[path].templated and payload.get("echo"):
        asked, field = payload.get("logprobs"), "logprobs"
    if not isinstance(asked, int) or isinstance(asked, bool):
        return None
    if asked < 0:
        return HttpError(
            400,
            f"`{field}: {asked}` asks for the whole vocabulary's logprobs at every prompt token. Ask for a "
            "number of them (0 for the prompt tokens' own).",
            field,
        )
    prompt = ctx.prompt_tokens_estimate or input_bound
    entries = prompt * (asked + 1)
    if entries <= max_entries:
        return None
    counted = "is" if ctx.prompt_tokens_estimate else "may be up to"
    return HttpError(
        400,
        f"The prompt {counted} {prompt} tokens, and `{field}: {asked}` asks for {asked + 1} logprobs at each: "
        f"{entries} in all, over this gateway's limit of {max_entries}. Ask for fewer, or send a shorter prompt.",
        field,
    )


def output_limit(payload: dict, path: str) -> tuple[str, object]:
    """The output limit the engine reads on this route, and its field (routing/rendering/routes.py: `max_completion_tokens`,
    else `max_tokens`, on chat completions, `max_output_tokens` on responses). Only that field sets the
    reservation, so no other field can make it smaller than the answer."""
    return ROUTES[path].output_limit_of(payload)


_overheads: WeakKeyDictionary = WeakKeyDictionary()


def template_overhead(tokenizer: RouterTokenizer, tools: bool) -> int:
    """The bytes a model's chat template writes around an empty conversation (its default system prompt, its role
    markers, with `tools` its instructions for calling them): worked out once per template, and the template's
    whole source when it cannot be rendered so."""
    known = _overheads.setdefault(tokenizer, {})
    if tools not in known:
        payload: dict = {"messages": [{"role": "user", "content": ""}]}
        if tools:
            payload["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        try:
            known[tools] = len(tokenizer.render(tokenizer.chat_inputs(payload)).encode())
        except Exception:  # a template that refuses an empty conversation
            known[tools] = len(tokenizer.template_source.encode())
    return known[tools]


def prompt_token_bound(payload: dict, template_chars: int = 0) -> int:
    """An upper bound of the prompt's tokens without tokenising (a prompt not given as token ids): byte-level BPE
    tokens cover at least one byte each, and every field that can reach the prompt (`messages`, `system`,
    `instructions`, `input`, `tools`, `documents`, `chat_template_kwargs`, ...) is in the request's JSON, so its
    bytes bound them all; plus what the chat template writes around a conversation (`template_chars`, from
    `template_overhead`), a few tokens per message for its role markers, and the tools once more (a template
    writes them out with spaces after separators). A request cut
    short pays this when the router did not tokenize it, and admission reserves it: no field can make either
    smaller than the prompt."""
    messages = payload.get("messages")
    tools = payload.get("tools")
    bound = len(dumps(payload)) + template_chars + 16
    bound += 8 * (len(messages) if isinstance(messages, list) else 1)
    return bound + (len(dumps(tools)) if tools else 0)
