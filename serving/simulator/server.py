"""The simulator's HTTP server: vLLM's OpenAI-compatible routes, response shapes and error bodies."""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .engine import Engine, RemotePrefillError, Request
from .tokenizer import ModelTokenizer

log = logging.getLogger(__name__)
VLLM_VERSION = "0.32.0"


@dataclass
class ServedModel:
    names: list[str]
    root: str
    max_model_len: int
    prompt_tokens_details: bool
    kv_events_config: dict | None


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        }


def _bad_param(message: str, param: str, value) -> ApiError:
    return ApiError(400, f"{message} (parameter={param}, value={value})", param=param)


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class SimulatorApp:
    def __init__(self, engine: Engine, tokenizer: ModelTokenizer, model: ServedModel):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.fingerprint = (
            f"vllm-{VLLM_VERSION}-" + hashlib.sha256(_dumps(model.__dict__).encode()).hexdigest()[:8]
        )
        self._text: dict[int, str] = {}
        self._rendered: OrderedDict[str, list[int]] = OrderedDict()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
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
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/messages", self.messages)
        return app

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
        return web.Response(status=200)

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            self._check_model(body)
            if "messages" in body:
                ids = self.tokenizer.render_chat(
                    body["messages"],
                    add_generation_prompt=body.get("add_generation_prompt", True),
                    continue_final_message=body.get("continue_final_message", False),
                    tools=body.get("tools"),
                    chat_template_kwargs=body.get("chat_template_kwargs"),
                )
            elif isinstance(body.get("prompt"), str):
                ids = self.tokenizer.encode(
                    body["prompt"], add_special_tokens=body.get("add_special_tokens", True)
                )
            else:
                raise ApiError(400, "Give either `prompt` (a string) or `messages`.")
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        strs = self.tokenizer.token_strs(ids) if body.get("return_token_strs") else None
        return web.json_response(
            {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ApiError(400, "`tokens` must be a list of token ids.", param="tokens")
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    # --- generation -------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, http: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await self._json(http)
            model = self._check_model(body)
            prompt_ids = self._prompt_ids(body, chat)
            max_tokens = self._max_tokens(body, chat, len(prompt_ids))
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        external = http.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex[:16]
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{external}"
        req = Request(
            request_id=response_id,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            seed=body.get("seed"),
            kv_transfer_params=body.get("kv_transfer_params"),
        )
        created = int(time.time())
        stream_options = body.get("stream_options") or {}
        if body.get("stream"):
            return await self._stream(http, req, chat, model, response_id, created, stream_options)
        return await self._complete(req, chat, model, response_id, created)

    async def _complete(
        self, req: Request, chat: bool, model: str, response_id: str, created: int
    ) -> web.Response:
        try:
            async for _ in self.engine.generate(req):
                pass
        except RemotePrefillError as exc:
            return web.json_response(ApiError(500, str(exc), "InternalServerError").body(), status=500)
        text = self._detok(req.output_ids)
        if chat:
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
        body = {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": self._usage(req, null_details=True),
            "kv_transfer_params": req.kv_transfer_out,
            "ec_transfer_params": None,
            "metrics": None,
        }
        if chat:
            body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        return web.json_response(body, dumps=_dumps)

    async def _stream(
        self,
        http: web.Request,
        req: Request,
        chat: bool,
        model: str,
        response_id: str,
        created: int,
        stream_options: dict,
    ) -> web.StreamResponse:
        include_usage = bool(stream_options.get("include_usage"))
        continuous = include_usage and bool(stream_options.get("continuous_usage_stats"))
        obj = "chat.completion.chunk" if chat else "text_completion"
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        await response.prepare(http)

        def chunk(choices: list, **extra) -> bytes:
            data = {
                "id": response_id,
                "object": obj,
                "created": created,
                "model": model,
                "choices": choices,
                **extra,
            }
            if continuous and choices:
                data["usage"] = self._running_usage(req)
            return f"data: {_dumps(data)}\n\n".encode()

        generator = self.engine.generate(req)
        # With no decode time the tokens come all at once: one write instead of one per event keeps this
        # zero-latency upstream cheaper than any gateway measured in front of it.
        timing = self.engine.timing
        coalesce = timing.decode_time == 0 and timing.decode_time_per_seq == 0
        pending: list[bytes] = []
        try:
            if chat:
                role = [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
                # Sent with the first token, as vLLM sends it: from its first output, after the prefill.
                pending.append(chunk(role, prompt_token_ids=None, prompt_text=None))
            produced = 0
            async for token in generator:
                produced += 1
                last = produced == req.max_tokens
                piece = self._detok([token])
                if chat:
                    choice = {
                        "index": 0,
                        "delta": {"content": piece},
                        "logprobs": None,
                        "finish_reason": "length" if last else None,
                    }
                else:
                    choice = {
                        "index": 0,
                        "text": piece,
                        "logprobs": None,
                        "finish_reason": "length" if last else None,
                        "stop_reason": None,
                        "prompt_token_ids": None,
                    }
                if last:
                    choice["stop_reason"] = None
                choice["token_ids"] = None
                extra = {"system_fingerprint": self.fingerprint} if last and not include_usage else {}
                pending.append(chunk([choice], **extra))
                if not coalesce:
                    await response.write(b"".join(pending))
                    pending.clear()
            if include_usage:
                pending.append(
                    chunk([], usage=self._usage(req, null_details=False), system_fingerprint=self.fingerprint)
                )
            pending.append(b"data: [DONE]\n\n")
            await response.write(b"".join(pending))
        except RemotePrefillError as exc:
            await response.write(
                f"data: {_dumps(ApiError(500, str(exc), 'InternalServerError').body())}\n\n".encode()
            )
            await response.write(b"data: [DONE]\n\n")
        finally:
            await generator.aclose()
        return response

    # --- Anthropic Messages API ---------------------------------------------------------------------------
    async def messages(self, http: web.Request) -> web.StreamResponse:
        """The Anthropic Messages API over the same engine, in the event format vLLM's /v1/messages streams."""
        try:
            body = await self._json(http)
            model = self._check_model(body)
            if not isinstance(body.get("max_tokens"), int):
                raise ApiError(400, "max_tokens: Field required", param="max_tokens")
            chat = {"messages": _anthropic_to_chat(body), "max_tokens": body["max_tokens"]}
            prompt_ids = self._prompt_ids(chat, True)
            max_tokens = self._max_tokens(chat, True, len(prompt_ids))
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        message_id = f"chatcmpl-{http.headers.get('X-Request-Id') or uuid.uuid4().hex[:16]}"
        req = Request(request_id=message_id, prompt_ids=prompt_ids, max_tokens=max_tokens)
        if not body.get("stream"):
            async for _ in self.engine.generate(req):
                pass
            return web.json_response(
                {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "text", "text": self._detok(req.output_ids)}],
                    "model": model,
                    "stop_reason": "max_tokens",
                    "stop_sequence": None,
                    "usage": self._anthropic_usage(req),
                },
                dumps=_dumps,
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(http)

        async def event(name: str, data: dict) -> None:
            await response.write(f"event: {name}\ndata: {_dumps(data)}\n\n".encode())

        generator = self.engine.generate(req)
        try:
            await event(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": message_id,
                        "type": "message",
                        "role": "assistant",
                        "content": [],
                        "model": model,
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {"input_tokens": len(prompt_ids), "output_tokens": 0},
                    },
                },
            )
            started = False
            async for token in generator:
                if not started:
                    started = True
                    await event(
                        "content_block_start",
                        {
                            "type": "content_block_start",
                            "index": 0,
                            "content_block": {"type": "text", "text": ""},
                        },
                    )
                await event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "text_delta", "text": self._detok([token])},
                    },
                )
            if started:
                await event("content_block_stop", {"type": "content_block_stop", "index": 0})
            await event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                    "usage": self._anthropic_usage(req),
                },
            )
            await event("message_stop", {"type": "message_stop"})
        finally:
            await generator.aclose()
        return response

    def _anthropic_usage(self, req: Request) -> dict:
        usage = {"input_tokens": len(req.prompt_ids), "output_tokens": len(req.output_ids)}
        if self.model.prompt_tokens_details:
            usage["input_tokens"] -= req.cached_tokens
            usage["cache_read_input_tokens"] = req.cached_tokens
        return usage

    # --- helpers ----------------------------------------------------------------------------------------
    def _usage(self, req: Request, *, null_details: bool) -> dict:
        """Usage as vLLM reports it; without --enable-prompt-tokens-details the details are null (full
        responses) or absent (stream chunks)."""
        prompt = len(req.prompt_ids)
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + len(req.output_ids),
            "completion_tokens": len(req.output_ids),
        }
        if self.model.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": req.cached_tokens}
            if null_details:
                usage["prompt_tokens_details"].update(created_cache_tokens=None, multimodal_tokens=None)
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

    def _render_cached(self, messages: list, body: dict) -> list[int]:
        """Chat rendering and tokenisation, cached by the request's exact chat inputs (agents and benchmarks
        resend the same context over and over)."""
        options = {
            k: body.get(k)
            for k in ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs")
        }
        key = _dumps([messages, options])
        ids = self._rendered.get(key)
        if ids is not None:
            self._rendered.move_to_end(key)
            return ids
        try:
            ids = self.tokenizer.render_chat(
                messages,
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                tools=body.get("tools"),
                chat_template_kwargs=body.get("chat_template_kwargs"),
            )
        except Exception as exc:  # a template error is the client's message shape
            raise ApiError(400, f"The messages could not be rendered with the chat template: {exc}") from exc
        self._rendered[key] = ids
        if len(self._rendered) > 4096:
            self._rendered.popitem(last=False)
        return ids

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        limit = self.model.max_model_len
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "`messages` must be a non-empty list.", param="messages")
            ids = self._render_cached(messages, body)
        else:
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
        if len(ids) > limit:
            raise _bad_param(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains {len(ids)} "
                "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
                "of the input prompt.",
                "input_tokens",
                len(ids),
            )
        if len(ids) == limit:
            raise ApiError(
                400,
                f"The decoder prompt (length {limit}) plus the number of requested output tokens (at least 1) "
                f"is longer than the maximum model length of {limit}. Make sure that `max_model_len` is no smaller "
                "than the number of text tokens (prompt + requested output tokens).",
            )
        return ids

    def _max_tokens(self, body: dict, chat: bool, prompt_len: int) -> int:
        limit = self.model.max_model_len
        param = (
            "max_completion_tokens"
            if chat and body.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        value = body.get(param)
        if value is None:
            return limit - prompt_len
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _bad_param(f"{param} must be at least 1, got {value}.", param, value)
        if value > limit:
            raise _bad_param(
                f"{param}={value} cannot be greater than max_model_len={limit}. Please request fewer output tokens.",
                param,
                value,
            )
        return min(value, limit - prompt_len)


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


def _anthropic_to_chat(body: dict) -> list[dict]:
    """Anthropic system and messages as chat messages (text blocks joined; other blocks as their JSON)."""

    def text_of(content) -> str:
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = []
            for block in content:
                if isinstance(block, dict) and block.get("type") == "text":
                    parts.append(block.get("text", ""))
                elif isinstance(block, dict) and block.get("type") == "tool_result":
                    parts.append(text_of(block.get("content", "")))
                else:
                    parts.append(_dumps(block))
            return "\n".join(parts)
        raise ApiError(400, "Message content must be a string or a list of content blocks.", param="messages")

    messages = []
    if body.get("system"):
        messages.append({"role": "system", "content": text_of(body["system"])})
    for message in body.get("messages") or []:
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise ApiError(400, "Each message needs a role of user or assistant.", param="messages")
        messages.append({"role": message["role"], "content": text_of(message.get("content", ""))})
    return messages
