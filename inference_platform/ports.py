"""Free TCP ports on this machine, each handed out once.

Asking the kernel for port 0 gives a port nothing is bound to at that instant, but nothing holds it after the
probe socket closes: two probes in a row can return the same port, and one engine told to serve HTTP and publish
KV events on one port fails to bind the second. So the ports handed out lately are remembered and not handed out
again. (Another process can still take a port between the probe and the bind; callers that start servers retry
on "address already in use".) No Django here: the dev stack, the tests' engine helpers and the benchmarks use it
before any settings exist.
"""

from __future__ import annotations

import collections
import socket
import threading
from collections.abc import Collection

# Enough to cover every port one process has in use at once (each engine takes up to three).
REMEMBERED = 4096

_recent: collections.deque[int] = collections.deque(maxlen=REMEMBERED)
_lock = threading.Lock()


def free_port(exclude: Collection[int] = (), host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, not in `exclude`, and not handed out lately by this process."""
    with _lock:
        for _ in range(100):
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
            if port not in exclude and port not in _recent:
                _recent.append(port)
                return port
    raise RuntimeError(f"no free port found on {host}")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind `port` now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
