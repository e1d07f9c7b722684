"""tiktoken tokenises for the router only where it gives exactly the deployment's tokenizer's ids."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from routing.rendering.fast_bpe import PROBE, fast_encoder
from routing.rendering.tokenize import RouterTokenizer

from ..serving.engines import MODEL_DIR

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def tiny() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


def variant(change) -> Tokenizer:
    """The tiny model's tokenizer with its tokenizer.json changed by `change(spec)`."""
    spec = json.loads(tiny().to_str())
    change(spec)
    return Tokenizer.from_str(json.dumps(spec))


def texts() -> list[str]:
    """The project's own code and docs, cut at special tokens as the router cuts a prompt: agents' kind of text."""
    special = re.compile(r"<\|[a-z_]+\|>")
    files = sorted([*ROOT.glob("routing/**/*.py"), *ROOT.glob("docs/*.md"), *ROOT.glob("tenants/*.py")])
    return [piece for path in files for piece in special.split(path.read_text()) if piece]


def same_ids(tokenizer: Tokenizer, encoder, pieces: list[str]) -> None:
    for piece in pieces:
        assert list(encoder.encode(piece)) == tokenizer.encode(piece, add_special_tokens=False).ids, piece[
            :200
        ]


def test_the_tiny_models_tokenizer_is_tokenised_with_tiktoken_and_gives_its_ids():
    tokenizer = tiny()
    encoder = fast_encoder(tokenizer)
    assert encoder is not None
    pieces = texts()
    assert sum(len(p) for p in pieces) > 500_000
    same_ids(tokenizer, encoder, [*pieces, PROBE, "", " ", "\n\n", "x" * 10_000])


def test_the_router_tokenises_with_it_and_its_ids_do_not_change():
    router = RouterTokenizer(MODEL_DIR)
    assert router.fast is not None
    text = "<|im_start|>user\nRead app.py<|im_end|>\n<|im_start|>assistant\n" + PROBE
    expected = router.tokenizer.encode(text, add_special_tokens=False).ids
    assert list(router.encode_text(text)) == expected
    router.fast = None  # the tokenizer itself, as for a tokenizer tiktoken cannot stand in for
    assert list(RouterTokenizer(MODEL_DIR).encode_text(text)) == expected


def test_token_ids_that_do_not_follow_the_merges_order_are_mapped_back():
    def swap_two_merge_results(spec):
        vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
        first, last = (
            "".join(m.split(" ")) if isinstance(m, str) else "".join(m) for m in (merges[0], merges[-1])
        )
        vocab[first], vocab[last] = vocab[last], vocab[first]

    tokenizer = variant(swap_two_merge_results)
    encoder = fast_encoder(tokenizer)
    assert encoder is not None and encoder._ids is not None
    same_ids(tokenizer, encoder, texts()[:200] + [PROBE])


def test_an_nfc_normaliser_is_applied_first():
    tokenizer = variant(lambda spec: spec.update(normalizer={"type": "NFC"}))
    encoder = fast_encoder(tokenizer)
    assert encoder is not None
    same_ids(tokenizer, encoder, ["Re\u0301sume\u0301 cafe\u0301 A\u030a", PROBE])


def test_a_piece_with_a_non_special_added_token_is_left_to_the_tokenizer():
    tokenizer = tiny()
    tokenizer.add_tokens(["<tool_call>"])
    encoder = fast_encoder(tokenizer)
    assert encoder is not None
    assert encoder.encode("call it: <tool_call>{}") is None
    assert (
        list(encoder.encode("call it: {}")) == tokenizer.encode("call it: {}", add_special_tokens=False).ids
    )


def another_merge(spec: dict) -> list[str] | str:
    """A second merge for a token some merge makes already: the same text, split elsewhere."""
    vocab = spec["model"]["vocab"]
    merges = {tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]}
    for left, right in sorted(merges):
        token = left + right
        for cut in range(1, len(token)):
            pair = (token[:cut], token[cut:])
            if pair not in merges and pair[0] in vocab and pair[1] in vocab:
                return " ".join(pair) if isinstance(spec["model"]["merges"][0], str) else list(pair)
    raise AssertionError("no token with two splits")


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda s: s.update(normalizer={"type": "NFKC"}), id="another normaliser"),
        pytest.param(lambda s: s["model"].update(byte_fallback=True), id="byte fallback"),
        pytest.param(lambda s: s["model"].update(dropout=0.1), id="dropout"),
        pytest.param(
            lambda s: s.update(pre_tokenizer={"type": "Whitespace"}),
            id="a pre-tokenizer that is not byte-level",
        ),
        pytest.param(
            lambda s: s["pre_tokenizer"]["pretokenizers"].insert(
                0, {"type": "Digits", "individual_digits": True}
            ),
            id="a step before the split",
        ),
        pytest.param(
            lambda s: s["model"]["vocab"].update({"Ġunreached": 10**6}), id="a token no merge makes"
        ),
        pytest.param(lambda s: s["model"]["merges"].append(another_merge(s)), id="two merges, one token"),
    ],
)
@pytest.mark.heavy
def test_a_tokenizer_it_cannot_stand_in_for_keeps_its_own_tokenising(change):
    assert fast_encoder(variant(change)) is None
