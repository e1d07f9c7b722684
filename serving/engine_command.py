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

from .model_families import model_folder
from .model_length import max_model_len_problem
from .models import EngineKind, KvConnector, ModelDeployment, Pool, PoolRole, SpeculativeMethod

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
        return [sys.executable, "-m", "simulator"]
    return [str(settings.ENGINE_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]


# ngram proposer settings rendered explicitly: vLLM 0.32's own defaults when neither is given
# (config/speculative.py), spelled out so the command says what runs.
NGRAM_PROMPT_LOOKUP_MAX = 5
NGRAM_PROMPT_LOOKUP_MIN = 5


def _check_supported(pool: Pool) -> None:
    offloading = pool.kv_connector in (KvConnector.OFFLOADING, KvConnector.MULTI)
    if offloading and not pool.cpu_offload_bytes:
        raise UnsupportedEngineOption(
            f"pool {pool.name}: the {pool.kv_connector} needs cpu_offload_bytes > 0 "
            "(vLLM's CPU offloading spec refuses to start without cpu_bytes_to_use)"
        )
    if pool.speculative_method == SpeculativeMethod.EAGLE:
        raise UnsupportedEngineOption(
            f"pool {pool.name}: EAGLE speculative decoding needs a draft model, which a pool cannot name yet; "
            'put a full --speculative-config (with "model") in the pool\'s extra engine args instead'
        )
    if pool.speculative_method and not pool.num_speculative_tokens:
        raise UnsupportedEngineOption(
            f"pool {pool.name}: speculative decoding ({pool.speculative_method}) needs num_speculative_tokens"
        )


def _offloading_connector(pool: Pool, kv_role: str) -> dict:
    """vLLM's OffloadingConnector with its default CPUOffloadingSpec (v1/kv_offload/cpu/spec.py).

    With KV events on, `self_describing_kv_events` makes its CPU BlockStored events carry token ids, parent
    hash and block size (offloading/events.py); without it they are placeholders (no tokens, block_size 0)
    that a prefix index keyed by token ids cannot use.
    """
    extra: dict = {"cpu_bytes_to_use": int(pool.cpu_offload_bytes)}
    if pool.enable_kv_events:
        extra["self_describing_kv_events"] = True
    return {
        "kv_connector": KvConnector.OFFLOADING.value,
        "kv_role": kv_role,
        "kv_connector_extra_config": extra,
    }


def _nixl_connector(kv_role: str) -> dict:
    """NIXL, with a failed pull recomputed: vLLM's default ("fail") ends the client's request with an error when
    its KV cannot be read from the prefill engine (a handshake past its 5 s limit, a peer gone); recomputing costs
    the decode engine that prefill and nothing else."""
    return {
        "kv_connector": KvConnector.NIXL.value,
        "kv_role": kv_role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
    }


def kv_transfer_config(pool: Pool) -> dict | None:
    """The --kv-transfer-config of a pool, or None without a connector.

    MultiConnector (distributed/kv_transfer/kv_connector/v1/multi_connector.py) takes its children as full
    KVTransferConfig dicts under kv_connector_extra_config.connectors; each child needs its own kv_role.
    It loads from the first child that has the tokens, so NIXL (a remote prefill) comes before the CPU tier.
    """
    kv_role = KV_ROLES[PoolRole(pool.role)]
    if pool.kv_connector == KvConnector.NIXL:
        return _nixl_connector(kv_role)
    if pool.kv_connector == KvConnector.OFFLOADING:
        return _offloading_connector(pool, kv_role)
    if pool.kv_connector == KvConnector.MULTI:
        return {
            "kv_connector": KvConnector.MULTI.value,
            "kv_role": kv_role,
            "kv_connector_extra_config": {
                "connectors": [_nixl_connector(kv_role), _offloading_connector(pool, kv_role)]
            },
        }
    return None


def speculative_config(pool: Pool) -> dict | None:
    """The --speculative-config of a pool (vLLM's SpeculativeConfig keys), or None."""
    if not pool.speculative_method:
        return None
    config: dict = {"method": pool.speculative_method, "num_speculative_tokens": pool.num_speculative_tokens}
    if pool.speculative_method == SpeculativeMethod.NGRAM:
        config |= {"prompt_lookup_max": NGRAM_PROMPT_LOOKUP_MAX, "prompt_lookup_min": NGRAM_PROMPT_LOOKUP_MIN}
    return config


def chat_format_args(deployment: ModelDeployment) -> list[str]:
    """Tool calling, reasoning and chat template flags: the deployment's own settings, else its family's."""
    tools = deployment.tool_calling()
    argv: list[str] = []
    if tools.tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", tools.tool_call_parser]
    if tools.reasoning_parser:
        argv += ["--reasoning-parser", tools.reasoning_parser]
    if deployment.chat_template:
        # The template itself: vLLM takes a value with `{`, `}` or a newline in it as the template, not a path.
        argv += ["--chat-template", deployment.chat_template]
    return argv


# What in a model's config.json says it has an image, audio or video encoder (as the router reads it too).
MEDIA_CONFIG_KEYS = ("vision_config", "audio_config", "vision_tower", "mm_projector_type")
# vLLM takes an empty --allowed-media-domains for "any domain" (multimodal/media/connector.py), so "none" is a
# name under .invalid, which no resolver answers (RFC 6761): the engine refuses every other host before fetching.
NO_MEDIA_DOMAIN = "none.invalid"


def takes_media(deployment: ModelDeployment) -> bool:
    """Whether the deployment's engines may be sent images, audio or video, and so asked to fetch media URLs.

    Read from the model's folder where it is here (an encoder in config.json, or a preprocessor config); a model
    named by hub id alone cannot be ruled out, so it counts as taking media."""
    folder = model_folder(deployment.model_source)
    if folder is None:
        return True
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return True
    if not isinstance(config, dict) or any(key in config for key in MEDIA_CONFIG_KEYS):
        return True
    folders = [folder, model_folder(deployment.tokenizer) if deployment.tokenizer else None]
    return any(f is not None and (f / "preprocessor_config.json").exists() for f in folders)


def media_args(deployment: ModelDeployment) -> list[str]:
    """vLLM's media URL allow-list for a model that takes media (settings.ENGINE_ALLOWED_MEDIA_DOMAINS; none by
    default, so media arrives inline as data: URLs). The simulator fetches no URLs and takes no such flag."""
    if deployment.engine_kind == EngineKind.SIM or not takes_media(deployment):
        return []
    domains = [domain.lower() for domain in settings.ENGINE_ALLOWED_MEDIA_DOMAINS] or [NO_MEDIA_DOMAIN]
    return ["--allowed-media-domains", *domains]


# vLLM's logits processors that end answers and call tools on dummy weights, as the simulator's model does (the
# modules run in the engine's own environment).
ANSWER_LENGTH_PROCESSOR = "serving.engine_plugins.answer_length:AnswerLength"
TOOL_CALLS_PROCESSOR = "serving.engine_plugins.tool_calls:ToolCalls"
# The tool-call format the tool-calling processor writes.
SCRIPTED_TOOL_PARSER = "hermes"


def simulated_model_args() -> list[str]:
    """What the simulator's model does that real weights decide: how long its answers are, how many tool calls
    it makes in one conversation (settings.DUMMY_ANSWER_LENGTH, SIMULATOR_TOOL_CALLS_PER_CONVERSATION)."""
    argv = []
    if settings.DUMMY_ANSWER_LENGTH:
        argv += ["--answer-length", str(settings.DUMMY_ANSWER_LENGTH)]
    if settings.SIMULATOR_TOOL_CALLS_PER_CONVERSATION:
        argv += ["--tool-calls-per-conversation", str(settings.SIMULATOR_TOOL_CALLS_PER_CONVERSATION)]
    return argv


def dummy_model_processors(argv: list[str]) -> list[str]:
    """The logits processors a vLLM engine on random weights runs: answers that end, and, with the tool-call
    parser whose format they write, tool calls (settings.SIMULATOR_TOOL_CALLS_PER_CONVERSATION per conversation)."""
    processors = [ANSWER_LENGTH_PROCESSOR]
    parser = argv[argv.index("--tool-call-parser") + 1] if "--tool-call-parser" in argv else None
    if parser == SCRIPTED_TOOL_PARSER and settings.SIMULATOR_TOOL_CALLS_PER_CONVERSATION:
        processors.append(TOOL_CALLS_PROCESSOR)
    return processors


def _check_model_length(deployment: ModelDeployment, pool: Pool) -> None:
    """An engine that would refuse its max_model_len is reported, not started again and again: for a
    deployment saved before the model's config could be read (a hub model the first engine then fetched)."""
    problem = max_model_len_problem(
        model_source=deployment.model_source,
        tokenizer=deployment.tokenizer,
        revision=deployment.revision,
        max_model_len=deployment.max_model_len,
        pools=[pool],
    )
    if problem:
        raise UnsupportedEngineOption(problem)


def render_engine_command(*, deployment: ModelDeployment, pool: Pool, ports: EnginePorts) -> EngineCommand:
    """The command and environment for one replica of `pool` listening on `ports`."""
    _check_supported(pool)
    _check_model_length(deployment, pool)
    if pool.enable_kv_events and ports.kv_events is None:
        raise ValueError("a pool with KV events needs a KV events port")
    nixl = pool.kv_connector in (KvConnector.NIXL, KvConnector.MULTI)
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
    argv += chat_format_args(deployment)
    media = media_args(deployment)
    argv += media
    # vLLM refuses custom logits processors beside speculative decoding: such a pool's answers run to max_tokens.
    speculative = speculative_config(pool) is not None or "--speculative-config" in (
        pool.extra_engine_args or []
    )
    dummy_answers = (
        deployment.engine_kind != EngineKind.SIM
        and settings.LOCAL_ENGINE_LOAD_FORMAT == "dummy"
        and settings.DUMMY_ANSWER_LENGTH
        and not speculative
    )
    if deployment.engine_kind == EngineKind.SIM:
        argv += simulated_model_args()
    elif dummy_answers:
        # Random weights never stop nor call a tool: vLLM plays a model that does both, as the simulator does.
        argv += ["--logits-processors", *dummy_model_processors(argv)]
    if pool.enable_kv_events:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{ports.kv_events}",
            "topic": f"kv@{ENGINE_HOST}:{ports.http}@{deployment.served_model_name}",
        }
        argv += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    transfer = kv_transfer_config(pool)
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    speculative = speculative_config(pool)
    if speculative is not None:
        argv += ["--speculative-config", json.dumps(speculative, separators=(",", ":"))]
    if pool.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(pool.tensor_parallel_size)]
    if pool.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(pool.data_parallel_size)]
    if pool.enable_expert_parallel:
        argv.append("--enable-expert-parallel")
    if settings.ENGINE_TRACES_ENDPOINT and deployment.engine_kind != EngineKind.SIM:
        # vLLM exports its request spans there, under the traceparent the router sends (routing/server/tracing.py).
        argv += ["--otlp-traces-endpoint", settings.ENGINE_TRACES_ENDPOINT]
    argv += [str(arg) for arg in pool.extra_engine_args or []]

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0"}
    if dummy_answers:
        env |= {
            "PYTHONPATH": str(settings.BASE_DIR),
            "PLATFORM_ANSWER_LENGTH": str(settings.DUMMY_ANSWER_LENGTH),
            "PLATFORM_TOOL_CALLS_PER_CONVERSATION": str(settings.SIMULATOR_TOOL_CALLS_PER_CONVERSATION),
        }
    if media:
        # vLLM checks the domain of the URL it is given, not of where a redirect leads.
        env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] = "0"
    if nixl:
        env |= {
            "UCX_NET_DEVICES": "lo",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": ENGINE_HOST,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports.side_channel),
        }
    return EngineCommand(argv=argv, env=env)
