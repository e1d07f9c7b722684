"""Measure one running engine through its OpenAI API and /metrics, for a profile (planner.fit fits it).

- Prefill: completions of a few prompt lengths with max_tokens=1, one at a time, each prompt new to the cache; then
  prompts behind a prefix an earlier request cached. Timed by the engine's own `vllm:time_to_first_token_seconds`
  (from the request's arrival in the engine's server to its first token), else by the client.
- Decode: N streams at once of the same prompt (each cached beforehand but for its last partial block, so that
  their prefills hardly disturb the steps), at a few prompt lengths. Timed by the engine's
  `vllm:inter_token_latency_seconds` (the mean gap over all their tokens), else by the client from the tokens'
  arrival times.
- Mixed iterations (a check of the model, not fitted): a prefill sent while N streams decode, so that its chunks
  share iterations with their decode steps as under load. Timed by the engine's TTFT histogram (the streams'
  first tokens are in it before the prefill is sent), else by the client; the streams are cancelled once it is
  answered.
- KV capacity: vLLM's `vllm:cache_config_info` (num_gpu_blocks); an engine without it (the simulator) from
  `vllm:kv_cache_usage_perc` read while the decode streams hold a known number of blocks.

The engine's own clocks come first because a client on a busy machine reads its sockets in bursts: on two shared
cores, tokens a vLLM-CPU engine produced 2 ms apart arrived twenty at a time. Each point keeps the least of its
repeats: whatever else runs on the machine only ever adds time (seen: the same 16-sequence step 2 ms, then 13 ms).
Where other engines are kept busy beside it on purpose (`Plan.pick = "median"`), it keeps their median instead:
that load is part of what is measured, and the least would keep the runs during which it ebbed.
Prompts are token ids drawn at random from what the engine's /tokenize makes of some text, so their lengths are
exact and no two share a cached block by chance. Measure an engine that serves nothing else: other requests would
land in its histograms.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
WORDS = "the of and to in is that for it as with was on be by at this from or an are not which but have one".split()


@dataclass
class PrefillPoint:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float  # the least (or median: Plan.pick) of the repeats
    timed_by: str = "engine"  # engine (its TTFT histogram) or client
    # The same of the repeats by the client's clock (sent to answered), which holds the HTTP round trip and the
    # server's parsing and serialisation that the engine's TTFT does not; None in measurements made before.
    client_s: float | None = None


@dataclass
class DecodePoint:
    seqs: int
    prompt_tokens: int  # each sequence's
    output_tokens: int  # each sequence's
    itl_s: float  # seconds per token while the sequences decode together (the least or median of the repeats)
    timed_by: str = "engine"  # engine (its ITL histogram) or client


@dataclass
class MixedPoint:
    seqs: int  # streams decoding while the prefill runs
    context: int  # each stream's prompt tokens
    prompt_tokens: int  # the prefill's
    cached_tokens: int
    ttft_s: float  # the least (or median: Plan.pick) of the repeats
    timed_by: str = "engine"
    client_s: float | None = None  # the same by the client's clock


@dataclass
class Measurements:
    url: str
    model: str
    block_size: int
    prefill: list[PrefillPoint] = field(default_factory=list)
    decode: list[DecodePoint] = field(default_factory=list)
    mixed: list[MixedPoint] = field(default_factory=list)
    kv_blocks: int | None = None
    kv_blocks_from: str = ""  # cache_config_info, or kv_cache_usage_perc
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Measurements:
        return cls(
            **{
                **data,
                "prefill": [PrefillPoint(**p) for p in data.get("prefill", [])],
                "decode": [DecodePoint(**d) for d in data.get("decode", [])],
                "mixed": [MixedPoint(**x) for x in data.get("mixed", [])],
            }
        )


PICKS = {"least": min, "median": statistics.median}


@dataclass(frozen=True)
class Plan:
    """What to measure. Lengths beyond the engine's max_model_len are left out."""

    prefill_lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048, 3072)
    prefix_lengths: tuple[int, ...] = (1024, 2048)  # cached, then followed by each suffix
    suffix_lengths: tuple[int, ...] = (128, 512, 1024)
    repeats: int = 5
    decode_seqs: tuple[int, ...] = (1, 2, 4, 8, 16)
    decode_contexts: tuple[int, ...] = (256, 1024, 3072)  # rounded so that the streams' blocks do not change
    decode_tokens: int = 64
    decode_repeats: int = 4  # each decode point is made of these many runs (see `pick`)
    # A decode point's sequences hold at most this many tokens in all (None: 80 % of the KV capacity the engine
    # reports, if it does), so that they fit its cache and are not preempted while they are timed.
    decode_max_tokens: int | None = None
    # Prefills beside decoding streams: (streams, each stream's prompt tokens, the prefill's prompt tokens, the
    # leading ones of them cached), each made of `repeats` runs. Fewer streams than the engine's max_num_seqs, so
    # that the prefill is scheduled at once.
    mixed: tuple[tuple[int, int, int, int], ...] = ((4, 1024, 2048, 0), (8, 1024, 2048, 1024))
    # How a point's repeats make one time: "least" drops what an otherwise quiet machine added to some of them;
    # "median", where other engines are kept busy on the same machine on purpose, keeps their share of the time
    # (the least would pick the runs during which the neighbours' load happened to ebb).
    pick: str = "least"

    def __post_init__(self) -> None:
        if self.pick not in PICKS:
            raise ValueError(f"pick must be one of {sorted(PICKS)}, not {self.pick!r}")

    def typical(self, times: list[float]) -> float:
        """The time a point's repeats make, by `pick`."""
        return PICKS[self.pick](times)

    @classmethod
    def up_to(cls, context: int, max_num_seqs: int) -> Plan:
        """A plan reaching `context` tokens (the longest prompts the engine's traffic sends) and
        `max_num_seqs` sequences decoding at once, fewer repeats and decode tokens at the long lengths' cost."""
        lengths = tuple(n for n in (128, 512, 1024, 2048, 4096, 8192, 12288, 16384) if n < context) + (
            context,
        )
        return cls(
            prefill_lengths=lengths,
            prefix_lengths=(1024, context // 2),
            suffix_lengths=(128, 1024),
            repeats=3,
            decode_seqs=tuple(n for n in (1, 2, 4, 8, 16, 32, 64) if n < max_num_seqs) + (max_num_seqs,),
            decode_contexts=tuple(n for n in (256, 1024, 4096) if n < context) + (context,),
            decode_tokens=16,
            decode_repeats=2,
            mixed=tuple(
                (seqs, min(1024, context), prompt, cached)
                for seqs in sorted({max(1, max_num_seqs // 4), max(1, max_num_seqs - 1)})
                for prompt, cached in (
                    (min(4096, context), 0),
                    (context // 2 + 1024, context // 2),
                    (context, context // 2),
                )
            ),
        )


class Engine:
    """One engine's HTTP API, as the measurements use it."""

    def __init__(self, url: str, model: str, *, timeout: float = 300.0):
        self.url = url.rstrip("/")
        self.model = model
        self.client = httpx.AsyncClient(base_url=self.url, timeout=timeout)

    async def close(self) -> None:
        await self.client.aclose()

    async def token_pool(self) -> list[int]:
        """Token ids of ordinary text, as this engine's tokenizer makes them."""
        rng = random.Random(0)
        text = " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(400))
        r = await self.client.post("/tokenize", json={"model": self.model, "prompt": text})
        r.raise_for_status()
        return sorted(set(r.json()["tokens"]))

    async def complete(self, prompt: list[int]) -> tuple[float, int]:
        """One token for `prompt`: (seconds to the answer, cached prompt tokens reported, -1 if none)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        start = time.perf_counter()
        r = await self.client.post("/v1/completions", json=body)
        elapsed = time.perf_counter() - start
        r.raise_for_status()
        details = r.json().get("usage", {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return elapsed, -1 if cached is None else int(cached)

    async def stream(
        self, prompt: list[int], tokens: int, started: asyncio.Event | None = None
    ) -> list[float]:
        """Stream `tokens` tokens for `prompt`: each token's arrival time (perf_counter). A chunk that carries
        several tokens (an engine's server may merge the outputs its client has not read yet) counts for each;
        the sampled tokens' logprobs say how many there are. `started` is set once two tokens are in (the
        sequence is decoding)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": tokens,
            "min_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "logprobs": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        times: list[float] = []
        usage_tokens = None
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    carried = len(((choice.get("logprobs") or {}).get("tokens")) or []) or 1
                    times += [now] * carried
                if started is not None and len(times) >= 2:
                    started.set()
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
        if usage_tokens and usage_tokens != len(times) and len(times) >= 2:
            # Chunks whose tokens could not be counted: spread the tokens evenly over the stream.
            step = (times[-1] - times[0]) / (usage_tokens - 1)
            times = [times[0] + i * step for i in range(usage_tokens)]
        return times

    async def metrics(self) -> str:
        r = await self.client.get("/metrics")
        r.raise_for_status()
        return r.text

    async def histogram(self, name: str) -> tuple[float, float] | None:
        """(sum, count) of a histogram on /metrics, over its label sets; None if the engine has none."""
        return histogram(await self.metrics(), name)

    async def observed(self, name: str, before: tuple[float, float] | None, count: int) -> float | None:
        """The sum a histogram gained from `before` once it has gained `count` observations (an engine may
        record them just after the answer is out), divided by them; None if it has no such histogram or
        gained other observations than those."""
        if before is None:
            return None
        for _ in range(100):
            after = await self.histogram(name)
            if after is None:
                return None
            gained = after[1] - before[1]
            if gained == count:
                return (after[0] - before[0]) / count
            if gained > count:
                return None
            await asyncio.sleep(0.01)
        return None


def config_blocks(metrics_text: str) -> int | None:
    """num_gpu_blocks from vLLM's cache_config_info gauge, if the engine exports it."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            found = re.search(r'num_gpu_blocks="(\d+)"', line)
            if found:
                return int(found.group(1))
    return None


def histogram(metrics_text: str, name: str) -> tuple[float, float] | None:
    total = count = 0.0
    found = False
    for line in metrics_text.splitlines():
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        if metric == f"{name}_sum":
            total += float(line.rpartition(" ")[2])
            found = True
        elif metric == f"{name}_count":
            count += float(line.rpartition(" ")[2])
    return (total, count) if found else None


def kv_usage(metrics_text: str) -> float | None:
    values = [
        float(line.rpartition(" ")[2])
        for line in metrics_text.splitlines()
        if line.startswith("vllm:kv_cache_usage_perc")
    ]
    return sum(values) if values else None


class Meter:
    def __init__(
        self, engine: Engine, block_size: int, max_model_len: int, plan: Plan, seed: int | None = None
    ):
        self.engine = engine
        self.bs = block_size
        self.max_len = max_model_len
        self.plan = plan
        self.rng = random.Random(seed)  # unseeded: a second run on the same engine finds nothing cached
        self.pool: list[int] = []

    def prompt(self, length: int) -> list[int]:
        return [self.rng.choice(self.pool) for _ in range(length)]

    async def run(self) -> Measurements:
        start = time.perf_counter()
        self.pool = await self.engine.token_pool()
        out = Measurements(self.engine.url, self.engine.model, self.bs)
        for _ in range(2):  # warm-up: a first request pays for compilation and allocation
            await self.engine.complete(self.prompt(64))
        await self.prefill_fresh(out)
        await self.prefill_cached(out)
        await self.decode(out)
        await self.mixed(out)
        out.kv_blocks, out.kv_blocks_from = await self.kv_capacity(out)
        out.seconds = round(time.perf_counter() - start, 1)
        return out

    async def timed_prefill(self, prompt: list[int]) -> tuple[float | None, float, int]:
        """(seconds to the first token by the engine's clock or None, by the client's, cached tokens reported
        or -1) of one request."""
        before = await self.engine.histogram(TTFT)
        elapsed, cached = await self.engine.complete(prompt)
        return await self.engine.observed(TTFT, before, 1), elapsed, cached

    async def prefill_point(self, prompts: list[list[int]], prefix_len: int) -> PrefillPoint:
        timed = [await self.timed_prefill(p) for p in prompts]
        cached = min(hit if hit >= 0 else prefix_len // self.bs * self.bs for _, _, hit in timed)
        client = self.plan.typical([t[1] for t in timed])
        if all(engine_s is not None for engine_s, _, _ in timed):
            return PrefillPoint(
                len(prompts[0]), cached, self.plan.typical([t[0] for t in timed]), "engine", client
            )
        return PrefillPoint(len(prompts[0]), cached, client, "client", client)

    async def prefill_fresh(self, out: Measurements) -> None:
        for length in self.plan.prefill_lengths:
            if length + 1 > self.max_len:
                continue
            out.prefill.append(
                await self.prefill_point([self.prompt(length) for _ in range(self.plan.repeats)], 0)
            )

    async def prefill_cached(self, out: Measurements) -> None:
        for prefix_len in self.plan.prefix_lengths:
            for suffix_len in self.plan.suffix_lengths:
                if prefix_len + suffix_len + 1 > self.max_len:
                    continue
                prefix = self.prompt(prefix_len)
                # A first request caches the prefix's full blocks.
                await self.engine.complete(prefix + self.prompt(suffix_len))
                prompts = [prefix + self.prompt(suffix_len) for _ in range(self.plan.repeats)]
                out.prefill.append(await self.prefill_point(prompts, prefix_len))

    def decode_length(self, context: int) -> int | None:
        """A prompt length near `context` whose sequences keep their number of blocks while they decode."""
        tokens = self.plan.decode_tokens
        blocks = max(1, round(context / self.bs))
        while blocks * self.bs > self.max_len:
            blocks -= 1
        length = blocks * self.bs - tokens - 1
        return length if length >= 16 else None

    async def decode(self, out: Measurements) -> None:
        tokens = self.plan.decode_tokens
        most = self.plan.decode_max_tokens
        if most is None:
            blocks = config_blocks(await self.engine.metrics())
            most = int(0.8 * blocks * self.bs) if blocks else None
        for context in self.plan.decode_contexts:
            length = self.decode_length(context)
            if length is None:
                continue
            for n in self.plan.decode_seqs:
                if most and n * (length + tokens) > most:
                    continue
                runs = [await self.decode_run(n, length) for _ in range(self.plan.decode_repeats)]
                timed_by = "engine" if all(by == "engine" for _, by in runs) else "client"
                gaps = [gap for gap, by in runs if by == timed_by]
                out.decode.append(DecodePoint(n, length, tokens, self.plan.typical(gaps), timed_by))

    async def decode_run(self, n: int, length: int) -> tuple[float, str]:
        """(seconds per token, timed by whom) of `n` sequences of `length` prompt tokens decoding together."""
        tokens = self.plan.decode_tokens
        prompts = [self.prompt(length) for _ in range(n)]
        for p in prompts:  # cache all but the last partial block, so that the streams' prefills are short
            await self.engine.complete(p)
        before = await self.engine.histogram(ITL)
        streams = await asyncio.gather(*(self.engine.stream(p, tokens) for p in prompts))
        engine_s = await self.engine.observed(ITL, before, n * (tokens - 1))
        if engine_s is None:
            return steady_gap(streams), "client"
        return engine_s, "engine"

    async def mixed(self, out: Measurements) -> None:
        for seqs, context, prompt_len, cached in self.plan.mixed:
            length = self.decode_length(context)
            if length is None or prompt_len + 1 > self.max_len or cached + self.bs > prompt_len:
                continue
            runs = [await self.mixed_run(seqs, length, prompt_len, cached) for _ in range(self.plan.repeats)]
            timed_by = "engine" if all(by == "engine" for _, by, _, _ in runs) else "client"
            times = [t if timed_by == "engine" else c for t, _, c, _ in runs]
            hit = min(h if h >= 0 else cached // self.bs * self.bs for _, _, _, h in runs)
            client = self.plan.typical([c for _, _, c, _ in runs])
            out.mixed.append(
                MixedPoint(seqs, length, prompt_len, hit, self.plan.typical(times), timed_by, client)
            )

    async def mixed_run(
        self, seqs: int, length: int, prompt_len: int, cached: int
    ) -> tuple[float, str, float, int]:
        """(seconds to the first token, timed by whom, by the client's clock, cached tokens reported or -1) of a
        prefill of `prompt_len` tokens, the first `cached` of them cached beforehand, sent while `seqs` streams
        of `length` prompt tokens decode."""
        prefix = self.prompt(cached)
        if cached:
            await self.engine.complete(prefix + self.prompt(self.bs))
        prompts = [self.prompt(length) for _ in range(seqs)]
        for p in prompts:  # cached but for the last partial block, as for the decode points
            await self.engine.complete(p)
        tokens = min(4096, self.max_len - length - 1)  # more than the prefill lasts: cancelled after it
        decoding = [asyncio.Event() for _ in prompts]
        streams = [
            asyncio.ensure_future(self.engine.stream(p, tokens, started=e))
            for p, e in zip(prompts, decoding, strict=True)
        ]
        try:
            async with asyncio.timeout(300):
                for event, stream in zip(decoding, streams, strict=True):
                    waiter = asyncio.ensure_future(event.wait())
                    await asyncio.wait([waiter, stream], return_when=asyncio.FIRST_COMPLETED)
                    if not event.is_set():  # the stream ended before it decoded: its error, or too short
                        waiter.cancel()
                        stream.result()
                        raise RuntimeError("a decoding stream ended before the prefill was sent")
            before = await self.engine.histogram(TTFT)
            elapsed, hit = await self.engine.complete(prefix + self.prompt(prompt_len - cached))
            engine_s = await self.engine.observed(TTFT, before, 1)
        finally:
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        await asyncio.sleep(0.2)  # the cancelled streams leave the engine
        if engine_s is None:
            return elapsed, "client", elapsed, hit
        return engine_s, "engine", elapsed, hit

    async def kv_capacity(self, out: Measurements) -> tuple[int | None, str]:
        text = await self.engine.metrics()
        blocks = config_blocks(text)
        if blocks:
            return blocks, "cache_config_info"
        if kv_usage(text) is None:
            return None, ""
        # While the largest decode set runs, its blocks over the usage reported.
        n = max(self.plan.decode_seqs)
        length = self.decode_length(max(self.plan.decode_contexts))
        if length is None:
            return None, ""
        held = n * -(-(length + self.plan.decode_tokens) // self.bs)
        streams = [
            asyncio.ensure_future(self.engine.stream(self.prompt(length), self.plan.decode_tokens))
            for _ in range(n)
        ]
        seen = 0.0
        while not all(s.done() for s in streams):
            seen = max(seen, kv_usage(await self.engine.metrics()) or 0.0)
            await asyncio.sleep(0.005)
        await asyncio.gather(*streams)
        if seen <= 0:
            return None, ""
        return round(held / seen), "kv_cache_usage_perc"


def steady_gap(streams: list[list[float]]) -> float:
    """The time per token while every stream is decoding (after the last first token, before the first last
    one): per stream, the slope of its tokens' arrival times against their count, fitted by least squares so
    that tokens arriving in bursts matter less; the median over the streams. Where that window holds too few
    tokens, each whole stream after its first token."""
    start = max(s[0] for s in streams)
    end = min(s[-1] for s in streams)
    slopes = []
    for s in streams:
        inside = [t for t in s if start <= t <= end]
        if len(inside) < 4 or inside[-1] == inside[0]:
            inside = s[1:]
        slopes.append(slope(inside))
    return statistics.median(slopes)


def slope(times: list[float]) -> float:
    """Least-squares slope of times against 0, 1, 2, ..."""
    n = len(times)
    if n < 2:
        return math.nan
    mean_i = (n - 1) / 2
    mean_t = sum(times) / n
    num = sum((i - mean_i) * (t - mean_t) for i, t in enumerate(times))
    den = sum((i - mean_i) ** 2 for i in range(n))
    return num / den


def measure(
    url: str, model: str, *, block_size: int, max_model_len: int, plan: Plan | None = None
) -> Measurements:
    """Measure the engine at `url` serving `model` (blocking)."""

    async def main() -> Measurements:
        engine = Engine(url, model)
        try:
            return await Meter(engine, block_size, max_model_len, plan or Plan()).run()
        finally:
            await engine.close()

    return asyncio.run(main())
