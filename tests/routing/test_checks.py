"""Checking a request before admission, without a server: the requests are the bytes and headers the official
OpenAI and Anthropic SDKs build (captured on their way out), fed to routing/server/checks.py's functions."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import anthropic
import httpx
import httpx2
import openai
import orjson
import pytest
from django.conf import settings

from routing.info import DeploymentInfo, KeyInfo, PolicyInfo
from routing.kvindex.prefix import PrefixRouting
from routing.rendering.dialects import ANTHROPIC, OPENAI, RESPONSES
from routing.rendering.tokenize import RouterTokenizer, token_ids
from routing.scheduling.pipeline import RequestContext
from routing.server.checks import (
    BODY_FLOOR_BYTES,
    ClientGone,
    HttpError,
    authenticate,
    body_limit,
    deployment_for,
    dumps,
    engine_fields,
    output_limit,
    over_context,
    parse,
    priority_for,
    prompt_token_bound,
    read_body,
    template_overhead,
    validate,
)
from routing.server.redis_pool import router_redis
from routing.snapshot import Snapshot

from ..serving.engines import MODEL_DIR, MODEL_NAME

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)

SECRET = "ipk_abcdefghijkm_s3cret-for-unit-tests"
PEPPER = b"unit-test-pepper"
CONTEXT = 4096
MAX_MESSAGES, MAX_CHOICES = 50, 4


# --- what the SDKs send -----------------------------------------------------------------------------------------


class Sent:
    """One request as an SDK sent it, in the shapes the ASGI app receives: scope headers, path, body."""

    def __init__(self, request: httpx.Request | httpx2.Request):
        self.headers = [(name.lower(), value) for name, value in request.headers.raw]
        self.path = request.url.path
        self.body = request.read()

    @property
    def payload(self) -> dict:
        return orjson.loads(self.body)


def capture(make_call, http_module=httpx) -> Sent:
    """Run one SDK call against a transport that keeps the request and answers 503 (no retries). The OpenAI
    SDK speaks through httpx, the Anthropic SDK through httpx2."""
    sent: list = []

    def handler(request):
        sent.append(request)
        return http_module.Response(503, json={"error": {"message": "captured"}})

    http = http_module.Client(transport=http_module.MockTransport(handler))
    with pytest.raises((openai.APIError, anthropic.APIError)):
        make_call(http)
    assert len(sent) == 1
    return Sent(sent[0])


def openai_client(http, key: str = SECRET) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://router/v1", api_key=key, max_retries=0, http_client=http)


def anthropic_client(http, key: str = SECRET) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://router", api_key=key, max_retries=0, http_client=http)


def openai_chat(**fields) -> Sent:
    fields.setdefault("messages", [{"role": "user", "content": "Refactor parse() to return a list."}])
    return capture(lambda http: openai_client(http).chat.completions.create(model=MODEL_NAME, **fields))


def anthropic_message(**fields) -> Sent:
    fields.setdefault("messages", [{"role": "user", "content": "Explain this stack trace."}])
    fields.setdefault("max_tokens", 256)
    return capture(lambda http: anthropic_client(http).messages.create(model=MODEL_NAME, **fields), httpx2)


# --- the snapshot they are checked against ----------------------------------------------------------------------


def key_info(**changes) -> KeyInfo:
    key = KeyInfo(7, "ipk_abcdefghijkm", 3, 2, frozenset({"inference"}), None, "salt-of-tenant-2")
    return replace(key, **changes)


def snapshot_with(key: KeyInfo | None = None, secret: str = SECRET) -> Snapshot:
    digest = hmac.new(PEPPER, secret.encode(), hashlib.sha256).hexdigest()
    return Snapshot(keys={digest: key or key_info()}, deployments={MODEL_NAME: tiny()})


def tiny(tokenizer_path: str = str(MODEL_DIR), max_model_len: int = CONTEXT) -> DeploymentInfo:
    return DeploymentInfo(
        1, "tiny", MODEL_NAME, max_model_len, 16, PolicyInfo(), (), 0, tokenizer_path=tokenizer_path
    )


@pytest.fixture(scope="module")
def tokenizers() -> PrefixRouting:
    return PrefixRouting(router_redis(settings.REDIS_URL, 1))


def check(sent: Sent, tokenizers: PrefixRouting, dialect=OPENAI, deployment: DeploymentInfo | None = None):
    """The request's fields for the engine, and its (prompt, output) token bounds."""
    payload = engine_fields(parse(sent.body), sent.path, key_info())
    prompt_ids = token_ids(payload.get("prompt"))  # as the router converts a prompt of token ids
    bounds = validate(
        payload, deployment or tiny(), dialect, prompt_ids, sent.path, MAX_MESSAGES, MAX_CHOICES, tokenizers
    )
    return payload, bounds


