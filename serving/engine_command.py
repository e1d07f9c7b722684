"""The exact command line and environment of one engine, from a deployment, a pool and the ports chosen.

vLLM and the simulator take the same flags, so the only difference between the two engine kinds is the
program that runs them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

from .models import EngineKind, KvConnector, ModelDeployment, Pool, PoolRole

ENGINE_HOST = "127.0.0.1"

KV_ROLES = {
    PoolRole.PREFILL: "kv_producer",
    PoolRole.DECODE: "kv_consumer",
    PoolRole.BOTH: "kv_both",
}


class UnsupportedEngineOption(ValueError):
    """The pool asks for something this renderer cannot express correctly yet."""


@dataclass(frozen=True)
class EnginePorts:
    http: int
    kv_events: int | None = None
    side_channel: int | None = None


@dataclass(frozen=True)
class EngineCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def config_hash(self) -> str:
        """Changes whenever the engine would have to be restarted to take a new configuration."""
        payload = json.dumps({"argv": self.argv, "env": self.env}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()

    def shell(self) -> str:
        import shlex

        env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)}".strip()


def _local_path(value: str) -> str:
    """A relative model path that exists under BASE_DIR becomes absolute; a hub id is left alone."""
    path = Path(value)
    if path.is_absolute():
        return value
    candidate = Path(settings.BASE_DIR) / path
    return str(candidate) if candidate.exists() else value


def _program(deployment: ModelDeployment) -> list[str]:
    if deployment.engine_kind == EngineKind.SIM:
        return [sys.executable, "-m", "serving.simulator"]
    return [str(settings.ENGINE_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]


def _check_supported(pool: Pool) -> None:
    if pool.kv_connector in (KvConnector.OFFLOADING, KvConnector.MULTI):
        raise UnsupportedEngineOption(
            f"pool {pool.name}: the {pool.kv_connector} (CPU offload) is not rendered for engines yet"
        )
    if pool.speculative_method:
        raise UnsupportedEngineOption(
            f"pool {pool.name}: speculative decoding ({pool.speculative_method}) is not rendered for engines yet"
        )


def render_engine_command(*, deployment: ModelDeployment, pool: Pool, ports: EnginePorts) -> EngineCommand:
    """The command and environment for one replica of `pool` listening on `ports`."""
    _check_supported(pool)
    if pool.enable_kv_events and ports.kv_events is None:
        raise ValueError("a pool with KV events needs a KV events port")
    nixl = pool.kv_connector == KvConnector.NIXL
    if nixl and ports.side_channel is None:
        raise ValueError("a pool with the NIXL connector needs a side channel port")

    model = _local_path(deployment.model_source)
    argv = [
        *_program(deployment),
        "--model",
        model,
        "--served-model-name",
        deployment.served_model_name,
        "--host",
        ENGINE_HOST,
        "--port",
        str(ports.http),
        "--max-model-len",
        str(deployment.max_model_len),
        "--block-size",
        str(deployment.block_size),
        "--max-num-seqs",
        str(pool.max_num_seqs),
        "--enable-prefix-caching" if pool.enable_prefix_caching else "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]
    if deployment.tokenizer:
        argv += ["--tokenizer", _local_path(deployment.tokenizer)]
    if deployment.revision:
        argv += ["--revision", deployment.revision]
    if settings.LOCAL_ENGINE_LOAD_FORMAT:
        argv += ["--load-format", settings.LOCAL_ENGINE_LOAD_FORMAT]
    if pool.enable_kv_events:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{ports.kv_events}",
            "topic": f"kv@{ENGINE_HOST}:{ports.http}@{deployment.served_model_name}",
        }
        argv += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    if nixl:
        transfer = {
            "kv_connector": KvConnector.NIXL.value,
            "kv_role": KV_ROLES[PoolRole(pool.role)],
            "kv_buffer_device": "cpu",
        }
        argv += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    if pool.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(pool.tensor_parallel_size)]
    if pool.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(pool.data_parallel_size)]
    if pool.enable_expert_parallel:
        argv.append("--enable-expert-parallel")
    argv += [str(arg) for arg in pool.extra_engine_args or []]

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0"}
    if nixl:
        env |= {
            "UCX_NET_DEVICES": "lo",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": ENGINE_HOST,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports.side_channel),
        }
    return EngineCommand(argv=argv, env=env)
