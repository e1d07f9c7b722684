"""The autoscaler on the virtual clock: serving/autoscaling.py's own rule (`recommend`, with `Signals` and `Trend`
from its `growth`) and `stabilise`, evaluated every `interval_s` (the worker's AUTOSCALER_INTERVAL_S) on each
simulated pool that has a policy: the aggregated pool, or a P/D deployment's decode and prefill pools, each with
its own policy and each read as its role reads it (`role_signals`: a prefill pool by its prompt backlog and TTFT, a
decode pool by its sequences, KV use and inter-token latency). An engine asked for is ready `startup_s` later; one let go leaves the routing at once and stops
when it has drained (nothing running or waiting). Each engine's lifetime, start to stop, is its engine-time.

What is the simulation's, because the platform's pass (`autoscale_all`) reads and writes the database and Redis:
the signals are read from the simulated engines as `pool_signals` reads the scraped loads (running + waiting,
mean KV use over the pool's ready engines, the routers' uncached prompt backlog: `EndpointLoad.prefill_left`); TTFT p90
over the latency window from the simulated requests (the ledger's figure); the recommendations of the last
windows and the trend's samples are kept in memory instead of Redis; the start-up time is given
(`startup_seconds` reads the pool's recorded lifetimes). The inter-token latency p90 is the ledger's figure too
(`latency_p90s`): over the requests finished in the window with more than one output token, each one's time from
its first token to its last over its output tokens less one. Both p90s are taken by rank, where the database
interpolates. Which engine goes on a scale-down: the ready one with the fewest requests in flight (the latest
started among equals).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .django_env import ensure_django

ensure_django()

from serving.autoscaling import (  # noqa: E402
    TREND_WINDOW_S,
    Signals,
    Trend,
    growth,
    recommend,
    role_signals,
    stabilise,
)
from serving.models import AutoscalingPolicy  # noqa: E402

# The policy's thresholds and steps: its model's own fields, less the pool it belongs to and the bookkeeping.
POLICY_FIELDS = {
    f.name
    for f in AutoscalingPolicy._meta.concrete_fields
    if not f.primary_key and not f.is_relation and f.name not in {"enabled", "paused_reason", "updated_at"}
}


@dataclass
class Autoscale:
    """`Simulation(autoscale=Autoscale(...))`: the pool's AutoscalingPolicy fields, its start-up time, the pass
    interval and the latency window (the worker's settings' defaults)."""

    policy: dict = field(default_factory=dict)
    startup_s: float = 60.0
    interval_s: float = 5.0
    latency_window_s: float = 60.0

    def __post_init__(self):
        unknown = sorted(set(self.policy) - POLICY_FIELDS)
        if unknown:
            raise ValueError(f"unknown autoscaling policy fields: {', '.join(unknown)}")
        if self.startup_s < 0 or self.interval_s <= 0 or self.latency_window_s <= 0:
            raise ValueError("startup_s must be >= 0, interval_s and latency_window_s > 0")


class Autoscaler:
    def __init__(self, sim, spec: Autoscale | dict, pool_id: int = 1, role: str = "both"):
        if isinstance(spec, dict):  # Autoscale's fields
            spec = Autoscale(**spec)
        self.sim = sim
        self.spec = spec
        self.pool_id = pool_id
        self.role = role
        self.policy = AutoscalingPolicy(
            enabled=True, **spec.policy
        )  # never saved: recommend reads its fields
        if self.policy.min_replicas > self.policy.max_replicas:
            raise ValueError("min_replicas is above max_replicas")
        self.history: list[tuple[float, int]] = []  # (time, recommended replicas)
        self.samples: deque[tuple[float, Signals]] = deque()  # this pool's passes, for the trend
        self.ttfts: deque[tuple[float, float]] = deque()  # (first token at, TTFT) over the latency window
        self.itls: deque[tuple[float, float]] = deque()  # (finished at, mean inter-token gap) over the window
        self.replicas = len(sim.pool_endpoints(pool_id))  # what the pool asks for: ready and starting
        self.timeline: list[tuple[float, int, int]] = []  # (time, replicas asked, engines ready)

    def first_token(self, at: float, ttft: float) -> None:
        self.ttfts.append((at, ttft))

    def finished(self, at: float, seq) -> None:
        output = seq.request.output_tokens
        if output > 1 and seq.first_token_s >= 0:
            self.itls.append((at, (at - seq.first_token_s) / (output - 1)))

    def _p90(self, window: deque[tuple[float, float]], now: float) -> float | None:
        """The p90 (by rank) of a latency window's values, once those older than the window have left it."""
        while window and now - window[0][0] > self.spec.latency_window_s:
            window.popleft()
        if not window:
            return None
        values = sorted(v for _, v in window)
        return values[min(len(values) - 1, math.ceil(0.9 * len(values)) - 1)]

    def signals(self, now: float) -> Signals:
        sim = self.sim
        ready = sim.pool_endpoints(self.pool_id)
        running = queued = 0.0
        kv = []
        for eid in ready:
            load = sim.loads[eid]
            running += load.running + load.waiting  # as scraped
            kv.append(load.kv_usage)
            queued += load.prefill_left(now)
        ttft, itl = (self._p90(window, now) for window in (self.ttfts, self.itls))
        return role_signals(self.role, len(ready), queued, running, kv, (ttft, itl, len(self.ttfts)))

    def trend(self, now: float, signals: Signals) -> Trend:
        while self.samples and now - self.samples[0][0] > TREND_WINDOW_S:
            self.samples.popleft()

        def slope(name: str) -> float:
            new = getattr(signals, name)
            if new is None:
                return 0.0
            points = [(t, getattr(s, name)) for t, s in self.samples if getattr(s, name) is not None]
            return growth([*points, (now, new)])

        return Trend(slope("queued_prompt_tokens"), slope("running_requests"), slope("kv_cache_utilization"))

    def tick(self, now: float) -> None:
        """One pass of the worker's autoscaler over the pool."""
        policy = self.policy
        signals = self.signals(now)
        trend = self.trend(now, signals)
        self.samples.append((now, signals))
        recommendation = recommend(policy, self.replicas, signals, trend, self.spec.startup_s)
        self.history.append((now, recommendation.replicas))
        keep = max(policy.scale_up_window_s, policy.scale_down_window_s)
        while self.history and now - self.history[0][0] > keep + 1:
            self.history.pop(0)
        target = stabilise(
            self.history, now, self.replicas, policy.scale_up_window_s, policy.scale_down_window_s
        )
        if target > self.replicas:
            for _ in range(target - self.replicas):
                self.sim.start_engine(now, self.spec.startup_s, self.pool_id)
        elif target < self.replicas:
            for _ in range(self.replicas - target):
                self.sim.drain_engine(now, self.pool_id)
        self.replicas = target
        self.timeline.append((now, target, len(self.sim.pool_endpoints(self.pool_id))))
