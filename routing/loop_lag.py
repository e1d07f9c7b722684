"""How late the router's event loop runs its callbacks: a probe that sleeps a few milliseconds and measures by how
much it overslept. Work that holds the loop (a large JSON body parsed, a prompt rendered on the loop's thread, a
long garbage collection) shows as lag, which every request and stream of the replica waits out.

`router_event_loop_lag_seconds` records each probe's lag; `late_by` tells a timer that fired late whether the loop,
rather than what it waited for, was slow (routing/prefix.py gives the index lookup one more period then).
"""

from __future__ import annotations

import asyncio
import time

from . import metrics

PROBE_INTERVAL_S = 0.01


class LoopLag:
    def __init__(self, interval_s: float = PROBE_INTERVAL_S):
        self.interval_s = interval_s
        self.worst_s = 0.0  # the largest lag seen since the replica started
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._probe_forever())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _probe_forever(self) -> None:
        observe = metrics.loop_lag.observe
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, time.perf_counter() - asked - self.interval_s)
            observe(lag)
            if lag > self.worst_s:
                self.worst_s = lag
                metrics.loop_lag_worst.set(lag)


def late_by(deadline: float) -> float:
    """How long after `deadline` (time.perf_counter) it is now."""
    return time.perf_counter() - deadline
