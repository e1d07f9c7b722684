"""Prefix-aware routing inputs for one request: tokens, block keys, what each endpoint holds, and the records
to update once an endpoint is chosen."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
from django.conf import settings
from redis.exceptions import RedisError

from routing.info import DeploymentInfo
from routing.kvindex.blocks import PromptKeyCache, chain_seed
from routing.kvindex.prefix_health import PrefixHealth
from routing.kvindex.prefix_index import Held, PrefixIndex
from routing.rendering.conversion import RenderError
from routing.rendering.shared_tokens import Sharing
from routing.rendering.tokenize import RouterTokenizer
from routing.rendering.tokenize_pool import TokenizePool, prompt_tokens
from routing.scheduling.affinity import ApproximateIndex, SessionMap
from routing.scheduling.pipeline import Candidate, RequestContext
from routing.server import metrics
from routing.server.loop_lag import late_by

log = logging.getLogger(__name__)
decisions = logging.getLogger("routing.decisions")
PREFIX_MODES = ("approximate", "precise")
RECENT_DECISIONS_S = 1.0
NOTHING = Held()


class PrefixRouting:
    def __init__(self, redis):
        self.index = PrefixIndex(redis, settings.ROUTER_SPECULATIVE_TTL_SECONDS)
        self.approximate = ApproximateIndex(settings.ROUTER_APPROX_BLOCKS_PER_ENDPOINT)
        # Precise lookups count this replica's decisions of the last moment, which Redis may not show yet: long
        # enough for any lookup in flight at a decision to come back; Redis's speculative entry serves after that.
        self.recent_s = min(RECENT_DECISIONS_S, settings.ROUTER_SPECULATIVE_TTL_SECONDS)
        self.sessions = SessionMap()
        self.lookup_timeout = settings.ROUTER_INDEX_LOOKUP_TIMEOUT_SECONDS
        self._warn_after = 0.0
        self._tokenizers: dict[tuple[str, str], RouterTokenizer | None] = {}
        self._render_logged: dict[tuple[str, str], float] = {}
        self.health = PrefixHealth()
        self.prompt_keys = PromptKeyCache()
        # Tokenising runs off the event loop: a small request on this thread, one at a time (the piece cache is
        # not shared); a large one in a worker process (routing/rendering/tokenize_pool.py), which holds no lock of ours.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        processes = settings.ROUTER_TOKENIZE_PROCESSES
        # Token ids of large pieces, shared with the other replicas (routing/rendering/shared_tokens.py).
        self.sharing = Sharing.from_settings()
        self.pool = TokenizePool(processes, sharing=self.sharing) if processes > 0 else None
        self.pool_min_bytes = settings.ROUTER_TOKENIZE_POOL_MIN_BYTES
        self.sample_rate = settings.ROUTER_DECISION_LOG_SAMPLE

    def tokenizer_for(self, deployment: DeploymentInfo) -> RouterTokenizer | None:
        """The deployment's tokenizer and template, loaded once; None when there is none to load."""
        key = (deployment.tokenizer_path, deployment.chat_template)
        if key not in self._tokenizers:
            try:
                path = Path(deployment.tokenizer_path)
                if not path.is_absolute():
                    path = settings.BASE_DIR / path
                tokenizer = RouterTokenizer(path, chat_template=deployment.chat_template or None)
                if self.sharing is not None:
                    tokenizer.shared = self.sharing.pieces_for(path)
                self._tokenizers[key] = tokenizer
                if self.pool is not None:
                    self.pool.preload(str(path), deployment.chat_template or "")
            except Exception as exc:  # a hub id or a broken folder: route without prefix scores
                log.warning(
                    "no tokenizer for %s at %s (%s); prefix scores are off for it",
                    deployment.name,
                    deployment.tokenizer_path,
                    exc,
                )
                self._tokenizers[key] = None
        return self._tokenizers[key]

    async def warm(self, deployments) -> None:
        """Load the tokenizers of the deployments that route by the prompt, and start the tokenizing workers with
        them, before their first request: on a busy host a worker's start and a tokenizer's load take seconds,
        which the first large request would otherwise wait out (past ROUTER_TOKENIZE_WAIT_SECONDS it is routed
        blind)."""
        wanted = [
            d
            for d in deployments
            if needs_prompt(d) and (d.tokenizer_path, d.chat_template) not in self._tokenizers
        ]
        if not wanted:
            return
        try:
            if self.pool is not None:
                self.pool.start()
            loop = asyncio.get_running_loop()
            for deployment in wanted:
                await loop.run_in_executor(self._executor, self.tokenizer_for, deployment)
        except Exception:  # a request loads what is missing then, as it would have without this
            log.exception("could not load the tokenizers ahead of requests")

    async def encode(self, tokenizer: RouterTokenizer, payload: dict, path: str) -> array | None:
        """A request's prompt token ids (tokenize_pool.prompt_tokens), from where its route (`path`, in
        routing/rendering/routes.py) holds the prompt and rendered as that route renders it: in a worker process when its
        JSON is at least ROUTER_TOKENIZE_POOL_MIN_BYTES long, else on the tokenizing thread."""
        loop = asyncio.get_running_loop()
        if self.pool is not None:
            try:
                body = orjson.dumps(payload)
            except orjson.JSONEncodeError:
                body = b""  # nested too deeply to send: the thread's tokenizer refuses it as the engine would
            if len(body) >= self.pool_min_bytes:
                return await self.pool.encode(
                    str(tokenizer.folder), tokenizer.chat_template_override, body, payload, path
                )
        return await loop.run_in_executor(self._executor, prompt_tokens, tokenizer, payload, path)

    async def _tokens(self, deployment: DeploymentInfo, payload: dict, path: str) -> array | None:
        key = (deployment.tokenizer_path, deployment.chat_template)
        if key in self._tokenizers:
            tokenizer = self._tokenizers[key]
        else:  # loaded once per deployment, on the thread: reading a tokenizer takes a while
            loop = asyncio.get_running_loop()
            tokenizer = await loop.run_in_executor(self._executor, self.tokenizer_for, deployment)
        if tokenizer is None:
            return None
        return await self.encode(tokenizer, payload, path)

    async def context(
        self,
        deployment: DeploymentInfo,
        payload: dict,
        prompt_ids: array | None,
        path: str,
        session_id: str | None,
    ) -> RequestContext:
        """`prompt_ids`: the prompt when it came as token ids (tokenize.token_ids), else None."""
        ctx = RequestContext(model=deployment.served_model_name, session_id=session_id)
        if session_id:
            ctx.session_endpoint = self.sessions.get(f"{deployment.id}:{session_id}")
        if not needs_prompt(deployment):
            return ctx
        # Token ids need no tokenizer (nor a hop to the tokenizing thread).
        tokens = prompt_ids
        if tokens is None:
            try:
                tokens = await self._tokens(deployment, payload, path)
            except RenderError as exc:  # routed blind: counted, and the engine will say what is wrong
                self.render_failed(deployment, exc.reason, str(exc))
                return ctx
            except Exception as exc:
                self.render_failed(deployment, "error", repr(exc))
                return ctx
        if tokens is None:
            return ctx
        ctx.prompt_tokens_estimate = len(tokens)
        # The tenant's cache salt (set by the router, never the client's) seeds the chain as it salts the engine's
        # block hashes: one tenant's prompt never matches blocks another tenant's requests computed.
        seed = chain_seed(deployment.served_model_name, cache_salt=payload.get("cache_salt"))
        ctx.block_keys = self.prompt_keys.hex_keys(tokens, deployment.block_size, seed)
        ctx.block_count = len(ctx.block_keys)
        if deployment.policy.mode == "precise":
            ctx.held, ctx.from_index = await self._precise_held(deployment, ctx.block_keys)
        elif deployment.policy.mode == "approximate":
            ctx.approx_held = self.approximate.lookup(ctx.block_keys)
        return ctx

    async def _precise_held(
        self, deployment: DeploymentInfo, keys: list[str]
    ) -> tuple[dict[int, Held], bool]:
        """What each endpoint holds of the prompt, from the index in Redis; when Redis does not answer within
        `lookup_timeout` (or fails), from this replica's own record of where it sent what, as approximate
        routing would, rather than holding the request up. The flag: whether the index answered."""
        model = deployment.served_model_name
        asked = time.perf_counter()
        lookup = asyncio.ensure_future(self.index.lookup(deployment.id, keys))
        try:
            try:
                held = await asyncio.wait_for(asyncio.shield(lookup), self.lookup_timeout)
            except TimeoutError:
                # A timer that fired late says the loop was busy (tokenising, parsing a large body) rather than
                # Redis slow: its answer is likely waiting to be read. It gets one more period, now the loop is free.
                if late_by(asked + self.lookup_timeout) < self.lookup_timeout / 2:
                    raise
                held = await asyncio.wait_for(asyncio.shield(lookup), self.lookup_timeout)
                metrics.of(metrics.index_late_loop, model).inc()
        except TimeoutError:
            # It finishes in the background; its connection stays usable.
            lookup.add_done_callback(read_outcome)
            return self._fallback(model, keys, "timeout"), False
        except RedisError as exc:
            self._warn(
                "the prefix index in Redis failed (%s); routing %s on this replica's record", exc, model
            )
            return self._fallback(model, keys, "error"), False
        metrics.of(metrics.index_lookup, model).observe(time.perf_counter() - asked)
        recent = self.approximate.lookup(
            keys, since=time.monotonic() - self.recent_s, beyond={e: h.blocks for e, h in held.items()}
        )
        return with_recent(held, recent), True

    def render_failed(self, deployment: DeploymentInfo, reason: str, detail: str) -> None:
        """A request whose prompt the router could not render is routed without prefix scores: counted per
        model and reason, kept for the portal, and logged once per reason per minute."""
        model = deployment.served_model_name
        metrics.of(metrics.render_failures, model, reason).inc()
        self.health.render_failed(deployment.id, reason)
        now = time.monotonic()
        if now >= self._render_logged.get((model, reason), 0.0):
            self._render_logged[(model, reason)] = now + 60
            log.warning("could not render a request for %s (%s), routed it blind: %s", model, reason, detail)

    def _warn(self, message: str, *args) -> None:
        """At most one warning per 10 s: while Redis is down, every request would say the same."""
        if time.monotonic() >= self._warn_after:
            self._warn_after = time.monotonic() + 10
            log.warning(message, *args)

    def _speculated(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._warn("could not write speculative prefix entries: %s", task.exception())

    def _fallback(self, model: str, keys: list[str], reason: str) -> dict[int, Held]:
        metrics.of(metrics.index_fallbacks, model, reason).inc()
        return {
            endpoint: Held(speculative=blocks) for endpoint, blocks in self.approximate.lookup(keys).items()
        }

    def chosen(
        self,
        deployment: DeploymentInfo,
        ctx: RequestContext,
        chosen: Candidate,
        candidates: list[Candidate],
        request_id: str = "-",
    ) -> int:
        """Record the decision; returns the prompt tokens predicted to be cached on the chosen endpoint."""
        endpoint = chosen.endpoint.id
        if ctx.session_id:
            self.sessions.put(f"{deployment.id}:{ctx.session_id}", endpoint)
        sampled = bool(self.sample_rate) and random.random() < self.sample_rate
        compared = ""
        if sampled and ctx.from_index:
            # Before this decision enters the record: what the record said when the index was asked.
            answer = index_vs_record(ctx.held, self.approximate.lookup(ctx.block_keys))
            metrics.of(metrics.index_vs_record, deployment.served_model_name, answer).inc()
            compared = f" index_vs_record={answer}"
        predicted_blocks = 0
        if ctx.block_keys:
            if deployment.policy.mode == "precise":
                held = ctx.held.get(endpoint)
                predicted_blocks = held.blocks if held else 0
                # Its own record serves lookups in flight now, and those Redis does not answer in time.
                self.approximate.record(endpoint, ctx.block_keys)
                # The leading blocks it holds already have an entry, which a speculative one never replaces.
                if predicted_blocks < ctx.block_count:
                    task = asyncio.get_running_loop().create_task(
                        self.index.speculate(deployment.id, endpoint, ctx.block_keys[predicted_blocks:])
                    )
                    task.add_done_callback(self._speculated)
            elif deployment.policy.mode == "approximate":
                predicted_blocks = ctx.approx_held.get(endpoint, 0)
                self.approximate.record(endpoint, ctx.block_keys)
        if sampled:
            decisions.info(
                "request=%s model=%s chose=%s blocks=%d %s%s",
                request_id,
                deployment.served_model_name,
                chosen.endpoint.name,
                ctx.block_count,
                " ".join(f"{c.endpoint.name}:{_fmt(ctx, c)}" for c in candidates),
                compared,
            )
        predicted = min(predicted_blocks * deployment.block_size, max(0, ctx.prompt_tokens_estimate - 1))
        return predicted

    def observe(
        self, deployment: DeploymentInfo, endpoint_name: str, predicted: int, prompt: int, cached: int
    ) -> None:
        """Predicted against engine-reported cached prompt tokens, per endpoint."""
        labels = (deployment.served_model_name, endpoint_name)
        metrics.of(metrics.prefix_prompt_tokens, *labels).inc(prompt)
        metrics.of(metrics.prefix_predicted_tokens, *labels).inc(predicted)
        metrics.of(metrics.prefix_reported_tokens, *labels).inc(cached)
        self.health.observed(deployment.id, predicted, cached)


def needs_prompt(deployment: DeploymentInfo) -> bool:
    """Whether routing looks at the prompt's tokens: prefix scores and P/D decisions do, the rest do not."""
    return deployment.policy.mode in PREFIX_MODES or deployment.has_prefill_pool


def with_recent(held: dict[int, Held], recent: dict[int, int]) -> dict[int, Held]:
    """Redis's answer, with the leading blocks this replica's own recent decisions sent beyond it counted as
    speculative."""
    for endpoint, blocks in recent.items():
        found = held.get(endpoint, NOTHING)
        if blocks > found.blocks:
            held[endpoint] = Held(found.gpu, found.cpu, found.speculative + blocks - found.blocks)
    return held


def index_vs_record(held: dict[int, Held], record: dict[int, int]) -> str:
    """Whether the index's answer and this replica's record of what it sent agree on how many of the prompt's
    leading blocks each endpoint holds; where they differ, which way: the engines hold more than this replica
    sent them (other replicas' requests) or less (blocks evicted, an engine restarted), or both."""
    more = less = False
    for endpoint in held.keys() | record.keys():
        found = held.get(endpoint, NOTHING).blocks
        sent = record.get(endpoint, 0)
        more |= found > sent
        less |= found < sent
    if more and less:
        return "both"
    return "engines_hold_more" if more else "engines_hold_less" if less else "same"


def _fmt(ctx: RequestContext, candidate: Candidate) -> str:
    """One candidate in a decision log line: the blocks it holds (precise: GPU/CPU/speculative; approximate:
    sent before), whether the load guard dropped its affinity, and every scorer's score."""
    parts = []
    held = ctx.held.get(candidate.endpoint.id)
    if held is not None:
        parts.append(f"held={held.gpu}/{held.cpu}/{held.speculative}")
    elif candidate.endpoint.id in ctx.approx_held:
        parts.append(f"held={ctx.approx_held[candidate.endpoint.id]}")
    if candidate.guarded:
        parts.append("guarded")
    parts += [f"{name}={value:.2f}" for name, value in sorted(candidate.scores.items())]
    return ",".join(parts)


def read_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # read, so a late failure is not reported as never retrieved
