"""bench/engine_profile.py's busy neighbours: the other engines kept computing while the first is measured."""

from __future__ import annotations

import time

from bench import harness as h
from bench import prefix_routing as pr
from bench.engine_profile import Neighbours


def test_neighbours_keep_the_other_engines_busy_until_stopped():
    with h.Processes() as procs:
        engine = pr.Engine(0)
        engine.start(procs)
        engine.wait()
        busy = Neighbours([engine.url], pr.MODEL, streams=2)
        try:
            h.wait_until(
                lambda: engine.counters().get("vllm:request_success", 0) >= 2, engine.proc, engine.name, 60
            )
            queried = engine.counters()["vllm:prefix_cache_queries"]
            # Fresh prompts each time: the engine computes them, nothing comes from its cache.
            assert queried >= 2 * Neighbours.PROMPT_TOKENS
            assert engine.counters()["vllm:prefix_cache_hits"] < Neighbours.PROMPT_TOKENS
        finally:
            busy.stop()
        assert not busy._thread.is_alive()
        done = engine.counters()["vllm:request_success"]
        time.sleep(1.0)
        assert engine.counters()["vllm:request_success"] == done  # stopped: nothing more sent
