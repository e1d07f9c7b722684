"""The longest context a model's engines start with, derived from its config.json as vLLM derives it.

vLLM refuses to start when `--max-model-len` is above the length it derives from the model's config (its
`_get_and_verify_max_len`) unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set, which the platform never sets for its
engines. The platform refuses such a deployment up front, the simulator refuses to start as vLLM does, and the
orchestrators report it instead of restarting an engine that cannot start.

vLLM's rule, followed here: the smallest of the config's length keys; config.json's `model_max_length` instead when
it has one; with --disable-sliding-window, no more than the sliding window; no more than the tokenizer's
`model_max_length`; times the RoPE scaling factor (a YaRN factor applies to `original_max_position_embeddings`;
llama3, longrope and su scaling keep the length; Gemma 3's is scaled already). A config with none of these keys
sets no limit. A value up to config.json's own `model_max_length` is accepted as well.

The first half needs nothing but the standard library: the simulator runs it at start-up.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# vLLM's keys for a model's length, in its order (the smallest wins).
LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose factor does not lengthen the context (the config's length already counts it).
UNSCALED_ROPE_TYPES = ("su", "longrope", "llama3")
# vLLM's wording for the refusal, after its message (vllm/config/model.py).
VLLM_WARNING = (
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative position "
    "encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model uses absolute position "
    "encoding, positions exceeding derived_max_model_len will cause a CUDA array out-of-bounds error."
)


@dataclass(frozen=True)
class ModelLength:
    """What vLLM derives: `derived` (a float once a RoPE factor applies, as vLLM computes it), the key it came
    from, config.json's own `model_max_length` (vLLM accepts up to it too), and how, in words."""

    derived: float
    key: str
    model_max_length: int | None
    how: str

    @property
    def limit(self) -> int:
        """The longest max_model_len vLLM accepts."""
        return math.floor(max(self.derived, self.model_max_length or 0))


def _number(value) -> float | None:
    """A length as config files hold it; anything else (a bool, a string, null) is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def text_config(config: Mapping) -> Mapping:
    """The language model's part of a config (a multimodal model nests it), as vLLM reads it."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def apply_overrides(config: Mapping, overrides: Mapping) -> dict:
    """config.json with vLLM's --hf-overrides applied: a nested config (`text_config`) is updated key by key,
    any other key replaced whole."""
    merged = dict(config)
    for key, value in overrides.items():
        current = merged.get(key)
        if key.endswith("_config") and isinstance(current, Mapping) and isinstance(value, Mapping):
            merged[key] = apply_overrides(current, value)
        else:
            merged[key] = value
    return merged


def _rope_parameters(config: Mapping) -> list[Mapping]:
    """RoPE settings as vLLM reads them: `rope_parameters` (one dict, or one per layer type) or the older
    `rope_scaling`, with `type` read as `rope_type`. A config with `rope_theta` alone has default RoPE."""
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(rope, Mapping):
        return [{"rope_type": "default"}] if "rope_theta" in config else []
    if rope and all(isinstance(value, Mapping) for value in rope.values()):
        return list(rope.values())
    return [rope]


def _sliding_window(config: Mapping) -> float | None:
    if config.get("use_sliding_window") is False:
        return None
    window = _number(config.get("sliding_window"))
    return window if window else None


def derive(
    config: Mapping, tokenizer_config: Mapping | None = None, *, disable_sliding_window: bool = False
) -> ModelLength | None:
    """The length vLLM derives from a model's config.json (and tokenizer_config.json); None when the config
    names no length, where vLLM takes any --max-model-len."""
    config = text_config(config)
    derived, key, how = math.inf, "", ""
    for name in LENGTH_KEYS:
        value = _number(config.get(name))
        if value is not None and value < derived:
            derived, key, how = value, name, f"{name} {value} in its config.json"
    model_max_length = _number(config.get("model_max_length"))
    if model_max_length:  # Command-R and the like: this one, whatever the others say
        derived, key = model_max_length, "model_max_length"
        how = f"model_max_length {model_max_length} in its config.json"
    window = _sliding_window(config)
    if disable_sliding_window and window is not None and window < derived:
        derived, key, how = window, "sliding_window", f"sliding_window {window} (--disable-sliding-window)"
    tokenizer_max = _number((tokenizer_config or {}).get("model_max_length"))
    if tokenizer_max is not None and tokenizer_max < derived:
        derived, how = tokenizer_max, f"model_max_length {tokenizer_max} in its tokenizer_config.json"
    if derived == math.inf:
        return None
    derived, how = _scaled(config, derived, how)
    return ModelLength(derived, key, int(model_max_length) if model_max_length else None, how)


