"""KV-cache events over ZMQ, framed and encoded as vLLM's ZmqEventPublisher does.

Each message has three frames: the topic, an 8-byte big-endian sequence number, and a msgpack payload
`[timestamp, [event, ...], data_parallel_rank]` whose events are maps tagged by `type`. An endpoint with a
wildcard host binds (subscribers connect to each engine); a concrete host connects to a central subscriber.
With a replay endpoint, a ROUTER socket resends buffered batches from a requested sequence number.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import msgpack
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)
END_SEQ = b"\xff" * 8


def is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Collects the events of one engine step and publishes them as one batch."""

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ):
        self.endpoint = endpoint
        self.topic = topic.encode()
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if is_bind_endpoint(endpoint):
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._pending: list[dict] = []
        self._flush_scheduled = False
        self._replay_task: asyncio.Task | None = None

    def start(self) -> None:
        if self._replay is not None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def add(self, event: dict) -> None:
        """Queue an event; all events added in one turn of the event loop go out as one batch."""
        self._pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def block_stored(self, event: dict) -> None:
        stored = {
            "type": "BlockStored",
            "block_hashes": event["block_hashes"],
            "parent_block_hash": event["parent_block_hash"],
            "token_ids": event["token_ids"],
            "block_size": event["block_size"],
            "lora_id": None,
            "medium": event["medium"],
            "lora_name": None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
        if event.get("extra_keys") is not None:  # vLLM omits the field where it has none (its CPU tier)
            stored["extra_keys"] = event["extra_keys"]
        self.add(stored)

    def block_removed(self, event: dict) -> None:
        self.add(
            {
                "type": "BlockRemoved",
                "block_hashes": event["block_hashes"],
                "medium": event["medium"],
                "group_idx": 0,
            }
        )

    def all_cleared(self) -> None:
        self.add({"type": "AllBlocksCleared"})

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._pending:
            return
        events, self._pending = self._pending, []
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring a replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(
                        [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                    )
            await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        if self._replay_task:
            self._replay_task.cancel()
        self._flush()
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()
