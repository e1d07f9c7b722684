"""Tokenising large prompts in worker processes, so the router's event loop keeps serving while they are worked out.

Rendering a chat template and encoding its text hold the interpreter lock: a prompt of megabytes tokenised on a
thread of the router's own process stops every stream of the replica until it is done. A request whose JSON is at
least ROUTER_TOKENIZE_POOL_MIN_BYTES long is tokenised in one of ROUTER_TOKENIZE_PROCESSES worker processes
instead. Each worker loads a deployment's tokenizer once and keeps it with its caches; every turn of a conversation
goes to the same worker (chosen by a hash of its first message), so those caches serve its next turn as they would
in the router. A smaller request costs less than the trip to a worker and stays on the router's tokenizing thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing
import os
import threading
from array import array
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import islice

import orjson

from routing.rendering.conversion import RenderError
from routing.rendering.routes import ROUTES
from routing.rendering.shared_tokens import Sharing
from routing.rendering.tokenize import RouterTokenizer

log = logging.getLogger(__name__)

WORKER_TOKENIZERS = 8  # deployments' tokenizers one worker keeps loaded
AFFINITY_CHARS = 512  # of each string in a conversation's head, hashed to choose its worker


def prompt_tokens(tokenizer: RouterTokenizer, payload: dict, path: str) -> array | None:
    """The prompt's token ids as the engine computes them: a completions `prompt` string, or the rendered chat
    (chat completions, Anthropic messages, Responses); None for a request with neither."""
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return tokenizer.encode_prompt(prompt)
    route = ROUTES[path]
    if not route.templated or not isinstance(payload.get(route.prompt), list | str):
        return None
    return tokenizer.encode_request(payload, path)


# --- in the worker process ------------------------------------------------------------------------------------
_loaded: OrderedDict[tuple[str, str], RouterTokenizer] = OrderedDict()
_sharing: Sharing | None = None  # the router's, given at the worker's start


def _tokenizer(folder: str, chat_template: str) -> RouterTokenizer:
    key = (folder, chat_template)
    tokenizer = _loaded.get(key)
    if tokenizer is None:
        tokenizer = _loaded[key] = RouterTokenizer(folder, chat_template=chat_template or None)
        if _sharing is not None:
            tokenizer.shared = _sharing.pieces_for(tokenizer.folder)
        while len(_loaded) > WORKER_TOKENIZERS:
            _loaded.popitem(last=False)
    _loaded.move_to_end(key)
    return tokenizer


def _load(folder: str, chat_template: str) -> None:
    _tokenizer(folder, chat_template)


def _encode(folder: str, chat_template: str, body: bytes, path: str):
    """Run in a worker: the ids, or ("render_error", reason, message, param) for a request that cannot be
    rendered (RenderError does not survive pickling as it is)."""
    try:
        return prompt_tokens(_tokenizer(folder, chat_template), orjson.loads(body), path)
    except RenderError as exc:
        return ("render_error", exc.reason, str(exc), exc.param)


def _start_worker(sharing: Sharing | None) -> None:
    """In each worker, first: share token ids as the router does, and exit when the router does, however it ends
    (the worker holds its own queue's write end, so it would wait for work forever)."""
    global _sharing
    _sharing = sharing
    router = multiprocessing.parent_process()
    if router is not None:
        threading.Thread(target=_exit_after, args=(router,), daemon=True).start()


def _exit_after(router) -> None:
    router.join()
    os._exit(0)


# --- in the router ---------------------------------------------------------------------------------------------
class TokenizePool:
    """`processes` single-process executors, so a conversation can be sent to the same worker every turn."""

    def __init__(self, processes: int, start_method: str = "spawn", sharing: Sharing | None = None):
        # Spawned, the workers are the router's own children: they end with it, however it ends (a forkserver
        # outlived its router, with its workers). The router starts them when a deployment routes by the prompt
        # (PrefixRouting.warm), else at the first large request.
        self.processes = max(1, processes)
        self.context = multiprocessing.get_context(start_method)
        self.sharing = sharing
        self._executors: list[ProcessPoolExecutor | None] = [None] * self.processes

    def _executor(self, index: int) -> ProcessPoolExecutor:
        executor = self._executors[index]
        if executor is None:
            executor = self._executors[index] = ProcessPoolExecutor(
                1, mp_context=self.context, initializer=_start_worker, initargs=(self.sharing,)
            )
        return executor

    def start(self) -> None:
        """Start the workers now rather than at the first large request."""
        for index in range(self.processes):
            self._executor(index).submit(int)

    def preload(self, folder: str, chat_template: str) -> None:
        """Have every worker already started load a deployment's tokenizer in the background (one started later
        loads it at its first request)."""
        for executor in self._executors:
            if executor is not None:
                executor.submit(_load, folder, chat_template).add_done_callback(_logged)

    async def encode(
        self, folder: str, chat_template: str, body: bytes, payload: dict, path: str
    ) -> array | None:
        """The prompt's ids, worked out in a worker from the request's JSON (`body`); `payload` (the same request,
        parsed) chooses the worker. RenderError as the tokenizer raises it."""
        index = worker_for(payload, path, self.processes)
        executor = self._executor(index)
        try:
            result = await asyncio.wrap_future(executor.submit(_encode, folder, chat_template, body, path))
        except BrokenProcessPool:
            # A worker died (killed for memory, say): the next request starts a new one.
            log.warning("a tokenizing worker died; starting another")
            if self._executors[index] is executor:
                self._executors[index] = None
                executor.shutdown(wait=False, cancel_futures=True)
            raise
        if isinstance(result, tuple):
            _, reason, message, param = result
            raise RenderError(reason, message, param)
        return result

    def close(self) -> None:
        for index, executor in enumerate(self._executors):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
                self._executors[index] = None


def worker_for(payload: dict, path: str, processes: int) -> int:
    """The worker for a request: a hash of the head of its system prompt and first message (or of its prompt),
    which every turn of a conversation repeats."""
    if processes == 1:
        return 0
    head = payload.get("prompt")
    if not isinstance(head, str):
        messages = payload.get(ROUTES[path].prompt)
        head = messages[:1] if isinstance(messages, list) else messages
        head = [payload.get("system"), payload.get("instructions"), head]
    digest = hashlib.blake2b(_head_text(head).encode(errors="replace"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % processes


def _head_text(value, depth: int = 0) -> str:
    """A bounded text of `value`'s head: strings cut at AFFINITY_CHARS, eight items a level, four levels."""
    if isinstance(value, str):
        return value[:AFFINITY_CHARS]
    if depth >= 4:
        return ""
    if isinstance(value, dict):
        items = islice(value.items(), 8)
        return "{" + ",".join(f"{k}:{_head_text(v, depth + 1)}" for k, v in items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_head_text(v, depth + 1) for v in value[:8]) + "]"
    return repr(value)[:AFFINITY_CHARS]


def _logged(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("a tokenizing worker could not load a tokenizer: %s", future.exception())
