"""Token ids of text pieces, shared by every router replica and tokenizing worker through Redis.

A conversation's next turn reaches whichever replica the balancer picks. The replica that did not see the turns
before it would tokenise everything they added (about 1 us a token: 200 ms for a 200K-token context), and with
R replicas behind a round-robin balancer the fleet tokenised each conversation up to R times. Here a piece of
rendered text (the text between two special tokens, which tokenises alike wherever it stands, routing/rendering/tokenize.py)
is stored once under a digest of its text and of the tokenizer, and any replica reads its ids back instead of
tokenising it again.

Only large pieces are shared, and only for a prompt with enough text the replica has not tokenised: a round trip
costs more than tokenising a few hundred characters. Redis failing is a cache miss, never a failed request.
Each piece lives `ttl_s` after it was last written; its size in Redis is 4 bytes a token, plus the key.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import redis

from routing.contracts import SHARED_TOKENS_PREFIX

log = logging.getLogger(__name__)

WARN_EVERY_S = 60.0


def tokenizer_fingerprint(folder: Path) -> str:
    """A digest of the tokenizer's own definition: replicas share ids only for the very same tokenizer."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update((folder / "tokenizer.json").read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Sharing:
    """Where and what to share (the router's settings), as the router hands it to its tokenizing workers."""

    redis_url: str
    min_piece_chars: int
    min_request_chars: int
    ttl_s: int

    @classmethod
    def from_settings(cls) -> Sharing | None:
        from django.conf import settings

        if not settings.ROUTER_SHARED_TOKENS:
            return None
        return cls(
            settings.REDIS_URL,
            settings.ROUTER_SHARED_TOKENS_MIN_PIECE_CHARS,
            settings.ROUTER_SHARED_TOKENS_MIN_REQUEST_CHARS,
            settings.ROUTER_SHARED_TOKENS_TTL_SECONDS,
        )

    def pieces_for(self, folder: Path) -> SharedPieces:
        """The shared ids of the tokenizer in `folder`."""
        client = redis.Redis.from_url(self.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        return SharedPieces(
            client,
            tokenizer_fingerprint(folder),
            min_piece_chars=self.min_piece_chars,
            min_request_chars=self.min_request_chars,
            ttl_s=self.ttl_s,
        )


class SharedPieces:
    """Ids of text pieces in Redis, read and written in one round trip each (sync: it runs on the tokenizing
    thread or in a tokenizing worker, never on the event loop)."""

    def __init__(
        self,
        client: redis.Redis,
        fingerprint: str,
        *,
        min_piece_chars: int,
        min_request_chars: int,
        ttl_s: int,
    ):
        self.client = client
        self.prefix = f"{SHARED_TOKENS_PREFIX}:{fingerprint}:"
        self.min_piece_chars = min_piece_chars
        self.min_request_chars = min_request_chars
        self.ttl_s = ttl_s
        self.hits = 0
        self.misses = 0
        self.errors = 0
        self._warned_at = 0.0

    def key(self, text: str) -> str:
        return self.prefix + hashlib.blake2b(text.encode(errors="surrogatepass"), digest_size=16).hexdigest()

    def wanted(self, pieces: list[str]) -> list[str]:
        """The pieces worth asking for: the large ones, when there is enough text in all to pay the trip."""
        if sum(len(piece) for piece in pieces) < self.min_request_chars:
            return []
        return [piece for piece in pieces if len(piece) >= self.min_piece_chars]

    def get_many(self, pieces: list[str]) -> list[array | None]:
        """The ids stored for each piece, None where there are none (or Redis could not be read)."""
        try:
            values = self.client.mget([self.key(piece) for piece in pieces])
        except redis.RedisError as exc:
            self._failed("read", exc)
            return [None] * len(pieces)
        found: list[array | None] = []
        for value in values:
            if value is None:
                found.append(None)
                continue
            ids = array("I")
            ids.frombytes(value)
            if sys.byteorder != "little":
                ids.byteswap()
            found.append(ids)
        hits = sum(ids is not None for ids in found)
        self.hits += hits
        self.misses += len(found) - hits
        return found

    def put_many(self, pieces: dict[str, array]) -> None:
        """Store the ids of newly tokenised pieces for the other replicas."""
        if not pieces:
            return
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for text, ids in pieces.items():
                    if sys.byteorder != "little":
                        ids = array("I", ids)
                        ids.byteswap()
                    pipe.set(self.key(text), ids.tobytes(), ex=self.ttl_s)
                pipe.execute()
        except redis.RedisError as exc:
            self._failed("write", exc)

    def _failed(self, what: str, exc: Exception) -> None:
        self.errors += 1
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("shared token ids: could not %s Redis (%s); tokenising locally", what, exc)
