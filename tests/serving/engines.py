"""Start real engine processes for tests: the simulator, or vLLM (CPU build) from the engine environment."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq

from inference_platform.ports import free_port
from tests import costs

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "tiny-qwen"
MODEL_NAME = "tiny-qwen"
ENGINE_PYTHON = Path(os.environ.get("ENGINE_PYTHON", ROOT / ".venv-engine" / "bin" / "python"))
LOG_DIR = ROOT / ".local" / "test-engines"
# The params of a fixture or test run once on each engine: the vLLM half declares its tier.
BOTH_ENGINES = ["sim", pytest.param("vllm", marks=pytest.mark.vllm)]


_vllm_cores = itertools.cycle(sorted(os.sched_getaffinity(0)))

# Tool calling as the platform configures it for this model's family (Hermes-style tool calls): every test
# engine has it unless started with tool_parser=False.
TOOL_PARSER_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


@dataclass
class RunningEngine:
    kind: str
    url: str
    events_endpoint: str | None
    process: subprocess.Popen
    log_path: Path
    side_channel_port: int | None = None
    extra: dict = field(default_factory=dict)

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """The engine's /metrics, summed per metric name over label sets (without _created series)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            if name.endswith("_created"):
                continue
            values[name] = values.get(name, 0.0) + float(value)
        return values

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """Stop the engine and every process it started (vLLM's engine core, NIXL's threads' helpers).

        The engine runs in a session of its own, so its whole process group is signalled: a child left
        behind would keep its ports, its memory and a busy-polling core, and stall the next test."""
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._signal_group(signal.SIGKILL)  # whatever the main process left behind

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def engine_flags(
    port: int, events_port: int | None, *, nixl_role: str | None = None, tool_parser: bool = True
) -> list[str]:
    flags = [
        "--model",
        str(MODEL_DIR),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "4096",
        "--block-size",
        "128",
        "--seed",
        "0",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--load-format",
        "dummy",
    ]
    if tool_parser:
        flags += TOOL_PARSER_FLAGS
    if events_port is not None:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}",
            "topic": f"kv@127.0.0.1:{port}@{MODEL_NAME}",
        }
        flags += ["--kv-events-config", json.dumps(config)]
    if nixl_role is not None:
        transfer = {
            "kv_connector": "NixlConnector",
            "kv_role": nixl_role,
            "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "recompute",  # as the platform renders it
        }
        flags += ["--kv-transfer-config", json.dumps(transfer)]
    return flags


def start_engine(
    kind: str,
    *extra: str,
    events: bool = True,
    nixl_role: str | None = None,
    timeout: float = 400,
    tool_parser: bool = True,
) -> RunningEngine:
    """Start an engine on fresh ports; again on others (up to three tries) when some other process took one
    of them between the choice and the engine's bind."""
    (engine,) = start_engines(
        kind, [nixl_role], *extra, events=events, timeout=timeout, tool_parser=tool_parser
    )
    return engine


def start_engines(
    kind: str,
    nixl_roles: list[str | None],
    *extra: str,
    events: bool = True,
    timeout: float = 600,
    tool_parser: bool = True,
) -> list[RunningEngine]:
    """Start one engine per entry of `nixl_roles` side by side (vLLM takes a minute to come up) and wait for
    all of them; one that lost a port to another process between the choice and its bind is started again on
    others (up to three tries each). On any other failure every engine started here is stopped."""
    started = time.monotonic()
    engines = [
        _launch(kind, extra, events=events, nixl_role=role, tool_parser=tool_parser) for role in nixl_roles
    ]
    try:
        for index, role in enumerate(nixl_roles):
            for attempt in range(3):
                try:
                    wait_healthy(engines[index], timeout)
                    break
                except RuntimeError as exc:
                    engines[index].stop()
                    if "address already in use" not in str(exc).lower() or attempt == 2:
                        raise
                    engines[index] = _launch(
                        kind, extra, events=events, nixl_role=role, tool_parser=tool_parser
                    )
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    for _ in engines:  # side by side: each is charged the wait for all
        costs.record("vLLM engine" if kind == "vllm" else "simulator", time.monotonic() - started)
    return engines


def _launch(
    kind: str, extra: tuple[str, ...], *, events: bool, nixl_role: str | None, tool_parser: bool = True
) -> RunningEngine:
    port = free_port()
    events_port = free_port() if events else None
    side_channel_port = free_port() if nixl_role else None
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if kind == "vllm":
        # One core per vLLM engine, in turn: engines whose OpenMP threads all spin on every core starve each
        # other (and NIXL's side channel, whose handshake times out after 5 s).
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(next(_vllm_cores))
        # The platform's engine plugins (serving/engine_plugins/) import from the repository, as the local
        # orchestrator's engines do.
        env["PYTHONPATH"] = str(ROOT)
    if nixl_role:
        env.update(
            {
                "UCX_NET_DEVICES": "lo",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            }
        )
    if kind == "sim":
        argv = [sys.executable, "-m", "simulator"]
    elif kind == "vllm":
        # At a lower priority than the router and the test: a vLLM-CPU engine's threads spin on their core even
        # when idle, and on two cores two engines starved the router past its 2 s connect timeout.
        argv = ["nice", "-n", "10", str(ENGINE_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
    else:
        raise ValueError(kind)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"{kind}-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*argv, *engine_flags(port, events_port, nixl_role=nixl_role, tool_parser=tool_parser), *extra],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return RunningEngine(
        kind,
        f"http://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{events_port}" if events_port else None,
        process,
        log_path,
        side_channel_port,
    )


def wait_healthy(engine: RunningEngine, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.process.poll() is not None:
            raise RuntimeError(
                f"{engine.kind} engine exited with {engine.process.returncode}:\n{engine.log()[-3000:]}"
            )
        if "Address already in use" in engine.log():
            # vLLM's NIXL side channel binds in a thread of its own: the engine lives on, and never serves.
            raise RuntimeError(f"{engine.kind} engine lost a port:\n{engine.log()[-3000:]}")
        try:
            if httpx.get(f"{engine.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    engine.stop()
    raise TimeoutError(f"{engine.kind} engine not healthy after {timeout}s:\n{engine.log()[-3000:]}")


class EventSubscriber:
    """A SUB socket connected to an engine's KV-event endpoint (the engine binds)."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        time.sleep(0.3)  # let the subscription reach the publisher

    def messages(self, timeout: float = 5.0, until=None) -> list[tuple[bytes, int, list]]:
        """Collect (topic, seq, payload) until `until(collected)` is true or the timeout passes."""
        got = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                topic, seq, payload = self.sock.recv_multipart()
                got.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)))
                if until and until(got):
                    break
        return got

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def events_of(messages) -> list[dict]:
    return [event for _, _, payload in messages for event in payload[1]]
