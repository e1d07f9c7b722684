"""`python -m simulator`: serve a model folder with vLLM's command-line flags and interfaces."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import mmap
import os
import signal
import sys

import aiohttp
from aiohttp import web

from serving import model_length

from .engine import Engine, Timing
from .events import KVEventPublisher
from .kv_cache import BlockPool, CpuTier
from .metrics import EngineMetrics
from .server import ServedModel, SideChannel, SimulatorApp, remote_puller
from .tokenizer import ModelTokenizer

log = logging.getLogger("simulator")

# vLLM flags that change nothing in a simulation; accepted so one command line serves either engine.
IGNORED_VALUE_FLAGS = [
    "--load-format",
    "--dtype",
    "--gpu-memory-utilization",
    "--tensor-parallel-size",
    "--data-parallel-size",
    "--pipeline-parallel-size",
    "--revision",
    "--kv-cache-dtype",
    "--speculative-config",
    "--prefix-caching-hash-algo",
    "--swap-space",
    "--max-num-batched-tokens",
    "--kv-offloading-backend",
    "--tool-strict-level",
    "--tool-parser-plugin",
]
IGNORED_SWITCHES = [
    "--enforce-eager",
    "--enable-expert-parallel",
    "--disable-log-requests",
    "--trust-remote-code",
    "--enable-chunked-prefill",
    "--disable-log-stats",
]


# A CPU-tier load costs this fraction of recomputing the same tokens unless --cpu-restore-time-per-token says.
CPU_RESTORE_FRACTION = 0.1


def json_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simulator", description=__doc__)
    p.add_argument("--model", required=True, help="model folder (config and tokenizer)")
    p.add_argument("--tokenizer", help="tokenizer folder; defaults to --model")
    p.add_argument("--served-model-name", nargs="+", help="names clients use; defaults to --model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="defaults to the length derived from the model's config",
    )
    p.add_argument("--hf-overrides", type=json_arg, default={}, help="changes to the model's config.json")
    p.add_argument(
        "--disable-sliding-window", action="store_true", help="cap the length at the sliding window"
    )
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-prompt-tokens-details", action="store_true")
    p.add_argument("--kv-events-config", type=json_arg)
    p.add_argument("--kv-transfer-config", type=json_arg)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV cache capacity in blocks")
    p.add_argument(
        "--enable-auto-tool-choice", action="store_true", help="call tools (needs --tool-call-parser)"
    )
    p.add_argument("--tool-call-parser", help="vLLM's tool-call parser for the model (hermes, ...)")
    p.add_argument("--reasoning-parser", help="vLLM's reasoning parser for the model")
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="leave the tools out of the prompt when tool_choice is none",
    )
    p.add_argument("--chat-template", help="a chat template, or the path of a file that holds one")
    sim = p.add_argument_group("simulator")
    sim.add_argument(
        "--kv-cache-blocks", type=int, default=4096, help="KV capacity in blocks if not overridden"
    )
    sim.add_argument(
        "--prefill-time-per-token", type=float, default=0.0, help="seconds per uncached prompt token"
    )
    sim.add_argument("--prefill-overhead", type=float, default=0.0, help="seconds per prefill")
    sim.add_argument(
        "--decode-time", type=float, default=0.0, help="seconds per output token, one sequence running"
    )
    sim.add_argument(
        "--answer-length",
        type=int,
        default=None,
        help="end a sampled answer with the end-of-sequence token after this many tokens (a model that stops "
        "by itself); unset: it runs to max_tokens",
    )
    sim.add_argument(
        "--tool-calls-per-conversation",
        type=int,
        default=None,
        help='with tool_choice "auto", answer a conversation already holding this many tool calls in text; '
        "unset: a user turn always gets a call of the first tool",
    )
    sim.add_argument(
        "--decode-time-per-seq",
        type=float,
        default=0.0,
        help="extra seconds per output token for every other running sequence",
    )
    p.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB of CPU memory for offloaded KV blocks (vLLM's native OffloadingConnector)",
    )
    sim.add_argument(
        "--cpu-offload-blocks",
        type=int,
        default=None,
        help="CPU tier capacity in blocks; defaults to the offloading connector's cpu_bytes_to_use "
        "(or --kv-offloading-size) divided by the model's KV bytes per block",
    )
    sim.add_argument(
        "--cpu-restore-time-per-token",
        type=float,
        default=None,
        help="seconds per prompt token loaded back from the CPU tier; "
        f"defaults to {CPU_RESTORE_FRACTION} of --prefill-time-per-token",
    )
    sim.add_argument(
        "--kv-transfer-time-per-token",
        type=float,
        default=0.0,
        help="seconds per token pulled from a prefill engine",
    )
    p.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="keys /v1 (and vLLM's other guarded paths) require as a Bearer token; else VLLM_API_KEY, as vLLM",
    )
    for flag in IGNORED_VALUE_FLAGS:
        p.add_argument(flag, help=argparse.SUPPRESS)
    for flag in IGNORED_SWITCHES:
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    return p


def check_args(args) -> None:
    """The start-up checks vLLM makes of these flags, failing as it fails (its error's last line, status 1)."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("TypeError: Error: --enable-auto-tool-choice requires --tool-call-parser")
    if not (args.enable_auto_tool_choice or args.reasoning_parser):
        return
    # vLLM 0.32's parser registries, as the platform lists them.
    from serving.model_families import REASONING_PARSERS, TOOL_CALL_PARSERS  # noqa: PLC0415

    if args.enable_auto_tool_choice and args.tool_call_parser not in TOOL_CALL_PARSERS:
        raise SystemExit(
            f"KeyError: 'invalid tool call parser: {args.tool_call_parser} "
            f"(chose from {{ {','.join(TOOL_CALL_PARSERS)} }})'"
        )
    if args.reasoning_parser and args.reasoning_parser not in REASONING_PARSERS:
        raise SystemExit(
            f"KeyError: 'invalid reasoning parser: {args.reasoning_parser} "
            f"(chose from {{ {','.join(REASONING_PARSERS)} }})'"
        )


def load_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: the file at that path, else the value itself when it looks like a
    template (it holds `{`, `}` or a newline); anything else is a path that does not exist."""
    if value is None:
        return None
    try:
        with open(value) as fh:
            return fh.read()
    except OSError as exc:
        if not any(c in value for c in "{}\n"):
            raise SystemExit(
                f"ValueError: The supplied chat template string ({value}) appears path-like, but doesn't exist! "
                f"({exc})"
            ) from exc
        return value


def model_config(args) -> dict:
    """The model's config.json with --hf-overrides applied; empty when there is none."""
    config = model_length.read_json(os.path.join(args.model, "config.json")) or {}
    return model_length.apply_overrides(config, args.hf_overrides or {})


def derived_length(args) -> model_length.ModelLength | None:
    """The length vLLM derives from the model's config and its tokenizer's."""
    tokenizer_config = model_length.read_json(
        os.path.join(args.tokenizer or args.model, "tokenizer_config.json")
    )
    return model_length.derive(
        model_config(args), tokenizer_config, disable_sliding_window=args.disable_sliding_window
    )


def check_max_model_len(args) -> None:
    """Refuse a --max-model-len above what the model allows as vLLM does: in its model config's pydantic
    validation error, unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set (then it warns and goes on)."""
    if not args.max_model_len:
        return
    refusal = model_length.vllm_refusal(args.max_model_len, derived_length(args))
    if refusal is None:
        return
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true"):
        log.warning("%s %s", refusal.partition(" To allow")[0], model_length.VLLM_WARNING)
        return
    # vLLM's model config is a pydantic dataclass: the ValueError reaches the log as its validation error.
    detail = f"{refusal} [type=value_error, input_value=ArgsKwargs((), {{'model': {args.model!r}, ...}})"
    raise SystemExit(
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        f"  Value error, {detail}, input_type=ArgsKwargs]"
    )


def kv_bytes_per_block(config: dict, block_size: int) -> int:
    """Bytes of K and V for one block of all layers, as vLLM sizes a full-attention page (16-bit dtype)."""
    heads = int(config.get("num_attention_heads", 32))
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 4096)) // heads)
    layers = int(config.get("num_hidden_layers", 32))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    dtype_bytes = 4 if dtype in ("float32", "float") else 2
    return 2 * layers * kv_heads * head_dim * dtype_bytes * block_size


