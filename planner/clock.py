"""The virtual clock, and running the routing code on it.

The routing plugins read the time themselves (`time.monotonic()` in routing/picker.py, routing/steps.py and
routing/scorers/queue.py; EndpointLoad's own methods take `now`). `on_clock` swaps the `time` those modules see for
one whose monotonic() is the simulation's clock, for the duration of a run, and restores it after: the routing code
runs unchanged, and nothing outside those modules sees the virtual time.
"""

from __future__ import annotations

import contextlib
import importlib
import time as real_time
from collections.abc import Iterator

# The routing modules that call time.monotonic() during a pick (see docs/planner.md#virtual-time).
TIMED_MODULES = ("routing.picker", "routing.steps", "routing.scorers.queue")


class VirtualClock:
    """Seconds since the start of the trace."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def monotonic(self) -> float:
        return self.now


class _TimeOf:
    """Stands in for the `time` module inside a routing module: monotonic() is virtual, the rest is the real one."""

    def __init__(self, clock: VirtualClock):
        self._clock = clock

    def monotonic(self) -> float:
        return self._clock.now

    def __getattr__(self, name: str):
        return getattr(real_time, name)


@contextlib.contextmanager
def on_clock(clock: VirtualClock, modules: tuple[str, ...] = TIMED_MODULES) -> Iterator[VirtualClock]:
    saved = []
    try:
        for name in modules:
            module = importlib.import_module(name)
            saved.append((module, module.time))
            module.time = _TimeOf(clock)
        yield clock
    finally:
        for module, original in saved:
            module.time = original