# --- authentication ---------------------------------------------------------------------------------------------


def test_the_key_each_sdk_sends_authenticates():
    """Both SDKs send `Authorization: Bearer`; Claude Code with ANTHROPIC_API_KEY sends `x-api-key` instead."""
    snapshot = snapshot_with()
    openai_sent, anthropic_sent = openai_chat(max_tokens=8), anthropic_message()
    claude_code = [
        (b"x-api-key", value.split(None, 1)[1]) if name == b"authorization" else (name, value)
        for name, value in anthropic_sent.headers
    ]
    assert (b"authorization", f"Bearer {SECRET}".encode()) in openai_sent.headers
    assert not any(name == b"authorization" for name, _ in claude_code)
    for headers in (openai_sent.headers, anthropic_sent.headers, claude_code):
        assert authenticate(snapshot, headers, PEPPER, False) == key_info()


@pytest.mark.parametrize(
    ("key", "secret", "status", "words"),
    [
        (key_info(), "ipk_abcdefghijkm_another-secret", 401, "Invalid"),
        (key_info(expires_at=datetime.now(UTC) - timedelta(seconds=1)), SECRET, 401, "expired"),
        (key_info(scopes=frozenset({"read"})), SECRET, 403, "inference scope"),
    ],
    ids=["unknown", "expired", "no-inference-scope"],
)
def test_a_key_that_may_not_infer_is_refused(key, secret, status, words):
    sent = capture(lambda http: openai_client(http, secret).models.list())
    with pytest.raises(HttpError) as refused:
        authenticate(snapshot_with(key), sent.headers, PEPPER, False)
    assert refused.value.status == status and words in refused.value.message


def test_no_key_is_a_401_even_when_keys_cannot_be_confirmed():
    sent = openai_chat(max_tokens=8)
    without = [(name, value) for name, value in sent.headers if name != b"authorization"]
    for unconfirmed in (False, True):
        with pytest.raises(HttpError) as refused:
            authenticate(snapshot_with(), without, PEPPER, unconfirmed)
        assert refused.value.status == 401 and "Missing API key" in refused.value.message


def test_a_valid_key_is_refused_with_a_503_while_revocations_cannot_be_read():
    sent = anthropic_message()
    with pytest.raises(HttpError) as refused:
        authenticate(snapshot_with(), sent.headers, PEPPER, True)
    assert refused.value.status == 503 and refused.value.headers == {"retry-after": "5"}


def test_the_key_is_checked_under_the_pepper():
    sent = openai_chat(max_tokens=8)
    with pytest.raises(HttpError) as refused:
        authenticate(snapshot_with(), sent.headers, b"another-pepper", False)
    assert refused.value.status == 401


# --- the body ---------------------------------------------------------------------------------------------------


def receiving(*messages: dict):
    queue = list(messages)

    async def receive() -> dict:
        return queue.pop(0)

    return receive


def test_a_body_in_pieces_is_read_whole():
    body = openai_chat(max_tokens=8, stream=True).body
    pieces = [body[:10], body[10:40], body[40:]]
    receive = receiving(
        *({"type": "http.request", "body": p, "more_body": i < 2} for i, p in enumerate(pieces))
    )
    assert asyncio.run(read_body(receive, len(body))) == body


def test_a_body_over_the_limit_is_a_413_before_it_is_all_read():
    body = openai_chat(max_tokens=8).body
    receive = receiving(
        {"type": "http.request", "body": body[:20], "more_body": True},
        {"type": "http.request", "body": body[20:], "more_body": True},
    )  # a third piece would be an IndexError: reading stops at the limit
    with pytest.raises(HttpError) as refused:
        asyncio.run(read_body(receive, len(body) - 1))
    assert refused.value.status == 413


def test_a_client_that_leaves_while_sending_is_gone():
    receive = receiving(
        {"type": "http.request", "body": b'{"mo', "more_body": True}, {"type": "http.disconnect"}
    )
    with pytest.raises(ClientGone):
        asyncio.run(read_body(receive, BODY_FLOOR_BYTES))


