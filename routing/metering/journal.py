"""The usage journal: where a request's usage goes when Redis cannot take it, until Redis can.

Format: one JSON line per request, `{"e": <the usage event>, "s": <its settlement or null>}`, appended and fsynced
once per batch. One directory per machine (`ROUTER_USAGE_JOURNAL_DIR`); each process appends to its own segments,
`<owner>.<n>.jsonl`, and holds an exclusive lock on `<owner>.lock` while it lives, so segments whose lock can be
taken were left by a process that died. At most `ROUTER_USAGE_JOURNAL_MAX_BYTES` per process: an append past it,
or one the disk refuses, marks the journal failed. See docs/routing.md#failures-timeouts-and-metering.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

log = logging.getLogger(__name__)

SEGMENT_BYTES = 16 << 20  # a new segment past this, so a replay reads one bounded file at a time


class JournalError(Exception):
    """The journal could not take the lines (full, or the disk refused them)."""


@dataclass
class Segment:
    path: Path
    owner: str
    size: int


def journal_dir() -> Path:
    return Path(settings.ROUTER_USAGE_JOURNAL_DIR)


def journal_max_bytes() -> int:
    return settings.ROUTER_USAGE_JOURNAL_MAX_BYTES


def journal_line(event_json: str, settlement: dict | None) -> str:
    """One request's line: the event as the stream carries it, and the settlement (`keys`, `args`) if any."""
    return f'{{"e":{event_json},"s":{json.dumps(settlement, separators=(",", ":"))}}}'


def read_lines(path: Path) -> list[tuple[str, dict | None]]:
    """A segment's (event JSON, settlement) pairs. A line cut short by a crash, or unreadable, is skipped: its
    request never ended normally, since a request ends only after its line is on disk."""
    pairs = []
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            line = json.loads(raw)
            event = json.dumps(line["e"], separators=(",", ":"))
            pairs.append((event, line["s"]))
        except (ValueError, KeyError, TypeError):
            log.error("usage journal %s: line %d is unreadable, skipped: %r", path, number, raw[:200])
    return pairs


class Journal:
    def __init__(self, directory: Path | None = None, max_bytes: int | None = None):
        self.directory = Path(directory) if directory is not None else journal_dir()
        self.max_bytes = max_bytes if max_bytes is not None else journal_max_bytes()
        host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())
        self.owner = f"{host}-{os.getpid()}-{os.urandom(3).hex()}"
        self.failed = False  # the last append failed (full, or the disk refused it)
        self.bytes = 0  # in this process's segments not yet replayed
        self._mutex = threading.Lock()
        self._lock_fd: int | None = None
        self._fd: int | None = None  # the segment appended to, opened at the first append
        self._fd_size = 0
        self._next = 0
        self._adopted: dict[str, int] = {}  # dead owners whose lock this process took: their lock's fd

    # --- appending (call from a thread: it waits for the disk) -----------------------------------------
    def append(self, lines: list[str]) -> None:
        """Write the lines and fsync them; raises JournalError when they are not durably written."""
        data = "".join(line + "\n" for line in lines).encode()
        with self._mutex:
            if self.bytes + len(data) > self.max_bytes:
                self.failed = True
                raise JournalError(f"the usage journal is full ({self.bytes} of {self.max_bytes} bytes)")
            try:
                if self._fd is None or self._fd_size >= SEGMENT_BYTES:
                    self._open_segment()
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view) :]
                os.fsync(self._fd)
            except OSError as exc:
                self.failed = True
                self._close_segment()  # a part-written line must not run into the next append's
                raise JournalError(f"the usage journal cannot be written: {exc}") from exc
            self._fd_size += len(data)
            self.bytes += len(data)
            self.failed = False

    def _open_segment(self) -> None:
        self._close_segment()
        self._take_own_lock()
        path = self.directory / f"{self.owner}.{self._next:06d}.jsonl"
        self._next += 1
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._fd_size = 0
        _fsync_dir(self.directory)  # the new file's name is durable too

    def _close_segment(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _take_own_lock(self) -> None:
        if self._lock_fd is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Locked under a temporary name, then renamed: no other process can see the lock file unlocked and
        # take this live process's segments for a dead one's.
        temporary = self.directory / f"{self.owner}.lock.new"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(temporary, self.directory / f"{self.owner}.lock")
        self._lock_fd = fd

    # --- replaying ------------------------------------------------------------------------------------
    def sealed(self) -> list[Segment]:
        """The segments to replay, oldest first: this process's (the one being appended to is closed, so later
        appends start a new one), then those of dead processes whose lock this process takes now."""
        with self._mutex:
            self._close_segment()
            segments = self._segments(self.owner)
        self._adopt_dead()
        for owner in list(self._adopted):
            segments += self._segments(owner)
        return segments

    def done(self, segment: Segment) -> None:
        """A segment is replayed: delete it."""
        segment.path.unlink(missing_ok=True)
        if segment.owner == self.owner:
            with self._mutex:
                self.bytes = max(0, self.bytes - segment.size)
        elif not self._segments(segment.owner):
            (self.directory / f"{segment.owner}.lock").unlink(missing_ok=True)
            os.close(self._adopted.pop(segment.owner))

    def waiting(self) -> bool:
        """Whether anything of this process's is waiting for a replay."""
        return self.bytes > 0

    def probe(self) -> bool:
        """Whether an append would be taken now (room left, and the directory writable); clears `failed`."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            probe = self.directory / f"{self.owner}.probe"
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
                probe.unlink(missing_ok=True)
        except OSError:
            return False
        with self._mutex:
            if self.bytes < self.max_bytes:
                self.failed = False
        return not self.failed

    def close(self) -> None:
        with self._mutex:
            self._close_segment()
        for fd in self._adopted.values():
            os.close(fd)
        self._adopted.clear()
        if self._lock_fd is not None:
            if not self._segments(self.owner):
                (self.directory / f"{self.owner}.lock").unlink(missing_ok=True)
            os.close(self._lock_fd)  # what is left is replayed by the next router to start here
            self._lock_fd = None

    def _segments(self, owner: str) -> list[Segment]:
        if not self.directory.is_dir():
            return []
        segments = []
        for path in sorted(self.directory.glob(f"{owner}.*.jsonl")):
            try:
                segments.append(Segment(path, owner, path.stat().st_size))
            except FileNotFoundError:
                continue
        return segments

    def _adopt_dead(self) -> None:
        if not self.directory.is_dir():
            return
        for lock in self.directory.glob("*.lock"):
            owner = lock.name.removesuffix(".lock")
            if owner == self.owner or owner in self._adopted:
                continue
            try:
                fd = os.open(lock, os.O_WRONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # its owner lives, or another router is replaying it
                continue
            if not lock.exists():  # replayed and removed by another router just before
                os.close(fd)
                continue
            log.warning(
                "usage journal: replaying the segments of %s, a router process that has stopped", owner
            )
            self._adopted[owner] = fd
            if not self._segments(owner):
                lock.unlink(missing_ok=True)
                os.close(self._adopted.pop(owner))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
