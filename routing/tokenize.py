"""Tokenisation in the router, with the deployment's own tokenizer and chat template.

Agents resend a growing context every turn. The rendered chat is cut at the template's special tokens (which the
tokenizer never merges with their neighbours), and each piece's token ids are cached, so a new turn costs work in
proportion to its new text, and the ids equal those of tokenising the whole text at once, as the engine does.
"""

from __future__ import annotations

import json
import re
from array import array
from collections import OrderedDict
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def token_ids(prompt) -> array | None:
    """A prompt sent as a list of token ids (as vLLM's completions API takes it), as an array; None for anything
    else, including ids no tokenizer could have made (negative, over 32 bits, not integers)."""
    if not isinstance(prompt, list) or not prompt:
        return None
    try:
        return array("I", prompt)  # converted and checked in C: a per-item isinstance costs 5x as much
    except (TypeError, OverflowError):
        return None


class SegmentCache:
    """An LRU of text piece -> token ids, bounded by the number of ids it holds."""

    def __init__(self, max_tokens: int = 20_000_000):
        self.max_tokens = max_tokens
        self._items: OrderedDict[str, array] = OrderedDict()
        self._size = 0
        self.hits = 0
        self.misses = 0

    def get(self, text: str) -> array | None:
        ids = self._items.get(text)
        if ids is not None:
            self._items.move_to_end(text)
            self.hits += 1
        return ids

    def put(self, text: str, ids: array) -> None:
        self.misses += 1
        self._items[text] = ids
        self._size += len(ids)
        while self._size > self.max_tokens and self._items:
            _, dropped = self._items.popitem(last=False)
            self._size -= len(dropped)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


class RouterTokenizer:
    def __init__(self, model_dir: str | Path, cache: SegmentCache | None = None):
        folder = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        self.cache = cache or SegmentCache()
        self.special = {
            token.content: token_id
            for token_id, token in self.tokenizer.get_added_tokens_decoder().items()
            if token.special
        }
        self._split = re.compile(
            "(" + "|".join(re.escape(t) for t in sorted(self.special, key=len, reverse=True)) + ")"
        )
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next(
                (t["template"] for t in template if t.get("name") == "default"), template[0]["template"]
            )
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template) if template else None

    def render_chat(
        self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list | None = None, **kwargs
    ) -> str:
        if self.template is None:
            raise ValueError("this model has no chat template")
        return self.template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_text(self, text: str) -> array:
        """Token ids of `text` with no added special tokens, from cached pieces where it repeats."""
        ids = array("I")
        for piece in self._split.split(text) if self.special else [text]:
            if not piece:
                continue
            special = self.special.get(piece)
            if special is not None:
                ids.append(special)
                continue
            cached = self.cache.get(piece)
            if cached is None:
                cached = array("I", self.tokenizer.encode(piece, add_special_tokens=False).ids)
                self.cache.put(piece, cached)
            ids.extend(cached)
        return ids

    def encode_chat(self, messages: list[dict], **kwargs) -> array:
        return self.encode_text(self.render_chat(messages, **kwargs))

    def encode_prompt(self, prompt: str) -> array:
        """A completions prompt, as the engine tokenises it (with the tokenizer's own special tokens)."""
        return array("I", self.tokenizer.encode(prompt, add_special_tokens=True).ids)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value
