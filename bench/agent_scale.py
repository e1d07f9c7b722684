"""The router at the seed's shape: concurrent coding-agent sessions whose contexts grow to ~200K tokens, sub-agent
bursts, through R router replicas behind a balancer, on simulated engines with precise prefix routing.

    .venv/bin/python -m bench.agent_scale --quick          # R = 1, 2, 4 and vllm-router at R = 1, about 2 minutes
    .venv/bin/python -m bench.agent_scale                  # 24 sessions, 60 s phases, vllm-router at every R: 10 minutes
    .venv/bin/python -m bench.agent_scale --balancer session   # the balancer hashes the agent's session header
    .venv/bin/python -m bench.agent_scale --baseline HEAD~1    # the same phases against another commit's router

Without DATABASE_URL and REDIS_URL it re-runs itself under `python -m inference_platform.devstack exec`. It uses a
dedicated database (`bench_agent_scale`, dropped and re-created each run) and Redis database 13, and sets up one
tenant, team and key and a deployment `tiny-qwen` (precise prefix routing) whose endpoints are the simulators.

Traffic: `--sessions` agents, half Claude Code-shaped (POST /v1/messages?beta=true, built on the request the real
CLI sent, tests/agents/captured: its system blocks, 12 tools, thinking, metadata and headers, with its own
X-Claude-Code-Session-Id) and half Codex-shaped (POST /v1/responses with Codex's developer messages, tools,
prompt_cache_key and its session-id / x-codex-window-id headers). Each agent starts in the middle of its life, its
context already 40-95 % of `--max-context` tokens, and runs a closed loop: send the conversation, read the streamed
answer, append an assistant turn of 1-2 tool calls and their results (file text, unique to the session), think,
send again. Now and then a turn starts 3-5 sub-agents at once: new conversations with the parent's system prompt
and tools, two requests each, their findings coming back as the tool results of the parent's next turn. A
conversation that would pass `--max-context` is compacted: a new one starts from the base and a summary. Think
times aim at `--rate` requests a second in all, on this machine's scale (closed loops: the table says what came).

Phases, each on the same traffic (same seed, same agents), engines' caches reset and the prefix index and the
shared token ids in Redis emptied before each: `direct` (each agent straight to one engine, chosen by its session:
the TTFT the router is compared with), then our router at R = 1, 2, 4 replicas (restarted for every phase, each
warmed with one unrelated request so that its tokenizer and workers are up), the baseline's router likewise with
--baseline, and vllm-router `--policy cache_aware` behind the same balancer. The balancer (a process started here)
is a plain reverse proxy: each request on a new connection, sent to the next replica in turn (`--balancer rr`) or
to the replica its session header hashes to (`--balancer session`); it tells the client which replica it chose.

Measured per phase:
- router CPU per request: each replica's CPU time (every thread of the router process and of its tokenizing
  workers, /proc/<pid>/task/*/schedstat) read whenever a request starts, gets its first token or ends; the CPU
  between two readings goes to the requests in flight on that replica then, in equal shares, to those still
  waiting for their first token when there are some (the router's work on a request comes before it), and to no
  request when none is in flight (the replica's idle work, reported apart). A request alone on its replica gets
  exactly the CPU it caused; with others, those waiting on the engine share what the router spent on the others,
  so in bursts warm requests are over-counted and cold ones under-counted (`alone` says how much was exact). Classes:
  cold (the replica did not serve the conversation's previous request), warm (it did), new (a sub-agent's or a
  compacted conversation's first request: only the shared system prompt and tools are old);
- event-loop stall: the router's own probe (`router_event_loop_lag_seconds`, a 20 ms timer), its histogram over
  the phase (p99 and max as bucket bounds) and its worst-lag gauge;
- lookup fallbacks, late-loop retries and predicted / reported cached tokens from each replica's /metrics;
- TTFT at the client (to the first content event), and its p50 / p99 less the direct phase's;
- RSS of each replica with its workers at the end of the phase.
Everything shares the machine's cores (nothing is pinned): timings are noisy, more so while other work runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import json
import os
import random
import shutil
import statistics
import subprocess
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from bench import harness as h
from bench.docs_section import write_section

ROOT, PYTHON, MODEL, STATE = h.ROOT, h.PYTHON, h.MODEL, h.STATE
log = h.log

BENCH_DB = "bench_agent_scale"
BENCH_REDIS_DB = 13
BLOCK = 128
MAX_MODEL_LEN = 262_144
SEED_RATE = 127.0  # requests/s of the system this platform follows (7,612 a minute at 2,500 agents)
CAPTURED = ROOT / "tests" / "agents" / "captured"
CLAUDE_CODE = "claude_code_2.1.328_first_request.json"
CODEX = "codex_0.169.0_first_request.json"
# Cheap engines: the router is what is measured. Prefill 1 us a token (a cold 200K-token prompt: 0.2 s), answers
# of 32 tokens at 5 ms each.
SIM_ARGS = {
    "--prefill-time-per-token": "0.000001",
    "--prefill-overhead": "0.005",
    "--decode-time": "0.005",
    "--answer-length": "32",
    "--max-num-seqs": "64",
}
TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
REPLICA_HEADER = "x-bench-replica"
# The headers an agent names its session with, in the order the session balancer reads them.
SESSION_HEADERS = (b"x-session-id", b"x-claude-code-session-id", b"session-id", b"x-codex-window-id")


# --- the traffic -------------------------------------------------------------------------------------------


def source_files() -> list[tuple[str, list[str]]]:
    """The standard library's modules: the text agents read (deterministic for a Python version)."""
    lib = Path(os.__file__).parent
    out = []
    for path in sorted(lib.glob("*.py")):
        lines = path.read_text(errors="replace").splitlines()
        if len(lines) > 300:
            out.append((path.name, lines))
    return out


class Texts:
    """File text as a Read or a `sed -n` returns it: numbered lines of a module, 60-250 at a time."""

    def __init__(self, chars_per_token: float):
        self.files = source_files()
        self.chars_per_token = chars_per_token

    def read(self, rng: random.Random) -> tuple[str, str]:
        name, lines = self.files[rng.randrange(len(self.files))]
        n = rng.randint(60, 250)
        start = rng.randrange(0, len(lines) - n)
        body = "\n".join(f"{start + k + 1:>6}\t{line}" for k, line in enumerate(lines[start : start + n]))
        return f"/repo/src/{name}", body

    def tokens(self, text: str) -> int:
        return int(len(text) / self.chars_per_token)


