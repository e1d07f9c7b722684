"""The simulator's HTTP server: vLLM's OpenAI-compatible routes, response shapes and error bodies.

Tool calls: with a tool-call parser and tools, a request whose tool_choice is "required" or names a function
gets a call of that function (or of the first tool); with "auto", a conversation whose last message is the user's
gets a call of the first tool, unless it already holds `tool_calls_per_conversation` calls (so an agent that
answers each call with a new user turn, as Claude Code does for its background sub-agents, comes to an end);
the call's arguments are its schema's required properties with simple values. Anything else gets text.

Over 400 lines: one class per vLLM server, as vLLM's own routes share its engine, tokenizer and options; the
shapes each route answers with are in their own modules (errors, responses, fields)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from routing.rendering.conversion import (
    ChatInputs,
    RenderError,
    anthropic_chat_request,
    chat_inputs,
    responses_chat_request,
)
from routing.rendering.routes import ANTHROPIC_MESSAGES, CHAT_MESSAGES, PROMPT_TEXT, RESPONSES_INPUT, ROUTES
from routing.rendering.tokenize import rejects_inline_system, template_traits
from serving.engine_plugins.tool_arguments import example_arguments

from . import fields
from . import responses as responses_api
from .engine import Engine, RemotePrefillError, Request
from .errors import ApiError, literal_problem, problem, validation_error
from .errors import bad_param as _bad_param
from .errors import invalid as _invalid
from .tokenizer import ModelTokenizer

log = logging.getLogger(__name__)
VLLM_VERSION = "0.32.0"
NAMED_TOOL_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


@dataclass
class ServedModel:
    names: list[str]
    root: str
    max_model_len: int
    prompt_tokens_details: bool
    kv_events_config: dict | None
    # The tool-call parser when auto tool choice is on (vLLM loads none without --enable-auto-tool-choice).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    # With "auto", a conversation already holding this many tool calls is answered in text (None: no limit).
    tool_calls_per_conversation: int | None = None


CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
CACHE_SALT_MAX_LENGTH = 128


def cache_salt_of(body: dict) -> str | None:
    """The request's `cache_salt`, refused as vLLM's request models refuse it (validate_cache_salt)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise _invalid("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(salt) > CACHE_SALT_MAX_LENGTH or not CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        raise _invalid(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.",
            "cache_salt",
        )
    return salt


def anthropic_salt_type(salt) -> None:
    """/v1/messages' own request model types `cache_salt` (a string of 1 to 1024 characters) before anything
    else, and refuses it in pydantic's words and the plain error shape."""
    if salt is None:
        return
    if not isinstance(salt, str):
        problem = {"type": "string_type", "msg": "Input should be a valid string", "input": str(salt)}
    elif not salt:
        problem = {
            "type": "string_too_short",
            "msg": "String should have at least 1 character",
            "input": salt,
        }
        problem["ctx"] = {"min_length": 1}
    elif len(salt) > 1024:
        problem = {
            "type": "string_too_long",
            "msg": "String should have at most 1024 characters",
            "input": salt,
        }
        problem["ctx"] = {"max_length": 1024}
    else:
        return
    detail = {"type": problem.pop("type"), "loc": "body.cache_salt", **problem}
    raise ApiError(400, f"1 validation error:\n  {detail}", "Bad Request", "body.cache_salt")


THINKING_TYPES = ("enabled", "disabled", "adaptive")
THINKING_DISPLAYS = ("summarized", "omitted", "updates")
EFFORTS = ("low", "medium", "high", "xhigh", "max")


def anthropic_field_problems(body: dict) -> list[dict]:
    """What /v1/messages' request model refuses among the fields Claude Code sends (`thinking`,
    `output_config`, `metadata`, `max_tokens`), in pydantic's words. Other fields it does not know, such as
    `context_management`, it ignores."""
    problems = []
    max_tokens = body.get("max_tokens")
    if max_tokens <= 0:
        problems.append(
            problem(
                "value_error",
                "body.max_tokens",
                "Value error, max_tokens must be positive",
                max_tokens,
                {"error": ValueError("max_tokens must be positive")},
            )
        )
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in THINKING_TYPES:
            expected = ", ".join(f"'{t}'" for t in THINKING_TYPES)
            problems.append(
                problem(
                    "union_tag_invalid",
                    "body.thinking",
                    f"Input tag '{kind}' found using 'type' does not match any of the expected tags: {expected}",
                    thinking,
                    {"discriminator": "'type'", "tag": str(kind), "expected_tags": expected},
                )
            )
        else:
            display = thinking.get("display")
            if kind != "disabled" and display is not None and display not in THINKING_DISPLAYS:
                problems.append(literal_problem(f"body.thinking.{kind}.display", display, THINKING_DISPLAYS))
            budget = thinking.get("budget_tokens")
            if kind == "enabled" and isinstance(budget, int) and budget < 1024:
                problems.append(
                    problem(
                        "greater_than_equal",
                        "body.thinking.enabled.budget_tokens",
                        "Input should be greater than or equal to 1024",
                        budget,
                        {"ge": 1024},
                    )
                )
    output_config = body.get("output_config")
    if isinstance(output_config, dict):
        effort = output_config.get("effort")
        if effort is not None and effort not in EFFORTS:
            problems.append(literal_problem("body.output_config.effort", effort, EFFORTS))
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        problems.append(problem("dict_type", "body.metadata", "Input should be a valid dictionary", metadata))
    if problems:
        return problems
    transfer = body.get("kv_transfer_params")
    remote_decode = isinstance(transfer, dict) and transfer.get("do_remote_decode")
    if (
        isinstance(thinking, dict)
        and thinking.get("type") == "enabled"
        and isinstance(thinking.get("budget_tokens"), int)
        and thinking["budget_tokens"] >= max_tokens
        and not remote_decode
    ):
        message = "thinking.budget_tokens must be less than max_tokens"
        problems.append(
            problem("value_error", "body", f"Value error, {message}", body, {"error": ValueError(message)})
        )
    return problems


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _json_response(body: dict, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=_dumps)