@pytest.mark.parametrize(
    ("body", "words"),
    [(b'{"model": "tiny-qwen",', "not valid JSON"), (b'[{"model": "tiny-qwen"}]', "JSON object")],
    ids=["truncated", "array"],
)
def test_a_body_that_is_not_a_json_object_is_a_400(body, words):
    with pytest.raises(HttpError) as refused:
        parse(body)
    assert refused.value.status == 400 and words in refused.value.message


def test_json_nested_deeper_than_can_be_forwarded_is_a_400():
    nested = parse(b'{"model": "tiny-qwen", "metadata": ' + b"[" * 300 + b"]" * 300 + b"}")
    with pytest.raises(HttpError) as refused:
        dumps(nested)
    assert refused.value.status == 400 and "Nest" in refused.value.message
    assert orjson.loads(dumps({"model": MODEL_NAME})) == {"model": MODEL_NAME}


def test_the_body_limit_follows_the_longest_context_and_stays_within_its_bounds():
    def snapshot(*contexts: int) -> Snapshot:
        return Snapshot(deployments={f"m{i}": tiny(max_model_len=n) for i, n in enumerate(contexts)})

    assert body_limit(Snapshot(), 64 * 1024 * 1024) == BODY_FLOOR_BYTES
    small, large = body_limit(snapshot(4096), 10**9), body_limit(snapshot(4096, 131072), 10**9)
    assert BODY_FLOOR_BYTES < small < large
    assert body_limit(snapshot(131072), 2 * 1024 * 1024) == 2 * 1024 * 1024


# --- the deployment and the fields sent on ----------------------------------------------------------------------


def test_the_model_named_is_the_deployment():
    snapshot, key = snapshot_with(), key_info()
    payload = openai_chat(max_tokens=8).payload
    assert deployment_for(snapshot, payload, key) is snapshot.deployments[MODEL_NAME]
    with pytest.raises(HttpError) as unknown:
        deployment_for(snapshot, {**anthropic_message().payload, "model": "claude-sonnet-4-5"}, key)
    assert unknown.value.status == 404 and unknown.value.param == "model"
    with pytest.raises(HttpError) as unnamed:
        deployment_for(snapshot, {"messages": [], "model": ""}, key)
    assert unnamed.value.status == 400 and unnamed.value.param == "model"


def test_an_alias_names_its_deployment_for_its_tenant_only_and_the_engine_gets_the_served_name():
    snapshot, key = snapshot_with(), key_info()
    snapshot.aliases[(key.tenant_id, "coder")] = MODEL_NAME
    payload = {**openai_chat(max_tokens=8).payload, "model": "coder"}
    assert deployment_for(snapshot, payload, key) is snapshot.deployments[MODEL_NAME]
    assert payload["model"] == MODEL_NAME  # what the engines serve
    other_tenant = replace(key, tenant_id=key.tenant_id + 1)
    with pytest.raises(HttpError) as elsewhere:
        deployment_for(snapshot, {**payload, "model": "coder"}, other_tenant)
    assert elsewhere.value.status == 404
    assert [name for name, _ in snapshot.models_for_key(key)] == ["coder", MODEL_NAME]
    assert [name for name, _ in snapshot.models_for_key(other_tenant)] == [MODEL_NAME]


def test_a_model_the_key_may_not_call_is_answered_as_one_that_does_not_exist():
    snapshot = snapshot_with()
    deployment = snapshot.deployments[MODEL_NAME]
    allowed, denied = key_info(deployments=frozenset({deployment.id})), key_info(deployments=frozenset())
    payload = openai_chat(max_tokens=8).payload
    assert deployment_for(snapshot, dict(payload), allowed) is deployment
    with pytest.raises(HttpError) as refused:
        deployment_for(snapshot, dict(payload), denied)
    with pytest.raises(HttpError) as missing:
        deployment_for(snapshot, {**payload, "model": "no-such-model"}, denied)
    assert (
        (refused.value.status, refused.value.param)
        == (missing.value.status, missing.value.param)
        == (404, "model")
    )
    assert refused.value.message == missing.value.message.replace("no-such-model", MODEL_NAME)
    assert snapshot.models_for_key(denied) == []


def test_a_request_may_ask_for_a_lower_priority_class_never_a_higher_one():
    key = key_info(priority_class="standard")

    def scope(value: bytes | None) -> dict:
        return {"headers": [] if value is None else [(b"x-priority-class", value)]}

    assert priority_for(scope(None), key) == "standard"
    assert priority_for(scope(b"batch"), key) == "batch"
    assert priority_for(scope(b"Standard"), key) == "standard"
    with pytest.raises(HttpError) as higher:
        priority_for(scope(b"interactive"), key)
    assert higher.value.status == 403 and "`standard` at most" in higher.value.message
    with pytest.raises(HttpError) as unknown:
        priority_for(scope(b"urgent"), key)
    assert unknown.value.status == 400 and "interactive, standard, batch" in unknown.value.message


