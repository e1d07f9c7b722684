"""Workloads for bench/prefix_routing.py: Mooncake trace subsets, a synthetic agentic workload, token expansion and
the prefix-reuse ceilings.

A request is a list of 512-token "id blocks" (the traces' hash ids) plus its prompt length; each id expands to a
fixed block of 512 token ids in [100, 4000) (the tiny model's vocabulary is 4096), the same id always the same
tokens, so equal id prefixes are equal token prefixes. A prompt whose length is not a multiple of 512 takes the
leading tokens of its last id's block.
"""

from __future__ import annotations

import itertools
import json
import random
import zlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

ID_TOKENS = 512
TOKEN_LO, TOKEN_HI = 100, 4000
TRACES = Path("/work/shared/traces")
TRACE_FILES = {
    "conversation": "mooncake_conversation_trace.jsonl",
    "synthetic": "mooncake_synthetic_trace.jsonl",
}


@dataclass
class Req:
    at: float  # seconds from the start of the replay (already time-scaled)
    ids: list[int]
    length: int  # prompt tokens
    max_tokens: int
    session: str | None = None
    tags: dict = field(default_factory=dict)
    after: int | None = None  # index of the request this one continues: it is not sent before that one ended
    # Chat workloads: the request body (sent as text to `path`) and the prompt's token ids as the router renders
    # and tokenises it (RouterTokenizer.encode_request), from which the ceilings' block keys are taken.
    payload: dict | None = None
    path: str = "/v1/completions"
    tokens: list[int] | None = None


_BLOCKS: dict[int, list[int]] = {}


def id_tokens(block_id: int) -> list[int]:
    tokens = _BLOCKS.get(block_id)
    if tokens is None:
        rng = random.Random(block_id * 2654435761 + 12345)
        tokens = _BLOCKS[block_id] = [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(ID_TOKENS)]
    return tokens


def prompt_tokens(req: Req) -> list[int]:
    if req.tokens is not None:
        return req.tokens
    out: list[int] = []
    for block_id in req.ids:
        out.extend(id_tokens(block_id))
    return out[: req.length]