def chars_per_token() -> float:
    """Characters per token of the workload's file text on the model's tokenizer (for sizing contexts)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(ROOT / "models" / MODEL / "tokenizer.json"))
    texts = Texts(4.0)
    rng = random.Random(5)
    sample = "\n".join(texts.read(rng)[1] for _ in range(40))
    return len(sample) / len(tokenizer.encode(sample).ids)


@functools.cache
def router_tokenizer():
    """The router's tokenizer for the model: the prompts' sizes as the router counts them."""
    from routing.rendering.tokenize import RouterTokenizer

    return RouterTokenizer(ROOT / "models" / MODEL)


@dataclass
class Shape:
    """One CLI's first request as it was captured: what every conversation of that agent starts from."""

    kind: str  # claude-code or codex
    path: str
    headers: dict
    body: dict
    session: str  # the captured session id, replaced by each agent's own
    base_tokens: int

    @classmethod
    def load(cls, kind: str, key: str, cpt: float) -> Shape:
        captured = json.loads((CAPTURED / (CLAUDE_CODE if kind == "claude-code" else CODEX)).read_text())
        headers = {
            k: v
            for k, v in captured["headers"].items()
            if k.lower() not in ("x-api-key", "authorization", "content-length", "host", "accept-encoding")
        }
        if kind == "claude-code":
            session = headers["X-Claude-Code-Session-Id"]
            headers["x-api-key"] = key
        else:
            session = headers["session-id"]
            headers["Authorization"] = f"Bearer {key}"
        query = "&".join(f"{k}={v}" for k, v in captured["query"].items())
        body = captured["body"]
        body["model"] = MODEL
        base = len(router_tokenizer().encode_request(body, captured["path"]))
        return cls(kind, captured["path"] + (f"?{query}" if query else ""), headers, body, session, base)


class Conversation:
    """One conversation of an agent (its main one, a compacted continuation, or a sub-agent's), as its CLI sends it:
    the captured first request with this conversation's task, then the rounds appended since."""

    def __init__(self, shape: Shape, session: str, conv_id: str, task: str, texts: Texts, sub: bool = False):
        self.shape, self.session, self.id, self.texts, self.sub = shape, session, conv_id, texts, sub
        self.items: list[dict] = []
        self.calls = 0
        body = copy.deepcopy(shape.body)
        if shape.kind == "claude-code":
            # Its first user message: the system reminder block, then the task (the captured one's last block).
            body["messages"][0]["content"][-1]["text"] = task
            meta = json.loads(body["metadata"]["user_id"])
            meta["session_id"] = session
            body["metadata"]["user_id"] = json.dumps(meta, separators=(",", ":"))
            self.prefix = body.pop("messages")
        else:
            body["input"][-1]["content"][0]["text"] = task
            body["prompt_cache_key"] = session
            body["client_metadata"] = json.loads(
                json.dumps(body["client_metadata"]).replace(shape.session, session)
            )
            self.prefix = body.pop("input")
        self.body = body
        self.tokens = shape.base_tokens + texts.tokens(task)

    def headers(self) -> dict:
        raw = json.dumps(self.shape.headers).replace(self.shape.session, self.session)
        out = json.loads(raw)
        if self.shape.kind == "codex" and self.sub:
            # A Codex sub-agent is a thread of its own in the parent's session.
            out["x-codex-window-id"] = f"{self.id}:0"
            out["thread-id"] = self.id
        return out

    def payload(self) -> dict:
        key = "messages" if self.shape.kind == "claude-code" else "input"
        return {**self.body, key: self.prefix + self.items}

    def _call_id(self) -> str:
        self.calls += 1
        prefix = "toolu_" if self.shape.kind == "claude-code" else "call_"
        return f"{prefix}{zlib.crc32(self.id.encode()):08x}{self.calls:05d}"

    def add_round(self, rng: random.Random, turn: int) -> None:
        """The assistant's next step (text and 1-2 tool calls) and the calls' results: file text, headed by what
        was run in this session, so no two sessions send the same piece."""
        calls = []
        for _ in range(rng.choice((1, 1, 2))):
            path, text = self.texts.read(rng)
            command = f"sed -n 1,400p {path}  # {self.id} step {turn}"
            calls.append((self._call_id(), path, command, f"==> {path} ({self.id}, step {turn}) <==\n", text))
        self.add_calls(calls, f"Let me look at this (step {turn}).", error=rng.random() < 0.05)

    def add_calls(self, calls: list[tuple[str, str, str, str, str]], note: str, error: bool = False) -> None:
        if self.shape.kind == "claude-code":
            uses = [
                {"type": "tool_use", "id": i, "name": "Read", "input": {"file_path": path}}
                if n % 2 == 0
                else {"type": "tool_use", "id": i, "name": "Bash", "input": {"command": command}}
                for n, (i, path, command, _, _) in enumerate(calls)
            ]
            results = [
                {"type": "tool_result", "tool_use_id": i, "content": f"Error: {head}", "is_error": True}
                if error and n == 0
                else {
                    "type": "tool_result",
                    "tool_use_id": i,
                    "content": [{"type": "text", "text": head}, {"type": "text", "text": text}],
                }
                for n, (i, _, _, head, text) in enumerate(calls)
            ]
            self.items += [
                {"role": "assistant", "content": [{"type": "text", "text": note}, *uses]},
                {"role": "user", "content": results},
            ]
        else:
            self.items.append(
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": note}]}
            )
            for i, _, command, _, _ in calls:
                arguments = json.dumps({"cmd": command, "workdir": "/repo"})
                self.items.append(
                    {"type": "function_call", "call_id": i, "name": "exec_command", "arguments": arguments}
                )
            for n, (i, _, _, head, text) in enumerate(calls):
                output = f"Error: {head}" if error and n == 0 else head + text
                self.items.append({"type": "function_call_output", "call_id": i, "output": output})
        self.tokens += sum(
            self.texts.tokens(head) + self.texts.tokens(text) + 40 for _, _, _, head, text in calls
        )

    def add_subagents(self, tasks: list[str], findings: list[str]) -> None:
        """The parent's turn that started sub-agents, and their findings as the calls' results."""
        if self.shape.kind == "claude-code":
            ids = [self._call_id() for _ in tasks]
            uses = [
                {
                    "type": "tool_use",
                    "id": i,
                    "name": "Agent",
                    "input": {"description": task[:40], "prompt": task, "subagent_type": "general-purpose"},
                }
                for i, task in zip(ids, tasks, strict=True)
            ]
            results = [
                {"type": "tool_result", "tool_use_id": i, "content": found}
                for i, found in zip(ids, findings, strict=True)
            ]
            self.items += [
                {"role": "assistant", "content": [{"type": "text", "text": "I'll split this up."}, *uses]},
                {"role": "user", "content": results},
            ]
        else:
            ids = [self._call_id() for _ in tasks]
            for i, task in zip(ids, tasks, strict=True):
                arguments = json.dumps({"message": task, "agent_type": "explorer"})
                self.items.append(
                    {
                        "type": "function_call",
                        "call_id": i,
                        "name": "spawn_agent",
                        "namespace": "multi_agent_v1",
                        "arguments": arguments,
                    }
                )
            for i, found in zip(ids, findings, strict=True):
                self.items.append({"type": "function_call_output", "call_id": i, "output": found})
        self.tokens += sum(
            self.texts.tokens(t) + self.texts.tokens(f) + 60 for t, f in zip(tasks, findings, strict=True)
        )


@dataclass
class Agent:
    """One agent session: its main conversation, grown to its starting size before the phase."""

    index: int
    shape: Shape
    session: str
    rng: random.Random
    conv: Conversation
    compactions: int = 0
    subagents: int = 0
    turn: int = 0


def make_agents(
    count: int, shapes: dict[str, Shape], texts: Texts, max_context: int, seed: int
) -> list[Agent]:
    agents = []
    for i in range(count):
        rng = random.Random(f"{seed}-{i}")
        shape = shapes["claude-code" if i % 2 == 0 else "codex"]
        session = f"{zlib.crc32(f'{seed}-{i}'.encode()):08x}-bench-agent-{i:04d}"
        task = f"Agent {i}: make the failing tests of module {i} pass without changing its public API."
        conv = Conversation(shape, session, f"a{i}-c0", task, texts)
        start = rng.uniform(0.4, 0.95) * max_context
        while conv.tokens < start:
            conv.add_round(rng, -conv.calls)
        agents.append(Agent(i, shape, session, rng, conv))
    return agents


