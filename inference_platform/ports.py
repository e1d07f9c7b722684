"""Free TCP ports on this machine, each handed out once.

Asking the kernel for port 0 gives a port nothing is bound to at that instant, but nothing holds it after the
probe socket closes: two probes in a row can return the same port, and one engine told to serve HTTP and publish
KV events on one port fails to bind the second. So the ports handed out lately are remembered and not handed out
again. (Another process can still take a port between the probe and the bind; callers that start servers retry
on "address already in use".) No Django here: the dev stack, the tests' engine helpers and the benchmarks use it
before any settings exist.

`PLATFORM_PORT_RANGE=LOW-HIGH` confines the ports handed out to that range (probed at random), so that processes
that start servers side by side (the test suite's parallel workers) draw from slices that cannot meet.
"""

from __future__ import annotations

import collections
import os
import random
import socket
import threading
from collections.abc import Collection

# Enough to cover every port one process has in use at once (each engine takes up to three).
REMEMBERED = 4096

_recent: collections.deque[int] = collections.deque(maxlen=REMEMBERED)
_lock = threading.Lock()


def _port_range() -> tuple[int, int] | None:
    text = os.environ.get("PLATFORM_PORT_RANGE", "")
    if not text:
        return None
    try:
        low, high = (int(part) for part in text.split("-"))
    except ValueError:
        raise RuntimeError(
            f"PLATFORM_PORT_RANGE must read LOW-HIGH (e.g. 10000-11999), not {text!r}"
        ) from None
    if not 0 < low <= high < 65536:
        raise RuntimeError(f"PLATFORM_PORT_RANGE {text!r} is not a range of TCP ports")
    return low, high


def _probe(host: str, port: int) -> int | None:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return None
        return sock.getsockname()[1]


def free_port(exclude: Collection[int] = (), host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, not in `exclude`, and not handed out lately by this process."""
    confined = _port_range()
    with _lock:
        for _ in range(1000 if confined else 100):
            port = _probe(host, random.randint(*confined) if confined else 0)
            if port is not None and port not in exclude and port not in _recent:
                _recent.append(port)
                return port
    raise RuntimeError(
        f"no free port found on {host}" + (f" in {confined[0]}-{confined[1]}" if confined else "")
    )


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind `port` now."""
    return _probe(host, port) is not None
