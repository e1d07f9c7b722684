"""Model families: the parsers each family gets from its config.json or its name, and the parser names
checked against the pinned vLLM's own registries."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError

from serving.model_families import (
    FAMILIES,
    OFF,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    match_family,
    tool_calling_for,
    validate_chat_template,
    validate_reasoning_parser,
    validate_tool_call_parser,
)

from .engines import ENGINE_PYTHON

READ_REGISTRIES = (
    "import json; "
    "from vllm.tool_parsers import ToolParserManager; "
    "from vllm.reasoning import ReasoningParserManager; "
    "print(json.dumps([ToolParserManager.list_registered(), ReasoningParserManager.list_registered()]))"
)


@pytest.mark.vllm
@pytest.mark.skipif(not ENGINE_PYTHON.exists(), reason="no engine environment (make test builds it)")
def test_the_parser_names_are_the_pinned_vllms_own():
    run = subprocess.run(
        [str(ENGINE_PYTHON), "-c", READ_REGISTRIES], capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr[-3000:]
    tool_parsers, reasoning_parsers = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(TOOL_CALL_PARSERS) == sorted(tool_parsers)
    assert sorted(REASONING_PARSERS) == sorted(reasoning_parsers)
    assert OFF not in tool_parsers and OFF not in reasoning_parsers  # "none" can only mean off


def test_every_family_names_parsers_vllm_has():
    for family in FAMILIES:
        assert family.tool_call_parser is None or family.tool_call_parser in TOOL_CALL_PARSERS, family
        assert family.reasoning_parser is None or family.reasoning_parser in REASONING_PARSERS, family


def model_dir(tmp_path: Path, name: str, config: dict) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0}

# (folder name, config.json, family, tool-call parser, reasoning parser)
FOLDERS = [
    ("tiny-qwen", {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "qwen2", "hermes", None),
    ("Qwen2.5-7B-Instruct", {"model_type": "qwen2"}, "qwen2", "hermes", None),
    ("Qwen1.5-MoE-A2.7B", {"model_type": "qwen2_moe"}, "qwen2", "hermes", None),
    ("QwQ-32B", {"model_type": "qwen2"}, "qwq", "hermes", "deepseek_r1"),
    ("DeepSeek-R1-Distill-Qwen-7B", {"model_type": "qwen2"}, "deepseek-r1-distill", None, "deepseek_r1"),
    ("Qwen3-8B", {"model_type": "qwen3"}, "qwen3", "hermes", "qwen3"),
    ("qwen3-moe", {"model_type": "qwen3_moe"}, "qwen3", "hermes", "qwen3"),
    ("Qwen3-30B-A3B-Instruct-2507", {"model_type": "qwen3_moe"}, "qwen3-instruct", "hermes", None),
    ("Qwen3-Coder-30B-A3B-Instruct", {"model_type": "qwen3_moe"}, "qwen3-coder", "qwen3_coder", None),
    ("Qwen3-Coder-Next", {"model_type": "qwen3_next"}, "qwen3-coder", "qwen3_coder", None),
    ("Meta-Llama-3.1-8B-Instruct", {"model_type": "llama"}, "llama3", "llama3_json", None),
    ("my-finetune", {"model_type": "llama", "rope_scaling": LLAMA31_ROPE}, "llama3", "llama3_json", None),
    ("DeepSeek-R1-Distill-Llama-8B", {"model_type": "llama", "rope_scaling": LLAMA31_ROPE}, "deepseek-r1-distill", None, "deepseek_r1"),
    ("Llama-4-Scout-17B-16E-Instruct", {"model_type": "llama4"}, "llama4", "llama4_pythonic", None),
    ("maverick", {"architectures": ["Llama4ForConditionalGeneration"]}, "llama4", "llama4_pythonic", None),
    ("Mistral-7B-Instruct-v0.3", {"model_type": "mistral"}, "mistral", "mistral", None),
    ("Mistral-Small-3.2-24B-Instruct-2506", {"model_type": "mistral3"}, "mistral", "mistral", None),
    ("Mixtral-8x7B-Instruct-v0.1", {"model_type": "mixtral"}, "mistral", "mistral", None),
    ("Magistral-Small-2509", {"model_type": "mistral3"}, "magistral", "mistral", "mistral"),
    ("DeepSeek-V3-0324", {"model_type": "deepseek_v3"}, "deepseek-v3", "deepseek_v3", None),
    ("DeepSeek-R1-0528", {"model_type": "deepseek_v3"}, "deepseek-r1", "deepseek_v3", "deepseek_r1"),
    ("DeepSeek-V3.1-Terminus", {"model_type": "deepseek_v3"}, "deepseek-v3.1", "deepseek_v31", "deepseek_v3"),
    ("GLM-4.5-Air", {"model_type": "glm4_moe"}, "glm45", "glm45", "glm45"),
    ("GLM-4.6", {"model_type": "glm4_moe"}, "glm45", "glm45", "glm45"),
    ("GLM-4.7", {"model_type": "glm4_moe"}, "glm47", "glm47", "glm47"),
    ("flash", {"model_type": "glm4_moe_lite"}, "glm47", "glm47", "glm47"),
    ("gpt-oss-20b", {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}, "gpt-oss", "openai", "openai_gptoss"),
    # Kimi-K2 runs DeepSeek-V3's architecture under a model_type of its own.
    ("Kimi-K2-Instruct-0905", {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}, "kimi-k2", "kimi_k2", None),
    ("Kimi-K2-Thinking", {"model_type": "kimi_k2"}, "kimi-k2-thinking", "kimi_k2", "kimi_k2"),
]  # fmt: skip


@pytest.mark.parametrize("name, config, family, tool, reasoning", FOLDERS, ids=[row[0] for row in FOLDERS])
def test_it_finds_the_family_of_a_model_folder_from_its_config(
    tmp_path, name, config, family, tool, reasoning
):
    tools = tool_calling_for(model_source=model_dir(tmp_path, name, config))
    assert (tools.family, tools.tool_call_parser, tools.reasoning_parser) == (family, tool, reasoning)
    assert tools.source == tools.reasoning_source == f"family {family}"
    assert "config.json" in tools.note


def test_the_config_wins_over_a_misleading_folder_name(tmp_path):
    """A folder called after Qwen3 that holds a gpt-oss model is a gpt-oss model."""
    tools = tool_calling_for(model_source=model_dir(tmp_path, "Qwen3-8B", {"model_type": "gpt_oss"}))
    assert (tools.family, tools.tool_call_parser) == ("gpt-oss", "openai")


@pytest.mark.parametrize(
    "config, family, alternatives",
    [
        ({"model_type": "deepseek_v3"}, "deepseek-v3", ("deepseek-v3.1", "deepseek-r1")),
        ({"model_type": "glm4_moe"}, "glm45", ("glm47",)),
        ({"model_type": "kimi_k2"}, "kimi-k2", ("kimi-k2-thinking",)),
        ({"model_type": "qwen3_moe"}, "qwen3", ("qwen3-coder", "qwen3-instruct")),
    ],
)
def test_an_unnamed_folder_gets_the_config_family_and_a_note_on_the_variants(
    tmp_path, config, family, alternatives
):
    source = model_dir(tmp_path, "weights", config)
    match = match_family(source)
    assert match.family.name == family and match.alternatives == alternatives
    tools = tool_calling_for(model_source=source)
    assert all(name in tools.note for name in alternatives)


@pytest.mark.parametrize(
    "config, reason",
    [
        ({"model_type": "gemma3"}, "model_type 'gemma3'"),
        # model_type llama without Llama 3.1's RoPE scaling: Llama 2, or one of the many llama-shaped models.
        ({"model_type": "llama"}, "neither config.json nor the name"),
        ({"architectures": ["SomethingForCausalLM"]}, "architectures"),
    ],
)
def test_a_folder_of_no_known_family_has_tool_calling_off_and_says_why(tmp_path, config, reason):
    source = model_dir(tmp_path, "weights", config)
    tools = tool_calling_for(model_source=source)
    assert (tools.family, tools.tool_call_parser, tools.reasoning_parser) == (None, None, None)
    assert tools.source == tools.reasoning_source == "none"
    assert reason in tools.note and "set tool_call_parser to enable tool calls" in tools.note


@pytest.mark.parametrize(
    "hub_id, family, tool, reasoning",
    [
        ("Qwen/Qwen2.5-Coder-32B-Instruct", "qwen2", "hermes", None),
        ("Qwen/Qwen3-32B", "qwen3", "hermes", "qwen3"),
        ("Qwen/Qwen3-235B-A22B-Thinking-2507", "qwen3", "hermes", "qwen3"),
        ("Qwen/Qwen3-235B-A22B-Instruct-2507", "qwen3-instruct", "hermes", None),
        ("Qwen/Qwen3-Coder-480B-A35B-Instruct", "qwen3-coder", "qwen3_coder", None),
        ("meta-llama/Llama-3.3-70B-Instruct", "llama3", "llama3_json", None),
        ("meta-llama/Llama-4-Maverick-17B-128E-Instruct", "llama4", "llama4_pythonic", None),
        ("mistralai/Devstral-Small-2505", "mistral", "mistral", None),
        ("deepseek-ai/DeepSeek-V3", "deepseek-v3", "deepseek_v3", None),
        ("deepseek-ai/DeepSeek-R1", "deepseek-r1", "deepseek_v3", "deepseek_r1"),
        ("deepseek-ai/DeepSeek-V3.1", "deepseek-v3.1", "deepseek_v31", "deepseek_v3"),
        ("zai-org/GLM-4.5", "glm45", "glm45", "glm45"),
        ("zai-org/GLM-4.7", "glm47", "glm47", "glm47"),
        ("openai/gpt-oss-120b", "gpt-oss", "openai", "openai_gptoss"),
        ("moonshotai/Kimi-K2-Instruct", "kimi-k2", "kimi_k2", None),
        ("moonshotai/Kimi-K2-Thinking", "kimi-k2-thinking", "kimi_k2", "kimi_k2"),
    ],
)
def test_a_hub_id_is_matched_by_its_name(hub_id, family, tool, reasoning):
    tools = tool_calling_for(model_source=hub_id)
    assert (tools.family, tools.tool_call_parser, tools.reasoning_parser) == (family, tool, reasoning)
    assert "name" in tools.note


@pytest.mark.parametrize(
    "hub_id",
    ["google/gemma-3-27b-it", "Qwen/Qwen2.5-VL-7B-Instruct", "deepseek-ai/DeepSeek-V3.2", "org/model"],
)
def test_a_hub_id_of_no_known_family_has_tool_calling_off(hub_id):
    tools = tool_calling_for(model_source=hub_id)
    assert (tools.family, tools.tool_call_parser, tools.source) == (None, None, "none")
    assert "set tool_call_parser" in tools.note


def test_the_deployments_own_settings_win_and_none_switches_each_off():
    explicit = tool_calling_for(
        model_source="org/model", tool_call_parser="pythonic", reasoning_parser="deepseek_r1"
    )
    assert (explicit.tool_call_parser, explicit.source) == ("pythonic", "deployment")
    assert (explicit.reasoning_parser, explicit.reasoning_source) == ("deepseek_r1", "deployment")
    assert "No model family" not in explicit.note  # nothing was left to a family

    off = tool_calling_for(model_source="Qwen/Qwen3-8B", tool_call_parser=OFF)
    assert (off.tool_call_parser, off.source) == (None, "deployment")
    assert (off.reasoning_parser, off.reasoning_source) == ("qwen3", "family qwen3")
    assert 'switched off on this deployment (tool_call_parser "none")' in off.note

    no_reasoning = tool_calling_for(model_source="Qwen/Qwen3-8B", reasoning_parser=OFF)
    assert (no_reasoning.tool_call_parser, no_reasoning.reasoning_parser) == ("hermes", None)


def test_the_demo_model_gets_hermes_from_its_family():
    tools = tool_calling_for(model_source="models/tiny-qwen")
    assert (tools.family, tools.tool_call_parser, tools.source) == ("qwen2", "hermes", "family qwen2")


def test_an_unknown_parser_name_is_refused_with_the_valid_ones_listed():
    for value in ("", OFF, "hermes", "qwen3_coder"):
        validate_tool_call_parser(value)
    with pytest.raises(ValidationError) as refused:
        validate_tool_call_parser("qwen3")  # a reasoning parser, not a tool-call parser
    message = refused.value.messages[0]
    assert '"qwen3" is not a tool-call parser' in message
    assert all(name in message for name in TOOL_CALL_PARSERS)

    for value in ("", OFF, "qwen3", "deepseek_r1"):
        validate_reasoning_parser(value)
    with pytest.raises(ValidationError) as refused:
        validate_reasoning_parser("hermes")
    assert all(name in refused.value.messages[0] for name in REASONING_PARSERS)


def test_a_chat_template_must_be_a_jinja_template_that_parses():
    validate_chat_template("")
    validate_chat_template(
        "{% for m in messages %}{{ m['content'] }}{% if loop.last %}{% break %}{% endif %}{% endfor %}"
    )
    validate_chat_template("{% generation %}{{ message['content'] }}{% endgeneration %}")
    with pytest.raises(ValidationError, match="not valid Jinja"):
        validate_chat_template("{% for m in messages %}{{ m }}")
    with pytest.raises(ValidationError, match="not a path"):
        validate_chat_template("templates/tool_chat_template.jinja")
