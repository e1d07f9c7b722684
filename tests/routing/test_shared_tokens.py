"""Replicas share the token ids of large pieces of text through Redis: a conversation's turn on a replica that did
not see the turns before it reads their ids instead of tokenising them, and the ids are those of tokenising the
whole prompt at once."""

from __future__ import annotations

import time
import uuid

import httpx
import redis
from django.conf import settings

from inference_platform.config_version import bump_config_version
from routing.models import RoutingPolicy
from routing.rendering.shared_tokens import SharedPieces, tokenizer_fingerprint
from routing.rendering.tokenize import RouterTokenizer

from ..serving.engines import MODEL_DIR, MODEL_NAME
from .conftest import make_fleet, start_router, wait_for_version


def _shared(client: redis.Redis, fingerprint: str) -> SharedPieces:
    return SharedPieces(client, fingerprint, min_piece_chars=256, min_request_chars=4096, ttl_s=120)


def _tool_session(turns: int, lines: int = 80) -> list[dict]:
    """A coding agent's conversation: each turn a command and its long, distinct output."""
    messages = [{"role": "system", "content": "You are a coding agent working in a repository. " * 40}]
    for turn in range(turns):
        listing = "".join(
            f"src/module_{turn}_{line}.py: def handler_{line}(event): return {line}\n"
            for line in range(lines)
        )
        messages += [
            {"role": "user", "content": f"Run step {turn}."},
            {"role": "assistant", "content": f"Running `grep -rn handler src/` for step {turn}."},
            {"role": "user", "content": listing},
        ]
    return messages


def test_a_replica_reads_the_ids_another_replica_tokenised():
    client = redis.Redis.from_url(settings.REDIS_URL)
    fingerprint = f"{tokenizer_fingerprint(MODEL_DIR)}-{uuid.uuid4().hex[:8]}"
    first, second = RouterTokenizer(MODEL_DIR), RouterTokenizer(MODEL_DIR)
    first.shared, second.shared = _shared(client, fingerprint), _shared(client, fingerprint)
    alone = RouterTokenizer(MODEL_DIR)
    messages = _tool_session(12)

    ids = first.encode_chat(messages)
    assert first.shared.misses > 0 and first.shared.hits == 0  # it asked, nobody had them: it gave them
    assert list(second.encode_chat(messages)) == list(ids) == list(alone.encode_chat(messages))
    large = [m["content"] for m in messages if len(m["content"]) >= 256]
    assert second.shared.hits == len(large) == second.cache.shared_hits
    # What it tokenised itself: only the short pieces (role headers, short messages), never a large one.
    assert second.cache.misses < alone.cache.misses - len(large) + 1

    # The next turn, on the first replica again: its new text only is new to Redis.
    keys_before = len(client.keys(f"tok:{fingerprint}:*"))
    messages = messages + _tool_session(13)[-3:]
    assert list(first.encode_chat(messages)) == list(alone.encode_chat(messages))
    assert len(client.keys(f"tok:{fingerprint}:*")) == keys_before + 1
    client.delete(*client.keys(f"tok:{fingerprint}:*"))


def test_another_tokenizer_shares_nothing():
    client = redis.Redis.from_url(settings.REDIS_URL)
    one, other = RouterTokenizer(MODEL_DIR), RouterTokenizer(MODEL_DIR)
    one.shared = _shared(client, f"a-{uuid.uuid4().hex}")
    other.shared = _shared(client, f"b-{uuid.uuid4().hex}")
    messages = _tool_session(4)
    one.encode_chat(messages)
    other.encode_chat(messages)
    assert other.shared.hits == 0
    for shared in (one.shared, other.shared):
        client.delete(*client.keys(shared.prefix + "*"))


def test_redis_unreachable_is_a_cache_miss_and_small_prompts_never_ask():
    closed = redis.Redis(host="127.0.0.1", port=1, socket_timeout=0.2, socket_connect_timeout=0.2)
    tokenizer, alone = RouterTokenizer(MODEL_DIR), RouterTokenizer(MODEL_DIR)
    tokenizer.shared = _shared(closed, "unreachable")
    short = [{"role": "user", "content": "Fix the failing test in src/app.py, please."}]
    assert list(tokenizer.encode_chat(short)) == list(alone.encode_chat(short))
    assert tokenizer.shared.errors == 0  # not worth a round trip: not asked
    messages = _tool_session(6)
    assert list(tokenizer.encode_chat(messages)) == list(alone.encode_chat(messages))
    assert tokenizer.shared.errors == 2  # the read and the write failed; the request did not


def shared_pieces(client, pattern: str, expected: int, within: float = 10.0) -> int:
    """How many pieces' ids are in Redis, once `expected` are or `within` seconds have passed: on a busy host a
    router may answer before its worker has written them (it routes without the ids past its tokenizing limit)."""
    deadline = time.monotonic() + within
    while (count := len(client.keys(pattern))) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return count


def test_router_replicas_share_ids_through_their_tokenizing_workers(transactional_db, sim_pair):
    """Two routers over the same engines: a prompt sent to one is tokenised in its worker process, which leaves
    its large pieces' ids in Redis; the next turn, sent to the other router, adds only its new piece."""
    # The engines' 4,096-token context: small prompts, to workers and shared all the same.
    workers = {"ROUTER_TOKENIZE_POOL_MIN_BYTES": "2048", "ROUTER_SHARED_TOKENS_MIN_REQUEST_CHARS": "1024"}
    first = start_router(workers)
    second = start_router(workers)
    client = redis.Redis.from_url(settings.REDIS_URL)
    pattern = f"tok:{tokenizer_fingerprint(MODEL_DIR)}:*"
    client.delete(*client.keys(pattern) or ["none"])
    try:
        fleet = make_fleet(first, sim_pair)
        RoutingPolicy.objects.create(deployment=fleet.deployment, mode="approximate")
        fleet.sync()
        wait_for_version(second, bump_config_version())
        for router, turns in ((first, 2), (second, 3)):
            conversation = _tool_session(turns, lines=12)
            reply = httpx.post(
                f"{router.url}/v1/chat/completions",
                json={"model": MODEL_NAME, "messages": conversation, "max_tokens": 4},
                headers={"authorization": f"Bearer {fleet.key.secret}"},
                timeout=60,
            )
            assert reply.status_code == 200, reply.text
            if router is first:
                large = sum(len(m["content"]) >= 256 for m in conversation)
                assert shared_pieces(client, pattern, large) == large == 3
        assert (
            shared_pieces(client, pattern, large + 1) == large + 1
        )  # the second router's new tool output only
    finally:
        first.stop()
        second.stop()
        client.delete(*client.keys(pattern) or ["none"])
