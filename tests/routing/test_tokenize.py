"""The router tokenises prompts exactly as the engines do, and a new turn costs only its new text."""

from __future__ import annotations

import httpx
import pytest

from routing.kvindex.blocks import block_keys, chain_seed
from routing.rendering.tokenize import RouterTokenizer, token_ids

from ..serving.engines import MODEL_DIR, MODEL_NAME

CONVERSATION = [
    {"role": "system", "content": "You are a coding agent. Follow the repository's conventions. " * 20},
    {"role": "user", "content": "Open src/app.py and explain the <|im_end|> handling."},
    {"role": "assistant", "content": "It strips the marker before parsing."},
    {"role": "user", "content": [{"type": "text", "text": "Now fix the bug."}]},
]


@pytest.fixture(scope="module")
def tokenizer() -> RouterTokenizer:
    return RouterTokenizer(MODEL_DIR)


@pytest.mark.parametrize(
    "engine_fixture", ["sim_engine", pytest.param("vllm_engine", marks=pytest.mark.vllm)]
)
def test_it_tokenises_chat_exactly_as_the_engine(request, tokenizer, engine_fixture):
    engine = request.getfixturevalue(engine_fixture)
    expected = httpx.post(
        f"{engine.url}/tokenize", json={"model": MODEL_NAME, "messages": CONVERSATION}, timeout=30
    ).json()["tokens"]
    assert list(tokenizer.encode_chat(CONVERSATION)) == expected


def test_it_tokenises_completion_prompts_exactly_as_the_engine(tokenizer, sim_engine):
    prompt = "def parse(line: str) -> list[str]:\n    return line.split(',')\n"
    expected = httpx.post(f"{sim_engine.url}/tokenize", json={"model": MODEL_NAME, "prompt": prompt}).json()[
        "tokens"
    ]
    assert list(tokenizer.encode_prompt(prompt)) == expected


def test_a_new_turn_tokenises_only_its_new_text(tokenizer):
    history = [{"role": "system", "content": "Context line. " * 5000}]
    tokenizer.encode_chat(history)
    misses = tokenizer.cache.misses
    for turn in range(5):
        history = [
            *history,
            {"role": "user", "content": f"turn {turn}"},
            {"role": "assistant", "content": "ok"},
        ]
        tokenizer.encode_chat(history)
    # Each turn adds two messages: two new pieces of text (plus the role names, cached after the first turn).
    assert tokenizer.cache.misses - misses <= 5 * 2 + 4


def test_block_keys_chain_and_depend_on_the_model():
    tokens = list(range(1000, 1300))
    seed = chain_seed(MODEL_NAME)
    keys = block_keys(tokens, 128, seed)
    assert len(keys) == 2  # full blocks only
    assert block_keys(tokens[128:256], 128, seed, parent=keys[0]) == keys[1:]
    assert block_keys(tokens, 128, chain_seed("other-model"))[0] != keys[0]
    assert block_keys([7] + tokens[1:], 128, seed)[1] != keys[1]  # a block's key covers its whole prefix


def test_a_prompt_of_token_ids_is_taken_as_it_is_and_anything_else_is_not():
    assert token_ids([5, 0, 2**32 - 1]).tolist() == [5, 0, 2**32 - 1]
    for prompt in ([], [-1, 2], [2**32], [1.5], ["a"], [[1, 2]], "1 2", None):
        assert token_ids(prompt) is None, prompt


def test_prompt_key_cache_keys_as_block_keys_do_whatever_the_prompts_share():
    """Agents' next turns extend earlier prompts; others share only a system prompt, or nothing: the cache's
    keys are always exactly block_keys'."""
    import random
    from array import array

    from routing.kvindex.blocks import PromptKeyCache

    cache = PromptKeyCache(max_bytes=200_000, per_head=2)
    rng = random.Random(7)
    seed = chain_seed(MODEL_NAME)
    history: list[list[int]] = []
    for _ in range(400):
        if history and rng.random() < 0.7:
            base = rng.choice(history)
            tokens = base[: rng.randrange(len(base) + 1)] + [
                rng.randrange(60) for _ in range(rng.randrange(300))
            ]
        else:
            tokens = [5] * 128 + [rng.randrange(60) for _ in range(rng.randrange(2000))]
        history.append(tokens)
        ids = array("I", tokens)
        assert cache.hex_keys(ids, 128, seed) == [k.hex() for k in block_keys(ids, 128, seed)]
    assert cache._bytes <= 200_000 + 4 * 2300


def test_a_text_sharing_a_recent_ones_start_tokenises_as_if_alone(tokenizer):
    """What a next turn reuses of a recent text ends just after a special token, so the ids are exactly those
    of tokenising the text on its own, wherever the two part (inside a word, just before a special token)."""
    import random

    from tokenizers import Tokenizer

    plain = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    rng = random.Random(3)
    words = [
        "def",
        " parse",
        "(line",
        "):",
        "\n",
        " return",
        "<|im_start|>",
        "<|im_end|>",
        "user",
        "assistant",
        "é",
    ]
    texts = ["<|im_start|>system\nYou are a coding agent.<|im_end|>\n"]
    for _ in range(300):
        base = rng.choice(texts)
        cut = rng.randrange(len(base) + 1)
        text = base[:cut] + "".join(rng.choice(words) for _ in range(rng.randrange(1, 30)))
        texts.append(text)
        assert list(tokenizer.encode_text(text)) == plain.encode(text, add_special_tokens=False).ids


def test_an_agent_sessions_turns_render_as_each_would_alone():
    """Codex and Claude Code sessions, turn after turn through one tokenizer (which reuses what earlier turns
    converted and rendered), give the prompt a fresh tokenizer gives each turn alone; namespaced tools and
    calls appear by their flat names."""
    from .render_corpus import AGENT_CASES

    session = RouterTokenizer(MODEL_DIR)
    for case in AGENT_CASES:
        alone = RouterTokenizer(MODEL_DIR).render_request(case.payload, case.path)
        assert session.render_request(case.payload, case.path) == alone, case.name
        assert list(session.encode_request(case.payload, case.path)) == list(
            RouterTokenizer(MODEL_DIR).encode_text(alone)
        )
    codex = AGENT_CASES[1]
    text = session.render_request(codex.payload, codex.path)
    assert '"name": "mcp__docs__search"' in text and "web_search" not in text
    assert text.count('<tool_call>\n{"name": "mcp__docs__search"') == 1
