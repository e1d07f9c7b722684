"""The simulated engine: a scheduler over a bounded KV cache with a latency model.

- At most `max_num_seqs` requests run; the rest wait in arrival order until a slot and enough KV blocks free up.
- Prefill is one compute lane: requests prefill one after another, each taking `prefill_overhead` plus
  `prefill_time_per_token` for every prompt token not found in the prefix cache when its turn comes (as vLLM
  looks the prefix up when it schedules the prefill, so a prefill queued behind one of the same prefix reuses
  it) or received from a peer,
  plus `cpu_restore_time_per_token` for every token loaded back from the CPU tier (when there is one).
- Decode streams one token every `decode_time + decode_time_per_seq * (running - 1)` seconds.
- Generation is deterministic: the same prompt and seed give the same tokens. A request may bring its own
  output (`output_script`, such as a tool call ending with the end-of-sequence token): it is generated token by
  token like any other and finishes with "stop" when all of it fits in `max_tokens`.
- A sampled answer runs to `max_tokens` (as a model with random weights does), unless the engine has an
  `answer_length`: then it is that many tokens, the last the end-of-sequence token, as a model that stops by
  itself (an agent treats an answer cut at `max_tokens` as an error and retries it).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from .kv_cache import Allocation, BlockPool, block_hashes
from .metrics import EngineMetrics


@dataclass
class Timing:
    prefill_time_per_token: float = 0.0
    prefill_overhead: float = 0.0
    decode_time: float = 0.0
    decode_time_per_seq: float = 0.0
    kv_transfer_time_per_token: float = 0.0
    cpu_restore_time_per_token: float = 0.0


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    seed: int | None = None
    kv_transfer_params: dict | None = None
    output_script: list[int] | None = None  # the output to generate instead of sampled tokens
    cache_salt: str | None = None  # salts the prompt's first block: another salt's cached blocks never match
    arrival: float = field(default_factory=time.monotonic)
    # Filled in as the request runs.
    cached_tokens: int = 0  # GPU prefix hits plus tokens restored from the CPU tier, as vLLM's usage counts
    created_cache_tokens: int = 0  # prompt tokens this request computed and wrote to the prefix cache
    restored_tokens: int = 0  # the part of cached_tokens loaded from the CPU tier
    transferred_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    kv_transfer_out: dict | None = None
    first_token_at: float | None = None

    @property
    def output_limit(self) -> int:
        """How many tokens the request will generate if it runs to its end."""
        if self.output_script is None:
            return self.max_tokens
        return min(self.max_tokens, len(self.output_script))

    @property
    def stops(self) -> bool:
        """Whether it ends by itself (its whole script fits) rather than at max_tokens."""
        return self.output_script is not None and len(self.output_script) <= self.max_tokens


class RemotePrefillError(Exception):
    pass


# A function that pulls a prefilled request's KV blocks from a peer: (params) -> number of tokens received.
PullFn = Callable[[dict], "asyncio.Future[int]"]


class Engine:
    def __init__(
        self,
        *,
        pool: BlockPool,
        metrics: EngineMetrics,
        max_num_seqs: int,
        enable_prefix_caching: bool,
        timing: Timing,
        output_pool: list[int],
        seed: int = 0,
        engine_id: str | None = None,
        side_channel: tuple[str, int] | None = None,
        pull: PullFn | None = None,
        held_request_timeout: float = 480.0,
        answer_length: int | None = None,
        eos_token_id: int | None = None,
    ):
        self.pool = pool
        self.metrics = metrics
        self.max_num_seqs = max_num_seqs
        self.prefix_caching = enable_prefix_caching
        self.timing = timing
        self.output_pool = output_pool
        self.seed = seed
        self.engine_id = engine_id or str(uuid.uuid4())
        self.side_channel = side_channel
        self.pull = pull
        self.held_request_timeout = held_request_timeout
        self.answer_length = answer_length if eos_token_id is not None else None
        self.eos_token_id = eos_token_id
        self.running = 0
        self._waiting: deque[Request] = deque()
        self._changed = asyncio.Condition()
        self._prefill_lane = asyncio.Lock()
        # Prefilled requests whose KV blocks wait for a decode engine to pull them.
        self._held: dict[str, tuple[Allocation, int, float]] = {}

    # --- the request's life ---------------------------------------------------------------------------
    async def generate(self, request: Request) -> AsyncIterator[int]:
        """Yield the request's output token ids as they are generated."""
        size = self.pool.block_size
        hashes = (
            block_hashes(request.prompt_ids, size, cache_salt=request.cache_salt)
            if self.prefix_caching
            else []
        )
        allocation = Allocation(cache_salt=request.cache_salt)
        seed = self._seed_for(request)  # once: it digests the whole prompt (~15 ms at 200K tokens)
        if request.output_script is None and self.answer_length:
            sampler = random.Random(seed)
            request.output_script = [
                *(sampler.choice(self.output_pool) for _ in range(self.answer_length - 1)),
                self.eos_token_id,
            ]
        admitted = False
        finished_normally = False
        hold = False
        try:
            await self._admit(request, hashes, allocation)
            admitted = True
            await self._prefill(request, hashes, allocation)
            rng = random.Random(seed)
            script = request.output_script
            for index in range(request.output_limit):
                if index:
                    await self._decode_step()
                token = script[index] if script is not None else rng.choice(self.output_pool)
                request.output_ids.append(token)
                if index == 0:
                    request.first_token_at = time.monotonic()
                    self.metrics.ttft.observe(request.first_token_at - request.arrival)
                self.metrics.generation_tokens.inc()
                self._grow(request, allocation)
                yield token
            request.finish_reason = "stop" if request.stops else "length"
            finished_normally = True
            hold = bool((request.kv_transfer_params or {}).get("do_remote_decode"))
            if hold:
                request.kv_transfer_out = self._hold_for_remote_decode(request, allocation)
        except BaseException:
            request.finish_reason = request.finish_reason or "abort"
            raise
        finally:
            if admitted:
                self.running -= 1
                if not hold:
                    self.pool.release(allocation)
                self._observe_finish(request, finished_normally)
            elif request in self._waiting:
                self._waiting.remove(request)
            self._update_gauges()
            self._wake_waiters()

    async def _admit(self, request: Request, hashes: list[bytes], allocation: Allocation) -> None:
        size = self.pool.block_size
        total = len(request.prompt_ids)
        self._waiting.append(request)
        self._update_gauges()
        async with self._changed:
            while True:
                limit = (total - 1) // size  # the last token is always computed
                hit = min(self.pool.longest_prefix(hashes), limit) if hashes else 0
                new_blocks = math.ceil(total / size) - hit
                if (
                    self._waiting[0] is request
                    and self.running < self.max_num_seqs
                    and self.pool.can_allocate(hashes[:hit], new_blocks)
                ):
                    break
                await self._changed.wait()
            self._waiting.popleft()
            self.pool.acquire(hashes[:hit], allocation)
            self.pool.allocate_private(new_blocks, allocation, force=True)
            self.running += 1
            restored = 0
            cpu = self.pool.cpu
            if cpu is not None and hashes:
                # The connector loads what follows the GPU hit from the CPU tier into the new blocks.
                restored = min(cpu.longest_prefix(hashes, hit), limit - hit)
                # vLLM's LRU policy touches every block the request used, head to tail (GPU hits included).
                cpu.touch(hashes)
            request.restored_tokens = restored * size
            request.cached_tokens = (hit + restored) * size
            self._changed.notify_all()
        self._update_gauges()

    async def _prefill(self, request: Request, hashes: list[bytes], allocation: Allocation) -> None:
        total = len(request.prompt_ids)
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and self.pull is not None:
            start = time.monotonic()
            try:
                received = await self.pull(params)
            except RemotePrefillError:
                self.metrics.nixl_failed.inc()
                received = 0
            else:
                elapsed_needed = (
                    max(0, received - request.cached_tokens) * self.timing.kv_transfer_time_per_token
                )
                await asyncio.sleep(max(0.0, elapsed_needed - (time.monotonic() - start)))
                self.metrics.nixl_xfer_time.observe(time.monotonic() - start)
                self.metrics.nixl_bytes.observe(max(0, received - request.cached_tokens) * 1024)
            request.transferred_tokens = max(0, min(received, total) - request.cached_tokens)
        async with self._prefill_lane:
            if not params.get("do_remote_prefill"):
                self._late_hit(request, hashes, allocation)
            compute = total - request.cached_tokens - request.transferred_tokens
            restore = request.restored_tokens * self.timing.cpu_restore_time_per_token
            await asyncio.sleep(
                self.timing.prefill_overhead + compute * self.timing.prefill_time_per_token + restore
            )
        local_hit = request.cached_tokens - request.restored_tokens
        self.metrics.prefix_queries.inc(total)
        self.metrics.prefix_hits.inc(local_hit)  # vLLM counts connector loads apart, as external hits
        if self.pool.cpu is not None and total > local_hit:
            self.metrics.external_prefix_queries.inc(total - local_hit)
            self.metrics.external_prefix_hits.inc(request.restored_tokens)
        self.metrics.prompt_tokens.inc(total)
        if self.prefix_caching:
            # vLLM's usage: the prompt's full blocks, now all cached, less those that were cached already.
            size = self.pool.block_size
            held = request.cached_tokens + request.transferred_tokens
            request.created_cache_tokens = max(0, total // size * size - held)
            # Restored blocks are written into GPU blocks and cached there again (a new GPU BlockStored).
            hit_blocks = local_hit // self.pool.block_size
            size = self.pool.block_size
            self.pool.commit_full_blocks(
                hashes[hit_blocks:], request.prompt_ids[hit_blocks * size : len(hashes) * size], allocation
            )
        self._update_gauges()

    def _late_hit(self, request: Request, hashes: list[bytes], allocation: Allocation) -> None:
        """Count as hits the blocks of this prompt that a prefill ahead of it in the lane stored meanwhile.

        vLLM looks a request's prefix up when it schedules the request's prefill, not when the request
        arrives, so a request queued behind a prefill of the same prefix reuses what that prefill computed.
        The blocks found now replace as many of the request's private blocks."""
        if not hashes or request.restored_tokens:
            return
        size = self.pool.block_size
        have = len(allocation.hashes)
        now = min(self.pool.longest_prefix(hashes), (len(request.prompt_ids) - 1) // size)
        if now <= have:
            return
        self.pool.acquire(hashes[have:now], allocation)
        self.pool.release_private(now - have, allocation)
        request.cached_tokens += (now - have) * size

    async def _decode_step(self) -> None:
        delay = self.timing.decode_time + self.timing.decode_time_per_seq * max(0, self.running - 1)
        start = time.monotonic()
        await asyncio.sleep(delay)
        self.metrics.itl.observe(time.monotonic() - start)

    def _grow(self, request: Request, allocation: Allocation) -> None:
        """Account for the new token: a new block when the sequence crosses a boundary, cache the full one."""
        size = self.pool.block_size
        length = len(request.prompt_ids) + len(request.output_ids)
        if length % size == 1 and length > 1:
            self.pool.allocate_private(1, allocation, force=True)
        if self.prefix_caching and length % size == 0:
            sequence = request.prompt_ids + request.output_ids
            index = length // size - 1
            parent = allocation.hashes[-1] if allocation.hashes else None
            if len(allocation.hashes) == index:  # the chain is whole up to here
                new = block_hashes(
                    sequence[index * size : length], size, parent, cache_salt=request.cache_salt
                )
                self.pool.commit_full_blocks(new, sequence[index * size : length], allocation)
        self._update_gauges()

    def _hold_for_remote_decode(self, request: Request, allocation: Allocation) -> dict:
        remote_request_id = f"{request.request_id}-{uuid.uuid4().hex[:8]}"
        self._held[remote_request_id] = (allocation, len(request.prompt_ids), time.monotonic())
        asyncio.get_running_loop().call_later(self.held_request_timeout, self._expire_held, remote_request_id)
        host, port = self.side_channel or ("127.0.0.1", 0)
        blocks = len(allocation.hashes) + allocation.private_blocks
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(1, blocks + 1))],
            "remote_engine_id": self.engine_id,
            "remote_request_id": remote_request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(request.prompt_ids),
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
        }

    def take_held(self, remote_request_id: str) -> int | None:
        """Hand a held request's KV over to a puller: free its blocks here and return how many tokens it had."""
        held = self._held.pop(remote_request_id, None)
        if held is None:
            return None
        allocation, tokens, _ = held
        self.pool.release(allocation)
        self._update_gauges()
        self._wake_waiters()
        return tokens

    def _expire_held(self, remote_request_id: str) -> None:
        self.take_held(remote_request_id)

    # --- bookkeeping ------------------------------------------------------------------------------------
    def _seed_for(self, request: Request) -> int:
        digest = hashlib.sha256(repr((request.seed, self.seed, request.prompt_ids)).encode()).digest()
        return int.from_bytes(digest[:8], "big")

    def _observe_finish(self, request: Request, finished_normally: bool) -> None:
        reason = request.finish_reason if finished_normally else "abort"
        self.metrics.request_success[reason if reason in self.metrics.request_success else "abort"].inc()
        self.metrics.e2e.observe(time.monotonic() - request.arrival)
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.running.set(self.running)
        self.metrics.waiting.set(len(self._waiting))
        self.metrics.kv_usage.set(self.pool.usage)

    def _wake_waiters(self) -> None:
        """Let waiting requests re-check for a slot; safe to call from cleanup code that must not await."""

        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        asyncio.get_running_loop().create_task(notify())

    def reset_prefix_cache(self) -> bool:
        return self.pool.clear()
