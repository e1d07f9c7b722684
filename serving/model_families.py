"""Model families: which of vLLM's tool-call and reasoning parsers a model wants, found from its config.json
or, where there is none here (a hub id), from its name.

A deployment names its parsers, leaves them blank for its family's default, or sets "none" to switch one off
(ModelDeployment.tool_call_parser and reasoning_parser). The names are those of the pinned vLLM 0.32
(vllm/tool_parsers/__init__.py and vllm/reasoning/__init__.py); tests/serving/test_model_families.py checks
them against the engine itself, so an upgrade that renames a parser fails there first.

Over 400 lines: the table of families and the rules that read a model's config to find its family are one
lookup.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import jinja2
import jinja2.ext
from django.conf import settings
from django.core.exceptions import ValidationError

# A parser field left blank takes the family's default; this value switches it off.
FAMILY_DEFAULT = ""
OFF = "none"

# vLLM 0.32's ToolParserManager.list_registered().
TOOL_CALL_PARSERS = (
    "apertus",
    "cohere_command3",
    "cohere_command4",
    "deepseek_v3",
    "deepseek_v31",
    "deepseek_v32",
    "deepseek_v4",
    "deepseek_v41",
    "dots",
    "ernie45",
    "functiongemma",
    "gemma4",
    "gigachat3",
    "glm45",
    "glm47",
    "granite",
    "granite-20b-fc",
    "granite4",
    "hermes",
    "hf",
    "hunyuan_a13b",
    "hy_v3",
    "hy_v4",
    "inkling",
    "internlm",
    "jamba",
    "k2_horizon",
    "kimi_k2",
    "kimi_k3",
    "lfm2",
    "ling3",
    "llama3_json",
    "llama4_json",
    "llama4_pythonic",
    "longcat",
    "mimo",
    "minicpm5",
    "minimax_m2",
    "minimax_m3",
    "mistral",
    "muse_glimmer",
    "olmo3",
    "openai",
    "phi4_mini_json",
    "plamo3",
    "poolside_v1",
    "pythonic",
    "qwen3_coder",
    "qwen3_json",
    "qwen3_xml",
    "seed_oss",
    "step3",
    "step3p5",
    "xlam",
)

# vLLM 0.32's ReasoningParserManager.list_registered().
REASONING_PARSERS = (
    "cohere_command3",
    "cohere_command4",
    "deepseek_r1",
    "deepseek_v3",
    "deepseek_v4",
    "deepseek_v41",
    "ernie45",
    "gemma4",
    "glm45",
    "glm47",
    "granite",
    "granite_thinking_parser",
    "hf",
    "holo2",
    "hunyuan_a13b",
    "hy_v3",
    "hy_v4",
    "inkling",
    "k2_horizon",
    "kimi_k2",
    "kimi_k3",
    "ling3",
    "mimo",
    "minicpmv",
    "minimax_m2",
    "minimax_m2_append_think",
    "minimax_m3",
    "mistral",
    "muse_glimmer",
    "nemotron_v3",
    "olmo3",
    "openai_gptoss",
    "plamo3",
    "poolside_v1",
    "qwen3",
    "seed_oss",
    "step3",
    "step3p5",
)


def _check_parser(value: str, known: tuple[str, ...], kind: str) -> None:
    if value in (FAMILY_DEFAULT, OFF) or value in known:
        return
    raise ValidationError(
        '"%(value)s" is not a %(kind)s parser of vLLM. Leave it blank for the model family\'s default, '
        'set "none" to switch it off, or give one of: %(known)s.',
        code="unknown_parser",
        params={"value": value, "kind": kind, "known": ", ".join(known)},
    )


def validate_tool_call_parser(value: str) -> None:
    _check_parser(value, TOOL_CALL_PARSERS, "tool-call")


def validate_reasoning_parser(value: str) -> None:
    _check_parser(value, REASONING_PARSERS, "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which Hugging Face's chat template environment knows."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def validate_chat_template(value: str) -> None:
    """A chat template the engine takes as the template itself (vLLM would take a value without any of
    `{`, `}` or a newline for a path) and that parses as Jinja."""
    if not value:
        return
    if not any(char in value for char in "{}\n"):
        raise ValidationError(
            "Give the Jinja chat template itself, not a path or a name.", code="chat_template_not_a_template"
        )
    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    try:
        environment.parse(value)
    except jinja2.TemplateSyntaxError as exc:
        raise ValidationError(
            "The chat template is not valid Jinja: %(error)s (line %(line)s).",
            code="chat_template_syntax",
            params={"error": exc.message, "line": exc.lineno},
        ) from exc


def _rope_type(config: dict) -> str | None:
    rope = config.get("rope_scaling")
    if not isinstance(rope, dict):
        return None
    return rope.get("rope_type") or rope.get("type")


@dataclass(frozen=True)
class ModelFamily:
    name: str
    tool_call_parser: str | None
    reasoning_parser: str | None
    # config.json's model_type values (or, where no family knows the model_type, its architectures).
    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    # Searched, case-insensitively, in the model's hub id or path: picks this family among those that share a
    # model_type, and finds it alone when there is no config.json here.
    name_pattern: str = ""
    # Something else config.json must show when the name does not say.
    config_test: Callable[[dict], bool] | None = None

    def named(self, model: str) -> bool:
        return bool(self.name_pattern) and re.search(self.name_pattern, model, re.IGNORECASE) is not None


# First match wins. Families that share a model_type list the variants a name tells apart first and the one
# config.json alone stands for last.
FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        "qwen3-coder",
        "qwen3_coder",
        None,
        model_types=("qwen3", "qwen3_moe", "qwen3_next"),
        name_pattern=r"qwen3[-_.]?coder",
    ),
    # The 2507 Instruct models and Qwen3-Next Instruct never think: the qwen3 reasoning parser would take
    # their whole answer for reasoning.
    ModelFamily(
        "qwen3-instruct",
        "hermes",
        None,
        model_types=("qwen3", "qwen3_moe", "qwen3_next"),
        name_pattern=r"qwen3(?![._]\d).*[-_]instruct",
    ),
    ModelFamily(
        "qwen3",
        "hermes",
        "qwen3",
        model_types=("qwen3", "qwen3_moe", "qwen3_next"),
        architectures=("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"),
        name_pattern=r"qwen3(?![._]\d)",
    ),
    ModelFamily("qwq", "hermes", "deepseek_r1", model_types=("qwen2",), name_pattern=r"qwq"),
    # Distilled into Qwen2.5 and Llama 3 weights; their template has no tools.
    ModelFamily(
        "deepseek-r1-distill",
        None,
        "deepseek_r1",
        model_types=("qwen2", "llama"),
        name_pattern=r"r1[-_]distill",
    ),
    ModelFamily(
        "qwen2",
        "hermes",
        None,
        model_types=("qwen2", "qwen2_moe"),
        architectures=("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
        name_pattern=r"qwen2(\.5)?-(?!vl)",
    ),
    ModelFamily(
        "llama4",
        "llama4_pythonic",
        None,
        model_types=("llama4",),
        architectures=("Llama4ForConditionalGeneration", "Llama4ForCausalLM"),
        name_pattern=r"llama[-_]?4",
    ),
    # model_type llama is shared by many models; Llama 3.1 and later say so in their RoPE scaling.
    ModelFamily(
        "llama3",
        "llama3_json",
        None,
        model_types=("llama",),
        name_pattern=r"llama[-_]?3",
        config_test=lambda config: _rope_type(config) == "llama3",
    ),
    ModelFamily(
        "magistral", "mistral", "mistral", model_types=("mistral", "mistral3"), name_pattern=r"magistral"
    ),
    ModelFamily(
        "mistral",
        "mistral",
        None,
        model_types=("mistral", "mistral3", "mixtral"),
        architectures=("MistralForCausalLM", "Mistral3ForConditionalGeneration", "MixtralForCausalLM"),
        name_pattern=r"mistral|mixtral|devstral|ministral|codestral",
    ),
    # DeepSeek V3, R1 and V3.1 share model_type deepseek_v3 (as does Kimi-K2's architecture, hence no
    # architectures here). V3.1 thinks only when asked (chat_template_kwargs thinking=true), which the
    # deepseek_v3 reasoning parser follows.
    ModelFamily(
        "deepseek-v3.1",
        "deepseek_v31",
        "deepseek_v3",
        model_types=("deepseek_v3",),
        name_pattern=r"deepseek[-_]?v3\.1",
    ),
    ModelFamily(
        "deepseek-r1",
        "deepseek_v3",
        "deepseek_r1",
        model_types=("deepseek_v3",),
        name_pattern=r"deepseek[-_]?r1",
    ),
    ModelFamily(
        "deepseek-v3",
        "deepseek_v3",
        None,
        model_types=("deepseek_v3",),
        name_pattern=r"deepseek[-_]?v3(?![.\d])",
    ),
    # GLM-4.5, 4.6 and 4.7 share model_type glm4_moe; 4.7-Flash and GLM-5 have their own.
    ModelFamily(
        "glm47",
        "glm47",
        "glm47",
        model_types=("glm4_moe", "glm4_moe_lite", "glm_moe_dsa"),
        name_pattern=r"glm[-_]?(4\.[7-9]|5)",
    ),
    ModelFamily(
        "glm45",
        "glm45",
        "glm45",
        model_types=("glm4_moe",),
        name_pattern=r"glm[-_]?4\.[56]",
    ),
    ModelFamily(
        "gpt-oss",
        "openai",
        "openai_gptoss",
        model_types=("gpt_oss",),
        architectures=("GptOssForCausalLM",),
        name_pattern=r"gpt[-_]?oss",
    ),
    # The kimi_k2 reasoning parser expects thinking unless a request says otherwise: thinking models only.
    ModelFamily(
        "kimi-k2-thinking",
        "kimi_k2",
        "kimi_k2",
        model_types=("kimi_k2", "kimi_k25"),
        name_pattern=r"kimi[-_]?k2(\.5|.*thinking)",
    ),
    ModelFamily("kimi-k2", "kimi_k2", None, model_types=("kimi_k2",), name_pattern=r"kimi[-_]?k2"),
)


@dataclass(frozen=True)
class FamilyMatch:
    family: ModelFamily | None
    how: str  # what it was matched from, or why nothing matched
    alternatives: tuple[str, ...] = ()  # families config.json alone could also have been


def model_folder(model_source: str) -> Path | None:
    """The local folder of a model (a path relative to the project counts), or None for a hub id."""
    path = Path(model_source)
    if not path.is_absolute():
        path = Path(settings.BASE_DIR) / path
    return path if path.is_dir() else None


def read_config(model_source: str) -> dict | None:
    folder = model_folder(model_source)
    if folder is None:
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _by_config(config: dict, model: str) -> FamilyMatch:
    model_type = config.get("model_type") or ""
    architectures = sorted(config.get("architectures") or ())
    candidates = [family for family in FAMILIES if model_type in family.model_types]
    seen = f"config.json model_type {model_type!r}"
    if not candidates:
        candidates = [family for family in FAMILIES if set(architectures) & set(family.architectures)]
        seen = f"config.json architectures {architectures}"
    if not candidates:
        return FamilyMatch(
            None, f"config.json model_type {model_type!r}, architectures {architectures}: no family"
        )
    for family in candidates:
        if family.named(model):
            return FamilyMatch(family, f"{seen} and the model's name")
    # The name does not tell: the family config.json alone stands for, if it passes that family's own test.
    family = candidates[-1]
    if family.config_test is not None and not family.config_test(config):
        return FamilyMatch(None, f"{seen}, but neither config.json nor the name says {family.name}")
    others = tuple(candidate.name for candidate in candidates[:-1])
    return FamilyMatch(family, seen, others)


def match_family(model_source: str) -> FamilyMatch:
    """The family of the model at `model_source`: from its config.json when the folder is here, else by name."""
    config = read_config(model_source)
    if config is not None:
        return _by_config(config, model_source)
    for family in FAMILIES:
        if family.named(model_source):
            return FamilyMatch(family, "the model's name (no config.json here)")
    return FamilyMatch(None, "no config.json here and no family's name in the model id")


@dataclass(frozen=True)
class ToolCalling:
    """What a deployment's engines run with, and where each setting came from."""

    tool_call_parser: str | None
    reasoning_parser: str | None
    source: str  # of the tool-call parser: "deployment", "family <name>" or "none"
    reasoning_source: str
    family: str | None
    note: str

    def as_dict(self) -> dict:
        return asdict(self)