# --- tool calls -------------------------------------------------------------------------------------------
# With a tool-call parser the simulator calls a tool by a fixed rule: tool_choice "required" or a named
# function always (the named one, else the first tool); "auto" when the conversation ends with a user message
# (not a tool result); never with "none". The call's arguments are built from the tool's JSON schema, and its
# output tokens are the text the chat template renders for such a call, then the end-of-sequence token.


def _named_tool(choice) -> str | None:
    if isinstance(choice, dict):
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    return None


@dataclass
class ToolCall:
    """One tool call the simulator makes: what it returns, and the tokens that generate it."""

    name: str
    arguments: str  # JSON, as vLLM returns it (json.dumps of the parsed arguments)
    text: str  # what the model writes for the call, as the chat template renders it
    ids: list[int]  # its tokens, then the end-of-sequence token
    ends: list[int]  # for each token, where its text ends in `text`
    named: bool  # tool_choice named the function (vLLM then finishes with "stop", not "tool_calls")
    forced: bool  # tool_choice named or "required" (vLLM then gives content "", not null)
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex[:16]}")

    def message_entry(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolCallStream:
    """The tool-call deltas of a call streamed token by token, as vLLM's Hermes parser streams one: the call's
    id and name once the name is complete, then its arguments as the text that holds them arrives."""

    def __init__(self, call: ToolCall):
        self.call = call
        text = call.text
        self.name_end = 0  # where the name is complete in the call's text (not found: at once)
        for name in (json.dumps(call.name, ensure_ascii=False), call.name):
            at = text.find(name)
            if at >= 0:
                self.name_end = at + len(name)
                break
        self.args_start = text.find(call.arguments, self.name_end)
        self.named = False
        self.sent = 0

    def step(self, produced: int) -> list[dict]:
        """The deltas due once `produced` tokens of the call are out."""
        call = self.call
        at = call.ends[min(produced, len(call.ends)) - 1] if produced else 0
        deltas = []
        if not self.named and at >= self.name_end and produced:
            self.named = True
            deltas.append({"id": call.id, "type": "function", "index": 0, "function": {"name": call.name}})
        if not self.named:
            return deltas
        if self.args_start >= 0:
            visible = max(0, min(at, self.args_start + len(call.arguments)) - self.args_start)
        else:  # the template writes the arguments otherwise: spread them over the call's text
            visible = len(call.arguments) * at // max(1, len(call.text))
        if visible > self.sent:
            deltas.append({"index": 0, "function": {"arguments": call.arguments[self.sent : visible]}})
            self.sent = visible
        return deltas


RENDERED_CACHE_TOKENS = 2_000_000  # prompt ids the cache of rendered chats holds, in all


@dataclass
class ChatPrompt:
    ids: list[int]
    tools: list[dict] | None
    kwargs: dict
    last_role: str | None
    tool_calls: int = 0  # the calls the conversation's assistant turns made


# The paths vLLM's API key guards (its AuthenticationMiddleware); /health, /metrics, /tokenize, /invocations and
# the rest answer without one, on vLLM as here.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def _key_digests(keys: list[str] | None) -> list[bytes]:
    """vLLM's keys: `--api-key` when given, else VLLM_API_KEY; none means no check."""
    chosen = keys or [os.environ.get("VLLM_API_KEY", "")]
    return [hashlib.sha256(key.encode()).digest() for key in chosen if key]


class SimulatorApp:
    def __init__(
        self, engine: Engine, tokenizer: ModelTokenizer, model: ServedModel, api_keys: list[str] | None = None
    ):
        self.engine = engine
        self._key_digests = _key_digests(api_keys)
        self.tokenizer = tokenizer
        self.model = model
        self.fingerprint = (
            f"vllm-{VLLM_VERSION}-" + hashlib.sha256(_dumps(model.__dict__).encode()).hexdigest()[:8]
        )
        self._text: dict[int, str] = {}
        self._rendered: OrderedDict[str, ChatPrompt] = OrderedDict()
        self._rendered_tokens = 0
        self._calls: OrderedDict[str, tuple[str, list[int], list[int]]] = OrderedDict()
        template = tokenizer.chat_template
        self.traits = template_traits(template)
        self.merge_inline_system = rejects_inline_system(template)
        # The W3C trace context of the last requests that carried one, as vLLM would parent its own spans on it
        # (GET /debug/traceparents: the router's tracing tests read it).
        self.traceparents: deque[dict] = deque(maxlen=256)

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=256 * 1024 * 1024, middlewares=[self._authenticate, self._note_traceparent]
        )
        app.router.add_get("/debug/traceparents", self.debug_traceparents)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/load", self.load)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/kv_event_sources", self.kv_event_sources)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        # The generation routes are the router's (routing/rendering/routes.py), each served as vLLM serves its kind.
        generation = {
            PROMPT_TEXT: self.completions,
            CHAT_MESSAGES: self.chat_completions,
            ANTHROPIC_MESSAGES: self.messages,
            RESPONSES_INPUT: self.responses,
        }
        for route in ROUTES.values():
            app.router.add_post(route.path, generation[route.renders])
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_get("/v1/responses/{response_id}", self.stored_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.stored_response)
        return app

    @web.middleware
    async def _authenticate(self, request: web.Request, handler):
        """As vLLM started with an API key: a guarded path without `Authorization: Bearer <key>` is a 401."""
        if self._key_digests and request.method != "OPTIONS" and request.path.startswith(GUARDED_PREFIXES):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            digest = hashlib.sha256(token.encode()).digest()
            matched = False
            for known in self._key_digests:
                matched |= hmac.compare_digest(digest, known)
            if scheme.lower() != "bearer" or not matched:
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    @web.middleware
    async def _note_traceparent(self, request: web.Request, handler):
        traceparent = request.headers.get("traceparent")
        if traceparent is not None:
            self.traceparents.append(
                {
                    "path": request.path,
                    "request_id": request.headers.get("x-request-id"),
                    "traceparent": traceparent,
                }
            )
        return await handler(request)

    async def debug_traceparents(self, request: web.Request) -> web.Response:
        return web.json_response(list(self.traceparents))

    # --- small routes ---------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def load(self, request: web.Request) -> web.Response:
        return web.json_response({"server_load": self.engine.running + len(self.engine._waiting)})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.engine.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": self.model.root,
                "parent": None,
                "max_model_len": self.model.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                        "object": "model_permission",
                        "created": now,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in self.model.names
        ]
        return web.json_response({"object": "list", "data": data})

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        return web.json_response({"0": self.model.kv_events_config} if self.model.kv_events_config else {})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.engine.reset_prefix_cache():
            return web.json_response(
                ApiError(400, "Cannot reset the prefix cache while requests run.").body(), status=400
            )
        # The simulator's own caches of rendered prompts go too: what follows a reset (a benchmark's next phase)
        # costs the simulator what it did the first time.
        self._rendered.clear()
        self._rendered_tokens = 0
        self.tokenizer.forget_pieces()
        return web.Response(status=200)

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            self._check_model(body)
            if "messages" in body:
                ids = self._chat_prompt(body).ids
            elif isinstance(body.get("prompt"), str):
                ids = self.tokenizer.encode(
                    body["prompt"], add_special_tokens=body.get("add_special_tokens", True)
                )
            else:
                raise ApiError(400, "Give either `prompt` (a string) or `messages`.")
        except ApiError as exc:
            return _json_response(exc.body(), exc.status)
        strs = self.tokenizer.token_strs(ids) if body.get("return_token_strs") else None
        return _json_response(
            {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ApiError(400, "`tokens` must be a list of token ids.", param="tokens")
        except ApiError as exc:
            return _json_response(exc.body(), exc.status)
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    # --- generation -------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, http: web.Request, *, chat: bool) -> web.StreamResponse:
        call = None
        try:
            body = await self._json(http)
            cache_salt = cache_salt_of(body)
            # The typed fields as vLLM's request model reads them ("false" is false, "3" is 3), or its 400.
            read = fields.read_chat if chat else fields.read_completion
            body = read(body, self.tokenizer.vocab_size)
            model = self._check_model(body)
            if chat:
                choice = _tool_choice(body)
                self._check_tool_parser(choice)
                prompt = self._chat_prompt(body, choice)
                prompt_ids = prompt.ids
                self._check_length(prompt_ids, from_text=True)
                call = self._plan_tool_call(prompt, choice)
            else:
                prompt_ids = self._completion_prompt_ids(body)
            max_tokens = self._max_tokens(body, chat, len(prompt_ids))
            n = body.get("n") or 1
        except ApiError as exc:
            return _json_response(exc.body(), exc.status)
        external = http.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex[:16]
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{external}"
        req = Request(
            request_id=response_id,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            seed=body.get("seed"),
            kv_transfer_params=body.get("kv_transfer_params"),
            output_script=call.ids if call else None,
            cache_salt=cache_salt,
        )
        # `n` choices are n requests sharing the prompt, as vLLM fans a parent request out into children: the
        # first computes the prompt, the others find it cached.
        reqs = [req] + [
            dataclasses.replace(
                req,
                request_id=f"{index}_{response_id}",
                seed=None if req.seed is None else req.seed + index,
                kv_transfer_params=None,
                output_ids=[],
            )
            for index in range(1, n)
        ]
        created = int(time.time())
        include_usage, continuous = fields.stream_options(body)
        stream_options = {"include_usage": include_usage, "continuous_usage_stats": continuous}
        if body.get("stream"):
            return await self._stream(http, reqs, chat, model, response_id, created, stream_options, call)
        return await self._complete(reqs, chat, model, response_id, created, call)

    async def _complete(
        self,
        reqs: list[Request],
        chat: bool,
        model: str,
        response_id: str,
        created: int,
        call: ToolCall | None,
    ) -> web.Response:
        async def run(req: Request) -> None:
            async for _ in self.engine.generate(req):
                pass

        try:
            if len(reqs) == 1:
                await run(reqs[0])
            else:
                await asyncio.gather(*(run(req) for req in reqs))
        except RemotePrefillError as exc:
            return _json_response(ApiError(500, str(exc), "InternalServerError").body(), 500)
        choices = [self._choice(index, req, chat, call) for index, req in enumerate(reqs)]
        body = {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": self._usage(reqs, chat, null_details=True),
            "kv_transfer_params": reqs[0].kv_transfer_out,
            "ec_transfer_params": None,
            "metrics": None,
        }
        if chat:
            body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        return web.json_response(body, dumps=_dumps)

    def _choice(self, index: int, req: Request, chat: bool, call: ToolCall | None) -> dict:
        text = self._detok(req.output_ids)
        if chat:
            message = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            }
            finish_reason = req.finish_reason
            if call is not None and req.finish_reason == "stop":
                # A whole call: vLLM parses it out of the text (a cut one stays text, finishing "length").
                message = {
                    **{k: v for k, v in message.items() if k != "reasoning"},
                    "content": "" if call.forced else None,
                    "tool_calls": [call.message_entry()],
                    "reasoning": None,
                }
                finish_reason = "stop" if call.named else "tool_calls"
            return {
                "index": index,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
        return {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": req.finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        }

    async def _stream(
        self,
        http: web.Request,
        reqs: list[Request],
        chat: bool,
        model: str,
        response_id: str,
        created: int,
        stream_options: dict,
        call: ToolCall | None,
    ) -> web.StreamResponse:
        include_usage = bool(stream_options.get("include_usage"))
        continuous = include_usage and bool(stream_options.get("continuous_usage_stats"))
        obj = "chat.completion.chunk" if chat else "text_completion"
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        await response.prepare(http)

        def chunk(choices: list, req: Request | None = None, **extra) -> bytes:
            data = {
                "id": response_id,
                "object": obj,
                "created": created,
                "model": model,
                "choices": choices,
                **extra,
            }
            if continuous and choices:
                # Each chunk carries its own choice's running usage (vLLM's, with `n` over 1 as well).
                data["usage"] = self._running_usage(req)
            return f"data: {_dumps(data)}\n\n".encode()

        # With no decode time the tokens come all at once: one write instead of one per event keeps this
        # zero-latency upstream cheaper than any gateway measured in front of it.
        timing = self.engine.timing
        coalesce = timing.decode_time == 0 and timing.decode_time_per_seq == 0
        pending: list[bytes] = []
        produced = [0] * len(reqs)
        calls = [ToolCallStream(call) if call is not None else None for _ in reqs]

        def event(index: int, token: int) -> bytes | None:
            """The chunk for choice `index`'s next token, or None while a tool-call parser holds it back."""
            req = reqs[index]
            produced[index] += 1
            last = produced[index] == req.output_limit
            finish = None
            if last:
                finish = "stop" if req.stops else "length"
                if call is not None and finish == "stop" and not call.named:
                    finish = "tool_calls"
            if calls[index] is not None:
                # The parser holds back what is not yet part of the call's name or arguments.
                deltas = calls[index].step(produced[index])
                if not deltas and not last:
                    return None
                delta = {"content": None, "tool_calls": deltas} if deltas else {}
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            elif chat:
                choice = {
                    "index": index,
                    "delta": {"content": self._detok([token])},
                    "logprobs": None,
                    "finish_reason": finish,
                }
            else:
                choice = {
                    "index": index,
                    "text": self._detok([token]),
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "prompt_token_ids": None,
                }
            if last:
                choice["stop_reason"] = None
            choice["token_ids"] = None
            done = last and all(p == r.output_limit for p, r in zip(produced, reqs, strict=True))
            extra = {"system_fingerprint": self.fingerprint} if done and not include_usage else {}
            return chunk([choice], req, **extra)

        generators = [self.engine.generate(req) for req in reqs]
        try:
            if chat:
                # Sent with the first token, as vLLM sends it: from its first output, after the prefill.
                for index, req in enumerate(reqs):
                    role = {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    pending.append(chunk([role], req, prompt_token_ids=None, prompt_text=None))
            async for index, token in _merged(generators):
                data = event(index, token)
                if data is None:
                    # A token the tool-call parser holds back: the role chunks still go out with the first one,
                    # as vLLM yields them on its first output, before it parses any delta.
                    if pending and not coalesce:
                        await response.write(b"".join(pending))
                        pending.clear()
                    continue
                pending.append(data)
                if not coalesce:
                    await response.write(b"".join(pending))
                    pending.clear()
            if include_usage:
                pending.append(
                    chunk(
                        [],
                        usage=self._usage(reqs, chat, null_details=False),
                        system_fingerprint=self.fingerprint,
                    )
                )
            pending.append(b"data: [DONE]\n\n")
            await response.write(b"".join(pending))
        except RemotePrefillError as exc:
            await response.write(
                f"data: {_dumps(ApiError(500, str(exc), 'InternalServerError').body())}\n\n".encode()
            )
            await response.write(b"data: [DONE]\n\n")
        finally:
            for generator in generators:
                await generator.aclose()
        return response

    # --- Responses API ------------------------------------------------------------------------------------
    async def responses(self, http: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API as vLLM serves it: the request rendered as the chat request it becomes, the
        answer as a Response object or its stream of events (see responses.py for vLLM's sources)."""
        try:
            body = await self._json(http)
            cache_salt = cache_salt_of(body)
            body = fields.read_responses(body)
            call = responses_api.check_request(body)
            model = self._check_model(body)
            responses_api.check_serving(body)
            prompt = self._responses_prompt(call)
            self._check_length(prompt.ids, from_text=True)
            planned = self._plan_tool_call(prompt, call.plan_choice)
            max_tokens = self._max_output_tokens(body, len(prompt.ids))
        except ApiError as exc:
            return _json_response(exc.body(), exc.status)
        request_id = body.get("request_id")
        response_id = request_id if isinstance(request_id, str) else responses_api.new_id("resp")
        req = Request(
            request_id=response_id,
            prompt_ids=prompt.ids,
            max_tokens=max_tokens,
            seed=body.get("seed"),
            kv_transfer_params=body.get("kv_transfer_params"),
            output_script=planned.ids if planned else None,
            cache_salt=cache_salt,
        )
        created = responses_api.now()

        def response(output: list[dict], status: str, usage: dict | None) -> dict:
            return responses_api.response_object(
                call,
                response_id=response_id,
                model=model,
                created=created,
                max_tokens=max_tokens,
                output=output,
                status=status,
                usage=usage,
                kv_transfer_params=req.kv_transfer_out,
            )

        # With a reasoning parser a text answer reasons first: its first tokens are a reasoning item's.
        reasoning = self._reasoning_tokens(req, planned)

        def final_usage() -> dict:
            return responses_api.usage(
                len(req.prompt_ids),
                req.cached_tokens,
                req.created_cache_tokens,
                len(req.output_ids),
                min(reasoning, len(req.output_ids)),
            )

        status = lambda: "completed" if req.stops else "incomplete"  # noqa: E731
        if not call.stream:
            try:
                async for _ in self.engine.generate(req):
                    pass
            except RemotePrefillError as exc:
                return _json_response(ApiError(500, str(exc), "InternalServerError").body(), 500)
            output = self._responses_output(call, req, planned, reasoning)
            return _json_response(response(output, status(), final_usage()))

        stream = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        await stream.prepare(http)
        writer = responses_api.EventWriter(call)
        opening = response([], "in_progress", None)
        pending = [
            writer.response("response.created", opening),
            writer.response("response.in_progress", opening),
        ]
        timing = self.engine.timing
        coalesce = timing.decode_time == 0 and timing.decode_time_per_seq == 0
        calls = ToolCallStream(planned) if planned is not None else None
        generator = self.engine.generate(req)
        produced = 0
        try:
            async for token in generator:
                produced += 1
                if calls is not None:
                    # vLLM's parser streams the call (its name, then its arguments) and holds back the rest.
                    for delta in calls.step(produced):
                        if "id" in delta:
                            pending += writer.call_start(planned.id, planned.name)
                        else:
                            pending += writer.call_arguments(delta["function"]["arguments"])
                else:
                    text = self._detok([token])
                    if text and produced <= reasoning:
                        pending += writer.reasoning_delta(text)
                    elif text:
                        pending += writer.text_delta(text)
                if pending and not coalesce:
                    await stream.write(b"".join(pending))
                    pending.clear()
            pending += writer.close()
            pending.append(
                writer.response("response.completed", response(writer.items, status(), final_usage()))
            )
            await stream.write(b"".join(pending))
        except RemotePrefillError as exc:
            await stream.write(b"".join(pending))
            error = {"type": "error", "code": "InternalServerError", "message": str(exc), "param": None}
            await stream.write(responses_api.sse(writer.event("error", **error)))
        finally:
            await generator.aclose()
        return stream

    async def stored_response(self, http: web.Request) -> web.Response:
        """Retrieving or cancelling a stored response: this engine stores none (vLLM's default)."""
        exc = responses_api.not_found(http.match_info["response_id"])
        return _json_response(exc.body(), exc.status)

    def _responses_prompt(self, call: responses_api.ResponsesCall) -> ChatPrompt:
        """The prompt of a Responses request: the chat request it becomes (routing.rendering.conversion, shared with the
        router), rendered as chat is."""
        body = call.body
        if body.get("input") == []:
            raise ApiError(
                400, "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        try:
            chat = responses_chat_request(body)  # previous_response_id: already answered 404
        except RenderError as exc:
            if exc.reason == "encrypted_reasoning":
                raise _invalid("Encrypted content is not supported.", "input") from exc
            raise ApiError(400, str(exc), param=exc.param) from exc
        choice = call.plan_choice
        if chat.get("tools") is None:
            chat.pop("tools", None)
        try:
            return self._chat_prompt(chat, "none" if choice is None else choice)
        except ApiError as exc:
            if "take" in exc.message and "text only" in exc.message:
                raise ApiError(400, f"{self.model.names[0]} is not a multimodal model") from exc
            raise

    def _max_output_tokens(self, body: dict, prompt_len: int) -> int:
        """max_output_tokens as vLLM takes it: at most the context, at least 1 (checked as the sampling
        parameters' max_tokens), by default what the context leaves."""
        limit = self.model.max_model_len
        value = body.get("max_output_tokens")  # an integer or null: read by fields.read_responses
        if value is None:
            return limit - prompt_len
        if value > limit:
            raise _bad_param(
                f"max_output_tokens={value} cannot be greater than max_model_len={limit}. Please request fewer "
                "output tokens.",
                "max_output_tokens",
                value,
            )
        if value < 1:
            raise _bad_param(f"max_tokens must be at least 1, got {value}.", "max_tokens", value)
        return min(value, limit - prompt_len)

    def _reasoning_tokens(self, req: Request, planned: ToolCall | None) -> int:
        """How many of a text answer's first tokens are reasoning: with a reasoning parser, the first half
        (rounded up) of the tokens it may produce; none without one, or for a tool call."""
        if self.model.reasoning_parser is None or planned is not None:
            return 0
        return (req.output_limit + 1) // 2

    def _responses_output(
        self, call: responses_api.ResponsesCall, req: Request, planned: ToolCall | None, reasoning: int = 0
    ) -> list[dict]:
        """A finished request's output items: a whole planned call as a function call, else its reasoning (with
        a reasoning parser) as a reasoning item and the rest of its text as one message (with a parser, none when
        that text is empty)."""
        if planned is not None and req.stops:
            return [
                responses_api.call_item(
                    call, responses_api.new_id("fc"), planned.id, planned.name, planned.arguments, "completed"
                )
            ]
        items = []
        if reasoning:
            thought = self._detok(req.output_ids[:reasoning])
            items.append(responses_api.reasoning_item(responses_api.new_id("rs"), thought))
        text = self._detok(req.output_ids[reasoning:])
        parser = self.model.tool_call_parser is not None or self.model.reasoning_parser is not None
        if parser and not text:
            return items
        return [*items, responses_api.message_item(responses_api.new_id("msg"), text)]

    # --- Anthropic Messages API ---------------------------------------------------------------------------
    async def messages(self, http: web.Request) -> web.StreamResponse:
        """The Anthropic Messages API over the same engine, as vLLM's /v1/messages serves it: the request made a
        chat-completions request, the answer and its events (and errors) in Anthropic's shapes."""
        try:
            body = await self._json(http)
            if "max_tokens" not in body:
                # Refused by the request model, before the endpoint: in vLLM's plain error shape.
                error = ApiError(400, "max_tokens: Field required", "Bad Request", "body.max_tokens")
                return _json_response(error.body(), 400)
            body = fields.read_messages(body)
            problems = anthropic_field_problems(body)
            if problems:
                raise validation_error(problems)
            anthropic_salt_type(body.get("cache_salt"))
        except ApiError as exc:
            return _json_response(exc.body(), exc.status)
        try:
            # Checked again as the chat-completions request it becomes, as vLLM does.
            cache_salt = cache_salt_of(body)
            model, chat, choice, prompt = self._anthropic_prompt(body)
            chat["max_tokens"] = chat["max_completion_tokens"] = body["max_tokens"]
            self._check_length(prompt.ids, from_text=True)
            call = self._plan_tool_call(prompt, choice)
            max_tokens = self._max_tokens(chat, True, len(prompt.ids))
        except ApiError as exc:
            return _json_response(exc.anthropic_body(), exc.status)
        message_id = f"chatcmpl-{http.headers.get('X-Request-Id') or uuid.uuid4().hex[:16]}"
        req = Request(
            request_id=message_id,
            prompt_ids=prompt.ids,
            max_tokens=max_tokens,
            output_script=call.ids if call else None,
            cache_salt=cache_salt,
        )
        if not body.get("stream"):
            async for _ in self.engine.generate(req):
                pass
            if call is not None and req.stops:
                content = [
                    {
                        "type": "tool_use",
                        "id": call.id,
                        "name": call.name,
                        "input": json.loads(call.arguments),
                    }
                ]
            else:
                content = [{"type": "text", "text": self._detok(req.output_ids)}]
            return web.json_response(
                {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "content": content,
                    "model": model,
                    "stop_reason": _anthropic_stop_reason(req, call),
                    "usage": self._anthropic_usage(req),
                },
                dumps=_dumps,
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(http)

        async def event(name: str, data: dict) -> None:
            await response.write(f"event: {name}\ndata: {_dumps(data)}\n\n".encode())

        generator = self.engine.generate(req)
        calls = ToolCallStream(call) if call is not None else None
        # message_start goes out with the first token, as vLLM sends it: its Messages stream is its chat stream
        # converted, whose first chunk (the role) comes with the first output.
        message_start = {
            "type": "message_start",
            "message": {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": model,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": len(prompt.ids), "output_tokens": 0},
            },
        }
        try:
            started = False
            produced = 0
            async for token in generator:
                produced += 1
                if produced == 1:
                    await event("message_start", message_start)
                if calls is not None:
                    for delta in calls.step(produced):
                        if "id" in delta:
                            started = True
                            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                            await event(
                                "content_block_start",
                                {"type": "content_block_start", "content_block": block, "index": 0},
                            )
                        else:
                            partial = delta["function"]["arguments"]
                            await event(
                                "content_block_delta",
                                {
                                    "type": "content_block_delta",
                                    "delta": {"type": "input_json_delta", "partial_json": partial},
                                    "index": 0,
                                },
                            )
                    continue
                if not started:
                    started = True
                    await event(
                        "content_block_start",
                        {
                            "type": "content_block_start",
                            "content_block": {"type": "text", "text": ""},
                            "index": 0,
                        },
                    )
                await event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "delta": {"type": "text_delta", "text": self._detok([token])},
                        "index": 0,
                    },
                )
            if not produced:
                await event("message_start", message_start)
            if started:
                await event("content_block_stop", {"type": "content_block_stop", "index": 0})
            await event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": _anthropic_stop_reason(req, call), "stop_sequence": None},
                    "usage": self._anthropic_usage(req),
                },
            )
            await event("message_stop", {"type": "message_stop"})
        finally:
            await generator.aclose()
        return response

    async def count_tokens(self, http: web.Request) -> web.Response:
        """Anthropic's token counting: the prompt the same request would have, refused as it would be."""
        try:
            body = await self._json(http)
        except ApiError as exc:
            return _json_response(exc.body(), exc.status)
        try:
            _, _, choice, prompt = self._anthropic_prompt(body)
            self._plan_tool_call(prompt, choice)  # a named tool that is not there is refused here too
        except ApiError as exc:
            return _json_response(exc.anthropic_body(), exc.status)
        count = len(prompt.ids)
        return _json_response({"input_tokens": count, "context_management": {"original_input_tokens": count}})

    def _anthropic_prompt(self, body: dict) -> tuple[str, dict, object, ChatPrompt]:
        """An Anthropic request as vLLM takes it: its model, the chat-completions request it becomes, that
        request's tool_choice and its rendered prompt."""
        model = self._check_model(body)
        try:
            chat = anthropic_chat_request(body, merge_inline_system=self.merge_inline_system)
        except RenderError as exc:
            raise ApiError(400, str(exc), param=exc.param) from exc
        choice = chat.get("tool_choice")
        self._check_tool_parser(choice)
        return model, chat, choice, self._chat_prompt(chat, choice)

    def _anthropic_usage(self, req: Request) -> dict:
        """vLLM's: the prompt split into uncached input, cache writes and cache reads (the latter two with
        --enable-prompt-tokens-details only)."""
        usage = {"input_tokens": len(req.prompt_ids), "output_tokens": len(req.output_ids)}
        if self.model.prompt_tokens_details:
            usage["input_tokens"] -= req.cached_tokens + req.created_cache_tokens
            usage["cache_creation_input_tokens"] = req.created_cache_tokens
            usage["cache_read_input_tokens"] = req.cached_tokens
        return usage

    # --- tools --------------------------------------------------------------------------------------------
    def _check_tool_parser(self, choice) -> None:
        """vLLM's refusal of a tool choice that needs a tool-call parser when the engine has none."""
        if self.model.tool_call_parser is not None or choice in (None, "none"):
            return
        if choice == "auto":
            raise ApiError(
                400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            )
        name = _named_tool(choice)
        described = f'function "{name}"' if name is not None else f'"{choice}"'
        raise ApiError(400, f"tool_choice={described} requires --tool-call-parser to be set")

    def _plan_tool_call(self, prompt: ChatPrompt, choice) -> ToolCall | None:
        """The tool call this request gets, if any (see the rule at the top of this module)."""
        limit = self.model.tool_calls_per_conversation
        if self.model.tool_call_parser is None or not prompt.tools:
            return None
        tools = [tool.get("function") or {} for tool in prompt.tools]
        named = _named_tool(choice)
        if named is not None:
            function = next((f for f in tools if f.get("name") == named), None)
            if function is None:
                raise ApiError(400, f"The tool with name '{named}' is not found in the tools list.")
        elif choice == "required" or (
            choice == "auto" and prompt.last_role == "user" and (limit is None or prompt.tool_calls < limit)
        ):
            function = tools[0]
        else:
            return None
        arguments = example_arguments(function.get("parameters"))
        text, ids, ends = self._call_tokens(function["name"], arguments, prompt)
        return ToolCall(
            name=function["name"],
            arguments=json.dumps(arguments, ensure_ascii=False),
            text=text,
            ids=ids,
            ends=ends,
            named=named is not None,
            forced=named is not None or choice == "required",
        )

    def _call_tokens(
        self, name: str, arguments: dict, prompt: ChatPrompt
    ) -> tuple[str, list[int], list[int]]:
        """The text the template renders for an assistant turn that makes this call (up to its end-of-turn
        token), its token ids with the end-of-sequence token after them, and where each token's text ends."""
        key = _dumps([name, arguments, prompt.kwargs, prompt.tools])
        cached = self._calls.get(key)
        if cached is not None:
            self._calls.move_to_end(key)
            return cached
        text = self._rendered_call(name, arguments, prompt)
        ids, ends = self.tokenizer.encode_with_ends(text)
        eos = self.tokenizer.eos_token_id
        if eos is not None:
            ids, ends = [*ids, eos], [*ends, len(text)]
        self._calls[key] = (text, ids, ends)
        if len(self._calls) > 1024:
            self._calls.popitem(last=False)
        return text, ids, ends

    def _rendered_call(self, name: str, arguments: dict, prompt: ChatPrompt) -> str:
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)},
        }
        kwargs = {**prompt.kwargs, "add_generation_prompt": False, "continue_final_message": False}
        try:
            probe = chat_inputs(
                {
                    "messages": [
                        {"role": "user", "content": "."},
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                    ]
                },
                self.traits,
            )
            user, turn = probe.messages

            def render(messages: list[dict], generation_prompt: bool) -> str:
                options = {**kwargs, "add_generation_prompt": generation_prompt}
                return self.tokenizer.render_text(ChatInputs(messages, prompt.tools, options))

            base = render([user], False)
            full = render([user, turn], False)
            opening = render([user], True)
        except Exception:  # a template that cannot render the probe: write the call the Hermes way
            log.debug("the chat template could not render a tool call", exc_info=True)
            full = base = opening = ""
        if not full.startswith(base) or full == base:
            return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"
        turn_text = full[len(base) :]
        generation = opening[len(base) :] if opening.startswith(base) else ""
        same = 0
        while same < min(len(turn_text), len(generation)) and turn_text[same] == generation[same]:
            same += 1
        text = turn_text[same:]
        eos = self.tokenizer.eos_token
        if eos and eos in text:
            text = text[: text.index(eos)]
        return text

    # --- helpers ----------------------------------------------------------------------------------------
    def _usage(self, reqs: list[Request], chat: bool, *, null_details: bool) -> dict:
        """Usage as vLLM reports it; without --enable-prompt-tokens-details the details are null (full
        responses) or absent (stream chunks). Chat usage also counts the prompt tokens written to the cache.
        With `n` choices the prompt counts once and the output of all of them; the cached part is what the
        choices after the first found of the first's blocks (vLLM reports the most any choice found)."""
        req = max(reqs, key=lambda r: r.cached_tokens)
        prompt = len(req.prompt_ids)
        output = sum(len(r.output_ids) for r in reqs)
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + output,
            "completion_tokens": output,
        }
        if self.model.prompt_tokens_details:
            details: dict = {"cached_tokens": req.cached_tokens}
            if chat:
                details["created_cache_tokens"] = req.created_cache_tokens
            elif null_details:
                details["created_cache_tokens"] = None
            if null_details:
                details["multimodal_tokens"] = None
            usage["prompt_tokens_details"] = details
        elif null_details:
            usage["prompt_tokens_details"] = None
        if null_details:
            usage["completion_tokens_details"] = None
        return usage

    def _running_usage(self, req: Request) -> dict:
        prompt = len(req.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + len(req.output_ids),
            "completion_tokens": len(req.output_ids),
        }

    def _detok(self, ids: list[int]) -> str:
        parts = []
        for token in ids:
            text = self._text.get(token)
            if text is None:
                text = self._text[token] = self.tokenizer.decode([token])
            parts.append(text)
        return "".join(parts)

    async def _json(self, request: web.Request) -> dict:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"The request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        return body

    def _check_model(self, body: dict) -> str:
        model = body.get("model")
        if model and model not in self.model.names:
            aliases = ", ".join(self.model.names)
            raise ApiError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {aliases}.",
                "NotFoundError",
                "model",
            )
        return model or self.model.names[0]

    def _chat_prompt(self, body: dict, choice=None) -> ChatPrompt:
        """A chat request's prompt token ids and what its template saw, rendered from the request's chat inputs
        (routing.rendering.conversion.chat_inputs, the router's own conversion) and cached by them: agents and benchmarks
        resend the same context over and over."""
        exclude_tools = self.model.exclude_tools_when_tool_choice_none and choice == "none"
        fields = ("messages", "tools", "add_generation_prompt", "continue_final_message")
        more = ("chat_template_kwargs", "reasoning_effort")
        key = _dumps([[body.get(k) for k in fields], [body.get(k) for k in more], exclude_tools])
        prompt = self._rendered.get(key)
        if prompt is not None:
            self._rendered.move_to_end(key)
            return prompt
        try:
            inputs = chat_inputs(body, self.traits)
        except RenderError as exc:
            raise ApiError(400, str(exc), param=exc.param) from exc
        if exclude_tools:
            inputs.tools = None
        try:
            ids = self.tokenizer.render_chat(inputs)
        except Exception as exc:  # a template error is the client's message shape
            raise ApiError(400, f"The messages could not be rendered with the chat template: {exc}") from exc
        last_role = inputs.messages[-1].get("role") if inputs.messages else None
        calls = sum(
            len(message.get("tool_calls") or ())
            for message in inputs.messages
            if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list)
        )
        prompt = ChatPrompt(ids, inputs.tools, inputs.kwargs, last_role, calls)
        self._rendered[key] = prompt
        self._rendered_tokens += len(ids)
        # Bounded by the ids it holds (a 200K-token prompt's are ~7 MB as a list): a miss costs a render and the
        # ids of the new pieces only (ModelTokenizer.encode_rendered).
        while len(self._rendered) > 4096 or self._rendered_tokens > RENDERED_CACHE_TOKENS:
            _, old = self._rendered.popitem(last=False)
            self._rendered_tokens -= len(old.ids)
        return prompt

    def _completion_prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=body.get("add_special_tokens", True))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            vocab = self.tokenizer.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise ApiError(
                    400, f"Token id out of vocabulary: ids must lie in [0, {vocab}).", param="prompt"
                )
        else:
            raise ApiError(
                400,
                "`prompt` must be a string or a list of token ids (one prompt per request).",
                param="prompt",
            )
        self._check_length(ids, from_text=isinstance(prompt, str))
        return ids

    def _check_length(self, ids: list[int], *, from_text: bool = False) -> None:
        """vLLM's refusal of a prompt that leaves no room for output. A prompt it tokenizes from text (a rendered
        chat, a string) it tokenizes no further than one token past the limit, and says "at least"."""
        limit = self.model.max_model_len
        if len(ids) > limit:
            count = limit + 1 if from_text else len(ids)
            qualifier = "at least " if count == limit + 1 else ""
            raise _bad_param(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. Please "
                "reduce the length of the input prompt.",
                "input_tokens",
                count,
            )
        if len(ids) == limit:
            raise ApiError(
                400,
                f"The decoder prompt (length {limit}) plus the number of requested output tokens (at least 1) "
                f"is longer than the maximum model length of {limit}. Make sure that `max_model_len` is no smaller "
                "than the number of text tokens (prompt + requested output tokens).",
            )

    def _max_tokens(self, body: dict, chat: bool, prompt_len: int) -> int:
        limit = self.model.max_model_len
        param = (
            "max_completion_tokens"
            if chat and body.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        value = body.get(param)  # an integer or null: read by fields.read_chat / read_completion
        if value is None:
            return limit - prompt_len
        if value > limit:
            raise _bad_param(
                f"{param}={value} cannot be greater than max_model_len={limit}. Please request fewer output tokens.",
                param,
                value,
            )
        if value < 1:  # checked as the sampling parameters' max_tokens, whichever field set it
            raise _bad_param(f"max_tokens must be at least 1, got {value}.", "max_tokens", value)
        return min(value, limit - prompt_len)


async def _merged(generators: list) -> AsyncIterator[tuple[int, int]]:
    """(index, token) from each generator as it comes; one generator is read directly."""
    if len(generators) == 1:
        async for token in generators[0]:
            yield 0, token
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generator) -> None:
        try:
            async for token in generator:
                await queue.put((index, token, None))
            await queue.put((index, None, None))
        except Exception as exc:  # re-raised in the reader
            await queue.put((index, None, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generators)]
    try:
        running = len(tasks)
        while running:
            index, token, error = await queue.get()
            if error is not None:
                raise error
            if token is None:
                running -= 1
            else:
                yield index, token
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _tool_choice(body: dict):
    """A chat request's tool_choice after vLLM's request checks (ChatCompletionRequest.check_tool_usage):
    "auto" when tools come without one, refusals in its words."""
    tools = body.get("tools")
    if tools == []:
        raise _invalid(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    if "tool_choice" not in body:
        return "auto" if tools else "none"
    choice = body["tool_choice"]
    if choice is None or choice == "none":
        return choice
    if tools is None:
        raise _invalid("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise _invalid(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" '
            "are supported.",
            "tool_choice",
        )
    if isinstance(choice, dict):
        function = choice.get("function")
        if not isinstance(function, dict):
            raise _invalid(
                f"Invalid value for `function`: `{function}` in `tool_choice`! {NAMED_TOOL_USAGE}",
                "tool_choice.function",
            )
        if "name" not in function:
            raise _invalid(
                f"Expected field `name` in `function` in `tool_choice`! {NAMED_TOOL_USAGE}",
                "tool_choice.function.name",
            )
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise _invalid(
                f"Invalid `name` in `function`: `{name}` in `tool_choice`! {NAMED_TOOL_USAGE}",
                "tool_choice.function.name",
            )
        tools = tools if isinstance(tools, list) else []
        names = [(tool.get("function") or {}).get("name") for tool in tools if isinstance(tool, dict)]
        if name not in names:
            raise _invalid(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )
    return choice


def _anthropic_stop_reason(req: Request, call: ToolCall | None) -> str:
    if not req.stops:
        return "max_tokens"
    return "tool_use" if call is not None else "end_turn"


class SideChannel:
    """The NIXL-style side channel: a decode engine pulls a prefilled request's KV from here."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/pull", self.pull)
        return app

    async def pull(self, request: web.Request) -> web.Response:
        body = await request.json()
        tokens = self.engine.take_held(str(body.get("remote_request_id")))
        if tokens is None:
            return web.json_response({"error": "unknown or expired request"}, status=404)
        return web.json_response({"num_tokens": tokens, "engine_id": self.engine.engine_id})


def remote_puller(session_factory):
    """A pull function for the engine: fetch a prefilled request's KV from the producer's side channel."""

    async def pull(params: dict) -> int:
        for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port"):
            if not params.get(key):
                raise RemotePrefillError(f"Got invalid KVTransferParams: {key} is missing")
        url = f"http://{params['remote_host']}:{params['remote_port']}/pull"
        try:
            async with session_factory().post(
                url, json={"remote_request_id": params["remote_request_id"]}
            ) as resp:
                if resp.status != 200:
                    raise RemotePrefillError(
                        f"the prefill engine has no KV for {params['remote_request_id']}"
                    )
                return int((await resp.json())["num_tokens"])
        except aiohttp.ClientError as exc:
            raise RemotePrefillError(
                f"could not reach the prefill engine's side channel at {url}: {exc}"
            ) from exc

    return pull