def offloading_bytes(args) -> int | None:
    """CPU bytes for offloaded KV from the command line: vLLM's OffloadingConnector (alone or as a
    MultiConnector child) `cpu_bytes_to_use`, else --kv-offloading-size GiB."""
    transfer = args.kv_transfer_config or {}
    connectors = [transfer]
    if transfer.get("kv_connector") == "MultiConnector":
        connectors = (transfer.get("kv_connector_extra_config") or {}).get("connectors") or []
    for connector in connectors:
        if connector.get("kv_connector") == "OffloadingConnector":
            value = (connector.get("kv_connector_extra_config") or {}).get("cpu_bytes_to_use")
            if not value:
                raise SystemExit(
                    "OffloadingConnector: cpu_bytes_to_use must be specified in kv_connector_extra_config"
                )
            return int(value)
    if args.kv_offloading_size:
        return int(args.kv_offloading_size * (1 << 30))
    return None


def cpu_offload_blocks(args) -> int:
    """The CPU tier's capacity in blocks, 0 without one."""
    if args.cpu_offload_blocks is not None:
        return max(0, args.cpu_offload_blocks)
    size = offloading_bytes(args)
    if not size:
        return 0
    per_block = kv_bytes_per_block(model_config(args), args.block_size)
    page = mmap.PAGESIZE  # vLLM aligns each offloaded chunk to the page size
    return size // (-(-per_block // page) * page)