# --- the balancer (a process of its own: `python -m bench.agent_scale balance ...`) --------------------------


def pick_replica(head: bytes, replicas: int, policy: str, turn: int) -> int:
    """The replica for a request: the next in turn, or the one its session header hashes to (else the next)."""
    if policy == "session":
        lines = head.split(b"\r\n")
        fields = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if sep:
                fields[name.strip().lower()] = value.strip()
        for name in SESSION_HEADERS:
            if fields.get(name):
                return zlib.crc32(fields[name]) % replicas
    return turn % replicas


def close_head(head: bytes) -> bytes:
    """The request head with `Connection: close`: one request a connection, so every request is placed anew."""
    lines = [line for line in head[:-4].split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def balance(port: int, backends: list[int], policy: str) -> None:
    turns = iter(range(1 << 62))

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        index = pick_replica(head, len(backends), policy, next(turns))
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", backends[index])
        except OSError:
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            writer.close()
            return
        up_writer.write(close_head(head))
        upload = asyncio.create_task(_pump(reader, up_writer))
        try:
            answer = await up_reader.readuntil(b"\r\n\r\n")
            writer.write(answer[:-2] + f"{REPLICA_HEADER}: {index}\r\n\r\n".encode())
            await _pump(up_reader, writer)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
        finally:
            upload.cancel()
            up_writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", port, limit=1 << 20, backlog=1024)
    async with server:
        await server.serve_forever()


def balance_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench.agent_scale balance")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backends", required=True, help="ports, comma-separated")
    p.add_argument("--policy", choices=("rr", "session"), default="rr")
    args = p.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    asyncio.run(balance(args.port, [int(x) for x in args.backends.split(",")], args.policy))
    return 0


def start_balancer(procs: h.Processes, ports: list[int], policy: str, tag: str):
    port = h.free_port()
    argv = [PYTHON, "-m", "bench.agent_scale", "balance", "--port", str(port)]
    argv += ["--backends", ",".join(map(str, ports)), "--policy", policy]
    proc = procs.start(f"agent-scale-balancer-{tag}", argv, core=None)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            import socket

            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, port
        if proc.poll() is not None:
            raise RuntimeError(f"the balancer exited: {h.log_tail(f'agent-scale-balancer-{tag}')}")
        time.sleep(0.1)
    raise TimeoutError("the balancer did not listen")


# --- CPU time of a process tree, to the nanosecond ---------------------------------------------------------


