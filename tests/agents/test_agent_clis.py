"""The coding agents themselves, unchanged: the pinned Claude Code and Codex CLIs (tests/agents/package.json, which
`make agents` installs from npm) run non-interactively against the router in front of the demo deployment's
engines, on the simulator and on real vLLM-CPU.

Each runs a task of two user turns (the second resumes the first session) in a throwaway HOME and work folder,
with every proxy variable pointing at a closed port, so the router is the only thing it can reach. Checked:
every request the router saw was answered 2xx, the CLI exits 0, the ledger has one usage record per request whose
tokens add up to the engine's own counters, the router's predicted cached tokens are within 2 % of what the
engine reported, and no request was a render failure. The model answers a user turn with a call of the first tool
until the conversation holds two calls, and a tool result with text, as the platform starts it
(settings.DUMMY_ANSWER_LENGTH, SIMULATOR_TOOL_CALLS_PER_CONVERSATION): the simulator by itself, vLLM's random
weights through the platform's logits processors (serving/engine_plugins/), which end each answer and write the
calls, parsed by vLLM's own tool-call parser. On both, every call is executed by the CLI and its result sent back.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from routing.rendering.tokenize import RouterTokenizer
from serving.engine_command import ANSWER_LENGTH_PROCESSOR, TOOL_CALLS_PROCESSOR, simulated_model_args
from serving.management.commands.bootstrap_demo import DEMO_MAX_MODEL_LEN
from serving.models import ModelDeployment
from tenants.models import UsageRecord
from tenants.usage_stream import usage_ingest_until_empty

from ..routing.conftest import Fleet
from ..routing.router_metrics import router_metrics
from ..routing.test_precise_routing import ingester_process, precise_fleet  # noqa: F401 (a fixture)
from ..serving.engines import MODEL_DIR, MODEL_NAME, RunningEngine, start_engine

pytestmark = pytest.mark.agents

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "tests" / "agents" / "node_modules" / ".bin"
# The CLIs' first requests, as the router received them (method, path, query, headers, body).
CAPTURED = sorted((ROOT / "tests" / "agents" / "captured").glob("*.json"))
CLAUDE_TOOLS = "Agent Bash Read Glob Grep LS"


def agent_env(home: Path, **extra: str) -> dict[str, str]:
    """A bare environment: a fresh HOME, and proxies that lead nowhere for anything but the local router."""
    closed = "http://127.0.0.1:9"
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "TERM": "dumb",
        "LANG": "C.UTF-8",
        "HTTP_PROXY": closed,
        "HTTPS_PROXY": closed,
        "ALL_PROXY": closed,
        "http_proxy": closed,
        "https_proxy": closed,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        **extra,
    }


@dataclass
class AgentRun:
    returncode: int
    events: list[dict]
    stderr: str

    def of_type(self, kind: str) -> list[dict]:
        return [event for event in self.events if event.get("type") == kind]


def run_cli(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 600) -> AgentRun:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    events = []
    for line in done.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            events.append(json.loads(line))
    return AgentRun(done.returncode, events, done.stderr[-4000:] + done.stdout[-4000:])


# --- the two CLIs -------------------------------------------------------------------------------------------
def claude(fleet: Fleet, home: Path, work: Path, prompt: str, *, resume: bool = False) -> AgentRun:
    env = agent_env(
        home,
        ANTHROPIC_BASE_URL=fleet.router.url,
        ANTHROPIC_API_KEY=fleet.key.secret,
        ANTHROPIC_MODEL=MODEL_NAME,
        ANTHROPIC_SMALL_FAST_MODEL=MODEL_NAME,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL_NAME,
        ANTHROPIC_DEFAULT_SONNET_MODEL=MODEL_NAME,
        ANTHROPIC_DEFAULT_OPUS_MODEL=MODEL_NAME,
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        CLAUDE_CODE_MAX_OUTPUT_TOKENS="2048",
    )
    argv = [str(BIN / "claude"), "-p", prompt, "--output-format", "stream-json", "--verbose"]
    argv += ["--max-turns", "8", "--allowedTools", CLAUDE_TOOLS]
    if resume:
        argv.append("--continue")
    return run_cli(argv, env, work)


def claude_tool_calls(run: AgentRun) -> tuple[list[dict], list[dict]]:
    """The tool_use blocks the model sent and the tool_result blocks the CLI answered them with."""
    uses = [
        block
        for event in run.of_type("assistant")
        for block in event["message"]["content"]
        if block.get("type") == "tool_use"
    ]
    results = [
        block
        for event in run.of_type("user")
        for block in (event["message"]["content"] if isinstance(event["message"]["content"], list) else [])
        if block.get("type") == "tool_result"
    ]
    return uses, results


def codex(fleet: Fleet, home: Path, work: Path, prompt: str, *, resume: bool = False) -> AgentRun:
    config = home / ".codex" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f'model = "{MODEL_NAME}"\n'
        'model_provider = "platform"\n'
        "[model_providers.platform]\n"
        'name = "platform"\n'
        f'base_url = "{fleet.router.url}/v1"\n'
        'env_key = "PLATFORM_API_KEY"\n'
        'wire_api = "responses"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
    )
    env = agent_env(home, PLATFORM_API_KEY=fleet.key.secret)
    argv = [str(BIN / "codex"), "exec"]
    if resume:
        argv += ["resume", "--last"]
    # No sandbox: the work folder is thrown away, and a container may not allow bubblewrap's namespaces.
    argv += ["--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", prompt]
    return run_cli(argv, env, work)


def codex_tool_calls(run: AgentRun) -> list[dict]:
    return [
        event["item"]
        for event in run.of_type("item.completed")
        if event["item"].get("type") in ("command_execution", "function_call", "mcp_tool_call")
    ]


# --- what the router, the engine and the ledger saw ------------------------------------------------------------
def router_counts(fleet: Fleet) -> dict[str, float]:
    counts = {"2xx": 0.0, "render_failures": 0.0, "predicted": 0.0, "reported": 0.0}
    for line in router_metrics(fleet.router.url).splitlines():
        value = line.rpartition(" ")[2]
        if line.startswith("router_requests_total{"):
            status = line.partition('status="')[2][:3]
            name = "2xx" if status.startswith("2") else f"status {status}"
            counts[name] = counts.get(name, 0.0) + float(value)
        elif line.startswith("router_prefix_render_failures_total{"):
            counts["render_failures"] += float(value)
        elif line.startswith("router_prefix_predicted_cached_tokens_total{"):
            counts["predicted"] += float(value)
        elif line.startswith("router_prefix_reported_cached_tokens_total{"):
            counts["reported"] += float(value)
    return counts


ENGINE_COUNTERS = {
    "prompt": "vllm:prompt_tokens_total",
    "output": "vllm:generation_tokens_total",
    "cached": "vllm:prefix_cache_hits_total",
}


def engine_counts(engine: RunningEngine) -> dict[str, float]:
    metrics = engine.metrics()
    return {name: metrics.get(metric, 0.0) for name, metric in ENGINE_COUNTERS.items()}


def settled(fleet: Fleet, before: dict[str, float]) -> dict[str, float]:
    """The router's counts once every request it took has been settled (a stream's usage is counted after its
    end reached the client)."""
    deadline = time.monotonic() + 30
    previous = None
    while time.monotonic() < deadline:
        now = router_counts(fleet)
        if now == previous:
            break
        previous = now
        time.sleep(1.0)
    return {name: now[name] - before.get(name, 0.0) for name in now}


def check_ledger(fleet: Fleet, engine: RunningEngine, router: dict, engine_before: dict) -> list[UsageRecord]:
    usage_ingest_until_empty(consumer="agents-test")
    records = list(UsageRecord.objects.filter(api_key=fleet.key.api_key).order_by("created_at"))
    refused = {name: value for name, value in router.items() if name.startswith("status") and value}
    assert not refused, (refused, fleet.router.log()[-3000:])
    assert len(records) == router["2xx"] > 0, (len(records), router)
    assert len({record.request_id for record in records}) == len(records)
    assert all(record.status == "completed" for record in records), [r.status for r in records]
    engine_delta = {name: value - engine_before[name] for name, value in engine_counts(engine).items()}
    assert sum(r.prompt_tokens for r in records) == engine_delta["prompt"], engine_delta
    assert sum(r.output_tokens for r in records) == engine_delta["output"], engine_delta
    assert sum(r.cached_prompt_tokens for r in records) == engine_delta["cached"], engine_delta
    assert router["render_failures"] == 0, router
    # The router predicted the cached tokens the engine then reported, within 2 %.
    assert router["reported"] > 0, router
    assert abs(router["predicted"] - router["reported"]) <= 0.02 * router["reported"], router
    return records


def demo_fleet(engine: RunningEngine) -> Fleet:
    """The demo deployment's shape (its context, tool calling, precise prefix routing on the engines' KV
    events) behind a router of its own."""
    fleet = precise_fleet([engine])
    ModelDeployment.objects.filter(pk=fleet.deployment.pk).update(max_model_len=DEMO_MAX_MODEL_LEN)
    fleet.sync()
    return fleet


@pytest.fixture(scope="module")
def demo_sim() -> RunningEngine:
    # The simulated model the platform starts (its answer length and tool calls per conversation).
    engine = start_engine(
        "sim", "--max-model-len", str(DEMO_MAX_MODEL_LEN), "--decode-time", "0.001", *simulated_model_args()
    )
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def demo_vllm() -> RunningEngine:
    # The tiny model's random weights never write the end-of-sequence token nor call a tool: the platform's logits
    # processors end each answer and write the calls, as the local orchestrator's engines do
    # (serving/engine_command.py). --enable-scale-out serves vLLM's own renderer, the oracle of the captured
    # requests' render parity.
    engine = start_engine(
        "vllm",
        "--max-model-len",
        str(DEMO_MAX_MODEL_LEN),
        "--logits-processors",
        ANSWER_LENGTH_PROCESSOR,
        TOOL_CALLS_PROCESSOR,
        "--enable-scale-out",
    )
    yield engine
    engine.stop()


@pytest.fixture
def workspace(tmp_path: Path) -> tuple[Path, Path]:
    if not (BIN / "claude").exists() or not (BIN / "codex").exists():
        pytest.fail(f"the agents' CLIs are not installed in {BIN.parent}: run `make agents` (make test does)")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "README.md").write_text("# demo\n\nA folder for the agent to look at.\n")
    (work / "main.py").write_text("def main():\n    return 42\n")
    return home, work


# --- sessions ------------------------------------------------------------------------------------------------
PROMPTS = ("Look at the files here and tell me what main() returns.", "Now check README.md as well.")


def claude_finished(run: AgentRun) -> None:
    assert all(result["is_error"] is False for result in run.of_type("result")), run.events


def codex_finished(run: AgentRun) -> None:
    assert run.of_type("turn.completed") and not run.of_type("turn.failed"), run.events


CLIS = {"claude": (claude, claude_finished), "codex": (codex, codex_finished)}


def agent_session(engine: RunningEngine, workspace: tuple[Path, Path], cli: str) -> list[AgentRun]:
    """Two user turns of one CLI (the second resumes the first's session) through a router in front of `engine`;
    each must exit 0 and finish its turn, and the router, the engine and the ledger must agree on them."""
    home, work = workspace
    run, finished = CLIS[cli]
    fleet = demo_fleet(engine)
    try:
        router_before, engine_before = router_counts(fleet), engine_counts(engine)
        runs = []
        for turn, prompt in enumerate(PROMPTS):
            runs.append(run(fleet, home, work, prompt, resume=bool(turn)))
            assert runs[-1].returncode == 0, runs[-1].stderr
            finished(runs[-1])
        check_ledger(fleet, engine, settled(fleet, router_before), engine_before)
        return runs
    finally:
        fleet.router.stop()


ENGINES = ["demo_sim", pytest.param("demo_vllm", marks=pytest.mark.vllm)]


@pytest.mark.parametrize("engine", ENGINES, ids=["simulator", "vllm"])
def test_claude_code_runs_a_session_with_tool_calls(ingester_process, workspace, engine, request):  # noqa: F811
    uses, results = [], []
    for run in agent_session(request.getfixturevalue(engine), workspace, "claude"):
        uses += claude_tool_calls(run)[0]
        results += claude_tool_calls(run)[1]
    # Every call the model made was run by the CLI and answered (the main agent's and its sub-agents').
    assert uses and {u["id"] for u in uses} == {r["tool_use_id"] for r in results}, (uses, results)


@pytest.mark.parametrize("engine", ENGINES, ids=["simulator", "vllm"])
def test_codex_runs_a_session_with_tool_calls(ingester_process, workspace, engine, request):  # noqa: F811
    for run in agent_session(request.getfixturevalue(engine), workspace, "codex"):
        assert codex_tool_calls(run), run.events  # it ran the command the model asked for


def answers_end_by_themselves(engine: RunningEngine) -> None:
    """An answer ends with the stop token at the answer length (settings.DUMMY_ANSWER_LENGTH), unless max_tokens
    cuts it first: as on the engine's whole stream of agent requests, the usage counts what was generated."""
    for max_tokens, finish, count in ((1000, "stop", settings.DUMMY_ANSWER_LENGTH), (10, "length", 10)):
        reply = httpx.post(
            f"{engine.url}/v1/chat/completions",
            json={
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": max_tokens,
            },
            timeout=120,
        ).json()
        assert reply["choices"][0]["finish_reason"] == finish, reply
        assert reply["usage"]["completion_tokens"] == count, reply


def test_the_simulated_model_ends_its_answers(demo_sim):
    answers_end_by_themselves(demo_sim)


@pytest.mark.vllm
def test_vllm_on_dummy_weights_ends_its_answers(demo_vllm):
    answers_end_by_themselves(demo_vllm)


@pytest.mark.vllm
@pytest.mark.parametrize("captured", CAPTURED, ids=lambda path: path.stem)
def test_the_router_renders_the_agents_captured_requests_as_vllm_does(demo_vllm, captured):
    """Token id for token id, the prompt vLLM's own renderer makes of each CLI's real request."""
    request = json.loads(captured.read_text())
    body = {**request["body"], "model": MODEL_NAME}
    reply = httpx.post(f"{demo_vllm.url}{request['path']}/render", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    mine = list(RouterTokenizer(MODEL_DIR).encode_request(copy.deepcopy(body), request["path"]))
    assert mine == reply.json()["token_ids"] and len(mine) > 5000


def test_the_pinned_versions_are_the_ones_installed():
    """A version bump is one line in package.json; the installed CLIs must be the pinned ones."""
    pinned = json.loads((ROOT / "tests" / "agents" / "package.json").read_text())["dependencies"]
    if not BIN.exists():
        pytest.fail(f"the agents' CLIs are not installed in {BIN.parent}: run `make agents` (make test does)")
    env = {**os.environ, "HOME": str(ROOT / ".local")}
    claude_version = subprocess.run(
        [str(BIN / "claude"), "--version"], capture_output=True, text=True, env=env, timeout=60
    ).stdout
    codex_version = subprocess.run(
        [str(BIN / "codex"), "--version"], capture_output=True, text=True, env=env, timeout=60
    ).stdout
    assert pinned["@anthropic-ai/claude-code"] in claude_version
    assert pinned["@openai/codex"] in codex_version
    assert shutil.which("node") or shutil.which("nodejs")