def max_model_len(args) -> int:
    """--max-model-len, else the length derived from the model's config (4096 when it names none)."""
    if args.max_model_len:
        return args.max_model_len
    length = derived_length(args)
    return int(length.derived) if length else 4096


async def serve(args) -> None:
    names = args.served_model_name or [args.model]
    metrics = EngineMetrics(model_name=names[0])
    publisher = None
    events_config = None
    if args.kv_events_config and args.kv_events_config.get("enable_kv_cache_events"):
        events_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": None,
            "buffer_steps": 10_000,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": "",
            **args.kv_events_config,
        }
        publisher = KVEventPublisher(
            events_config["endpoint"],
            events_config["topic"],
            events_config.get("replay_endpoint"),
            events_config["buffer_steps"],
            events_config["hwm"],
        )
        events_config["endpoint"] = publisher.endpoint
        publisher.start()
    cpu_blocks = cpu_offload_blocks(args)
    cpu = None
    if cpu_blocks:
        cpu = CpuTier(
            cpu_blocks,
            args.block_size,
            on_stored=publisher.block_stored if publisher else None,
            on_removed=publisher.block_removed if publisher else None,
        )
        log.info("CPU offload tier of %d blocks", cpu_blocks)
    pool = BlockPool(
        args.num_gpu_blocks_override or args.kv_cache_blocks,
        args.block_size,
        on_stored=publisher.block_stored if publisher else None,
        on_removed=publisher.block_removed if publisher else None,
        on_cleared=publisher.all_cleared if publisher else None,
        cpu=cpu,
    )
    session: aiohttp.ClientSession | None = None

    def client() -> aiohttp.ClientSession:
        nonlocal session
        if session is None:
            session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return session

    transfer = args.kv_transfer_config or {}
    side_channel = None
    if transfer.get("kv_connector") in ("NixlConnector", "MultiConnector"):
        side_channel = (
            os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1"),
            int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")),
        )
    tokenizer = ModelTokenizer(args.tokenizer or args.model, chat_template=args.chat_template_text)
    engine = Engine(
        pool=pool,
        metrics=metrics,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
        timing=Timing(
            args.prefill_time_per_token,
            args.prefill_overhead,
            args.decode_time,
            args.decode_time_per_seq,
            args.kv_transfer_time_per_token,
            args.cpu_restore_time_per_token
            if args.cpu_restore_time_per_token is not None
            else CPU_RESTORE_FRACTION * args.prefill_time_per_token,
        ),
        output_pool=tokenizer.output_pool,
        seed=args.seed,
        engine_id=transfer.get("engine_id"),
        side_channel=side_channel,
        pull=remote_puller(client) if side_channel else None,
        held_request_timeout=float(os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "480")),
        answer_length=args.answer_length,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = ServedModel(
        names=names,
        root=args.model,
        max_model_len=max_model_len(args),
        prompt_tokens_details=args.enable_prompt_tokens_details,
        kv_events_config=events_config,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=args.reasoning_parser,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        tool_calls_per_conversation=args.tool_calls_per_conversation,
    )
    runner = web.AppRunner(
        SimulatorApp(engine, tokenizer, model, api_keys=args.api_key).app(),
        handler_cancellation=True,
        access_log=None,
    )
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port, backlog=4096).start()
    if side_channel:
        side_runner = web.AppRunner(SideChannel(engine).app(), access_log=None)
        await side_runner.setup()
        await web.TCPSite(side_runner, side_channel[0], side_channel[1]).start()
    log.info("simulator serving %s on http://%s:%d", ", ".join(names), args.host, args.port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    if session:
        await session.close()
    if publisher:
        publisher.close()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    check_args(args)
    check_max_model_len(args)
    args.chat_template_text = load_chat_template(args.chat_template)
    try:
        import uvloop  # noqa: PLC0415  (faster event loop when installed)

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
