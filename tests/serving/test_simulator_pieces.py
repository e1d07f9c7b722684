"""The simulator tokenises a rendered chat piece by piece (between the tokenizer's added tokens), from a cache: its
ids must be those of tokenising the whole text at once, as vLLM does, whatever the text holds."""

from __future__ import annotations

import random

import pytest

from bench import agent_scale
from routing.rendering.conversion import anthropic_chat_request, chat_inputs, responses_chat_request
from routing.rendering.tokenize import template_traits
from simulator.tokenizer import ModelTokenizer

from .engines import MODEL_DIR

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)


@pytest.fixture(scope="module")
def tokenizer():
    return ModelTokenizer(str(MODEL_DIR))


def whole(tokenizer: ModelTokenizer, text: str) -> list[int]:
    return tokenizer._tok.encode(text, add_special_tokens=False)


def test_pieces_join_to_the_ids_of_the_whole_text(tokenizer):
    rng = random.Random(4)
    alphabet = [
        "a",
        "b",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "é",
        "🙂",
        "'s",
        "12",
        "<|im_start|>",
        "<|im_end|>",
        "<|",
    ]
    alphabet += ["<|endoftext|>", "im_end|>", "\r\n", "def f():", "ü"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert tokenizer.encode_rendered(text) == whole(tokenizer, text), repr(text)
        assert tokenizer.encode_rendered(text) == whole(tokenizer, text)  # from the cache this time


def test_a_growing_agent_conversation_is_tokenised_as_the_whole_prompt(tokenizer):
    cpt = agent_scale.chars_per_token()
    texts = agent_scale.Texts(cpt)
    traits = template_traits(tokenizer.chat_template)
    rng = random.Random(2)
    for kind in ("claude-code", "codex"):
        shape = agent_scale.Shape.load(kind, "key", cpt)
        conv = agent_scale.Conversation(shape, "s", "s-c0", "Fix the test.", texts)
        for turn in range(4):
            conv.add_round(rng, turn)
            payload = conv.payload()
            chat = (
                anthropic_chat_request(payload) if kind == "claude-code" else responses_chat_request(payload)
            )
            inputs = chat_inputs(chat, traits)
            assert tokenizer.render_chat(inputs) == whole(tokenizer, tokenizer.render_text(inputs))


def test_the_cache_is_bounded_by_characters(tokenizer):
    cache = type(tokenizer._pieces)(max_chars=10)
    from array import array

    cache.put("abcdef", array("I", [1]))
    cache.put("ghijkl", array("I", [2]))  # 12 characters: the oldest goes
    assert cache.get("abcdef") is None and list(cache.get("ghijkl")) == [2]
    cache.put("x" * 11, array("I", [3]))  # larger than the whole cache: not kept
    assert cache.get("x" * 11) is None