class TreeClock:
    """CPU nanoseconds run by every thread of a process and of its descendants (its tokenizing workers), from
    /proc/<pid>/task/<tid>/schedstat. A thread or process that ends keeps the time it was last seen with."""

    def __init__(self, pid: int):
        self.pid = pid
        self.pids = [pid]
        self.listed = 0.0
        self.seen: dict[tuple[int, str], int] = {}

    def ns(self) -> int:
        now = time.monotonic()
        if now - self.listed > 0.5:
            import psutil

            with contextlib.suppress(psutil.Error):
                self.pids = [self.pid, *(c.pid for c in psutil.Process(self.pid).children(recursive=True))]
            self.listed = now
        for pid in self.pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                        self.seen[(pid, tid)] = int(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    pass
        return sum(self.seen.values())

    def rss(self) -> tuple[int, int]:
        """(the process's resident bytes, with its descendants')."""
        import psutil

        try:
            root = psutil.Process(self.pid)
            own = root.memory_info().rss
            return own, own + sum(c.memory_info().rss for c in root.children(recursive=True))
        except psutil.Error:
            return 0, 0


# --- one phase: the agents against a target ----------------------------------------------------------------


@dataclass
class Record:
    agent: int
    conv: str
    seq: int  # the conversation's request number in this phase (0: its first)
    kind: str  # main or sub
    new_conversation: bool  # a sub-agent's or a compacted conversation's first request
    body_bytes: int
    sent: float = 0.0  # seconds from the phase's start, as the CPU readings' times
    ttft: float | None = None
    first: float | None = None  # when its first content event came, as `sent`
    done: float = 0.0
    status: int = 0
    error: str = ""
    replica: int | None = None
    prompt: int = 0
    cached: int = 0
    cpu_ms: float = 0.0
    alone_ms: float = 0.0  # of cpu_ms, what it was given while alone on its replica
    klass: str = ""
    unseen: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.ttft is not None and not self.error


@dataclass
class Target:
    """Where a phase sends its requests: one port (the balancer) or, direct, an engine per agent session."""

    ports: list[int]
    direct: bool = False

    def port(self, session: str) -> int:
        if self.direct:
            return self.ports[zlib.crc32(session.encode()) % len(self.ports)]
        return self.ports[0]


@dataclass
class PhaseResult:
    records: list[Record]
    wall: float
    samples: list[tuple[float, list[int]]] = field(default_factory=list)


async def run_phase(
    agents: list[Agent],
    target: Target,
    clocks: list[TreeClock],
    duration: float,
    rate: float,
    burst: float,
    max_context: int,
) -> PhaseResult:
    """The agents' closed loops for `duration` seconds (requests in flight then are waited for)."""
    import aiohttp
    import orjson

    records: list[Record] = []
    samples: list[tuple[float, list[int]]] = []
    start = time.perf_counter()
    deadline = start + duration
    # Each turn brings on average 1 + burst * 4 * 2 requests (3-5 sub-agents of two requests each).
    per_turn = 1 + burst * 4 * 2
    think_mean = len(agents) * per_turn / rate

    def sample() -> float:
        """Every replica's CPU clock, read now; the time it was read at (from the phase's start)."""
        at = time.perf_counter() - start
        if clocks:
            samples.append((at, [c.ns() for c in clocks]))
        return at

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def send(agent: Agent, conv: Conversation, seq: int, new: bool) -> Record:
            body = orjson.dumps(conv.payload())
            rec = Record(agent.index, conv.id, seq, "sub" if conv.sub else "main", new, len(body))
            records.append(rec)
            anthropic = conv.shape.kind == "claude-code"
            marker = b'"content_block_' if anthropic else b'"response.output_'
            headers = {**conv.headers(), "Content-Type": "application/json"}
            url = f"http://127.0.0.1:{target.port(agent.session)}{conv.shape.path}"
            rec.sent = sample()
            sent = time.perf_counter()
            try:
                async with http.post(url, data=body, headers=headers) as resp:
                    rec.status = resp.status
                    replica = resp.headers.get(REPLICA_HEADER)
                    rec.replica = int(replica) if replica is not None else None
                    async for line in resp.content:
                        if not line.startswith(b"data: {"):
                            continue
                        if rec.ttft is None and marker in line:
                            rec.ttft = time.perf_counter() - sent
                            rec.first = sample()
                        if anthropic and b'"message_delta"' in line:
                            usage = orjson.loads(line[6:]).get("usage") or {}
                            rec.cached = usage.get("cache_read_input_tokens") or 0
                            rec.prompt = (
                                (usage.get("input_tokens") or 0)
                                + rec.cached
                                + (usage.get("cache_creation_input_tokens") or 0)
                            )
                        elif not anthropic and b'"response.completed"' in line:
                            usage = (orjson.loads(line[6:]).get("response") or {}).get("usage") or {}
                            rec.prompt = usage.get("input_tokens") or 0
                            rec.cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
                    if resp.status != 200:
                        rec.error = f"status {resp.status}"
            except Exception as exc:  # noqa: BLE001 - counted as an error
                rec.error = repr(exc)[:200]
            rec.done = sample()
            return rec

        async def subagent(agent: Agent, parent: Conversation, k: int, task: str) -> str:
            conv = Conversation(
                agent.shape, agent.session, f"{parent.id}-s{agent.subagents}-{k}", task, parent.texts, True
            )
            await asyncio.sleep(agent.rng.uniform(0, 0.2))
            await send(agent, conv, 0, True)
            conv.add_round(agent.rng, 1)
            await asyncio.sleep(agent.rng.uniform(0.2, 0.6))
            await send(agent, conv, 1, False)
            found = f"Sub-agent {k} ({conv.id}) found {agent.rng.randint(2, 9)} callers; details follow.\n"
            return found + f"- caller in module m{agent.rng.randint(1, 999)}\n" * agent.rng.randint(3, 12)

        async def loop(agent: Agent) -> None:
            seq = 0
            new = False
            await asyncio.sleep(agent.rng.uniform(0, min(think_mean, duration / 3)))
            while time.perf_counter() < deadline:
                conv = agent.conv
                await send(agent, conv, seq, new)
                seq += 1
                new = False
                agent.turn += 1
                if agent.rng.random() < burst:
                    agent.subagents += 1
                    tasks = [
                        f"Sub-agent {k} of {conv.id}, turn {agent.turn}: find every caller of helper_{k} "
                        f"and report the call sites."
                        for k in range(agent.rng.randint(3, 5))
                    ]
                    findings = await asyncio.gather(
                        *(subagent(agent, conv, k, t) for k, t in enumerate(tasks))
                    )
                    conv.add_subagents(tasks, list(findings))
                conv.add_round(agent.rng, agent.turn)
                if conv.tokens > max_context:
                    agent.compactions += 1
                    summary = f"This session continues {conv.id}. Summary of the work so far:\n"
                    summary += "\n".join(f"- step {n}: read and changed module m{n}" for n in range(120))
                    agent.conv = Conversation(
                        agent.shape,
                        agent.session,
                        f"a{agent.index}-c{agent.compactions}",
                        summary,
                        conv.texts,
                    )
                    seq, new = 0, True
                await asyncio.sleep(agent.rng.uniform(0.5, 1.5) * think_mean)

        sample()
        await asyncio.gather(*(loop(agent) for agent in agents))
        sample()
    return PhaseResult(records, time.perf_counter() - start, samples)


def classify(records: list[Record]) -> None:
    """cold / warm / new for each request (see the module's docstring), from the replica each one went to; a cold
    request is `unseen` too when its replica served none of the conversation's requests before."""
    last: dict[str, int | None] = {}
    served: dict[str, set] = {}
    for rec in sorted(records, key=lambda r: r.sent):
        seen = served.setdefault(rec.conv, set())
        if rec.new_conversation:
            rec.klass = "new"
        elif rec.conv in last and last[rec.conv] == rec.replica and rec.replica is not None:
            rec.klass = "warm"
        else:
            rec.klass = "cold"
            rec.unseen = rec.replica not in seen
        last[rec.conv] = rec.replica
        seen.add(rec.replica)


def attribute(result: PhaseResult, replicas: int) -> None:
    """Share each replica's CPU between two readings among the requests in flight on it then (see the module's
    docstring): among those still waiting for their first token if any (the router's work on a request, parse,
    render, tokenise, look up, comes before it), else among those streaming; CPU while none is in flight is the
    replica's idle work, given to no request."""
    samples = result.samples
    on: list[list[Record]] = [[] for _ in range(replicas)]
    for rec in result.records:
        if rec.replica is not None and rec.replica < replicas:
            on[rec.replica].append(rec)
    for k in range(replicas):
        for (t0, a), (t1, b) in zip(samples, samples[1:], strict=False):
            spent = (b[k] - a[k]) / 1e6  # ms
            live = [r for r in on[k] if r.sent <= t0 and r.done >= t1]
            waiting = [r for r in live if r.first is None or r.first >= t1]
            for r in waiting or live:
                r.cpu_ms += spent / len(waiting or live)
                if len(live) == 1:
                    r.alone_ms += spent


# --- the platform ------------------------------------------------------------------------------------------


class Engine:
    def __init__(self, index: int, kv_blocks: int):
        self.index, self.kv_blocks = index, kv_blocks
        self.port, self.kv_port, self.replay_port = h.free_port(), h.free_port(), h.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"{MODEL}-main-{index}"
        self.proc = None

    def start(self, procs: h.Processes) -> None:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.kv_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "kv-events",
        }
        argv = [PYTHON, "-m", "simulator", "--model", str(ROOT / "models" / MODEL)]
        argv += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--block-size", str(BLOCK), "--num-gpu-blocks-override", str(self.kv_blocks)]
        argv += ["--max-model-len", str(MAX_MODEL_LEN), "--enable-prompt-tokens-details"]
        argv += ["--kv-events-config", json.dumps(events), *TOOL_FLAGS]
        for flag, value in SIM_ARGS.items():
            argv += [flag, value]
        self.proc = procs.start(
            f"agent-scale-engine-{self.index}", argv, core=None, env={"PYTHONHASHSEED": "0"}
        )

    def wait(self) -> None:
        h.wait_until(lambda: h.http_get(self.port, "/health") == 200, self.proc, self.name, 120)

    def reset(self, deadline: float) -> None:
        while True:
            status, body = h.http_post(self.port, "/reset_prefix_cache", b"", {})
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} refused to reset its prefix cache: {status} {body[:200]!r}")
            time.sleep(0.2)


def create_objects(env: dict, engines: list[Engine]) -> tuple[str, int]:
    os.environ.update(env)
    import django

    django.setup()
    from routing.models import RoutingPolicy
    from serving.models import Endpoint, Health, ModelDeployment, Pool
    from tenants.keys import api_key_create
    from tenants.models import Scope, Team, Tenant

    tenant = Tenant.objects.create(name="Bench", slug="bench")
    team = Team.objects.create(tenant=tenant, name="Agents", slug="agents")
    deployment = ModelDeployment.objects.create(
        name=MODEL,
        served_model_name=MODEL,
        model_source=str(ROOT / "models" / MODEL),
        engine_kind="sim",
        orchestrator="kubernetes",  # nothing reconciles it: the endpoints below are all there is
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
    )
    pool = Pool.objects.create(deployment=deployment, name="main", replicas=len(engines))
    for engine in engines:
        Endpoint.objects.create(
            pool=pool,
            name=engine.name,
            url=engine.url,
            role="both",
            health=Health.HEALTHY,
            kv_events_endpoint=f"tcp://127.0.0.1:{engine.kv_port}",
        )
    RoutingPolicy.objects.update_or_create(deployment=deployment, defaults={"mode": "precise"})
    key = api_key_create(team=team, name="bench", scopes=[Scope.INFERENCE]).secret
    return key, deployment.id


