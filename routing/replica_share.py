"""What the router replicas share through Redis: a hash per endpoint or deployment, a field per replica, each field
stamped with the unix time its replica wrote it. The loads (routing/load.py), the fair-share work and the queues
(routing/flow.py) are shared so, every ROUTER_LOAD_SHARE_SECONDS; the drain, the autoscaler and the portal read
them too. A field older than MAX_AGE_S is a replica gone."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

TTL_S = 10  # a hash outlives the last replica that wrote it by this long
MAX_AGE_S = 3.0

T = TypeVar("T")


def others_fields(
    published: dict[bytes, bytes], replica_id: str, wall: float, read: Callable[[bytes], tuple[float, T]]
) -> tuple[list[tuple[float, T]], list[bytes]]:
    """The fields of the replicas other than `replica_id` ("": every replica's) in a hash as HGETALL returns it,
    each read by `read` into its unix time and its value: (age, value) of each fresh one, and the names of the
    others, older than MAX_AGE_S (a replica gone) or unreadable."""
    fresh: list[tuple[float, T]] = []
    stale: list[bytes] = []
    mine = replica_id.encode()
    for name, raw in published.items():
        if name == mine:
            continue
        try:
            at, value = read(raw)
        except (ValueError, KeyError, TypeError, AttributeError):
            stale.append(name)
            continue
        age = wall - at
        if age <= MAX_AGE_S:
            fresh.append((age, value))
        else:
            stale.append(name)
    return fresh, stale
