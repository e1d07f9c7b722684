"""The KV-event ingester's loop: follow the endpoints, subscribe to their events, keep each stream in sequence.

Connect mode (a SUB socket per endpoint) or central-bind mode (KV_EVENTS_BIND, the topic `kv@HOST:PORT@MODEL`
naming the endpoint). Each batch must follow the previous one in sequence; a gap is filled from the engine's
replay socket when it has one, else the endpoint's entries are dropped and rebuilt, so the index under-reports
rather than claims a block that is gone. See docs/routing.md#prefix-routing.
"""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import urlsplit

import httpx
import redis
import zmq
from django.db import close_old_connections

from inference_platform.config_version import CONFIG_VERSION_KEY
from routing.contracts import PREFIX_BLIND_KEY
from routing.kvindex.kv_ingest import Source, Writes, apply_events, clear_source, clear_stored, decode_payload
from routing.kvindex.prefix_index import EXPIRE_SPECULATIVE
from serving.models import Endpoint, ModelDeployment

log = logging.getLogger(__name__)
END_SEQ = b"\xff" * 8
UNKNOWN = object()
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


class KVIngester:
    def __init__(
        self,
        redis,
        *,
        bind: str | None = None,
        refresh_s: float = 2.0,
        expire_s: float = 1.0,
        replay_timeout_s: float = 2.0,
        max_drain: int = 512,
    ):
        self.redis = redis
        self.bind = bind
        self.refresh_s = refresh_s
        self.expire_s = expire_s
        self.replay_timeout_s = replay_timeout_s
        self.max_drain = max_drain
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.sources: dict[int, Source] = {}
        self.fingerprints: dict[int, tuple] = {}
        self.sockets: dict[int, zmq.Socket] = {}  # endpoint id -> its SUB socket (connect mode)
        self.socket_source: dict[zmq.Socket, int] = {}
        self.replay_endpoints: dict[int, object] = {}
        # Per endpoint, the first batch its last replay applied: live batches at or after it, up to the last one
        # applied, waited in the socket during the replay and are skipped, not taken for an engine restart.
        self.replayed_from: dict[int, int] = {}
        self.by_netloc: dict[str, int] = {}
        self.deployments: list[int] = []
        self.central: zmq.Socket | None = None
        self._expire = redis.register_script(EXPIRE_SPECULATIVE)
        self.writes = Writes(redis)
        self._config_version: bytes | None = None
        self._unknown_topics: set[bytes] = set()
        self.stats = {"batches": 0, "blocks": 0, "gaps": 0, "replays": 0, "restarts": 0}

    # --- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self.bind:
            self.central = self._sub()
            self.central.bind(self.bind)
            self.poller.register(self.central, zmq.POLLIN)
            log.info("kv ingester: central socket bound at %s", self.bind)
        self.refresh()
        self._clear_orphans()

    def run(self, stop: threading.Event) -> None:
        """Follow the engines until `stop`. Redis going away does not end it: events that arrive meanwhile cannot
        be written, so once Redis answers again every endpoint's entries are rebuilt from nothing (and from the
        engine's replay where it has one), as after a restart of the ingester."""
        self.start()
        next_refresh = next_expire = next_version = time.monotonic()
        down_since: float | None = None
        try:
            while not stop.is_set():
                try:
                    if down_since is not None:
                        self.rebuild_all()
                        log.warning(
                            "kv ingester: Redis is back after %.0f s; every endpoint's entries rebuilt",
                            time.monotonic() - down_since,
                        )
                        down_since = None
                    self.poll_once(100)
                    now = time.monotonic()
                    if now >= next_version:
                        next_version = now + 0.25
                        version = self.redis.get(CONFIG_VERSION_KEY)
                        if version != self._config_version:
                            self._config_version = version
                            next_refresh = now
                    if now >= next_refresh:
                        next_refresh = now + self.refresh_s
                        self.refresh()
                    if now >= next_expire:
                        next_expire = now + self.expire_s
                        self.expire_speculative()
                except redis.RedisError as exc:
                    if down_since is None:
                        down_since = time.monotonic()
                        log.warning(
                            "kv ingester: Redis unavailable (%r); its index is rebuilt once it is back", exc
                        )
                    self.writes = Writes(self.redis)  # what was queued is lost with the events it came from
                    stop.wait(0.5)
        finally:
            self.close()

    def rebuild_all(self) -> None:
        """Forget every endpoint and follow them again: their entries cleared, their sequences started anew."""
        for endpoint_id in list(self.sources):
            self.forget(endpoint_id)
        self.refresh()

    def close(self) -> None:
        for sock in [*self.sockets.values(), *([self.central] if self.central else [])]:
            sock.close(0)
        self.sockets.clear()
        self.socket_source.clear()
        self.central = None
        self.ctx.term()

    def _sub(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, 1_000_000)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    # --- endpoints -----------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read the Endpoint rows: subscribe to new ones, forget deleted or restarted ones."""
        close_old_connections()
        try:
            rows = list(
                Endpoint.objects.values_list(
                    "id",
                    "url",
                    "kv_events_endpoint",
                    "pid",
                    "started_at",
                    "pool__deployment_id",
                    "pool__deployment__served_model_name",
                    "pool__deployment__block_size",
                )
            )
            self.deployments = list(ModelDeployment.objects.values_list("id", flat=True))
        except Exception:  # the database is away: keep following what we know
            log.exception("kv ingester: could not read the endpoints")
            return
        seen = set()
        for endpoint_id, url, events, pid, started_at, deployment_id, model, block_size in rows:
            seen.add(endpoint_id)
            fingerprint = (url, events, pid, started_at, deployment_id, model, block_size)
            old = self.fingerprints.get(endpoint_id)
            if old == fingerprint:
                continue
            if old is not None:
                log.info("kv ingester: endpoint %s changed (restarted or moved); clearing it", endpoint_id)
                self.forget(endpoint_id)
            self.follow(endpoint_id, fingerprint)
        for endpoint_id in set(self.sources) - seen:
            log.info("kv ingester: endpoint %s deleted; clearing it", endpoint_id)
            self.forget(endpoint_id)

    def follow(self, endpoint_id: int, fingerprint: tuple) -> None:
        url, events, _, _, deployment_id, model, block_size = fingerprint
        # What an earlier ingester wrote for it may be stale: start from nothing, then replay what we can.
        clear_stored(self.redis, endpoint_id)
        self.sources[endpoint_id] = Source(endpoint_id, deployment_id, model, url, block_size=block_size)
        self.fingerprints[endpoint_id] = fingerprint
        self.by_netloc[urlsplit(url).netloc] = endpoint_id
        if events:
            sock = self._sub()
            sock.connect(events)
            self.sockets[endpoint_id] = sock
            self.socket_source[sock] = endpoint_id
            self.poller.register(sock, zmq.POLLIN)
        log.info("kv ingester: following endpoint %s (%s, events %s)", endpoint_id, url, events or "central")

    def forget(self, endpoint_id: int) -> None:
        self.replayed_from.pop(endpoint_id, None)
        source = self.sources.pop(endpoint_id, None)
        self.fingerprints.pop(endpoint_id, None)
        self.replay_endpoints.pop(endpoint_id, None)
        sock = self.sockets.pop(endpoint_id, None)
        if sock is not None:
            self.poller.unregister(sock)
            self.socket_source.pop(sock, None)
            sock.close(0)
        if source is not None:
            if self.by_netloc.get(urlsplit(source.url).netloc) == endpoint_id:
                del self.by_netloc[urlsplit(source.url).netloc]
            clear_source(self.writes, source)
            self.writes.flush()
        clear_stored(self.redis, endpoint_id)

    def _clear_orphans(self) -> None:
        """Entries of endpoints deleted while no ingester ran."""
        for key in self.redis.scan_iter(match="pxe:*", count=1000):
            endpoint = key.decode().partition(":")[2]
            if endpoint.isdigit() and int(endpoint) not in self.sources:
                log.info("kv ingester: clearing entries of endpoint %s, no longer configured", endpoint)
                clear_stored(self.redis, int(endpoint))

    def expire_speculative(self) -> None:
        now = time.time()
        for deployment_id in self.deployments:
            self._expire(args=[deployment_id, now])

    # --- events --------------------------------------------------------------------------------------
    def poll_once(self, timeout_ms: int) -> int:
        """Wait for events, then apply everything that is waiting in one write. Returns batches applied."""
        ready = dict(self.poller.poll(timeout_ms))
        if not ready:
            return 0
        applied = 0
        for sock in ready:
            for _ in range(self.max_drain):
                try:
                    topic, seq, payload = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                source = self._source_for(sock, topic)
                if source is not None:
                    self._check_topic(source, topic)
                    self.handle(self.writes, source, int.from_bytes(seq, "big"), payload)
                    self._report_mismatch(source)
                    applied += 1
        self.writes.flush()
        return applied

    def _check_topic(self, source: Source, topic: bytes) -> None:
        """The topic `kv@HOST:PORT@MODEL` names the model the engine serves: another model's blocks chain from
        another seed, so none of them would match the router's keys."""
        parts = topic.decode(errors="replace").split("@", 2)
        if len(parts) == 3 and parts[2] and parts[2] != source.model:
            source.mismatch = (
                f"the engine publishes events for model {parts[2]!r}, the deployment serves {source.model!r}"
            )

    def _report_mismatch(self, source: Source) -> None:
        """Loudly, and where the operator looks: an error in the log once a minute, and a flag in Redis that the
        deployment's portal page shows, while the engine's blocks cannot be keyed as the router keys prompts."""
        if source.mismatch is None or time.monotonic() < source.reported_at + 60:
            return
        source.reported_at = time.monotonic()
        log.error(
            "kv ingester: endpoint %s (%s) cannot be indexed: %s; precise routing is blind to it until this is fixed",
            source.endpoint_id,
            source.url,
            source.mismatch,
        )
        key = PREFIX_BLIND_KEY.format(source.deployment_id)
        self.redis.hset(key, str(source.endpoint_id), source.mismatch)
        self.redis.expire(key, 300)

    def _source_for(self, sock: zmq.Socket, topic: bytes) -> Source | None:
        endpoint_id = self.socket_source.get(sock)
        if endpoint_id is None:  # the central socket: the topic says who sent it
            parts = topic.decode(errors="replace").split("@", 2)
            endpoint_id = self.by_netloc.get(parts[1]) if len(parts) == 3 else None
            if endpoint_id is None:
                if topic not in self._unknown_topics:
                    self._unknown_topics.add(topic)
                    log.warning("kv ingester: events with topic %r match no endpoint; dropped", topic)
                return None
        return self.sources.get(endpoint_id)

    def handle(self, writes: Writes, source: Source, seq: int, payload: bytes) -> None:
        """Apply one batch, keeping the stream in sequence."""
        covered_from = self.replayed_from.pop(source.endpoint_id, None)
        if covered_from is not None and covered_from <= seq <= source.last_seq:
            self.replayed_from[source.endpoint_id] = covered_from
            return  # applied from the replay already
        if seq <= source.last_seq:
            log.warning(
                "kv ingester: endpoint %s sequence went back from %s to %s: engine restarted; clearing it",
                source.endpoint_id,
                source.last_seq,
                seq,
            )
            self.stats["restarts"] += 1
            clear_source(writes, source)
            source.last_seq = -1
        if seq != source.last_seq + 1:
            self.stats["gaps"] += 1
            self.resync(writes, source, seq)
            if seq <= source.last_seq:
                return  # the replay covered this batch
        self._apply(writes, source, seq, payload)

    def _apply(self, writes: Writes, source: Source, seq: int, payload: bytes) -> None:
        self.stats["blocks"] += apply_events(writes, source, decode_payload(payload))
        self.stats["batches"] += 1
        source.last_seq = seq

    def resync(self, writes: Writes, source: Source, seq: int) -> None:
        """Fill the gap before `seq` from the replay socket, or start over from `seq`."""
        start = source.last_seq + 1
        log.warning(
            "kv ingester: endpoint %s missed batches %s..%s; resynchronising",
            source.endpoint_id,
            start,
            seq - 1,
        )
        replay = self._replay_endpoint(source)
        batches = self._request_replay(replay, start) if replay else None
        if batches:
            if batches[0][0] == start:
                self.stats["replays"] += 1
            else:
                log.warning(
                    "kv ingester: endpoint %s replay starts at %s, not %s: rebuilding from there",
                    source.endpoint_id,
                    batches[0][0],
                    start,
                )
                clear_source(writes, source)
                source.last_seq = batches[0][0] - 1
            first = source.last_seq + 1
            for replayed_seq, payload in batches:
                if replayed_seq == source.last_seq + 1:
                    self._apply(writes, source, replayed_seq, payload)
            if source.last_seq >= first:
                self.replayed_from[source.endpoint_id] = first
            log.info("kv ingester: endpoint %s replayed up to %s", source.endpoint_id, source.last_seq)
            if source.last_seq + 1 >= seq:
                return
        log.warning(
            "kv ingester: endpoint %s: dropping its entries and rebuilding from batch %s (blocks cached "
            "before the gap stay out of the index)",
            source.endpoint_id,
            seq,
        )
        clear_source(writes, source)
        source.last_seq = seq - 1

    def _replay_endpoint(self, source: Source) -> str | None:
        known = self.replay_endpoints.get(source.endpoint_id, UNKNOWN)
        if known is not UNKNOWN:
            return known
        try:
            response = httpx.get(f"{source.url.rstrip('/')}/kv_event_sources", timeout=1.0)
            response.raise_for_status()
            configs = list(response.json().values())
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.info("kv ingester: no event sources from %s: %s", source.url, exc)
            return None  # ask again at the next gap
        replay = configs[0].get("replay_endpoint") if configs else None
        if replay:
            scheme, _, rest = replay.partition("://")
            host, _, port = rest.rpartition(":")
            if host in WILDCARD_HOSTS:
                replay = f"{scheme}://{urlsplit(source.url).hostname}:{port}"
        self.replay_endpoints[source.endpoint_id] = replay or None
        return replay or None

    def _request_replay(self, endpoint: str, start: int) -> list[tuple[int, bytes]] | None:
        """The engine's buffered batches from `start` on (DEALER to its ROUTER); None when it does not answer."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            batches = []
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    log.warning("kv ingester: replay from %s timed out", endpoint)
                    return None
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                _, _, seq, payload = frames
                if seq == END_SEQ:
                    return batches
                batches.append((int.from_bytes(seq, "big"), payload))
        finally:
            sock.close(0)