class Scraper(threading.Thread):
    """The engines' /metrics into Redis every second (Celery beat's job in production)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop = threading.Event()

    def run(self) -> None:
        from django.db import close_old_connections

        from routing.scheduling.load_scraper import endpoint_loads_scrape

        while not self.stop.wait(1.0):
            try:
                endpoint_loads_scrape()
            except Exception as exc:  # noqa: BLE001 - a missed scrape is not fatal
                log(f"scrape failed: {exc}")
            finally:
                close_old_connections()


def start_router(procs: h.Processes, env: dict, tag: str, root: Path, kv_blocks: int):
    port = h.free_port()
    argv = [PYTHON, "-m", "uvicorn", "inference_platform.asgi:application", "--host", "127.0.0.1"]
    http = h.router_http(root)
    argv += ["--port", str(port), "--loop", "uvloop", "--http", http, "--no-access-log"]
    argv += ["--workers", "1", "--log-level", "warning"]
    extra = {
        "ROUTER_CONFIG_POLL_SECONDS": "0.5",
        "ROUTER_APPROX_BLOCKS_PER_ENDPOINT": str(kv_blocks),
        "ROUTER_DECISION_LOG_SAMPLE": "0",
        "PYTHONPATH": str(root),
    }
    name = f"agent-scale-router-{tag}"
    proc = procs.start(name, argv, core=None, env={**env, **extra}, cwd=root)
    return proc, port, name


def start_vllm_router(procs: h.Processes, venv: Path, engines: list[Engine], tag: str):
    port = h.free_port()
    argv = [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--worker-urls"]
    argv += [e.url for e in engines]
    argv += [
        "--policy",
        "cache_aware",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(h.free_port()),
    ]
    name = f"agent-scale-vllm-router-{tag}"
    proc = procs.start(name, argv, core=None, full_env=h.peer_env())
    return proc, port, name


def warm_body() -> bytes:
    """A request unlike the workload (so it caches none of its text) but large enough to start the router's
    tokenizing workers, which start at the first large request."""
    rng = random.Random(99)
    words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(6000))
    payload = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": words}]}
    return json.dumps(payload).encode()


def router_metrics(port: int) -> dict[str, float]:
    """Our router's /metrics as sample name (with its `le` for buckets) -> value, summed over other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = None
    try:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/metrics", headers=h.metrics_headers())
        text = conn.getresponse().read().decode()
    except OSError:
        return {}
    finally:
        if conn is not None:
            conn.close()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name + (f"@{s.labels['le']}" if "le" in s.labels else "")
            out[name] = out.get(name, 0.0) + s.value
            if "reason" in s.labels:  # fallbacks and render failures, by why
                name += f"#{s.labels['reason']}"
                out[name] = out.get(name, 0.0) + s.value
    return out


def lag_bounds(before: dict, after: dict) -> tuple[float, float, int]:
    """(p99, max) of the loop-lag probe over the phase, each as the upper bound of its histogram bucket (s), and
    how many probes ran."""
    name = "router_event_loop_lag_seconds_bucket@"
    buckets = sorted(
        ((float(k[len(name) :]), after[k] - before.get(k, 0.0)) for k in after if k.startswith(name)),
        key=lambda kv: kv[0],
    )
    if not buckets or not buckets[-1][1]:
        return float("nan"), float("nan"), 0
    total = buckets[-1][1]
    p99 = next(le for le, n in buckets if n >= 0.99 * total)
    top = next(le for le, n in buckets if n >= total)
    return p99, top, int(total)


# --- a phase, set up and measured --------------------------------------------------------------------------


@dataclass
class Phase:
    name: str  # direct, ours, ours @ REV, vllm-router cache_aware
    replicas: int
    result: PhaseResult | None = None
    idle_s: list[float] = field(default_factory=list)
    metrics: list[tuple[dict, dict]] = field(default_factory=list)  # per replica: before, after
    worst_lag: list[float] = field(default_factory=list)
    rss: list[tuple[int, int]] = field(default_factory=list)
    tree_cpu_s: float = 0.0
    skipped: str = ""


class Bench:
    def __init__(self, args, procs: h.Processes, engines: list[Engine], env: dict, key: str, redis_url: str):
        self.args, self.procs, self.engines, self.env, self.key = args, procs, engines, env, key
        self.redis_url = redis_url
        cpt = chars_per_token()
        self.texts = Texts(cpt)
        self.shapes = {k: Shape.load(k, key, cpt) for k in ("claude-code", "codex")}

    def agents(self) -> list[Agent]:
        return make_agents(self.args.sessions, self.shapes, self.texts, self.args.max_context, self.args.seed)

    def clean(self, deployment_id: int) -> None:
        """Engines' caches reset (their KV blocks, and with them the prefix index, and the simulator's rendered
        prompts); the token ids replicas share through Redis dropped."""
        import redis

        deadline = time.monotonic() + 60
        for engine in self.engines:
            engine.reset(deadline)
        client = redis.Redis.from_url(self.redis_url)
        try:
            while time.monotonic() < deadline:
                if next(client.scan_iter(match=f"px:{deployment_id}:*", count=10_000), None) is None:
                    break
                time.sleep(0.2)
            keys = list(client.scan_iter(match="tok:*", count=10_000))  # routing/rendering/shared_tokens.py
            for i in range(0, len(keys), 500):
                client.delete(*keys[i : i + 500])
        finally:
            client.close()

    def run(self, phase: Phase, target: Target, clocks: list[TreeClock], metric_ports: list[int]) -> None:
        # The replicas' idle work over a quiet second, for the cores at the seed's rate.
        quiet = [c.ns() for c in clocks]
        time.sleep(1.0)
        idle = [(c.ns() - b) / 1e9 for c, b in zip(clocks, quiet, strict=True)]
        before = [router_metrics(p) for p in metric_ports]
        agents = self.agents()
        args = self.args
        result = asyncio.run(
            run_phase(agents, target, clocks, args.duration, args.rate, args.burst, args.max_context)
        )
        phase.result = result
        classify(result.records)
        attribute(result, len(clocks))
        phase.idle_s = idle
        if len(result.samples) > 1:
            phase.tree_cpu_s = (sum(result.samples[-1][1]) - sum(result.samples[0][1])) / 1e9
        after = [router_metrics(p) for p in metric_ports]
        phase.metrics = list(zip(before, after, strict=True))
        phase.worst_lag = [a.get("router_event_loop_lag_worst_seconds", float("nan")) for a in after]
        phase.rss = [c.rss() for c in clocks]
        ok = [r for r in result.records if r.ok]
        log(
            f"{phase.name} R={phase.replicas}: {len(result.records)} requests ({len(ok)} ok) in {result.wall:.0f} s; "
            f"CPU per request {cpu_summary(ok)}"
        )
        bad = [r for r in result.records if not r.ok]
        if bad:
            log(f"  errors: {len(bad)}, e.g. {bad[0].error or bad[0].status}")


def cpu_summary(records: list[Record]) -> str:
    cpu = [r.cpu_ms for r in records]
    if not cpu:
        return "n/a"
    return f"mean {statistics.mean(cpu):.1f} ms, p50 {pct(cpu, 0.5):.1f}, p99 {pct(cpu, 0.99):.1f}"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- the report --------------------------------------------------------------------------------------------


def fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value != value else f"{value:,.{digits}f}"