def test_the_engine_gets_the_tenants_cache_salt_and_no_field_of_its_own_from_the_client():
    sent = openai_chat(max_tokens=8, extra_body={"kv_transfer_params": {"do_remote_prefill": True}})
    payload = engine_fields(parse(sent.body), sent.path, key_info())
    assert payload["cache_salt"] == "salt-of-tenant-2"
    assert "kv_transfer_params" not in payload and payload["messages"] == sent.payload["messages"]
    unsalted = engine_fields(parse(sent.body), sent.path, key_info(cache_salt=""))
    assert "cache_salt" not in unsalted


def test_media_by_url_is_a_400_naming_the_part():
    image = {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}
    sent = openai_chat(
        max_tokens=8, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]
    )
    with pytest.raises(HttpError) as refused:
        engine_fields(parse(sent.body), sent.path, key_info())
    assert refused.value.status == 400 and "messages[0].content[1]" in refused.value.message
    assert refused.value.param == "messages"


# --- limits and bounds ------------------------------------------------------------------------------------------


def test_a_chat_request_reserves_its_prompt_bound_and_max_completion_tokens_per_answer(tokenizers):
    sent = openai_chat(max_completion_tokens=300, n=2, stream=True, stream_options={"include_usage": True})
    payload, (prompt, output) = check(sent, tokenizers)
    assert output == 600
    overhead = template_overhead(tokenizers.tokenizer_for(tiny()), tools=False)
    assert 0 < overhead < 100  # the tiny model's template: role markers and the generation prompt
    assert prompt == prompt_token_bound(payload, overhead) < CONTEXT
    tokens = len(RouterTokenizer(MODEL_DIR).encode_chat(payload["messages"]))
    assert tokens <= prompt  # a bound of the real count


BIG = 3000  # tokens of filler in one field, well over what the rest of a request holds


def filler(words: int) -> str:
    return " ".join(f"w{i % 97}x" for i in range(words))


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (
            "/v1/responses",
            {"instructions": filler(BIG), "input": "hi", "max_output_tokens": 8},
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "documents": [{"title": "doc", "text": filler(BIG)}],
                "max_tokens": 8,
            },
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"extra_context": filler(BIG)},
                "max_tokens": 8,
            },
        ),
        (
            "/v1/messages",
            {"system": filler(BIG), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        ),
    ],
    ids=["responses-instructions", "chat-documents", "chat-template-kwargs", "messages-system"],
)
@pytest.mark.heavy
def test_the_reserved_prompt_bound_covers_every_field_that_reaches_the_prompt(tokenizers, path, fields):
    """`instructions`, `documents`, `chat_template_kwargs`: what a request reserves (and pays when cut short
    before the router counted it) bounds the whole prompt, whatever field holds it."""
    dialect = {"/v1/messages": ANTHROPIC, "/v1/responses": RESPONSES}.get(path, OPENAI)
    payload = engine_fields({"model": MODEL_NAME, **fields}, path, key_info())
    prompt, _ = validate(
        payload, tiny(max_model_len=65536), dialect, None, path, MAX_MESSAGES, MAX_CHOICES, tokenizers
    )
    text = filler(BIG)
    tokens = len(RouterTokenizer(MODEL_DIR).encode_prompt(text))
    assert (
        prompt > tokens >= BIG
    )  # on main before: only `input`, `messages`, `system` and `tools` were counted


def test_an_anthropic_request_without_max_tokens_is_a_400_and_an_openai_one_reserves_the_context(tokenizers):
    sent = anthropic_message()
    without = {k: v for k, v in sent.payload.items() if k != "max_tokens"}
    with pytest.raises(HttpError) as refused:
        validate(without, tiny(), ANTHROPIC, None, sent.path, MAX_MESSAGES, MAX_CHOICES, tokenizers)
    assert refused.value.param == "max_tokens"
    _, (_, output) = check(openai_chat(), tokenizers)
    assert output == CONTEXT


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": CONTEXT + 1}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 8, "n": MAX_CHOICES + 1}, "n"),
        ({"max_tokens": 8, "stream": True, "extra_body": {"stream_options": "usage"}}, "stream_options"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}, "messages"),
    ],
    ids=[
        "max-tokens-over-context",
        "zero-max-completion-tokens",
        "too-many-choices",
        "stream-options",
        "too-many-messages",
    ],
)
def test_a_chat_request_over_a_limit_is_a_400_naming_the_field(tokenizers, fields, param):
    with pytest.raises(HttpError) as refused:
        check(openai_chat(**fields), tokenizers)
    assert refused.value.status == 400 and refused.value.param == param


