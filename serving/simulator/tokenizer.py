"""The model's own tokenizer and chat template, loaded from the model folder as vLLM loads them."""

from __future__ import annotations

import logging
import os
from functools import cached_property

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
logging.getLogger("transformers").setLevel(logging.ERROR)


class ModelTokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        rendered = self._tok.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
        # vLLM tokenizes the rendered text without adding special tokens again.
        return self._tok.encode(rendered, add_special_tokens=False)

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