def trace_subset(
    name: str, modulus: int, duration_s: float, max_ids: int, max_output: int, rare: float = 0.01
) -> tuple[list[Req], dict]:
    """Requests whose conversation root falls in one of `modulus` buckets (bucket 0), over the whole trace, with
    the timeline compressed to `duration_s`.

    The root is a request's first hash id that fewer than `rare` of all requests share (ids every request shares,
    like a common system prompt, are skipped). Sampling whole conversations keeps each kept request's history, so
    the subset's reuse ceiling stays close to the full trace's, which a contiguous time window would not (its
    start is cold). Prompts are capped at `max_ids` ids (the leading ones, which carry the shared prefixes).
    """
    rows = [json.loads(line) for line in (TRACES / TRACE_FILES[name]).open()]
    freq = Counter(i for r in rows for i in set(r["hash_ids"]))
    limit = rare * len(rows)

    def root(row) -> int:
        for block_id in row["hash_ids"]:
            if freq[block_id] < limit:
                return block_id
        return -1

    kept = [r for r in rows if zlib.crc32(str(root(r)).encode()) % modulus == 0]
    t0 = kept[0]["timestamp"]
    span = max(1, kept[-1]["timestamp"] - t0)
    scale = span / 1000.0 / duration_s
    reqs = []
    for r in kept:
        ids = r["hash_ids"][:max_ids]
        length = min(r["input_length"], len(ids) * ID_TOKENS)
        length = max(length, (len(ids) - 1) * ID_TOKENS + 1)
        reqs.append(
            Req(
                at=(r["timestamp"] - t0) / 1000.0 / scale,
                ids=ids,
                length=length,
                max_tokens=max(1, min(max_output, r["output_length"])),
            )
        )
    roots = [root(r) for r in kept]
    link_turns(reqs, [req.ids.index(i) if i in req.ids else None for req, i in zip(reqs, roots, strict=True)])
    info = {
        "trace_requests": len(rows),
        "trace_span_s": (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000,
        "kept": len(kept),
        "modulus": modulus,
        "time_scale": scale,
        "kept_span_s": span / 1000,
        "continued": sum(r.after is not None for r in reqs),
    }
    return reqs, info


def link_turns(reqs: list[Req], root_positions: list[int | None]) -> None:
    """Make each request wait for the turn it continues: the latest earlier request of the same conversation
    whose full blocks (all its ids but the last, which may cover a partial block) start its own ids (a
    conversation's next turn carries the previous answer, so a client cannot send it before that answer arrived,
    however much the replay compresses time). Prefixes shorter than the conversation's root (its first id that
    few requests share) do not count: a common system prompt does not make two conversations one."""
    latest: dict[tuple[int, ...], int] = {}
    for index, (req, root_at) in enumerate(zip(reqs, root_positions, strict=True)):
        if root_at is not None:
            for k in range(len(req.ids), root_at, -1):
                parent = latest.get(tuple(req.ids[:k]))
                if parent is not None:
                    req.after = parent
                    break
        latest[tuple(req.ids)] = index
        if root_at is not None and len(req.ids) - 1 > root_at:
            latest[tuple(req.ids[:-1])] = index


def agentic(sessions: int, duration_s: float, max_output: int, seed: int = 7) -> tuple[list[Req], dict]:
    """Agent sessions: a system prompt all sessions share (4 ids), a per-session task (2 ids), a context that
    grows by 1-2 ids a turn; after some turns a burst of 3-6 sub-agents, each starting from the session's
    current context plus its own task id, two turns each. Every request carries its session's `x-session-id`
    (sub-agents their parent's). Sessions start over the first 55 % of the run; think time between turns
    scales with the run's length."""
    rng = random.Random(seed)
    system = [9_000_000 + i for i in range(4)]
    next_id = 10_000_000
    gap = duration_s / 12

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    reqs: list[Req] = []
    bursts = subagents = 0
    for s in range(sessions):
        session = f"sess-{s}"
        context = system + fresh(2)
        t = rng.uniform(0, 0.55 * duration_s)
        turns = rng.randint(6, 9)
        for turn in range(turns):
            reqs.append(
                Req(t, list(context), len(context) * ID_TOKENS - rng.randrange(0, 300), max_output, session)
            )
            if turn >= 1 and rng.random() < 0.35:
                bursts += 1
                for _ in range(rng.randint(3, 6)):
                    subagents += 1
                    sub = context + fresh(1)
                    t_sub = t + rng.uniform(0.3, 0.6) * gap * 0.5
                    reqs.append(Req(t_sub, list(sub), len(sub) * ID_TOKENS - 200, max_output, session))
                    sub = sub + fresh(1)
                    reqs.append(
                        Req(
                            t_sub + rng.uniform(0.6, 1.0) * gap,
                            list(sub),
                            len(sub) * ID_TOKENS - 100,
                            max_output,
                            session,
                        )
                    )
                context = context + fresh(1)  # the sub-agents' findings come back into the session
            context = context + fresh(rng.randint(1, 2))
            t += rng.uniform(0.6, 1.2) * gap
    reqs.sort(key=lambda r: r.at)
    info = {"sessions": sessions, "bursts": bursts, "subagent_requests": 2 * subagents}
    return reqs, info


def block_keys(req: Req, block_size: int) -> list[int]:
    """Chained keys of the prompt's full engine blocks (equal keys, equal token prefixes)."""
    if req.tokens is not None:
        keys, prev = [], None
        for j in range(len(req.tokens) // block_size):
            prev = hash((prev, tuple(req.tokens[j * block_size : (j + 1) * block_size])))
            keys.append(prev)
        return keys
    per_id = ID_TOKENS // block_size
    keys = []
    prev = None
    for j in range(req.length // block_size):
        prev = hash((prev, req.ids[j // per_id], j % per_id))
        keys.append(prev)
    return keys


def timed_ceiling(reqs: list[Req], results: list[dict], block_size: int) -> float:
    """The ceiling once timing is taken into account: one infinite cache in which a request's blocks become
    usable only when its prefill ended (its observed send time plus TTFT). An engine looks a prompt up when it
    schedules the prefill, which is at the latest when the first token comes, so a request is credited with the
    blocks computed before its own first token: an upper bound on what any router could have reused when turns
    of a conversation (or sub-agents) arrive before the previous prompt has been computed."""
    ready: dict[int, float] = {}
    for req, res in zip(reqs, results, strict=True):
        if res.get("ok"):
            at = res["sent"] + res["ttft"]
            for key in block_keys(req, block_size):
                if at < ready.get(key, float("inf")):
                    ready[key] = at
    total = hit = 0
    for req, res in zip(reqs, results, strict=True):
        if not res.get("ok"):
            continue
        usable = (req.length - 1) // block_size
        looked_up = res["sent"] + res["ttft"]
        n = 0
        for key in block_keys(req, block_size)[:usable]:
            if ready.get(key, float("inf")) >= looked_up:  # its own blocks are ready only at its first token
                break
            n += 1
        total += req.length
        hit += n * block_size
    return hit / total if total else 0.0


def ceilings(reqs: list[Req], block_size: int, lru_blocks: int | None = None) -> dict:
    """Prompt-token reuse an engine would report with one infinite cache (the ceiling), and with one LRU cache
    of `lru_blocks` blocks (what the fleet's total capacity could hold if it were one cache), over `reqs` in
    order. Block granularity `block_size`; the last prompt token is never served from cache (as on vLLM)."""
    seen: set = set()
    lru: OrderedDict = OrderedDict()
    total = hit_inf = hit_lru = 0
    for req in reqs:
        keys = block_keys(req, block_size)
        usable = (req.length - 1) // block_size
        n = 0
        while n < min(usable, len(keys)) and keys[n] in seen:
            n += 1
        m = 0
        if lru_blocks:
            while m < min(usable, len(keys)) and keys[m] in lru:
                m += 1
            for key in keys:
                lru[key] = None
                lru.move_to_end(key)
            while len(lru) > lru_blocks:
                lru.popitem(last=False)
        seen.update(keys)
        total += req.length
        hit_inf += n * block_size
        hit_lru += m * block_size
    return {
        "prompt_tokens": total,
        "ceiling": hit_inf / total if total else 0.0,
        "lru_fleet": hit_lru / total if total else 0.0,
    }


def ttft_tail(
    results: list[dict],
    engine_of: dict[str, str],
    per_token: float,
    overhead: float,
    q: float = 0.9,
    busy_s: float = 0.05,
) -> dict:
    """Why the requests at or above the TTFT quantile `q` waited, from what was observed: each engine's prefill
    lane is rebuilt from the requests sent there (`engine_of`: request id to engine, from the router's decision
    log), a request's own prefill (`overhead` plus `per_token` per uncached prompt token, the simulator's timing)
    ending at its first token. At each tail request's send time, the prefill still pending on every engine: was
    it placed behind more than the least-pending engine had (by more than `busy_s` / 5, two blocks' worth at
    the bench's timing), did every engine have at least `busy_s` pending (a burst no placement avoids), or
    neither (its wait is the machine's: HTTP, the router, the engine's event loop)?"""
    ok = [r for r in results if r.get("ok") and r.get("request_id") in engine_of]
    if not ok:
        return {"tail": 0}
    own = {id(r): overhead + max(0, r.get("prompt", 0) - r.get("cached", 0)) * per_token for r in ok}
    lanes: dict[str, list[tuple[str, float, float, float]]] = {}  # (request id, sent, first token, own)
    for r in ok:
        lane = lanes.setdefault(engine_of[r["request_id"]], [])
        lane.append((r["request_id"], r["sent"], r["sent"] + r["ttft"], own[id(r)]))

    def pending(engine: str, at: float, request_id: str) -> float:
        """Prefill work still ahead on `engine` at `at`, of the requests sent there before and not yet served."""
        return sum(
            min(work, end - at)
            for rid, sent, end, work in lanes[engine]
            if sent < at < end and rid != request_id
        )

    line = sorted(r["ttft"] for r in ok)[min(len(ok) - 1, int(q * len(ok)))]
    tail = [r for r in ok if r["ttft"] >= line]
    behind = burst = machine = 0
    waits, machine_waits = [], []
    for r in tail:
        here = {engine: pending(engine, r["sent"], r["request_id"]) for engine in lanes}
        mine, least = here[engine_of[r["request_id"]]], min(here.values())
        wait = max(0.0, r["ttft"] - own[id(r)])
        waits.append(wait)
        if mine > least + busy_s / 5:
            behind += 1
        elif least >= busy_s:
            burst += 1
        else:
            machine += 1
            machine_waits.append(wait)
    owns = sorted(own[id(r)] for r in tail)
    return {
        "tail": len(tail),
        "own_median": owns[len(owns) // 2],
        "wait_median": sorted(waits)[len(waits) // 2],
        "behind": behind,
        "burst": burst,
        "machine": machine,
        "machine_wait_median": sorted(machine_waits)[len(machine_waits) // 2] if machine_waits else 0.0,
    }


def router_costs(metrics_texts: list[str]) -> dict:
    """From our router replicas' /metrics at the end of a cell: the mean time the router added before a request
    reached an engine, its mean time to the first byte of the answer, the precise index's mean round trip, the
    lookups Redis did not answer in time, and the prompt tokens it predicted the chosen engines had cached against
    those the engines reported."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for text in metrics_texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (
                    "router_added_latency_seconds_sum",
                    "router_added_latency_seconds_count",
                    "router_time_to_first_token_seconds_sum",
                    "router_time_to_first_token_seconds_count",
                    "router_prefix_index_lookup_seconds_sum",
                    "router_prefix_index_lookup_seconds_count",
                    "router_prefix_index_fallbacks_total",
                    "router_prefix_predicted_cached_tokens_total",
                    "router_prefix_reported_cached_tokens_total",
                ):
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    added = sums.get("router_added_latency_seconds_count", 0.0)
    lookups = sums.get("router_prefix_index_lookup_seconds_count", 0.0)
    return {
        "added_ms": 1000 * sums.get("router_added_latency_seconds_sum", 0.0) / added
        if added
        else float("nan"),
        # From the request's arrival at the router to the first byte of the answer it sent on.
        "ttft_ms": (
            1000
            * sums["router_time_to_first_token_seconds_sum"]
            / sums["router_time_to_first_token_seconds_count"]
            if sums.get("router_time_to_first_token_seconds_count")
            else float("nan")
        ),
        "lookup_ms": (
            1000 * sums.get("router_prefix_index_lookup_seconds_sum", 0.0) / lookups
            if lookups
            else float("nan")
        ),
        "lookups": int(lookups),
        "fallbacks": int(sums.get("router_prefix_index_fallbacks_total", 0.0)),
        "predicted": sums.get("router_prefix_predicted_cached_tokens_total", 0.0),
        "reported": sums.get("router_prefix_reported_cached_tokens_total", 0.0),
    }


# --- chat workloads: agent sessions sent as text -------------------------------------------------------------

CHAT_PATHS = {"claude-code": "/v1/messages", "openai-tools": "/v1/chat/completions"}
SOURCE_MODULES = ["typing.py", "inspect.py", "argparse.py", "functools.py", "subprocess.py", "difflib.py"]
_STR, _INT, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
AGENT_TOOLS = [
    (
        "Bash",
        "Executes a shell command in a persistent shell session, with an optional timeout.",
        {"command": _STR, "description": _STR, "timeout": _INT, "run_in_background": _BOOL},
        ["command"],
    ),
    (
        "Read",
        "Reads a file from the local filesystem; lines are numbered from 1 (cat -n format).",
        {"file_path": _STR, "offset": _INT, "limit": _INT},
        ["file_path"],
    ),
    (
        "Edit",
        "Performs an exact string replacement in a file; old_string must be unique unless replace_all.",
        {"file_path": _STR, "old_string": _STR, "new_string": _STR, "replace_all": _BOOL},
        ["file_path", "old_string", "new_string"],
    ),
    (
        "MultiEdit",
        "Makes several edits to one file in a single operation, applied in order.",
        {
            "file_path": _STR,
            "edits": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"old_string": _STR, "new_string": _STR, "replace_all": _BOOL},
                    "required": ["old_string", "new_string"],
                },
            },
        },
        ["file_path", "edits"],
    ),
    (
        "Write",
        "Writes a file to the local filesystem, overwriting it if it exists.",
        {"file_path": _STR, "content": _STR},
        ["file_path", "content"],
    ),
    (
        "Grep",
        "A search tool built on ripgrep: regular expressions, glob filters and output modes.",
        {
            "pattern": _STR,
            "path": _STR,
            "glob": _STR,
            "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
            "-i": _BOOL,
            "-n": _BOOL,
            "head_limit": _INT,
        },
        ["pattern"],
    ),
    (
        "Glob",
        "Fast file pattern matching that works with any codebase size, sorted by modification time.",
        {"pattern": _STR, "path": _STR},
        ["pattern"],
    ),
    (
        "LS",
        "Lists files and directories in a given path; absolute paths only.",
        {"path": _STR, "ignore": {"type": "array", "items": _STR}},
        ["path"],
    ),
    (
        "Task",
        "Launches a new agent to handle a complex, multi-step task autonomously.",
        {"description": _STR, "prompt": _STR, "subagent_type": _STR},
        ["description", "prompt", "subagent_type"],
    ),
    (
        "TodoWrite",
        "Creates and manages a structured task list for the current coding session.",
        {
            "todos": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "content": _STR,
                        "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                        "id": _STR,
                    },
                    "required": ["content", "status", "id"],
                },
            }
        },
        ["todos"],
    ),
    (
        "WebFetch",
        "Fetches content from a URL and processes it with a prompt.",
        {"url": {"type": "string", "format": "uri"}, "prompt": _STR},
        ["url", "prompt"],
    ),
    (
        "WebSearch",
        "Searches the web and uses the results to inform responses.",
        {"query": _STR, "allowed_domains": {"type": "array", "items": _STR}},
        ["query"],
    ),
    (
        "NotebookEdit",
        "Replaces the contents of a specific cell in a Jupyter notebook.",
        {
            "notebook_path": _STR,
            "cell_id": _STR,
            "new_source": _STR,
            "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]},
        },
        ["notebook_path", "new_source"],
    ),
    (
        "BashOutput",
        "Retrieves output from a running or completed background bash shell.",
        {"bash_id": _STR, "filter": _STR},
        ["bash_id"],
    ),
    ("KillShell", "Kills a running background bash shell by its id.", {"shell_id": _STR}, ["shell_id"]),
    (
        "ExitPlanMode",
        "Prompts the user to exit plan mode once the plan is ready to be coded.",
        {"plan": _STR},
        ["plan"],
    ),
]


def _source_lines() -> list[str]:
    import os

    lib = Path(os.__file__).parent
    lines: list[str] = []
    for name in SOURCE_MODULES:
        lines += (lib / name).read_text().splitlines()
    return lines


def _system_texts(lines: list[str]) -> list[str]:
    """Claude Code's two system blocks: the identity line and the large instructions block (a project's
    instructions file, here standard-library text)."""
    rules = "\n".join(
        f"- Rule {i}: follow the repository's conventions for {topic}; read the code before changing it."
        for i, topic in enumerate(["naming", "tests", "imports", "errors", "logging", "types", "docs"] * 4)
    )
    return [
        "You are Claude Code, Anthropic's official CLI for Claude.",
        "You are an interactive CLI tool that helps users with software engineering tasks.\n\n# Conventions\n"
        + rules
        + "\n\n# Project instructions (CLAUDE.md)\n"
        + "\n".join(lines[:260]),
    ]


def _tool_specs() -> list[tuple[str, str, dict]]:
    out = []
    for name, summary, props, required in AGENT_TOOLS:
        notes = " ".join(
            f"The `{p}` parameter is {'required' if p in required else 'optional'}." for p in props
        )
        description = (
            f"{summary}\n\nUsage notes: {notes} Prefer this tool over shell equivalents where it fits."
        )
        out.append(
            (
                name,
                description,
                {"type": "object", "properties": props, "required": required, "additionalProperties": False},
            )
        )
    return out


@dataclass
class _Round:
    text: str
    calls: list[tuple[str, str, dict]]  # (id, tool name, input)
    results: list[tuple[str, str, bool]]  # (tool use id, content, is_error)


@dataclass
class _Conversation:
    task: str
    rounds: list[_Round] = field(default_factory=list)


def chat_payload(
    dialect: str, system: list[str], tools: list, conv: _Conversation, max_tokens: int, user_id: str
) -> dict:
    """One request of a session, as `dialect` sends it: the conversation so far, ending with a user turn."""
    if dialect == "claude-code":
        messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": conv.task}]}]
        for r in conv.rounds:
            content: list[dict] = [{"type": "text", "text": r.text}]
            content += [{"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in r.calls]
            messages.append({"role": "assistant", "content": content})
            results = []
            for tool_id, text, error in r.results:
                block: dict = {"type": "tool_result", "tool_use_id": tool_id}
                if error:
                    block.update(content=text, is_error=True)
                elif len(text) % 3 == 0:  # a string or a list of text blocks, as clients send both
                    block["content"] = [{"type": "text", "text": text}]
                else:
                    block["content"] = text
                results.append(block)
            messages.append({"role": "user", "content": results})
        return {
            "model": "tiny-qwen",
            "max_tokens": max_tokens,
            "stream": True,
            "system": [{"type": "text", "text": t, "cache_control": {"type": "ephemeral"}} for t in system],
            "tools": [{"name": n, "description": d, "input_schema": s} for n, d, s in tools],
            "messages": messages,
            "metadata": {"user_id": user_id},
        }
    messages = [
        {"role": "system", "content": "\n\n".join(system)},
        {"role": "user", "content": [{"type": "text", "text": conv.task}]},
    ]
    for r in conv.rounds:
        calls = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, n, a in r.calls
        ]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        messages += [{"role": "tool", "tool_call_id": i, "content": text} for i, text, _ in r.results]
    return {
        "model": "tiny-qwen",
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [
            {"type": "function", "function": {"name": n, "description": d, "parameters": s}}
            for n, d, s in tools
        ],
        "messages": messages,
    }


def chat_agentic(
    dialect: str,
    sessions: int,
    duration_s: float,
    max_output: int,
    tokenizer,
    max_prompt: int,
    seed: int = 11,
) -> tuple[list[Req], dict]:
    """Tool-using agent sessions sent as text (`dialect`: claude-code, /v1/messages; openai-tools,
    /v1/chat/completions): every request carries the shared system prompt and the 16 tools; a session's
    requests grow by one round a turn (an assistant turn of text plus 1-2 tool calls, then their results: file
    text, now and then an error). After some turns the assistant calls Task 3-5 times at once: a burst of
    sub-agents, new conversations with the same system prompt and tools, two requests each, whose findings
    come back as the Task results. Sessions start over the first 55 % of the run. Each request's `tokens` are
    the prompt as `tokenizer` (a RouterTokenizer) renders it; a session stops before a prompt would exceed
    `max_prompt` tokens. Deterministic for a seed and Python version (the text is standard-library source)."""
    path = CHAT_PATHS[dialect]
    rng = random.Random(seed)
    lines = _source_lines()
    system, tools = _system_texts(lines), _tool_specs()
    gap = duration_s / 12
    reqs: list[Req] = []
    after: dict[int, Req] = {}  # id(request) -> the request it continues
    counter = itertools.count()
    bursts = subagents = 0

    def file_text(n_lines: int) -> tuple[str, str]:
        start = rng.randrange(260, len(lines) - n_lines)
        body = "\n".join(
            f"{start + k + 1:>6}\t{line}" for k, line in enumerate(lines[start : start + n_lines])
        )
        return f"src/{SOURCE_MODULES[start % len(SOURCE_MODULES)].replace('.py', '')}/m{start}.py", body

    def tool_round(turn: int) -> _Round:
        calls, results = [], []
        for _ in range(rng.choice((1, 1, 2))):
            call_id = f"toolu_{next(counter):06d}"
            path_, body = file_text(rng.randint(60, 140))
            if rng.random() < 0.5:
                calls.append((call_id, "Read", {"file_path": f"/repo/{path_}"}))
            else:
                calls.append(
                    (call_id, "Grep", {"pattern": f"def \\w+_{turn}", "path": "/repo/src", "-n": True})
                )
            error = rng.random() < 0.08
            results.append((call_id, f"Error: file not found: /repo/{path_}" if error else body, error))
        return _Round(f"Let me look at this (step {turn}).", calls, results)

    def make(conv: _Conversation, at: float, session: str, prev: Req | None) -> Req | None:
        payload = chat_payload(dialect, system, tools, conv, max_output, f"user_bench_session_{session}")
        tokens = list(tokenizer.encode_request(payload, path))
        if len(tokens) > max_prompt:
            return None
        req = Req(at, [], len(tokens), max_output, session, payload=payload, path=path, tokens=tokens)
        reqs.append(req)
        if prev is not None:
            after[id(req)] = prev
        return req

    for s in range(sessions):
        session = f"sess-{s}"
        conv = _Conversation(f"In session {s}: fix the failing test in module {s} and keep the public API.")
        t = rng.uniform(0, 0.55 * duration_s)
        prev: Req | None = None
        for turn in range(rng.randint(6, 9)):
            req = make(conv, t, session, prev)
            if req is None:
                break
            prev = req
            if turn >= 1 and rng.random() < 0.2:
                bursts += 1
                calls, results = [], []
                t_sub = t + rng.uniform(0.3, 0.6) * gap * 0.5
                for k in range(rng.randint(3, 5)):
                    subagents += 1
                    task = f"Sub-agent {k} of session {s}, turn {turn}: find every caller of helper_{k}."
                    call_id = f"toolu_{next(counter):06d}"
                    calls.append(
                        (
                            call_id,
                            "Task",
                            {
                                "description": f"callers {k}",
                                "prompt": task,
                                "subagent_type": "general-purpose",
                            },
                        )
                    )
                    sub = _Conversation(task)
                    first = make(sub, t_sub, f"{session}-sub{turn}-{k}", None)
                    sub.rounds.append(tool_round(100 + k))
                    make(sub, t_sub + rng.uniform(0.6, 1.0) * gap, f"{session}-sub{turn}-{k}", first)
                    results.append(
                        (call_id, f"Sub-agent {k} found {rng.randint(2, 9)} callers of helper_{k}.", False)
                    )
                conv.rounds.append(_Round("I'll split this across sub-agents.", calls, results))
                t = t_sub + 1.2 * gap
            conv.rounds.append(tool_round(turn))
            t += rng.uniform(0.6, 1.2) * gap
    reqs.sort(key=lambda r: r.at)
    position = {id(r): i for i, r in enumerate(reqs)}
    for r in reqs:
        if id(r) in after:
            r.after = position[id(after[id(r)])]
    info = {
        "sessions": sessions,
        "bursts": bursts,
        "subagent_requests": sum(1 for r in reqs if "-sub" in (r.session or "")),
        "path": path,
    }
    return reqs, info