def class_cell(records: list[Record], klass: str) -> str:
    cpu = [r.cpu_ms for r in records if r.klass == klass]
    if not cpu:
        return "0"
    return f"{len(cpu)}: {fmt(statistics.mean(cpu))} / {fmt(pct(cpu, 0.5))} / {fmt(pct(cpu, 0.99))}"


def mean_of(records: list[Record], klass: str, unseen: bool | None = None) -> float:
    cpu = [r.cpu_ms for r in records if r.klass == klass and (unseen is None or r.unseen == unseen)]
    return statistics.mean(cpu) if cpu else float("nan")


def phase_rows(phases: list[Phase], direct: Phase | None) -> tuple[list[str], list[str]]:
    cpu_rows = [
        "| router | R | requests (errors) | req/s | CPU per request: mean / p50 / p99 (ms) | cold: n: mean / p50 / p99 "
        "| of which unseen: n: mean | warm: n: mean / p50 / p99 | new: n: mean / p50 / p99 | alone | idle CPU per "
        "replica | CPU per request, whole trees |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lat_rows = [
        "| router | R | prompt tokens p50 / max | cache hits (engines) | TTFT p50 / p99 (ms) | added vs direct p50 / "
        "p99 (ms) | router added, mean (ms) | loop lag p99 / max (ms, worst replica) | lookups: fallbacks / late "
        "| predicted / reported | RSS per replica, max: router / with workers (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    d_ttft = [r.ttft * 1000 for r in direct.result.records if r.ok] if direct and direct.result else []
    for p in phases:
        if p.skipped:
            cpu_rows.append(f"| {p.name} | {p.replicas} | skipped: {p.skipped} | | | | | | | | | |")
            lat_rows.append(f"| {p.name} | {p.replicas} | skipped | | | | | | | | |")
            continue
        recs = p.result.records
        ok = [r for r in recs if r.ok]
        errors = len(recs) - len(ok)
        rps = len(ok) / p.result.wall if p.result.wall else float("nan")
        prompts = [r.prompt for r in ok]
        hits = sum(r.cached for r in ok) / sum(prompts) if sum(prompts) else float("nan")
        ttft = [r.ttft * 1000 for r in ok]
        if p.name == "direct":
            cpu_rows.append(f"| direct (no router) | - | {len(ok)} ({errors}) | {rps:.1f} | | | | | | | | |")
            lat_rows.append(
                f"| direct (no router) | - | {fmt(pct(prompts, 0.5), 0)} / {fmt(max(prompts, default=0), 0)} | "
                f"{hits:.1%} | {fmt(pct(ttft, 0.5), 0)} / {fmt(pct(ttft, 0.99), 0)} | | | | | | |"
            )
            continue
        cpu = [r.cpu_ms for r in ok]
        alone = sum(r.alone_ms for r in ok) / sum(cpu) if sum(cpu) else float("nan")
        idle = statistics.mean(p.idle_s) if p.idle_s else float("nan")
        whole = 1000 * p.tree_cpu_s / len(ok) if ok else float("nan")
        cpu_rows.append(
            f"| {p.name} | {p.replicas} | {len(ok)} ({errors}) | {rps:.1f} | "
            f"{fmt(statistics.mean(cpu) if cpu else float('nan'))} / {fmt(pct(cpu, 0.5))} / {fmt(pct(cpu, 0.99))} | "
            f"{class_cell(ok, 'cold')} | {sum(r.unseen for r in ok)}: {fmt(mean_of(ok, 'cold', True))} | "
            f"{class_cell(ok, 'warm')} | {class_cell(ok, 'new')} | {alone:.0%} | "
            f"{idle * 1000:.0f} ms/s | {fmt(whole)} |"
        )
        added = (
            f"{pct(ttft, 0.5) - pct(d_ttft, 0.5):+.0f} / {pct(ttft, 0.99) - pct(d_ttft, 0.99):+.0f}"
            if d_ttft and ttft
            else "n/a"
        )
        if p.name.startswith("vllm-router"):
            lag = router_added = lookups = predicted = "n/a"
        else:
            lags = [lag_bounds(b, a) for b, a in p.metrics]
            worst_p99 = max((x[0] for x in lags), default=float("nan"))
            worst_top = max((x[1] for x in lags), default=float("nan"))
            gauge = max(p.worst_lag, default=float("nan"))
            lag = f"{fmt(worst_p99 * 1000, 0)} / {fmt(min(worst_top, gauge) * 1000, 0)}"
            total = {k: sum(a.get(k, 0.0) - b.get(k, 0.0) for b, a in p.metrics) for k in METRIC_KEYS}
            count = total["router_added_latency_seconds_count"]
            router_added = (
                fmt(1000 * total["router_added_latency_seconds_sum"] / count, 1) if count else "n/a"
            )
            looked = int(total["router_prefix_index_lookup_seconds_count"])
            fell = int(total["router_prefix_index_fallbacks_total"])
            late = int(total["router_prefix_index_late_loop_total"])
            lookups = f"{looked}: {fell} ({fell / looked:.1%}) / {late}" if looked else f"0: {fell} / {late}"
            rep = total["router_prefix_reported_cached_tokens_total"]
            pred = total["router_prefix_predicted_cached_tokens_total"]
            predicted = f"{pred / rep:.3f} ({pred / 1e6:.2f}M / {rep / 1e6:.2f}M)" if rep else "n/a"
            failed = {
                k.partition("#")[2]: a.get(k, 0.0) - b.get(k, 0.0)
                for b, a in p.metrics
                for k in a
                if k.startswith("router_prefix_render_failures_total#")
            }
            if any(failed.values()):
                predicted += "; routed blind: " + ", ".join(
                    f"{n:.0f} {why}" for why, n in failed.items() if n
                )
        rss = (
            f"{max(x[0] for x in p.rss) / 2**20:.0f} / {max(x[1] for x in p.rss) / 2**20:.0f}"
            if p.rss
            else "n/a"
        )
        lat_rows.append(
            f"| {p.name} | {p.replicas} | {fmt(pct(prompts, 0.5), 0)} / {fmt(max(prompts, default=0), 0)} | "
            f"{hits:.1%} | {fmt(pct(ttft, 0.5), 0)} / {fmt(pct(ttft, 0.99), 0)} | {added} | {router_added} | "
            f"{lag} | {lookups} | {predicted} | {rss} |"
        )
    return cpu_rows, lat_rows


METRIC_KEYS = (
    "router_added_latency_seconds_sum",
    "router_added_latency_seconds_count",
    "router_prefix_index_lookup_seconds_count",
    "router_prefix_index_fallbacks_total",
    "router_prefix_index_late_loop_total",
    "router_prefix_reported_cached_tokens_total",
    "router_prefix_predicted_cached_tokens_total",
)


def cores_rows(phases: list[Phase], policy: str) -> list[str]:
    """The router cores the seed's rate would take at R = 1, 2, 4, 8, from the per-request costs measured here."""
    ours = {p.replicas: p for p in phases if p.name == "ours" and not p.skipped and p.result}
    if not ours:
        return []
    every = [r for p in ours.values() for r in p.result.records if r.ok]
    c_unseen = mean_of(every, "cold", True)
    unseen = [r for r in every if r.klass == "cold" and r.unseen and r.prompt]
    per_token = sum(r.cpu_ms for r in unseen) / sum(r.prompt for r in unseen) if unseen else float("nan")
    mean_prompt = statistics.mean(r.prompt for r in every)
    c_none = per_token * mean_prompt
    idle = statistics.mean(x for p in ours.values() for x in p.idle_s)
    lines = [
        "",
        f"Router cores for the seed's {SEED_RATE:.0f} requests/s from the CPU per request measured above (ours, "
        f"{'round-robin' if policy == 'rr' else 'session'} balancer), three ways:",
        "",
        "    cores(R) = rate x c(R) + R x idle",
        "    this run:      c(R) = the run's mean CPU per request at R (its start-up included: every agent's "
        "first request is unseen)",
        "    caches hold:   c(R) = f_new x c_new + (1 - f_new) x (w(R) x c_warm + (1 - w(R)) x c_behind)",
        "    caches hold none (the seed's 1,300-3,800 live conversations): c(R) = c_unseen per prompt token x mean "
        "prompt",
        "",
        f"idle = {idle * 1000:.0f} ms/s of CPU per replica with no request; c_unseen = {fmt(c_unseen)} ms, "
        f"{per_token * 1000:.2f} ms per 1K prompt tokens (a cold request whose replica had served none of its "
        f"conversation, over every R), mean prompt {mean_prompt:,.0f} tokens; f_new, c_new, c_warm, c_behind "
        "(a cold request whose replica had served an earlier, not the previous, request of its conversation) from "
        "the run at R, at R = 8 from R = 4 (c_behind then a lower bound: a replica misses more turns; with no such "
        "request in the run, c_unseen stands in as an upper bound, marked <=); w(R) the "
        "share of continuing requests reaching the replica that served the previous one: "
        + ("1/R for round robin." if policy == "rr" else "as measured (session balancer)."),
        "",
        "| R | this run: c (ms) | cores | f_new / c_new / c_warm / c_behind (ms) | w(R) | caches hold: c (ms) "
        "| cores | caches hold none: cores |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (1, 2, 4, 8):
        run = ours.get(r) or ours.get(4) or ours[max(ours)]
        recs = [x for x in run.result.records if x.ok]
        f_new = sum(x.klass == "new" for x in recs) / len(recs) if recs else float("nan")
        c_new, c_warm = mean_of(recs, "new"), mean_of(recs, "warm")
        c_behind = mean_of(recs, "cold", False)
        bound = ""
        if c_behind != c_behind:  # none in the run: at most an unseen request's cost
            c_behind, bound = c_unseen, "<= "
        if c_new != c_new:  # no conversation started in the run
            c_new, f_new = 0.0, 0.0
        if policy == "rr":
            w = 1.0 / r
        else:
            going = [x for x in recs if x.klass in ("warm", "cold") and not x.unseen]
            w = sum(x.klass == "warm" for x in going) / len(going) if going else 1.0
        held = f_new * c_new + (1 - f_new) * (w * c_warm + (1 - w) * c_behind)
        mark = bound if w < 1 else ""
        this = "not run | "
        if r in ours:
            mean = statistics.mean(x.cpu_ms for x in recs) if recs else float("nan")
            this = f"{fmt(mean)} | {SEED_RATE * mean / 1000 + r * idle:.1f}"
        lines.append(
            f"| {r} | {this} | {f_new:.2f} / {fmt(c_new)} / {fmt(c_warm)} / {bound}{fmt(c_behind)} | {w:.2f} | "
            f"{mark}{fmt(held)} | {mark}{SEED_RATE * held / 1000 + r * idle:.1f} | "
            f"{SEED_RATE * c_none / 1000 + r * idle:.1f} |"
        )
    return lines


def report(args, argv: list[str], phases: list[Phase], notes: list[str], started: float) -> str:
    direct = next((p for p in phases if p.name == "direct"), None)
    measured = [p for p in phases if p.name != "direct"]
    cpu_rows, lat_rows = phase_rows(([direct] if direct else []) + measured, direct)
    lines = [
        f"### {'Quick run' if args.quick else args.title}",
        "",
        h.header("agent_scale", argv),
        f"- Our router at {h.git_head()}" + (f"; baseline at {args.baseline}" if args.baseline else "") + ".",
        f"- Traffic: {args.sessions} agent sessions (half Claude Code-shaped, /v1/messages?beta=true; half "
        f"Codex-shaped, /v1/responses), contexts starting at 40-95 % of {args.max_context:,} tokens and growing by "
        f"tool results each turn (compacted past it), sub-agent bursts of 3-5 (two requests each) at {args.burst:.0%} "
        f"of turns, think times aimed at {args.rate:g} requests/s in all (req/s: what came of it), {args.duration:g} s per phase.",
        f"- Engines: {args.engines} simulators, {args.kv_blocks} KV blocks of {BLOCK} tokens each "
        f"({args.kv_blocks * BLOCK:,} tokens), "
        + ", ".join(f"`{k} {v}`" for k, v in SIM_ARGS.items())
        + ", KV events, the KV-event ingester; precise prefix routing (policy defaults). Balancer: "
        + ("round robin" if args.balancer == "rr" else "hash of the agent's session header")
        + f", one request a connection. Nothing pinned: {os.cpu_count()} cores shared by everything, timings noisy.",
        "- Router CPU per request: CPU of each replica's process tree (router and tokenizing workers, per-thread "
        "schedstat) between the readings taken whenever a request starts, gets its first token or ends, shared among "
        "the requests in flight on that replica (those before their first token first); alone: the share of CPU "
        "given while a request was alone on its replica (exact; the rest is shared, which over-counts warm requests "
        "overlapping cold ones). cold: "
        "the replica did not serve the conversation's previous request (unseen: nor any of its requests in this "
        "phase, as every agent's first); warm: it did; new: a sub-agent's or a compacted conversation's first "
        "request. Whole trees: the replicas' CPU over the phase (idle work included) over requests.",
        "- Loop lag: the router's probe (`router_event_loop_lag_seconds`, a 20 ms timer) over the phase, as bucket "
        "bounds; max is the lesser of its bucket bound and the worst-lag gauge. TTFT: at the client, to the first "
        "content event; added: less the direct phase's (agents straight to an engine by session).",
        "",
        "Router CPU:",
        "",
        *cpu_rows,
        "",
        "Latency, routing and memory:",
        "",
        *lat_rows,
        *cores_rows(phases, args.balancer),
    ]
    if notes:
        lines += ["", "Notes:", "", *(f"- {n}" for n in notes)]
    lines += ["", f"Run took {time.monotonic() - started:.0f} s."]
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="fewer sessions, shorter phases, vllm-router at R=1 only"
    )
    p.add_argument("--sessions", type=int, help="concurrent agent sessions (default 24, 6 with --quick)")
    p.add_argument("--rate", type=float, help="requests/s the agents aim at in all (default 4)")
    p.add_argument(
        "--duration", type=float, help="seconds of traffic per phase (default 60, 15 with --quick)"
    )
    p.add_argument("--max-context", type=int, default=200_000, help="tokens a conversation grows to")
    p.add_argument("--burst", type=float, default=0.2, help="share of turns that start sub-agents")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4], help="router replica counts")
    p.add_argument(
        "--peer-replicas", type=int, nargs="*", help="vllm-router replica counts (default: 1 quick)"
    )
    p.add_argument("--balancer", choices=("rr", "session"), default="rr")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=4096, help="KV blocks per engine (128 tokens each)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--skip-peer", action="store_true", help="leave vllm-router out")
    p.add_argument("--skip-direct", action="store_true", help="no direct phase (no TTFT added)")
    p.add_argument("--baseline", metavar="REV", help="also run our router at this commit (a git worktree)")
    p.add_argument("--title", default="Agent sessions at the seed's shape")
    p.add_argument("--section", default="agent-scale")
    p.add_argument("--docs", default=None, help="write the section into this file (none by default)")
    args = p.parse_args(argv)
    args.sessions = args.sessions or (6 if args.quick else 24)
    args.rate = args.rate or 4.0
    args.duration = args.duration or (15.0 if args.quick else 60.0)
    if args.peer_replicas is None:
        args.peer_replicas = [1] if args.quick else list(args.replicas)
    return args


