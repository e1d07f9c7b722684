"""A simulated engine: continuous batching over a KV cache of fixed size with an LRU prefix cache of block hashes,
as vLLM runs it, in virtual time.

Blocks: a prompt's full blocks enter the prefix cache under their hash when the chunk that computes them is
scheduled (as vLLM's scheduler caches them: a request scheduled after it in the same iteration finds them, since a
forward pass writes every sequence's KV before any attends), and are shared by every sequence that uses them; the
partial last block and the blocks of generated tokens are the sequence's own. A cached block no sequence uses
stays until room is needed, least recently freed first. When a running sequence
needs a block and none can be freed, the latest admitted sequence is preempted (its blocks freed, its tokens
recomputed when it is admitted again), as vLLM does.

A CPU tier (the profile's `cpu_tier_tokens`): a block evicted from the GPU cache moves there, least recently
evicted first out; a prompt's leading blocks found there move back to the GPU at `cpu_tier_load_per_token_s`, paid
in the iteration of the prompt's first chunk, instead of being computed. A block is in one tier at a time.

Speculative decoding (`spec_draft_tokens`, `spec_acceptance`): each decode step gains the expected tokens
(Profile.tokens_per_step), kept as a fraction per sequence so that no token is lost or counted twice.

Decoding without speculation is counted for the engine, not for each sequence: every running sequence past its
prefill gains one token a step, so a decoding sequence's output is the engine's step count less a base fixed when
it began to decode (`Seq.dbase`), written back when it stops (finished or preempted). The decoders' context, the
tenants' token counts and the next step at which one finishes or needs a block are kept as totals and heaps as
sequences begin and stop decoding, so an iteration costs the same with 4 decoders or 400 (a pass over each one
every iteration was two fifths of a large simulation's time).

The fleet's directory (`directory`, shared by the engines of a simulation): block -> the engines holding it in
either tier (a bit mask of engine ids), kept as blocks enter and leave; the precise index walks it once along a
prompt instead of asking every engine.

Over 400 lines (a little): the cache's tiers, the directory and the scheduler share the block bookkeeping.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress, filterfalse, islice, repeat, takewhile
from operator import add, and_, not_, or_, sub, truth

from .profile import Profile
from .trace import TraceRequest, cached_tokens_for


# The block bookkeeping runs over each prompt's hundreds of blocks per request: it is written as C-level passes
# (map, zip, compress, dict.update) over the blocks, not Python loops, which made it most of the simulation's time.
def _drain(iterator) -> None:
    """Run an iterator of calls made for their effect."""
    deque(iterator, maxlen=0)


def _mask_enter(masks: dict[int, int] | None, hs: list[int], bit: int) -> None:
    """The engine of `bit` now holds blocks `hs` (in a directory: block -> a mask of its holders)."""
    if masks is not None and hs:
        masks.update(zip(hs, map(or_, map(masks.get, hs, repeat(0)), repeat(bit)), strict=True))


def _mask_leave(masks: dict[int, int] | None, hs: list[int], bit: int) -> None:
    """It no longer holds them; a block no one holds leaves the directory."""
    if masks is not None and hs:
        holders = list(map(and_, map(masks.__getitem__, hs), repeat(~bit)))
        masks.update(zip(hs, holders, strict=True))
        _drain(map(masks.__delitem__, compress(hs, map(not_, holders))))


def _take_oldest(lru: OrderedDict, k: int) -> list[int]:
    """Remove the `k` oldest keys of an LRU, returned oldest first: read off the front, then deleted (C-level passes,
    not a popitem call each)."""
    oldest = list(islice(lru, k))
    _drain(map(lru.__delitem__, oldest))
    return oldest


@dataclass(eq=False, slots=True)
class Seq:
    request: TraceRequest
    blocks: tuple[int, ...]  # the prompt's full blocks (hash ids)
    routed_s: float
    target: int = (
        0  # tokens to hold before the next token is sampled (the prompt, plus output after a preemption)
    )
    computed: int = 0  # of those, computed or found cached
    generated: int = 0
    cached_tokens: int = -1  # found cached at the first admission
    admitted_s: float = -1.0
    first_token_s: float = -1.0
    finished_s: float = -1.0
    preemptions: int = 0
    pinned: list[int] = field(default_factory=list)  # cached blocks it uses, in prefix order
    private: int = 0  # blocks of its own
    router_state: object = None  # the router's bookkeeping for this request
    loaded_tokens: int = 0  # prompt tokens loaded from the CPU tier (all admissions)
    load_due: int = 0  # of those, still to be paid for in its next prefill chunk
    spec_frac: float = 0.0  # speculative decoding: the fraction of a token gained beyond `generated`
    transferred_tokens: int = 0  # KV tokens received from a prefill engine (prefill/decode pools)
    # Its prompt's leading blocks it holds on arrival, pulled over NIXL where its engine lacked them: at its
    # admission they take blocks of its own allocation, as vLLM's connector loads into the blocks it allocates
    # for the request (so they cannot be evicted while it waits), and count as computed.
    pulled_upto: int = 0
    remote_cached: int = -1  # P/D: the prompt tokens its prefill leg found cached on the prefill engine
    full_at: int = 0  # the output tokens at which its blocks are full (blocks x block size, less the prompt)
    unique: bool = True  # its blocks are distinct (set by __post_init__), as chained block ids are
    order: int = 0  # its place in the running order (set at each admission; later admitted, higher)
    decoding: bool = False  # past its prefill, running (the engine's decode count holds its output meanwhile)
    dbase: int = 0  # while decoding without speculation: its output tokens less the engine's step count

    def __post_init__(self) -> None:
        self.unique = len(set(self.blocks)) == len(self.blocks)

    @property
    def context(self) -> int:
        return self.request.input_tokens + self.generated

    @property
    def prefill_left(self) -> int:
        return self.target - self.computed


class Engine:
    def __init__(
        self,
        engine_id: int,
        profile: Profile,
        block_tokens: int,
        schedule: Callable[[float, Engine, int], None],
        on_first_token: Callable[[Seq, float], None],
        on_finish: Callable[[Seq, float], None],
        directory: dict[int, int] | None = None,
        cpu_directory: dict[int, int] | None = None,
    ):
        self.id = engine_id
        self.profile = profile
        self.bt = block_tokens
        self.capacity = profile.kv_blocks(block_tokens)
        self._schedule = schedule
        self._on_first_token = on_first_token
        self._on_finish = on_finish
        self.ref: dict[int, int] = {}  # cached block -> sequences using it
        self.free_lru: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody uses, least recent first
        self.cpu: OrderedDict[int, None] = OrderedDict()  # the CPU tier, least recently evicted first
        self.cpu_capacity = profile.cpu_tier_tokens // block_tokens if profile.cpu_tier_tokens > 0 else 0
        self.directory = directory
        # The same for the CPU tier alone (with CPU tiers in the fleet): which of the engines holding a block hold it
        # there, so the precise index's walk tells the tiers apart without a pass over each engine's blocks.
        self.cpu_directory = cpu_directory if self.cpu_capacity else None
        self.bit = 1 << engine_id  # its bit in the directory's masks
        self.cpu_hits = 0  # blocks loaded from the CPU tier
        self.step_tokens = profile.tokens_per_step()
        self.step_room = math.ceil(self.step_tokens)  # tokens a decoding sequence may gain in one step
        self.private_total = 0
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.gen = 0  # the current iteration's event; a later one supersedes it
        self.busy = False
        self.busy_s = 0.0
        # The iteration under way: start, step time, steps, prefill chunks, the decoding sequences.
        self._start = 0.0
        self._dt = 0.0
        self._steps = 0
        self._chunks: list[tuple[Seq, int]] = []
        self._decoders: list[Seq] | tuple = []  # without the count (speculative decoding)
        self._n_decoders = 0
        self.preemptions = 0
        self.rejected = 0
        self.evictions = 0
        self.itl: dict[
            str, list[tuple[float, int]]
        ] = {}  # tenant -> (inter-token gap, tokens), per iteration
        self.peak_resident = 0
        self._admitted = 0  # sequences admitted so far (Seq.order)
        # Decoding counted for the engine (without speculation; see the module's docstring): the steps taken,
        # the sequences decoding (the first `n_dec` running), the sum of their prompts and bases, their count by
        # tenant, and heaps of (step count at which one finishes / would need a block, order, sequence), whose
        # entries for sequences that stopped decoding or got a block are skipped when met.
        self.counted = self.step_tokens == 1.0
        self.decode_steps = 0
        self.n_dec = 0
        self._dec_base = 0
        self._dec_tenants: dict[str, int] = {}
        self._finish_at: list[tuple[int, int, Seq]] = []
        self._full_at: list[tuple[int, int, Seq]] = []

    # The prefix cache, as the KV events report it.
    def held(self, blocks: tuple[int, ...] | list[int]) -> int:
        """The prompt's leading blocks the GPU cache holds."""
        return len(list(takewhile(self.ref.__contains__, blocks)))

    def held_tiers(
        self, blocks: tuple[int, ...] | list[int], start: int = 0, start_cpu: int | None = None
    ) -> tuple[int, int]:
        """(GPU, CPU): the prompt's leading blocks held in either tier, by tier (as the index counts them), the
        first `start` known to be held (`start_cpu` of them in the CPU tier, where known)."""
        ref, cpu = self.ref, self.cpu
        rest = blocks[start:]
        on_gpu = len(list(takewhile(ref.__contains__, rest)))
        if not cpu:
            return start + on_gpu, 0
        # As eviction leaves them: a run on the GPU, then a run in the CPU tier (a prompt's later blocks are
        # evicted first). Walked as two runs, one lookup a block; the tiers hold no block in common.
        in_cpu = len(list(takewhile(cpu.__contains__, rest[on_gpu:])))
        n = start + on_gpu + in_cpu
        if start_cpu is not None:
            gpu = on_gpu + start - start_cpu
        else:
            gpu = on_gpu + (sum(map(ref.__contains__, blocks[:start])) if start else 0)
        if n < len(blocks) and blocks[n] in ref:
            # GPU blocks again past the CPU run: the rest walked with both tiers asked.
            tail = blocks[n:]
            more = len(
                list(takewhile(truth, map(or_, map(ref.__contains__, tail), map(cpu.__contains__, tail))))
            )
            gpu += sum(map(ref.__contains__, tail[:more]))
            n += more
        return gpu, n - gpu

    # The fleet's directory: an engine enters a block when it first holds it in either tier, leaves it when it
    # holds it in neither. Holders are a bit mask of engine ids (bit 1 << id): ints, not a set per block, so that
    # a prompt's blocks enter and leave in C-level passes that allocate no containers.
    def _enter_all(self, hs: list[int]) -> None:
        _mask_enter(self.directory, hs, self.bit)

    def _leave_all(self, hs: list[int]) -> None:
        _mask_leave(self.directory, hs, self.bit)

    def _cpu_leave(self, hs: list[int]) -> None:
        """Blocks leave the CPU tier (loaded back, computed again, or dropped)."""
        _drain(map(self.cpu.__delitem__, hs))
        _mask_leave(self.cpu_directory, hs, self.bit)

    def _to_cpu(self, evicted: list[int]) -> None:
        """Blocks evicted from the GPU cache, in order: into the CPU tier if there is one (its least recently
        evicted out when full), else gone."""
        if not self.cpu_capacity:
            self._leave_all(evicted)
            return
        cpu = self.cpu
        cpu.update(zip(evicted, repeat(None)))
        _mask_enter(self.cpu_directory, evicted, self.bit)
        over = len(cpu) - self.cpu_capacity
        if over > 0:
            dropped = _take_oldest(cpu, over)
            _mask_leave(self.cpu_directory, dropped, self.bit)
            self._leave_all(dropped)

    def resident(self) -> int:
        return len(self.ref) + self.private_total

    def kv_usage(self) -> float:
        """vLLM's KV-cache usage: blocks in use by sequences, against the capacity (cached free blocks count as free)."""
        if not self.capacity:
            return 0.0
        return (self.resident() - len(self.free_lru)) / self.capacity

    def _room(self, n: int) -> bool:
        """Free `n` blocks, evicting unused cached ones least recent first; False when that is not enough."""
        if self.capacity is None:
            return True
        short = self.resident() + n - self.capacity
        if short <= 0:
            return True
        free = self.free_lru
        k = min(short, len(free))
        if k:
            evicted = _take_oldest(free, k)
            _drain(map(self.ref.__delitem__, evicted))
            self.evictions += k
            self._to_cpu(evicted)
        return short - k <= 0

    def _pin(self, h: int) -> None:
        count = self.ref.get(h, 0)
        if count == 0:
            if h in self.free_lru:
                del self.free_lru[h]
            elif h in self.cpu:  # computed again while a copy waited in the CPU tier: the GPU's is the one
                self._cpu_leave([h])
            else:
                self._enter_all([h])
        self.ref[h] = count + 1

    def _unpin(self, h: int) -> None:
        count = self.ref[h] - 1
        self.ref[h] = count
        if count == 0:
            self.free_lru[h] = None

    # The same over many blocks at once, where they are distinct (a prompt's chained block ids are): the counts
    # read, changed and written back in C-level passes.
    def _pin_held(self, hs: tuple[int, ...] | list[int], distinct: bool) -> None:
        """Pin blocks the GPU cache holds."""
        if not distinct:
            for h in hs:
                self._pin(h)
            return
        ref = self.ref
        counts = list(map(ref.__getitem__, hs))
        if 0 in counts:
            _drain(map(self.free_lru.__delitem__, compress(hs, map(not_, counts))))
        ref.update(zip(hs, map(add, counts, repeat(1)), strict=True))

    def _unpin_all(self, hs: tuple[int, ...] | list[int], distinct: bool) -> None:
        """Unpin blocks, in this order (the order they join the free list)."""
        if not distinct:
            for h in hs:
                self._unpin(h)
            return
        ref = self.ref
        counts = list(map(sub, map(ref.__getitem__, hs), repeat(1)))
        ref.update(zip(hs, counts, strict=True))
        if 0 in counts:
            self.free_lru.update(zip(compress(hs, map(not_, counts)), repeat(None)))

    def _pin_computed(self, hs: tuple[int, ...] | list[int], distinct: bool) -> None:
        """Pin blocks just computed: shared with the cache's copy where it holds one, out of the CPU tier where a
        copy waited there, new to the directory otherwise."""
        if not distinct:
            for h in hs:
                self._pin(h)
            return
        ref, free, cpu = self.ref, self.free_lru, self.cpu
        counts = list(map(ref.get, hs, repeat(0)))
        if 0 in counts:
            unused = list(compress(hs, map(not_, counts)))
            cached = list(filter(free.__contains__, unused))
            if cached:
                _drain(map(free.__delitem__, cached))
                unused = list(filterfalse(ref.__contains__, unused))
            if cpu:
                waited = list(filter(cpu.__contains__, unused))
                if waited:
                    self._cpu_leave(waited)
                    unused = list(compress(unused, map(not_, map(set(waited).__contains__, unused))))
            self._enter_all(unused)
        ref.update(zip(hs, map(add, counts, repeat(1)), strict=True))

    def _admit(self, seq: Seq, now: float) -> bool:
        on_gpu = self.held(seq.blocks)
        matched = seq.blocks[:on_gpu]
        # The blocks pulled for it from another engine (P/D), which come with their own allocation.
        pulled = seq.blocks[on_gpu : seq.pulled_upto]
        seq.target = seq.request.input_tokens + seq.generated
        blocks_in_all = math.ceil(seq.target / self.bt)
        # Room for it or nothing changes, as vLLM allocates a request's blocks only when the free ones (cached
        # ones nobody uses included) are enough: the cached blocks it matches leave the free ones when pinned.
        # The blocks it takes anew are all but those it matches and those pulled that the cache holds, wherever
        # the rest come from (computed, or loaded from the CPU tier): so this check needs no walk of the CPU
        # tier, which is done only once it passes (an engine out of room retries its queue's head each iteration).
        if self.capacity is not None:
            ref, free = self.ref, self.free_lru
            short = (
                self.resident()
                + blocks_in_all
                - on_gpu
                - len(pulled)
                + sum(map(not_, map(ref.__contains__, pulled)))
                - self.capacity
            )
            if short > 0 and short > len(free) - sum(map(free.__contains__, matched)) - sum(
                map(free.__contains__, pulled)
            ):
                return False
        # Then the blocks that follow in the CPU tier.
        cpu = self.cpu
        from_cpu = list(takewhile(cpu.__contains__, seq.blocks[on_gpu + len(pulled) :])) if cpu else []
        need = blocks_in_all - on_gpu - len(pulled) - len(from_cpu)
        self._pin_held(matched, seq.unique)
        self._pin_computed(pulled, seq.unique)
        # The CPU tier's blocks leave it before room is made, so that the blocks the room pushes there do not
        # push them out.
        self._cpu_leave(from_cpu)
        self._room(need + len(from_cpu))
        for h in from_cpu:
            self.ref[h] = 1
        seq.pinned = [*matched, *pulled, *from_cpu]
        seq.pulled_upto = 0  # used: if it is preempted, its prompt is computed again, as vLLM would
        seq.private = need
        seq.full_at = (len(seq.pinned) + need) * self.bt - seq.request.input_tokens
        self.private_total += need
        seq.computed = cached_tokens_for(seq.request.input_tokens, len(seq.pinned), self.bt)
        if from_cpu:
            loaded = max(0, seq.computed - (on_gpu + len(pulled)) * self.bt)
            seq.loaded_tokens += loaded
            seq.load_due = loaded
            self.cpu_hits += len(from_cpu)
        if seq.cached_tokens < 0:
            seq.cached_tokens = seq.computed
            seq.admitted_s = now
        self._track()
        return True

    def _release(self, seq: Seq) -> None:
        # The tail first, so that under pressure a prompt's later blocks go before its shared start.
        self._unpin_all(seq.pinned[::-1], seq.unique)
        seq.pinned = []
        self.private_total -= seq.private
        seq.private = 0

    def _cache_scheduled(self, seq: Seq, take: int) -> None:
        """The full blocks of a prompt that a chunk of `take` tokens scheduled now completes enter the prefix cache
        now, as vLLM caches a chunk's blocks when it schedules it: a request admitted after it, in this iteration
        or a later one, finds them."""
        upto = min(len(seq.blocks), (seq.computed + take) // self.bt)
        if upto > len(seq.pinned):
            self._cache_prompt(seq, upto)

    def _cache_prompt(self, seq: Seq, upto: int | None = None) -> None:
        """The prompt's computed full blocks (to `upto`, else all) enter the prefix cache (shared with an equal
        block already there)."""
        new = seq.blocks[len(seq.pinned) : upto]
        self._pin_computed(new, seq.unique)
        seq.pinned.extend(new)
        seq.private -= len(new)
        self.private_total -= len(new)
        self._track()

    def _track(self) -> None:
        resident = self.resident()
        if resident > self.peak_resident:
            self.peak_resident = resident

    def _preempt_one(self) -> Seq:
        victim = self.running.pop()
        if victim.decoding:
            self._stop_decoding(victim)
        self._release(victim)
        victim.computed = 0
        victim.load_due = 0
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    # Decoding counted for the engine.
    def _start_decoding(self, s: Seq) -> None:
        """`s` has sampled its first token after its prefill: it decodes from the next iteration on."""
        s.decoding = True
        self.n_dec += 1
        if not self.counted:
            return
        s.dbase = base = s.generated - self.decode_steps
        self._dec_base += s.request.input_tokens + base
        tenant = s.request.tenant
        self._dec_tenants[tenant] = self._dec_tenants.get(tenant, 0) + 1
        heapq.heappush(self._finish_at, (s.request.output_tokens - base, s.order, s))
        heapq.heappush(self._full_at, (s.full_at - base, s.order, s))

    def _stop_decoding(self, s: Seq) -> None:
        """`s` finished or was preempted: its output written back."""
        s.decoding = False
        self.n_dec -= 1
        if not self.counted:
            return
        s.generated = s.dbase + self.decode_steps
        self._dec_base -= s.request.input_tokens + s.dbase
        self._dec_tenants[s.request.tenant] -= 1

    @staticmethod
    def _top(heap: list[tuple[int, int, Seq]], full: bool) -> int | None:
        """The earliest step of a heap whose entry is current (its sequence decoding in the same admission,
        and for `full`, with the blocks it had), stale ones dropped; None when empty."""
        while heap:
            at, order, s = heap[0]
            if s.decoding and s.order == order and (not full or at == s.full_at - s.dbase):
                return at
            heapq.heappop(heap)
        return None

    def _give_blocks_counted(self) -> bool:
        """Each decoding sequence that would pass its last block in the next step gets one more, in the running
        order, preempting from the end of the running ones where none is free (as the scan in `_begin` does
        without the count); True if one was preempted."""
        heap, reach = self._full_at, self.decode_steps + self.step_room
        needy = []
        while (at := self._top(heap, True)) is not None and at < reach:
            needy.append(heapq.heappop(heap)[2])
        preempted = False
        for s in sorted(needy, key=lambda q: q.order):
            while s.decoding and s.full_at - s.dbase < reach:
                while not self._room(1):
                    preempted = True
                    if self._preempt_one() is s:
                        break
                if not s.decoding:
                    break  # it was preempted, the last one
                s.private += 1
                s.full_at += self.bt
                self.private_total += 1
                self._track()
            if s.decoding:
                heapq.heappush(heap, (s.full_at - s.dbase, s.order, s))
        return preempted

    # Scheduling.
    def submit(self, seq: Seq, now: float) -> None:
        self.waiting.append(seq)
        if not self.busy:
            self._begin(now)
        elif self._steps > 1:
            # A decode run is under way: end it at the step in progress, so the new request joins the next step.
            done = max(1, math.ceil((now - self._start) / self._dt - 1e-9))
            if done < self._steps:
                self._steps = done
                self.gen += 1
                self._schedule(self._start + done * self._dt, self, self.gen)

    def _begin(self, now: float) -> None:
        """Schedule one iteration as vLLM's scheduler does: the running sequences first, in admission order (room
        for each decoding one's next token, then prefill chunks first come first served within the token
        budget), then waiting ones while budget, slots and blocks allow, none if a sequence was preempted now."""
        p = self.profile
        # The running sequences are in admission order, and the decoding ones come first: prompts are prefilled
        # first come first served (a later one gets budget only once every earlier one has all it needs), a new
        # or readmitted sequence has a prompt to compute and joins at the end, and preemption takes from the end.
        # Each decoding sequence needs room for the token it samples next, in order; a preemption takes the last
        # admitted first, so the sequences before one are never touched by making room for it. (Properties are
        # inlined in this per-iteration pass.)
        running, bt, step_room = self.running, self.bt, self.step_room
        i = context = 0
        preempted = False
        if self.counted:
            preempted = self._give_blocks_counted()
            i = self.n_dec
            context = self._dec_base + i * self.decode_steps
        while not self.counted and i < len(running):
            # The decoding ones with room for their next token, in one run (most of them, most iterations).
            for s in islice(running, i, None):
                if s.target != s.computed or s.generated + step_room > s.full_at:
                    break
                context += s.request.input_tokens + s.generated
                i += 1
            if i == len(running):
                break
            s = running[i]
            if s.target != s.computed:
                break  # the prefilling ones, from here on
            # A decoding one that needs a block more.
            while not self._room(1):
                preempted = True
                if self._preempt_one() is s:
                    break
            if i == len(running):
                break  # it was preempted, the last one
            # One block more, and look at it again.
            s.private += 1
            s.full_at += bt
            self.private_total += 1
            self._track()
        decoders = running[:i] if not self.counted else ()
        budget = p.max_num_batched_tokens - i
        chunks: list[tuple[Seq, int]] = []
        for s in running[i:]:
            if budget <= 0:
                break
            take = min(s.target - s.computed, budget)
            chunks.append((s, take))
            self._cache_scheduled(s, take)
            budget -= take
        # Waiting sequences, in order, while the budget lasts: each finds the blocks scheduled before it cached,
        # those of this iteration's chunks included (vLLM caches a chunk's blocks as it schedules it, and a
        # forward pass writes every sequence's KV before any attends).
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < p.max_num_seqs and not preempted:
            s = waiting[0]
            if not self._admit(s, now):
                if not running:
                    # It cannot fit even in an empty cache: refused, as an engine refuses a prompt over its limit.
                    waiting.popleft()
                    self.rejected += 1
                    s.finished_s = now
                    self._on_finish(s, now)
                    continue
                break
            running.append(waiting.popleft())
            self._admitted += 1
            s.order = self._admitted
            take = min(s.target - s.computed, budget)
            chunks.append((s, take))
            self._cache_scheduled(s, take)
            budget -= take
        if not running:
            self.busy = False
            return
        rate = self.step_tokens
        if chunks or not i:
            steps = 1
            dt = p.iteration_s([(take, s.computed) for s, take in chunks], i, context)
            # Blocks loaded from the CPU tier are paid for in the iteration of the prompt's next chunk.
            for s, _ in chunks:
                if s.load_due:
                    dt += s.load_due * p.cpu_tier_load_per_token_s
                    s.load_due = 0
        elif self.counted:
            # Until the first decoder finishes or fills its blocks.
            ends = min(self._top(self._finish_at, False), self._top(self._full_at, True))
            steps = max(1, ends - self.decode_steps)
            # The context grows by one token a sequence a step: the run's step time is its middle step's.
            dt = p.iteration_s([], i, context + i * (steps - 1) // 2)
        else:
            steps = min(
                math.ceil((s.request.output_tokens - s.generated - s.spec_frac) / rate) for s in decoders
            )
            steps = min(
                steps,
                min(int((s.full_at - s.generated - s.spec_frac) / rate) for s in decoders),
            )
            steps = max(1, steps)
            dt = p.iteration_s([], len(decoders), context + int(len(decoders) * rate * (steps - 1) / 2))
        self.busy = True
        self._start, self._dt, self._steps = now, dt, steps
        self._chunks, self._decoders, self._n_decoders = chunks, decoders, i
        self.gen += 1
        self._schedule(now + steps * dt, self, self.gen)

    def step_done(self, now: float, gen: int) -> None:
        if gen != self.gen:
            return
        steps, dt = self._steps, self._dt
        self.busy_s += steps * dt
        # Only the sequences of this iteration can finish in it: the decoders, those whose prefill ended.
        done_decoding: list[Seq] = []
        if self._n_decoders and self.counted:
            self.decode_steps += steps
            for t, n in self._dec_tenants.items():
                if n:
                    self.itl.setdefault(t, []).append((dt, n * steps))
            heap, now_at = self._finish_at, self.decode_steps
            while (at := self._top(heap, False)) is not None and at <= now_at:
                done_decoding.append(heapq.heappop(heap)[2])
            done_decoding.sort(key=lambda q: q.order)
        elif self._decoders:
            done_decoding = self._decode_each(steps, dt)
        ended: list[Seq] = []
        for s, take in self._chunks:
            s.computed += take
            if s.target == s.computed:
                self._cache_prompt(s)
                s.generated += 1
                if s.first_token_s < 0:
                    s.first_token_s = now
                    self._on_first_token(s, now)
                if s.generated >= s.request.output_tokens:
                    ended.append(s)
                else:
                    self._start_decoding(s)
        for s in done_decoding:
            self._stop_decoding(s)
        if ended and done_decoding:  # both: in the running order, as each list is
            finished = sorted([*ended, *done_decoding], key=lambda q: q.order)
        else:
            finished = ended or done_decoding
        if finished:
            done = set(finished)
            self.running = [s for s in self.running if s not in done]
            for s in finished:
                s.finished_s = now
                self._release(s)
                self._on_finish(s, now)
        self._chunks, self._decoders, self._n_decoders = [], [], 0
        self._begin(now)

    def _decode_each(self, steps: int, dt: float) -> list[Seq]:
        """The decoders' steps one sequence at a time (speculative decoding: each keeps its fraction of a
        token): the tokens each gained, those that finished."""
        per_tenant: dict[str, int] = {}
        rate = self.step_tokens
        done_decoding: list[Seq] = []
        for s in self._decoders:
            r = s.request
            total = s.spec_frac + steps * rate
            gained = min(int(total), r.output_tokens - s.generated)
            s.spec_frac = total - int(total) if gained == int(total) else 0.0
            s.generated += gained
            per_tenant[r.tenant] = per_tenant.get(r.tenant, 0) + gained
            if s.generated >= r.output_tokens:
                done_decoding.append(s)
        gap = dt / rate  # the mean gap between its tokens (they come `rate` at a time)
        for t, n in per_tenant.items():
            self.itl.setdefault(t, []).append((gap, n))
        return done_decoding
