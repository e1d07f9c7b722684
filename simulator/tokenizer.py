"""The model's own tokenizer and chat template, loaded from the model folder as vLLM loads them.

An agent resends its whole conversation every turn, up to ~200K tokens, and tokenising that whole text costs the
tokenizer about half a second. The tokenizer cuts its input at its added tokens (`<|im_start|>` and the like, which
it never merges with their neighbours) before anything else, so a rendered chat's ids are those of each piece
between them, joined: each piece's ids are cached, and a new turn costs its new text only.
"""

from __future__ import annotations

import logging
import os
import re
from array import array
from collections import OrderedDict
from functools import cached_property

from routing.rendering.conversion import ChatInputs

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


class PieceCache:
    """An LRU of text piece -> token ids, bounded by the characters of the pieces it holds."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self._items: OrderedDict[str, array] = OrderedDict()
        self._chars = 0

    def clear(self) -> None:
        self._items.clear()
        self._chars = 0

    def get(self, piece: str) -> array | None:
        ids = self._items.get(piece)
        if ids is not None:
            self._items.move_to_end(piece)
        return ids

    def put(self, piece: str, ids: array) -> None:
        if len(piece) > self.max_chars or piece in self._items:
            return
        self._items[piece] = ids
        self._chars += len(piece)
        while self._chars > self.max_chars:
            old, _ = self._items.popitem(last=False)
            self._chars -= len(old)


class ModelTokenizer:
    # Pieces of rendered chats whose ids are kept: about 25 conversations of 200K tokens.
    PIECE_CACHE_CHARS = 24_000_000

    def __init__(self, path: str, chat_template: str | None = None):
        """`chat_template`: the text of a template that replaces the model's own (--chat-template)."""
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        self._override = chat_template
        self._pieces = PieceCache(self.PIECE_CACHE_CHARS)
        self._cut, self._added_ids = self._added_token_cut()

    def _added_token_cut(self) -> tuple[re.Pattern | None, dict[str, int]]:
        """A pattern that cuts text where the tokenizer cuts it first: at its added tokens matched on the raw
        text, leftmost and longest first. None (no piece cache) if an added token strips or must stand alone as a
        word: it then reaches into its neighbours' text."""
        added = getattr(self._tok, "added_tokens_decoder", None) or {}
        if not added or any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
            return None, {}
        raw = {t.content: token_id for token_id, t in added.items() if not t.normalized}
        if not raw:
            return None, {}
        alternatives = "|".join(re.escape(t) for t in sorted(raw, key=len, reverse=True))
        return re.compile(f"({alternatives})"), raw

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
        return self.encode_rendered(self.render_text(inputs))

    def forget_pieces(self) -> None:
        self._pieces.clear()

    def encode_rendered(self, text: str) -> list[int]:
        """The ids of `text` with no special tokens added: those of tokenising it whole, from the piece cache."""
        if self._cut is None:
            return self._tok.encode(text, add_special_tokens=False)
        ids = array("I")
        for i, piece in enumerate(self._cut.split(text)):
            if i % 2:  # an added token, which the split keeps
                ids.append(self._added_ids[piece])
            elif piece:
                known = self._pieces.get(piece)
                if known is None:
                    known = array("I", self._tok.encode(piece, add_special_tokens=False))
                    self._pieces.put(piece, known)
                ids.extend(known)
        return ids.tolist()

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
