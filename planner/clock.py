"""The virtual clock a simulation runs on.

The routing plugins read the time from `RequestContext.now`, which the pipeline sets from its clock at each choice
(routing/scheduling/pipeline.py: `time.monotonic` in the router); a simulation gives its pipeline this clock's `monotonic`,
so the routing code runs unchanged on virtual time, and nothing else sees it.
"""

from __future__ import annotations


class VirtualClock:
    """Seconds since the start of the trace."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def monotonic(self) -> float:
        return self.now
