"""The model's own tokenizer and chat template, loaded from the model folder as vLLM loads them."""

from __future__ import annotations

import logging
import os
from functools import cached_property

from routing.dialects import ChatInputs

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
logging.getLogger("transformers").setLevel(logging.ERROR)

# apply_chat_template's own parameters: a template variable of one of these names (from a request's
# chat_template_kwargs) would change how transformers renders instead of reaching the template.
_RESERVED = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ModelTokenizer:
    def __init__(self, path: str, chat_template: str | None = None):
        """`chat_template`: the text of a template that replaces the model's own (--chat-template)."""
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        self._override = chat_template

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_token(self) -> str | None:
        return self._tok.eos_token

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @cached_property
    def chat_template(self) -> str | None:
        """The template text chats are rendered with: the override, else the model's (its default one when the
        model names several)."""
        if self._override is not None:
            return self._override
        template = self._tok.chat_template
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()), None)
        return template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def encode_with_ends(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids of `text` (no special tokens added) and, for each, where its text ends in `text`."""
        encoding = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoding["input_ids"]), [end for _, end in encoding["offset_mapping"]]

    def render_text(self, inputs: ChatInputs) -> str:
        """The chat as the template renders it (transformers' apply_chat_template, as vLLM's renderer calls it)."""
        kwargs = {k: v for k, v in inputs.kwargs.items() if k not in _RESERVED}
        return self._tok.apply_chat_template(
            inputs.messages,
            tools=inputs.tools,
            chat_template=self._override,
            tokenize=False,
            **kwargs,
        )

    def render_chat(self, inputs: ChatInputs) -> list[int]:
        # vLLM tokenizes the rendered text without adding special tokens again.
        return self._tok.encode(self.render_text(inputs), add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_strs(self, ids: list[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(ids)

    @cached_property
    def output_pool(self) -> list[int]:
        """Token ids that decode, one at a time, to plain printable text: what the simulator 'generates'."""
        special = set(self._tok.all_special_ids)
        pool = []
        for token_id in range(len(self._tok)):
            if token_id in special:
                continue
            text = self._tok.decode([token_id])
            if text and text.isprintable() and text.isascii() and text.strip():
                pool.append(token_id)
        return pool or [i for i in range(len(self._tok)) if i not in special]
