"""Make the tiny model folder that real vLLM (CPU, `--load-format dummy`) and the simulator both serve.

The folder holds only a config, a generation config and a byte-level BPE tokenizer with a ChatML chat template;
vLLM initialises random weights for it, so the text is noise but the engine, its KV cache, prefix cache, metrics,
events and KV transfer are the real ones. Output is deterministic for a given Python version (the tokenizer is
trained on a fixed list of standard-library sources and the language reference's text), and the result is committed
under models/tiny-qwen.

The tokenizer is sized like production ones (a 32K vocabulary, as Llama 2's and Mistral's; Qwen's is 151K), so an
agent's prompt counts about as many tokens here as on a real model and the router's tokenising cost per byte is
representative; `--measure` prints its characters per token on English, code and agent JSON (docs/tiny-model.md).
The model declares 262,144 positions, so a deployment may serve a whole agent session (the demo serves 131,072).

    python scripts/make_tiny_model.py [OUTPUT_DIR]
    python scripts/make_tiny_model.py --measure [MODEL_DIR]
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 32768
MAX_POSITIONS = 262144
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Every top-level module of the standard library, the packages agents' code most often resembles, and the
# language reference's prose (pydoc_data/topics.py): code and English, both available wherever Python is.
CORPUS_PACKAGES = ["asyncio", "email", "http", "json", "logging", "urllib"]
CORPUS_PROSE = "pydoc_data/topics.py"
# ChatML with tools in the Hermes format (a system block listing the tools, assistant calls as <tool_call> JSON,
# results as <tool_response> in a user turn), so vLLM's `hermes` tool-call parser reads what it writes. Content is
# used as a string (vLLM joins text parts with newlines first); assistant reasoning in history is shown in <think>.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\n\\nTo call one, answer with <tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' and message['reasoning_content'] %}"
    "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + call['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": 0,
    "eos_token_id": 2,
}


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    for package in CORPUS_PACKAGES:
        files += sorted((stdlib / package).rglob("*.py"))
    return [*files, stdlib / CORPUS_PROSE]


def corpus() -> list[str]:
    return [path.read_text(encoding="utf-8", errors="replace") for path in corpus_files()]


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Qwen2's own split, then byte-level: the pre-tokenizer that transformers applies for a qwen2 model
    # whatever tokenizer.json says, so the file must say the same for tokenizers-only readers (the router).
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 2, "do_sample": False}, indent=2) + "\n"
    )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    print(f"wrote {out}")


ROOT = Path(__file__).resolve().parent.parent
# Held-out text for --measure (none of it is in the training corpus): the project's own English documents, a
# standard-library package left out of training, and the agents' own requests captured as test fixtures.
MEASURED = {
    "English prose (README.md, docs/routing.md, docs/flow-control.md)": lambda: [
        ROOT / "README.md",
        ROOT / "docs" / "routing.md",
        ROOT / "docs" / "flow-control.md",
    ],
    "tables of figures (docs/benchmarks.md)": lambda: [ROOT / "docs" / "benchmarks.md"],
    "Python (stdlib unittest/)": lambda: sorted(
        (Path(sysconfig.get_paths()["stdlib"]) / "unittest").rglob("*.py")
    ),
    "agent JSON (captured Claude Code and Codex requests)": lambda: sorted(
        (ROOT / "tests" / "agents" / "captured").glob("*.json")
    ),
}


def measure(model: Path) -> None:
    """Print characters per token for each kind of held-out text."""
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    print("| text | characters | tokens | characters per token |\n| --- | ---: | ---: | ---: |")
    for name, files in MEASURED.items():
        texts = [path.read_text(encoding="utf-8") for path in files()]
        chars = sum(len(text) for text in texts)
        tokens = sum(
            len(encoding.ids) for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)
        )
        print(f"| {name} | {chars:,} | {tokens:,} | {chars / max(tokens, 1):.2f} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--measure"]:
        measure(Path(args[1]) if len(args) > 1 else ROOT / "models" / "tiny-qwen")
    else:
        main(Path(args[0]) if args else ROOT / "models" / "tiny-qwen")
