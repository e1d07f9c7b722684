"""Byte-level BPE with tiktoken, for the tokenizers whose ids it gives exactly.

The router tokenises every piece of text it has not seen (routing/rendering/tokenize.py): tool results, files an agent read,
its own answers. HF tokenizers takes about 1 us a token for that here; tiktoken runs the same byte-level BPE
(split by the tokenizer's own pattern, then merged pair by pair in rank order) about ten times faster. It is used
only for a tokenizer whose pipeline it reproduces, read from its tokenizer.json: a BPE model without dropout or
byte fallback, every token a byte or one merge's result, no normaliser but NFC, and a pre-tokenizer that is
byte-level with GPT-2's pattern or one regex split before it. It is then checked on a probe text against the
tokenizer itself; any difference and the tokenizer is used as before. A piece holding one of the tokenizer's
non-special added tokens (which it matches before the model) is left to the tokenizer.
"""

from __future__ import annotations

import json
import logging
import re
import unicodedata
from array import array

import tiktoken
from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# The pattern of a ByteLevel pre-tokenizer with `use_regex` (GPT-2's).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Text of the kinds agents send (code, prose, numbers, several scripts, odd whitespace, decomposed accents), each
# tokenised both ways when a tokenizer is loaded.
PROBE = (
    "def encode(self, text: str) -> list[int]:\n\t\treturn [ord(c) for c in text]  # 12345 6789\r\n"
    "    if x != y and z >= 0x1F:\n        print(f'{x!r} {y:>8}')\n\n\n"
    "I'm sure they'll say WE'VE and it's 'QUOTED' -- 3.14159e-10; 1,000,000.00 $5 50% #tag @user\n"
    "Résumé naïve café e\u0301 A\u030a \u00a0non-breaking\u2003em\u2028line\u3000wide\n"
    "日本語のテキストと中文文本, 한국어 텍스트, русский текст, العربية, हिन्दी, ελληνικά.\n"
    "Emoji 🚀🔥👍🏽 and symbols ∑∫√∞ ≠ ≤ → ← ✓ ✗ © ® ™ … “quotes” ‘single’ «guillemets»\n"
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}\n<div class="x">&amp;</div>\n'
    "   leading spaces   and trailing   \n\n\t\t\n" + "x" * 300 + " " * 40 + "1" * 50 + "\n"
)


def _byte_chars() -> dict[str, int]:
    """The byte-level alphabet: the character each byte is written as in the vocabulary -> the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _pattern(pre_tokenizer: dict | None) -> str | None:
    if not pre_tokenizer:
        return None
    if pre_tokenizer.get("type") == "ByteLevel":
        if pre_tokenizer.get("add_prefix_space") or not pre_tokenizer.get("use_regex", True):
            return None
        return GPT2_PATTERN
    if pre_tokenizer.get("type") != "Sequence":
        return None
    steps = pre_tokenizer.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or "Regex" not in (split.get("pattern") or {})
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("add_prefix_space")
        or byte_level.get("use_regex")
    ):
        return None
    return split["pattern"]["Regex"]


class FastEncoder:
    """`encode(piece)`: the ids of a piece of text without special tokens, or None for one the tokenizer must
    take itself."""

    def __init__(
        self, encoding: tiktoken.Encoding, ids: list[int] | None, added: re.Pattern | None, nfc: bool
    ):
        self._encode = encoding.encode_ordinary
        self._ids = ids  # rank -> token id, where the ranks are not the ids themselves
        self._added = added
        self._nfc = nfc

    def encode(self, piece: str) -> array | None:
        if self._added is not None and self._added.search(piece):
            return None
        if self._nfc:
            piece = unicodedata.normalize("NFC", piece)
        ranks = self._encode(piece)
        if self._ids is None:
            return array("I", ranks)
        ids = self._ids
        return array("I", [ids[rank] for rank in ranks])


def fast_encoder(tokenizer: Tokenizer, name: str = "") -> FastEncoder | None:
    """A FastEncoder giving exactly `tokenizer`'s ids, or None where tiktoken cannot (the tokenizer is then used)."""
    try:
        encoder = _build(tokenizer, name)
    except (ValueError, KeyError, TypeError) as exc:  # a tokenizer.json of a shape not read here
        log.info("%s: tokenising with HF tokenizers (%s)", name or "tokenizer", exc)
        return None
    if encoder is None:
        return None
    for text in (PROBE, *PROBE.splitlines(keepends=True)):
        expected = tokenizer.encode(text, add_special_tokens=False).ids
        got = encoder.encode(text)
        if got is not None and list(got) != expected:
            log.warning("%s: tiktoken differs from the tokenizer on a probe text; using the tokenizer", name)
            return None
    return encoder


def _build(tokenizer: Tokenizer, name: str) -> FastEncoder | None:
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if (
        model.get("type") != "BPE"
        or model.get("dropout")
        or model.get("byte_fallback")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
    ):
        return None
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return None
    pattern = _pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return None
    chars = _byte_chars()

    def as_bytes(token: str) -> bytes:
        return bytes(chars[c] for c in token)  # KeyError: not a byte-level token

    vocab: dict[str, int] = model["vocab"]
    added = spec.get("added_tokens") or []
    added_contents = {token["content"] for token in added}
    ranks: dict[bytes, int] = {}
    for char in chars:
        ranks[as_bytes(char)] = vocab[char]
    results: list[tuple[bytes, int]] = []
    for merge in model["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = left + right
        result = as_bytes(token)
        if result in ranks:  # two merges make one token: rank order cannot stand for merge order
            return None
        ranks[result] = vocab[token]
        results.append((result, vocab[token]))
    # Every token is a byte or a merge's result (or an added token, matched before the model), so what the model
    # can reach is what tiktoken can.
    reachable = set(ranks.values())
    if any(token not in added_contents for token, token_id in vocab.items() if token_id not in reachable):
        return None
    # tiktoken merges the pair whose result ranks lowest; the model merges in the merges' order (a byte's rank is
    # never compared). Where the merges' token ids grow in that order they serve as ranks; otherwise ranks are the
    # order, mapped back to ids.
    ids = [token_id for _, token_id in results]
    mapping = None
    if any(later <= earlier for earlier, later in zip(ids, ids[1:], strict=False)):
        mapping = [vocab[c] for c in chars] + ids
        ranks = {as_bytes(c): rank for rank, c in enumerate(chars)}
        ranks.update({result: len(chars) + n for n, (result, _) in enumerate(results)})
    encoding = tiktoken.Encoding(name or "router", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    plain_added = [token["content"] for token in added if not token.get("special")]
    added_re = (
        re.compile("|".join(re.escape(t) for t in sorted(plain_added, key=len, reverse=True)))
        if plain_added
        else None
    )
    return FastEncoder(encoding, mapping, added_re, nfc=normalizer is not None)