def _scaled(config: Mapping, derived: float, how: str) -> tuple[float, str]:
    """The length with RoPE scaling applied, as vLLM applies it."""
    rope = _rope_parameters(config)
    if not rope or "gemma3" in str(config.get("model_type", "")):
        return derived, how
    factor = 1.0
    for parameters in rope:
        rope_type = parameters.get("rope_type") or parameters.get("type") or "default"
        if rope_type in UNSCALED_ROPE_TYPES:
            continue
        factor = parameters.get("factor", factor)
        if rope_type == "yarn" and _number(parameters.get("original_max_position_embeddings")):
            derived = parameters["original_max_position_embeddings"]
            how = f"original_max_position_embeddings {derived} in its config.json"
    if _number(factor) is None:
        return derived, how
    if factor != 1:
        how = f"{how}, times the RoPE scaling factor {factor}"
    return derived * factor, how


def vllm_refusal(max_model_len: int, length: ModelLength | None) -> str | None:
    """vLLM's start-up error for this max_model_len, word for word; None when vLLM accepts it."""
    if length is None or max_model_len <= length.limit:
        return None
    return (
        f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
        f"({length.key}={length.derived} or model_max_length={length.model_max_length} in model's "
        "config.json). To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. "
        f"{VLLM_WARNING}"
    )


def engine_options(args: Sequence[str]) -> tuple[dict, bool]:
    """From engine arguments, what changes the length vLLM derives: --hf-overrides (a JSON object) and
    --disable-sliding-window. Arguments vLLM itself would refuse are left to it."""
    overrides: dict = {}
    for index, arg in enumerate(args):
        text = None
        if arg == "--hf-overrides" and index + 1 < len(args):
            text = args[index + 1]
        elif arg.startswith("--hf-overrides="):
            text = arg.partition("=")[2]
        if text is not None:
            try:
                value = json.loads(text)
            except ValueError:
                continue
            if isinstance(value, dict):
                overrides = value
    return overrides, "--disable-sliding-window" in args


def read_json(path: Path | str | None) -> dict | None:
    """A JSON object from a file; None when it is missing or not one."""
    if path is None:
        return None
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


# --- the platform's side: a deployment's model, read where it already is --------------------------------------


def _model_file(source: str, filename: str, revision: str) -> Path | None:
    """A file of a model: in its folder here, else in this machine's Hugging Face cache. Never fetched: an API
    request does not wait on the hub, and the platform may run with no way out."""
    from .model_families import model_folder

    folder = model_folder(source)
    if folder is not None:
        return folder / filename
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source, filename, revision=revision or None)
    except Exception:  # not a hub id (a path on another machine), or no hub client
        return None
    return Path(found) if isinstance(found, str) else None


def max_model_len_problem(
    *, model_source: str, tokenizer: str, revision: str, max_model_len: int, pools: Sequence
) -> str | None:
    """Why engines of this deployment would refuse to start with its max_model_len, for an operator; None when
    they would start, or when the model's config is not here to tell (a hub model not in this machine's cache:
    its first engine reports it in its log, and the reconcile after it, which finds the config cached, stops
    restarting it). `pools`: Pool objects or mappings of their fields; each pool's engine arguments may change
    the config (--hf-overrides) or the rule (--disable-sliding-window)."""
    config = read_json(_model_file(model_source, "config.json", revision))
    if config is None:
        return None
    tokenizer_config = read_json(
        _model_file(tokenizer or model_source, "tokenizer_config.json", "" if tokenizer else revision)
    )
    for pool in pools or [{}]:
        name, args = _pool_args(pool)
        overrides, no_sliding_window = engine_options(args)
        length = derive(
            apply_overrides(config, overrides), tokenizer_config, disable_sliding_window=no_sliding_window
        )
        if vllm_refusal(max_model_len, length) is None:
            continue
        where = f" with pool {name}'s engine arguments" if overrides or no_sliding_window else ""
        return (
            f"max_model_len {max_model_len} is longer than {model_source} allows{where}: {length.limit} tokens "
            f"({length.how}). vLLM, and the simulator, refuse to start beyond that; set max_model_len to "
            f"{length.limit} or less."
        )
    return None


def _pool_args(pool) -> tuple[str, list[str]]:
    """A pool's name and extra engine arguments, from a Pool or a mapping of its fields."""
    if isinstance(pool, Mapping):
        name, args = pool.get("name", ""), pool.get("extra_engine_args")
    else:
        name, args = pool.name, pool.extra_engine_args
    return name, [arg for arg in args if isinstance(arg, str)] if isinstance(args, list | tuple) else []


# The deployment fields the check reads: a change of none of them (nor of the pools) needs no check, so that a
# deployment saved before its model could be read can still be stopped or renamed.
LENGTH_FIELDS = frozenset({"model_source", "tokenizer", "revision", "max_model_len"})


def max_model_len_check(deployment, pools: Sequence) -> None:
    """Raise a ValidationError on `max_model_len` when the deployment's engines would refuse to start with it.
    `deployment`: a ModelDeployment, saved or not."""
    from django.core.exceptions import ValidationError

    problem = max_model_len_problem(
        model_source=deployment.model_source,
        tokenizer=deployment.tokenizer,
        revision=deployment.revision,
        max_model_len=deployment.max_model_len,
        pools=pools,
    )
    if problem:
        raise ValidationError({"max_model_len": problem})
