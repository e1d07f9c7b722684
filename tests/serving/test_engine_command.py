"""The engine command line: vLLM's flag names for both engine kinds, and nothing rendered wrongly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from serving.engine_command import (
    ANSWER_LENGTH_PROCESSOR,
    TOOL_CALLS_PROCESSOR,
    EnginePorts,
    UnsupportedEngineOption,
    dummy_model_processors,
    render_engine_command,
)
from serving.model_families import FAMILIES
from serving.models import ModelDeployment, Pool

from .engines import ENGINE_PYTHON

PORTS = EnginePorts(http=8100, kv_events=5557, side_channel=5600)
# A local vLLM engine's environment on dummy weights: the answer-length logits processor is importable.
DUMMY_WEIGHTS_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "PYTHONHASHSEED": "0",
    "PYTHONPATH": str(settings.BASE_DIR),
    "PLATFORM_ANSWER_LENGTH": "317",
    "PLATFORM_TOOL_CALLS_PER_CONVERSATION": "2",
}


def deployment(**fields) -> ModelDeployment:
    defaults = dict(
        name="tiny",
        served_model_name="tiny-qwen",
        model_source="models/tiny-qwen",
        engine_kind="vllm",
        max_model_len=4096,
        block_size=128,
    )
    return ModelDeployment(**{**defaults, **fields})


def pool(**fields) -> Pool:
    return Pool(**{"name": "main", "max_num_seqs": 64, **fields})


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_it_renders_the_vllm_command_line():
    command = render_engine_command(deployment=deployment(), pool=pool(), ports=PORTS)
    model_dir = str(Path(settings.BASE_DIR) / "models" / "tiny-qwen")
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "topic": "kv@127.0.0.1:8100@tiny-qwen",
    }
    assert command.argv == [
        str(settings.ENGINE_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        "tiny-qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "8100",
        "--max-model-len",
        "4096",
        "--block-size",
        "128",
        "--max-num-seqs",
        "64",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--load-format",
        "dummy",
        # tiny-qwen is a qwen2 model: its family's tool-call parser, and no reasoning parser.
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        # On dummy weights its answers end by themselves and it calls tools in the hermes format
        # (serving/engine_plugins/answer_length.py, tool_calls.py).
        "--logits-processors",
        "serving.engine_plugins.answer_length:AnswerLength",
        "serving.engine_plugins.tool_calls:ToolCalls",
        "--kv-events-config",
        json.dumps(events, separators=(",", ":")),
    ]
    assert command.env == DUMMY_WEIGHTS_ENV


def test_speculative_decoding_gets_no_answer_length():
    """vLLM refuses custom logits processors beside speculative decoding."""
    for speculative in (
        pool(speculative_method="ngram", num_speculative_tokens=4),
        pool(extra_engine_args=["--speculative-config", '{"method":"ngram","num_speculative_tokens":4}']),
    ):
        command = render_engine_command(deployment=deployment(), pool=speculative, ports=PORTS)
        assert "--logits-processors" not in command.argv and "PYTHONPATH" not in command.env


def test_real_weights_get_no_answer_length(settings):
    settings.LOCAL_ENGINE_LOAD_FORMAT = ""
    command = render_engine_command(deployment=deployment(), pool=pool(), ports=PORTS)
    assert "--logits-processors" not in command.argv and "PYTHONPATH" not in command.env


def test_it_runs_the_simulator_with_the_same_flags_and_its_model_s_own():
    """vLLM's flags, then what a simulated model does that real weights decide (settings.DUMMY_ANSWER_LENGTH,
    SIMULATOR_TOOL_CALLS_PER_CONVERSATION), where vLLM on dummy weights has its logits processor."""
    vllm = render_engine_command(deployment=deployment(), pool=pool(), ports=PORTS)
    at = vllm.argv.index("--logits-processors")
    del vllm.argv[at : at + 3]
    for name in ("PYTHONPATH", "PLATFORM_ANSWER_LENGTH", "PLATFORM_TOOL_CALLS_PER_CONVERSATION"):
        vllm.env.pop(name)
    sim = render_engine_command(deployment=deployment(engine_kind="sim"), pool=pool(), ports=PORTS)
    assert sim.argv[:3] == [sys.executable, "-m", "simulator"]
    own = ["--answer-length", "317", "--tool-calls-per-conversation", "2"]
    at = sim.argv.index("--answer-length")
    assert sim.argv[at : at + 4] == own
    assert sim.argv[3:at] + sim.argv[at + 4 :] == vllm.argv[3:]
    assert sim.env == vllm.env


def test_the_simulated_model_s_flags_follow_the_settings(settings):
    settings.DUMMY_ANSWER_LENGTH = 0
    settings.SIMULATOR_TOOL_CALLS_PER_CONVERSATION = 5
    sim = render_engine_command(deployment=deployment(engine_kind="sim"), pool=pool(), ports=PORTS)
    assert "--answer-length" not in sim.argv
    assert sim.argv[sim.argv.index("--tool-calls-per-conversation") + 1] == "5"


def test_it_leaves_out_what_is_switched_off(settings):
    settings.LOCAL_ENGINE_LOAD_FORMAT = ""
    argv = render_engine_command(
        deployment=deployment(model_source="Qwen/Qwen3-0.6B"),
        pool=pool(enable_prefix_caching=False, enable_kv_events=False),
        ports=EnginePorts(http=8100),
    ).argv
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    assert "--load-format" not in argv and "--kv-events-config" not in argv
    assert "--kv-transfer-config" not in argv and "--tensor-parallel-size" not in argv
    assert flag(argv, "--model") == "Qwen/Qwen3-0.6B"  # a hub id is not a local path


@pytest.mark.parametrize(
    "role, kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer"), ("both", "kv_both")]
)
def test_it_renders_the_nixl_connector_per_role(role, kv_role):
    command = render_engine_command(
        deployment=deployment(), pool=pool(role=role, kv_connector="NixlConnector"), ports=PORTS
    )
    assert json.loads(flag(command.argv, "--kv-transfer-config")) == {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
    }
    assert command.env == {
        **DUMMY_WEIGHTS_ENV,
        "UCX_NET_DEVICES": "lo",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
    }


def test_it_renders_parallelism_and_extra_args_last():
    argv = render_engine_command(
        deployment=deployment(revision="abc123"),
        pool=pool(tensor_parallel_size=2, extra_engine_args=["--enforce-eager"]),
        ports=PORTS,
    ).argv
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert flag(argv, "--revision") == "abc123"
    assert argv[-1] == "--enforce-eager"


def test_it_renders_the_cpu_offloading_connector():
    command = render_engine_command(
        deployment=deployment(),
        pool=pool(kv_connector="OffloadingConnector", cpu_offload_bytes=1 << 30),
        ports=PORTS,
    )
    assert json.loads(flag(command.argv, "--kv-transfer-config")) == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30, "self_describing_kv_events": True},
    }
    assert command.env == DUMMY_WEIGHTS_ENV  # no NIXL side channel


def test_offload_without_kv_events_leaves_out_self_describing_events():
    argv = render_engine_command(
        deployment=deployment(),
        pool=pool(kv_connector="OffloadingConnector", cpu_offload_bytes=4096, enable_kv_events=False),
        ports=EnginePorts(http=8100),
    ).argv
    extra = json.loads(flag(argv, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra == {"cpu_bytes_to_use": 4096}


@pytest.mark.parametrize("role, kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_it_renders_the_multi_connector_as_nixl_then_cpu_offload(role, kv_role):
    command = render_engine_command(
        deployment=deployment(),
        pool=pool(role=role, kv_connector="MultiConnector", cpu_offload_bytes=2 << 30),
        ports=PORTS,
    )
    assert json.loads(flag(command.argv, "--kv-transfer-config")) == {
        "kv_connector": "MultiConnector",
        "kv_role": kv_role,
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "NixlConnector",
                    "kv_role": kv_role,
                    "kv_buffer_device": "cpu",
                    "kv_load_failure_policy": "recompute",
                },
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": kv_role,
                    "kv_connector_extra_config": {
                        "cpu_bytes_to_use": 2 << 30,
                        "self_describing_kv_events": True,
                    },
                },
            ]
        },
    }
    assert command.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert command.env["UCX_NET_DEVICES"] == "lo"


def test_the_multi_connector_needs_a_side_channel_port():
    with pytest.raises(ValueError, match="side channel"):
        render_engine_command(
            deployment=deployment(),
            pool=pool(kv_connector="MultiConnector", cpu_offload_bytes=1 << 30),
            ports=EnginePorts(http=8100, kv_events=5557),
        )


@pytest.mark.parametrize(
    "method, tokens, expected",
    [
        (
            "ngram",
            4,
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 5},
        ),
        ("mtp", 1, {"method": "mtp", "num_speculative_tokens": 1}),
    ],
)
def test_it_renders_speculative_decoding(method, tokens, expected):
    argv = render_engine_command(
        deployment=deployment(),
        pool=pool(speculative_method=method, num_speculative_tokens=tokens),
        ports=PORTS,
    ).argv
    assert json.loads(flag(argv, "--speculative-config")) == expected
    assert argv.count("--speculative-config") == 1


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kv_connector": "OffloadingConnector"}, "cpu_offload_bytes"),
        ({"kv_connector": "MultiConnector"}, "cpu_offload_bytes"),
        ({"speculative_method": "eagle", "num_speculative_tokens": 3}, "draft model"),
        ({"speculative_method": "ngram"}, "num_speculative_tokens"),
    ],
)
def test_it_refuses_what_it_cannot_render(fields, message):
    with pytest.raises(UnsupportedEngineOption, match=message):
        render_engine_command(deployment=deployment(), pool=pool(**fields), ports=PORTS)


@pytest.mark.parametrize(
    "fields, tool, reasoning",
    [
        ({}, "hermes", None),  # the family default of models/tiny-qwen (qwen2)
        ({"model_source": "Qwen/Qwen3-32B"}, "hermes", "qwen3"),
        ({"model_source": "deepseek-ai/DeepSeek-R1-0528"}, "deepseek_v3", "deepseek_r1"),
        ({"model_source": "openai/gpt-oss-20b"}, "openai", "openai_gptoss"),
        ({"tool_call_parser": "pythonic", "reasoning_parser": "deepseek_r1"}, "pythonic", "deepseek_r1"),
        ({"model_source": "Qwen/Qwen3-32B", "tool_call_parser": "none"}, None, "qwen3"),
        ({"model_source": "Qwen/Qwen3-32B", "reasoning_parser": "none"}, "hermes", None),
        ({"model_source": "org/unknown-model"}, None, None),  # no family: tool calling off
        ({"model_source": "org/unknown-model", "tool_call_parser": "hermes"}, "hermes", None),
    ],
)
def test_it_renders_the_tool_call_and_reasoning_parsers(fields, tool, reasoning):
    argv = render_engine_command(deployment=deployment(**fields), pool=pool(), ports=PORTS).argv
    if tool is None:
        assert "--enable-auto-tool-choice" not in argv and "--tool-call-parser" not in argv
    else:
        assert argv.count("--enable-auto-tool-choice") == 1 and flag(argv, "--tool-call-parser") == tool
    if reasoning is None:
        assert "--reasoning-parser" not in argv
    else:
        assert flag(argv, "--reasoning-parser") == reasoning
    assert "--chat-template" not in argv


CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_it_passes_the_chat_template_itself_as_one_argument():
    argv = render_engine_command(
        deployment=deployment(chat_template=CHAT_TEMPLATE), pool=pool(), ports=PORTS
    ).argv
    assert flag(argv, "--chat-template") == CHAT_TEMPLATE
    assert argv.count("--chat-template") == 1


def test_the_config_hash_follows_the_command():
    one = render_engine_command(deployment=deployment(), pool=pool(), ports=PORTS)
    same = render_engine_command(deployment=deployment(), pool=pool(), ports=PORTS)
    other = render_engine_command(deployment=deployment(), pool=pool(max_num_seqs=8), ports=PORTS)
    assert one.config_hash == same.config_hash != other.config_hash
    # A new parser restarts the engines: they read it at start-up only.
    parser = render_engine_command(deployment=deployment(tool_call_parser="none"), pool=pool(), ports=PORTS)
    assert parser.config_hash != one.config_hash


VLLM_PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager
from vllm.utils.argparse_utils import FlexibleArgumentParser
seen = []
for argv in json.load(sys.stdin):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    if args.tool_call_parser:
        ToolParserManager.get_tool_parser(args.tool_call_parser)
    if args.reasoning_parser:
        ReasoningParserManager.get_reasoning_parser(args.reasoning_parser)
    seen.append([args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser or None, args.chat_template])
print(json.dumps(seen))
"""


