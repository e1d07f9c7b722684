"""The router measures how late its event loop runs: a loop held by synchronous work shows as lag."""

from __future__ import annotations

import asyncio
import time

import pytest

from routing.server import metrics
from routing.server.loop_lag import LoopLag

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)


def test_a_loop_held_by_synchronous_work_shows_as_lag():
    def lag_count() -> float:
        return next(s.value for s in metrics.loop_lag.collect()[0].samples if s.name.endswith("_count"))

    async def scenario() -> tuple[float, float]:
        lag = LoopLag(0.005)
        lag.start()
        await asyncio.sleep(0.05)
        quiet = lag.worst_s
        time.sleep(0.08)  # a prompt tokenised on the loop's own thread, say
        await asyncio.sleep(0.03)
        lag.stop()
        return quiet, lag.worst_s

    before = lag_count()
    quiet, worst = asyncio.run(scenario())
    assert quiet < 0.05 and 0.07 <= worst < 0.5
    assert metrics.loop_lag_worst._value.get() >= worst
    assert lag_count() - before >= 5
