"""Traces in the Mooncake JSON-lines form: one request a line, with its arrival (ms), prompt and output lengths and
the ids of its prompt's blocks in prefix order. The public traces in shared/traces/ and the platform's own
exports read the same way; fields a public trace lacks (tenant, session) are optional, or assigned by a rule."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # the public traces' block: one hash id per 512 prompt tokens


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    tenant: str = "-"
    session: str | None = None
    # Output tokens made before the client saw any of the answer (our traces' `output_before_visible`: a tool
    # call the engine's parser held back, an answer not streamed); 0 in the public traces.
    output_before_visible: int = 0
    # The engine that served it in the recorded run (our traces' `endpoint`, numbered in order of first
    # appearance); None in the public traces. The planner routes by its own pipeline unless told to follow it.
    endpoint: int | None = None

    def full_blocks(self, block_tokens: int = TRACE_BLOCK_TOKENS) -> tuple[int, ...]:
        """The ids of the prompt's full blocks: only those can be cached and matched."""
        return self.hash_ids[: self.input_tokens // block_tokens]


def parse(lines: Iterable[str], limit: int | None = None) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    for line in lines:
        if limit is not None and len(requests) >= limit:
            break
        line = line.strip()
        if not line:
            continue
        row = json.loads(line)
        requests.append(
            TraceRequest(
                index=len(requests),
                arrival_s=float(row["timestamp"]) / 1000.0,
                input_tokens=int(row["input_length"]),
                output_tokens=max(1, int(row["output_length"])),
                hash_ids=tuple(int(h) for h in row.get("hash_ids", ())),
                tenant=str(row.get("tenant", "-")),
                session=None if row.get("session") is None else str(row["session"]),
                output_before_visible=max(0, int(row.get("output_before_visible") or 0)),
                endpoint=None if row.get("endpoint") is None else int(row["endpoint"]),
            )
        )
    requests.sort(key=lambda r: (r.arrival_s, r.index))
    return requests


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    with open(path, encoding="utf-8") as f:
        return parse(f, limit)


def tenant_rule(name: str, tenants: int, seed: int = 0) -> Callable[[TraceRequest], str]:
    """Tenants for a trace that has none: `index` deals requests out in turn, `random` draws each (seeded),
    `prefix` keeps requests that open with the same second block together (a conversation stays with one tenant;
    the first block is a system prompt the whole trace shares)."""
    if tenants < 1:
        raise ValueError("tenants must be at least 1")
    if name == "index":
        return lambda r: f"t{r.index % tenants}"
    if name == "random":
        rng = random.Random(seed)
        drawn: dict[int, str] = {}

        def draw(r: TraceRequest) -> str:
            if r.index not in drawn:
                drawn[r.index] = f"t{rng.randrange(tenants)}"
            return drawn[r.index]

        return draw
    if name == "prefix":
        return lambda r: f"t{(r.hash_ids[1] if len(r.hash_ids) > 1 else r.index) % tenants}"
    raise ValueError(f"unknown tenant rule {name!r} (index, random, prefix)")


def assign_tenants(requests: list[TraceRequest], rule: Callable[[TraceRequest], str]) -> list[TraceRequest]:
    out = []
    for r in requests:
        out.append(
            TraceRequest(
                r.index, r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids, rule(r), r.session
            )
        )
    return out


def cached_tokens_for(input_tokens: int, matched_blocks: int, block_tokens: int) -> int:
    """Prompt tokens served from cache when `matched_blocks` leading blocks are held: the engine always computes
    the prompt's last token, so a prompt held whole still prefills one."""
    return max(0, min(matched_blocks * block_tokens, input_tokens - 1))


def ceiling(requests: Iterable[TraceRequest], block_tokens: int = TRACE_BLOCK_TOKENS) -> tuple[int, int]:
    """(cacheable prompt tokens, prompt tokens) with one infinite cache shared by everything: a request's leading
    full blocks that any earlier request's prompt held count as cached."""
    seen: set[int] = set()
    cached = total = 0
    for r in sorted(requests, key=lambda r: (r.arrival_s, r.index)):
        blocks = r.full_blocks(block_tokens)
        matched = len(list(takewhile(seen.__contains__, blocks)))
        cached += cached_tokens_for(r.input_tokens, matched, block_tokens)
        total += r.input_tokens
        seen.update(blocks)
    return cached, total