@pytest.mark.vllm
@pytest.mark.skipif(not ENGINE_PYTHON.exists(), reason="no engine environment (make test builds it)")
def test_vllms_own_argument_parser_takes_every_familys_flags():
    """vLLM parses and checks the command as its server does, and loads each family's parser classes."""
    cases = [
        deployment(
            tool_call_parser=family.tool_call_parser or "none",
            reasoning_parser=family.reasoning_parser or "none",
        )
        for family in FAMILIES
    ]
    cases += [deployment(), deployment(model_source="org/unknown-model", chat_template=CHAT_TEMPLATE)]
    argvs = [render_engine_command(deployment=case, pool=pool(), ports=PORTS).argv[3:] for case in cases]
    run = subprocess.run(
        [str(ENGINE_PYTHON), "-c", VLLM_PARSE],
        input=json.dumps(argvs),
        cwd=settings.BASE_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    expected = [[bool(f.tool_call_parser), f.tool_call_parser, f.reasoning_parser, None] for f in FAMILIES]
    expected += [[True, "hermes", None, None], [False, None, None, CHAT_TEMPLATE]]
    assert seen == expected


PARSE_AND_SIZE = (
    "import sys; from simulator.__main__ import parser, cpu_offload_blocks; "
    "args = parser().parse_args(sys.argv[1:]); print('parsed', cpu_offload_blocks(args))"
)


@pytest.mark.parametrize(
    "fields, cpu_blocks",
    [
        ({"kv_connector": "NixlConnector", "tensor_parallel_size": 2}, 0),
        # the tiny model holds 2 layers x 2 KV heads x 64 x 2 bytes x (K, V) = 1 KiB per token: 128 KiB a block
        ({"kv_connector": "OffloadingConnector", "cpu_offload_bytes": 64 << 20}, 512),
        ({"kv_connector": "MultiConnector", "cpu_offload_bytes": 1 << 30}, 8192),
        ({"speculative_method": "ngram", "num_speculative_tokens": 4}, 0),
        ({"speculative_method": "mtp", "num_speculative_tokens": 2}, 0),
    ],
)
def test_the_simulator_accepts_every_flag_rendered(fields, cpu_blocks):
    """The full command parses in the simulator's own argument parser, which sizes its CPU tier from it."""
    command = render_engine_command(
        deployment=deployment(
            engine_kind="sim",
            revision="r1",
            tokenizer="models/tiny-qwen",
            reasoning_parser="qwen3",
            chat_template=CHAT_TEMPLATE,
        ),
        pool=pool(extra_engine_args=["--enforce-eager"], **fields),
        ports=PORTS,
    )
    out = subprocess.run(
        [sys.executable, "-c", PARSE_AND_SIZE, *command.argv[3:]],
        cwd=settings.BASE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"parsed {cpu_blocks}"


def test_dummy_weights_call_tools_only_in_the_format_their_processor_writes(settings):
    """The tool-calling processor writes Hermes calls: an engine with another parser, or with the setting at 0,
    gets only the answer length."""
    assert dummy_model_processors(["--tool-call-parser", "hermes"]) == [
        ANSWER_LENGTH_PROCESSOR,
        TOOL_CALLS_PROCESSOR,
    ]
    assert dummy_model_processors(["--tool-call-parser", "llama3_json"]) == [ANSWER_LENGTH_PROCESSOR]
    assert dummy_model_processors([]) == [ANSWER_LENGTH_PROCESSOR]
    settings.SIMULATOR_TOOL_CALLS_PER_CONVERSATION = 0
    assert dummy_model_processors(["--tool-call-parser", "hermes"]) == [ANSWER_LENGTH_PROCESSOR]