def test_one_prompt_in_a_list_is_taken_and_its_token_ids_bound_the_reservation(tokenizers):
    ids = list(range(10, 110))
    sent = capture(
        lambda http: openai_client(http).completions.create(model=MODEL_NAME, prompt=[ids], max_tokens=5)
    )
    payload, (prompt, output) = check(sent, tokenizers)
    assert payload["prompt"] == ids and (prompt, output) == (100, 5)
    too_many = capture(
        lambda http: openai_client(http).completions.create(model=MODEL_NAME, prompt=["a", "b"], max_tokens=5)
    )
    with pytest.raises(HttpError) as refused:
        check(too_many, tokenizers)
    assert refused.value.param == "prompt" and "2 prompts" in refused.value.message
    long = capture(
        lambda http: openai_client(http).completions.create(
            model=MODEL_NAME, prompt=list(range(CONTEXT)), max_tokens=5
        )
    )
    with pytest.raises(HttpError) as filled:
        check(long, tokenizers)
    assert filled.value.param == "prompt" and f"{CONTEXT} tokens" in filled.value.message


def test_best_of_is_a_400_on_completions_where_it_would_reach_the_engine(tokenizers):
    sent = capture(
        lambda http: openai_client(http).completions.create(
            model=MODEL_NAME, prompt="def add(a, b):", max_tokens=5, best_of=3
        )
    )
    with pytest.raises(HttpError) as refused:
        check(sent, tokenizers)
    assert refused.value.param == "best_of"
    sent = capture(
        lambda http: openai_client(http).completions.create(
            model=MODEL_NAME, prompt="def add(a, b):", max_tokens=5, best_of=1
        )
    )
    assert check(sent, tokenizers)[1][1] == 5


def test_an_image_for_a_text_only_model_is_a_400_and_passes_where_no_tokenizer_says_so(tokenizers):
    png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNk+A8AAQUBAScY42YAAAAASUVORK5CYII="
    image = {"type": "image_url", "image_url": {"url": png}}
    sent = openai_chat(max_tokens=8, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(HttpError) as refused:
        check(sent, tokenizers)
    assert refused.value.param == "messages" and "text only" in refused.value.message
    check(sent, tokenizers, deployment=tiny(tokenizer_path="no/such/tokenizer"))  # no refusal


def test_the_output_limit_is_the_field_the_engine_reads_on_each_route(tokenizers):
    chat = openai_chat(max_tokens=50, max_completion_tokens=40)
    assert output_limit(chat.payload, chat.path) == ("max_completion_tokens", 40)
    assert output_limit(openai_chat(max_tokens=50).payload, "/v1/chat/completions") == ("max_tokens", 50)
    responses = capture(
        lambda http: openai_client(http).responses.create(
            model=MODEL_NAME, input="Summarise the diff.", max_output_tokens=64, store=False
        )
    )
    assert responses.path == "/v1/responses"
    assert output_limit(responses.payload, responses.path) == ("max_output_tokens", 64)
    message = anthropic_message(max_tokens=99)
    assert output_limit(message.payload, message.path) == ("max_tokens", 99)
    _, (_, output) = check(responses, tokenizers, RESPONSES)
    assert output == 64


def test_a_prompt_that_leaves_no_room_for_the_answer_is_refused_as_the_engine_would():
    chat = openai_chat(max_completion_tokens=100)
    ctx = RequestContext(model=MODEL_NAME, prompt_tokens_estimate=CONTEXT - 50)
    refused = over_context(tiny(), chat.payload, ctx, chat.path)
    assert refused.status == 400 and refused.param == "max_completion_tokens"
    assert "at most 50 output tokens" in refused.message
    assert (
        over_context(tiny(), chat.payload, replace(ctx, prompt_tokens_estimate=CONTEXT - 100), chat.path)
        is None
    )
    full = over_context(tiny(), chat.payload, replace(ctx, prompt_tokens_estimate=CONTEXT), chat.path)
    assert full.param == "messages" and "Shorten" in full.message
    untokenized = replace(ctx, prompt_tokens_estimate=0)
    assert over_context(tiny(), chat.payload, untokenized, chat.path) is None