def baseline_worktree(rev: str) -> Path:
    """A detached worktree of `rev` under .local/bench/, made afresh, whose router runs beside this one."""
    path = STATE / "agent-scale-baseline"
    if path.exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)
        shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=True)
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True)
    return path


def router_phase(bench: Bench, name: str, replicas: int, root: Path, deployment_id: int) -> Phase:
    """Our router (from `root`) at R replicas behind the balancer."""
    args, procs = bench.args, bench.procs
    phase = Phase(name, replicas)
    tag = f"{'base' if root != ROOT else 'ours'}-{replicas}"
    up = [start_router(procs, bench.env, f"{tag}-{r}", root, args.kv_blocks) for r in range(replicas)]
    try:
        for proc, port, pname in up:
            h.wait_until(lambda p=port: h.http_get(p, "/health") == 200, proc, pname, 180)
        headers = {"Authorization": f"Bearer {bench.key}"}
        for _, port, _ in up:
            status, answer = h.http_post(port, "/v1/chat/completions", warm_body(), headers, timeout=60)
            if status != 200:
                raise RuntimeError(f"the warm-up request failed: {status} {answer[:200]!r}")
        for proc, _, _ in up:
            h.quiesce(proc.pid, 10)
        bench.clean(deployment_id)
        balancer, port = start_balancer(procs, [p for _, p, _ in up], args.balancer, tag)
        clocks = [TreeClock(proc.pid) for proc, _, _ in up]
        bench.run(phase, Target([port]), clocks, [p for _, p, _ in up])
        procs.stop(balancer)
    finally:
        for proc, _, _ in up:
            procs.stop(proc)
    return phase


