"""How late the router's event loop runs its callbacks: a timer due every few milliseconds, and by how much it ran
late. Work that holds the loop (a large JSON body parsed, a prompt rendered on the loop's thread, a
long garbage collection) shows as lag, which every request and stream of the replica waits out.

`router_event_loop_lag_seconds` records each probe's lag; `late_by` tells a timer that fired late whether the loop,
rather than what it waited for, was slow (routing/kvindex/prefix.py gives the index lookup one more period then).
"""

from __future__ import annotations

import asyncio
import time

from routing.server import metrics

# Each tick wakes the loop, about 40 us of CPU here: 50 a second cost a replica 2 ms/s. A stall still delays the
# tick due within it by what is left of the stall, so no stall longer than the interval goes unseen.
PROBE_INTERVAL_S = 0.02


class LoopLag:
    """The probe: a chain of timer callbacks on the loop, each due `interval_s` after the one before ran and
    recording by how much it ran late. No task or future per tick: a tick costs a timer handle and a histogram
    observation, a few microseconds."""

    def __init__(self, interval_s: float = PROBE_INTERVAL_S):
        self.interval_s = interval_s
        self.worst_s = 0.0  # the largest lag seen since the replica started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._observe = metrics.loop_lag.observe

    def start(self) -> None:
        if self._timer is None:
            self._loop = asyncio.get_running_loop()
            self._schedule()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self) -> None:
        self._due = self._loop.time() + self.interval_s
        self._timer = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        lag = max(0.0, self._loop.time() - self._due)
        self._observe(lag)
        if lag > self.worst_s:
            self.worst_s = lag
            metrics.loop_lag_worst.set(lag)
        self._schedule()


def late_by(deadline: float) -> float:
    """How long after `deadline` (time.perf_counter) it is now."""
    return time.perf_counter() - deadline