def _effective(setting: str, default: str | None, family: ModelFamily | None) -> tuple[str | None, str]:
    if setting == OFF:
        return None, "deployment"
    if setting:
        return setting, "deployment"
    if family is None:
        return None, "none"
    return default, f"family {family.name}"


def tool_calling_for(
    *, model_source: str, tool_call_parser: str = "", reasoning_parser: str = ""
) -> ToolCalling:
    """The parsers a deployment's engines get: its own settings, else its model family's defaults."""
    match = match_family(model_source)
    family = match.family
    tool, source = _effective(tool_call_parser, family.tool_call_parser if family else None, family)
    reasoning, reasoning_source = _effective(
        reasoning_parser, family.reasoning_parser if family else None, family
    )
    notes = []
    if family is not None:
        notes.append(f"Model family {family.name}, matched from {match.how}.")
        if match.alternatives and not (tool_call_parser and reasoning_parser):
            notes.append(
                f"{', '.join(match.alternatives)} share that config.json and the name picked none of them: "
                "set the parsers on the deployment if it is one of those."
            )
    elif not tool_call_parser or not reasoning_parser:
        notes.append(f"No model family matched {model_source} ({match.how}).")
    if tool_call_parser == OFF:
        notes.append('Tool calling is switched off on this deployment (tool_call_parser "none").')
    elif tool is None:
        notes.append("Tool calling is off: set tool_call_parser to enable tool calls.")
    return ToolCalling(
        tool_call_parser=tool,
        reasoning_parser=reasoning,
        source=source,
        reasoning_source=reasoning_source,
        family=family.name if family else None,
        note=" ".join(notes),
    )