def peer_phase(bench: Bench, venv: Path, replicas: int, deployment_id: int) -> Phase:
    args, procs = bench.args, bench.procs
    phase = Phase("vllm-router cache_aware", replicas)
    up = [start_vllm_router(procs, venv, bench.engines, f"{replicas}-{r}") for r in range(replicas)]
    try:
        small = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        for proc, port, pname in up:
            h.wait_until(
                lambda p=port: h.http_post(p, "/v1/chat/completions", small.encode(), {})[0] == 200,
                proc,
                pname,
                60,
            )
        for shape in bench.shapes.values():  # does it serve each agent's path? one small request tells
            conv = Conversation(shape, "probe", "probe", "hi", bench.texts)
            status, answer = h.http_post(
                up[0][1], shape.path, json.dumps(conv.payload()).encode(), conv.headers()
            )
            if status != 200:
                phase.skipped = f"{shape.path} answered {status}: {answer[:120]!r}"
                return phase
        bench.clean(deployment_id)
        balancer, port = start_balancer(procs, [p for _, p, _ in up], args.balancer, f"peer-{replicas}")
        clocks = [TreeClock(proc.pid) for proc, _, _ in up]
        bench.run(phase, Target([port]), clocks, [])
        procs.stop(balancer)
    except Exception as exc:  # noqa: BLE001 - a peer that does not run is reported, not fatal
        phase.skipped = f"did not run: {str(exc).splitlines()[0][:200]}"
    finally:
        for proc, _, _ in up:
            procs.stop(proc)
    return phase


def main(argv: list[str]) -> int:
    if argv[:1] == ["balance"]:
        return balance_main(argv[1:])
    args = parse_args(argv)
    h.under_devstack("agent_scale", argv, ("DATABASE_URL", "REDIS_URL"))
    started = time.monotonic()
    STATE.mkdir(parents=True, exist_ok=True)
    redis_url = h.with_path(os.environ["REDIS_URL"], f"/{BENCH_REDIS_DB}")
    notes: list[str] = []
    phases: list[Phase] = []
    with h.Processes() as procs:
        procs.after_stop(lambda: h.flush_redis(redis_url))
        installer = None
        if not args.skip_peer and args.peer_replicas:
            installer = h.Installer("vllm-router", h.PEERS["vllm-router"]["spec"], 600)
            installer.start()
        h.flush_redis(redis_url)
        engines = [Engine(i, args.kv_blocks) for i in range(args.engines)]
        for engine in engines:
            engine.start(procs)
        log(f"database {BENCH_DB} (dropped and re-created), Redis db {BENCH_REDIS_DB} (flushed)")
        env = h.platform_env(h.fresh_database(os.environ["DATABASE_URL"], BENCH_DB), redis_url)
        h.migrate(env)
        for engine in engines:
            engine.wait()
        key, deployment_id = create_objects(env, engines)
        procs.start("agent-scale-kv-ingester", [PYTHON, "manage.py", "run_kv_ingester"], core=None, env=env)
        scraper = Scraper()
        scraper.start()
        procs.before_stop(scraper.stop.set)
        bench = Bench(args, procs, engines, env, key, redis_url)
        log(
            f"{args.engines} engines up; {args.sessions} sessions; chars per token {bench.texts.chars_per_token:.2f}"
        )

        if not args.skip_direct:
            bench.clean(deployment_id)
            phase = Phase("direct", 0)
            bench.run(phase, Target([e.port for e in engines], direct=True), [], [])
            phases.append(phase)
        base_root = baseline_worktree(args.baseline) if args.baseline else None
        for replicas in args.replicas:
            phases.append(router_phase(bench, "ours", replicas, ROOT, deployment_id))
            if base_root is not None:
                phases.append(
                    router_phase(bench, f"ours @ {args.baseline}", replicas, base_root, deployment_id)
                )
        if installer is not None:
            log("waiting for the vllm-router install (.local/bench/vllm-router)")
            installer.join(timeout=620)
            if installer.venv is None:
                notes.append(
                    f"vllm-router cache_aware not run: {installer.error or 'install did not finish'}"
                )
            else:
                for replicas in args.peer_replicas:
                    phase = peer_phase(bench, installer.venv, replicas, deployment_id)
                    phases.append(phase)
                    if phase.skipped:
                        notes.append(f"vllm-router cache_aware at R={replicas}: {phase.skipped}")
                        break
                notes.append(
                    "vllm-router: its CPU is its whole process (Rust, several threads); it exports no loop lag, "
                    "lookups or predicted tokens (n/a)."
                )
        elif args.skip_peer:
            notes.append("vllm-router cache_aware left out (--skip-peer).")

    block = report(args, argv, phases, notes, started)
    print()
    print(block)
    if args.docs:
        write_section(Path(args.docs), args.section, block, "Agent sessions at scale", "bench/agent_scale.py")
        log(f"wrote {args.docs}")
    return 0


if __name__ == "__main__":
    h.run(main)
