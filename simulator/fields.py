"""The request fields that decide how a request is served (`stream`, `stream_options`, `n`, `max_tokens` and its
siblings, `logprobs`, `top_logprobs`, `prompt_logprobs`, `echo`), read as vLLM 0.32's pydantic request models read
them: in pydantic's lax mode, so the strings "false", "0" and "no" are false, "3", " 3 " and 3.0 are 3, while 3.5,
"maybe", a list or an object are refused with a 400 in pydantic's words. pydantic itself does the reading, so the
two agree value for value.

Some checks run before the types, on the raw body (the models' `mode="before"` validators): stream options with no
truthy `stream`, logprob counts that are not numbers. They run here in the same order and with the same raw
truthiness ("false" counts as a stream there)."""

from __future__ import annotations

from pydantic import BaseModel, TypeAdapter, ValidationError

from .errors import ApiError, bad_param, invalid, problem, validation_error

# vLLM's limits: VLLM_MAX_N_SEQUENCES, and the engine's default max_logprobs.
MAX_N = 16384
MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


BOOLEAN = TypeAdapter(bool)
OPTIONAL_BOOLEAN = TypeAdapter(bool | None)
INTEGER = TypeAdapter(int)
OPTIONAL_INTEGER = TypeAdapter(int | None)
OPTIONAL_STREAM_OPTIONS = TypeAdapter(StreamOptions | None)

# Each route's fields in its request model's order (pydantic reports problems in that order), with their types.
CHAT = {
    "logprobs": OPTIONAL_BOOLEAN,
    "top_logprobs": OPTIONAL_INTEGER,  # null reads as 0
    "max_tokens": OPTIONAL_INTEGER,
    "max_completion_tokens": OPTIONAL_INTEGER,
    "n": OPTIONAL_INTEGER,
    "stream": OPTIONAL_BOOLEAN,
    "stream_options": OPTIONAL_STREAM_OPTIONS,
    "prompt_logprobs": OPTIONAL_INTEGER,
    "echo": BOOLEAN,
}
COMPLETION = {
    "echo": OPTIONAL_BOOLEAN,
    "logprobs": OPTIONAL_INTEGER,
    "max_tokens": OPTIONAL_INTEGER,
    "n": INTEGER,
    "stream": OPTIONAL_BOOLEAN,
    "stream_options": OPTIONAL_STREAM_OPTIONS,
    "prompt_logprobs": OPTIONAL_INTEGER,
}
MESSAGES = {"max_tokens": INTEGER, "stream": OPTIONAL_BOOLEAN}
RESPONSES = {
    "max_output_tokens": OPTIONAL_INTEGER,
    "stream": OPTIONAL_BOOLEAN,
    "top_logprobs": OPTIONAL_INTEGER,
}


def read_chat(body: dict, vocab_size: int) -> dict:
    """A chat-completions body with its typed fields read as vLLM reads them (or an ApiError as it refuses)."""
    _stream_options_need_stream(body)
    _logprob_counts(body, ("prompt_logprobs", "top_logprobs"))
    top = body.get("top_logprobs")
    if top is not None:
        if top < 0 and top != -1:
            raise bad_param("`top_logprobs` must be a positive value or -1.", "top_logprobs", top)
        if (top == -1 or top > 0) and not body.get("logprobs"):
            raise invalid("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    read = _typed(body, CHAT)
    _check_choices(read)
    if read.get("logprobs"):
        _check_logprob_limit(read.get("top_logprobs"), "Requested sample logprobs", "logprobs", vocab_size)
    _check_logprob_limit(
        read.get("prompt_logprobs"), "Requested prompt logprobs", "prompt_logprobs", vocab_size
    )
    return read


def read_completion(body: dict, vocab_size: int) -> dict:
    """A completions body with its typed fields read as vLLM reads them: a null `max_tokens` is its default, 16."""
    _logprob_counts(body, ("prompt_logprobs", "logprobs"))
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs < 0 and logprobs != -1:
        raise bad_param("`logprobs` must be a positive value or -1.", "logprobs", logprobs)
    _stream_options_need_stream(body)
    read = _typed(body, COMPLETION)
    if read.get("max_tokens") is None:
        read["max_tokens"] = 16
    _check_choices(read)
    _check_logprob_limit(read.get("logprobs"), "Requested sample logprobs", "logprobs", vocab_size)
    _check_logprob_limit(
        read.get("prompt_logprobs"), "Requested prompt logprobs", "prompt_logprobs", vocab_size
    )
    return read


def read_messages(body: dict) -> dict:
    """An Anthropic Messages body's `max_tokens` (required) and `stream`, as its request model reads them."""
    return _typed(body, MESSAGES)


def read_responses(body: dict) -> dict:
    return _typed(body, RESPONSES)


def stream_options(read: dict) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a read body."""
    options = read.get("stream_options")
    if options is None:
        return False, False
    return bool(options.include_usage), bool(options.continuous_usage_stats)


def _check_logprob_limit(asked, words: str, param: str, vocab_size: int) -> None:
    """The engine's bound on logprobs per token; -1 (all of them) is the vocabulary's size."""
    if asked is None:
        return
    count = vocab_size if asked == -1 else asked
    if count > MAX_LOGPROBS:
        raise bad_param(
            f"{words} of {count}, which is greater than max allowed: {MAX_LOGPROBS}", param, count
        )


def _stream_options_need_stream(body: dict) -> None:
    if body.get("stream_options") and not body.get("stream"):
        raise invalid("Stream options can only be defined when `stream=True`.", "stream_options")


def _logprob_counts(body: dict, names: tuple[str, str]) -> None:
    """The raw-body check of logprob counts: not a number is refused before the types are read; a negative
    prompt_logprobs other than -1 too, and prompt logprobs on a stream."""
    for name in names:
        value = body.get(name)
        if value is not None and not isinstance(value, int | float):
            raise bad_param(f"`{name}` must be an integer.", name, value)
    prompt = body.get("prompt_logprobs")
    if prompt is not None:
        if body.get("stream") and (prompt > 0 or prompt == -1):
            raise invalid("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if prompt < 0 and prompt != -1:
            raise bad_param("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs", prompt)


def _check_choices(read: dict) -> None:
    n = read.get("n")
    if n is None:
        return
    if n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise ApiError(
            400,
            f"n must be at most {MAX_N}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
            "environment variable.",
        )


def _typed(body: dict, fields: dict[str, TypeAdapter]) -> dict:
    """The body with each field present read through its type; every field's problems together, as pydantic
    reports them (a field that is absent keeps its default, which is the caller's)."""
    read = dict(body)
    problems = []
    for name, adapter in fields.items():
        if name not in body:
            continue
        try:
            read[name] = adapter.validate_python(body[name], from_attributes=True)  # as FastAPI reads a body
        except ValidationError as exc:
            for error in exc.errors(include_url=False):
                loc = ".".join(["body", name, *(str(part) for part in error["loc"])])
                problems.append(problem(error["type"], loc, error["msg"], error["input"], error.get("ctx")))
    if problems:
        raise validation_error(problems)
    return read
