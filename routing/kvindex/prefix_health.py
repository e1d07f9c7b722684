"""Whether prefix routing sees what the engines hold, per deployment, across every router replica.

Each replica adds, per deployment, the cached tokens it predicted and those the engines then reported, and the
requests it could not render, to per-minute counters in Redis; the ratio is exported as a metric and shown on the
deployment's portal page, flagged when it drifts (a precise scorer that silently scores zero: a hash seed, block
size or topic that does not match the engines'). See docs/routing.md#prefix-routing.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from routing.contracts import PREFIX_BLIND_KEY, PREFIX_HEALTH_KEY
from routing.server import metrics

WINDOW_MINUTES = 5
DRIFT_BELOW = 0.8  # predicted under 80 % of what the engines report: routing is partly blind
MIN_REPORTED_TOKENS = 2048  # below this, too little traffic to judge
FLUSH_SECONDS = 1.0


@dataclass
class HealthSummary:
    predicted: int = 0
    reported: int = 0
    render_failures: dict[str, int] = field(default_factory=dict)
    blind: dict[str, str] = field(default_factory=dict)  # endpoint id -> why the ingester cannot index it

    @property
    def ratio(self) -> float | None:
        return self.predicted / self.reported if self.reported else None

    @property
    def drifting(self) -> bool:
        """Too few of the engines' cached tokens were predicted, over enough traffic to tell."""
        return self.reported >= MIN_REPORTED_TOKENS and self.predicted < DRIFT_BELOW * self.reported


def _summary(rows: list[dict]) -> HealthSummary:
    summary = HealthSummary()
    for row in rows:
        for name, value in row.items():
            name = name.decode() if isinstance(name, bytes) else name
            if name == "predicted":
                summary.predicted += int(value)
            elif name == "reported":
                summary.reported += int(value)
            elif name.startswith("render:"):
                reason = name.removeprefix("render:")
                summary.render_failures[reason] = summary.render_failures.get(reason, 0) + int(value)
    return summary


def _keys(deployment_id: int, now: float) -> list[str]:
    minute = int(now // 60)
    return [PREFIX_HEALTH_KEY.format(deployment_id, minute - back) for back in range(WINDOW_MINUTES)]


class PrefixHealth:
    """One replica's counts since its last flush."""

    def __init__(self):
        self._pending: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._flushed_at = 0.0

    def observed(self, deployment_id: int, predicted: int, reported: int) -> None:
        counts = self._pending[deployment_id]
        counts["predicted"] += predicted
        counts["reported"] += reported

    def render_failed(self, deployment_id: int, reason: str) -> None:
        self._pending[deployment_id][f"render:{reason}"] += 1

    async def flush(self, redis, models: dict[int, str]) -> None:
        """Add this replica's counts to the current minute and read the window back into the gauge, at most
        once per FLUSH_SECONDS. `models`: deployment id -> served model name, of the deployments served."""
        if time.monotonic() - self._flushed_at < FLUSH_SECONDS or not models:
            return
        self._flushed_at = time.monotonic()
        pending, self._pending = self._pending, defaultdict(lambda: defaultdict(int))
        now = time.time()
        async with redis.pipeline(transaction=False) as pipe:
            for deployment_id, counts in pending.items():
                key = PREFIX_HEALTH_KEY.format(deployment_id, int(now // 60))
                for name, value in counts.items():
                    pipe.hincrby(key, name, value)
                pipe.expire(key, (WINDOW_MINUTES + 1) * 60)
            for deployment_id in models:
                for key in _keys(deployment_id, now):
                    pipe.hgetall(key)
            replies = await pipe.execute()
        rows = replies[len(replies) - len(models) * WINDOW_MINUTES :]
        for index, model in enumerate(models.values()):
            summary = _summary(rows[index * WINDOW_MINUTES : (index + 1) * WINDOW_MINUTES])
            if summary.ratio is not None:
                metrics.of(metrics.prediction_ratio, model).set(summary.ratio)


def prefix_health_for(redis, deployment_id: int) -> HealthSummary:
    """The last WINDOW_MINUTES of one deployment, with a synchronous Redis client (the portal's)."""
    with redis.pipeline(transaction=False) as pipe:
        for key in _keys(deployment_id, time.time()):
            pipe.hgetall(key)
        pipe.hgetall(PREFIX_BLIND_KEY.format(deployment_id))
        *rows, blind = pipe.execute()
    summary = _summary(rows)
    summary.blind = {k.decode(): v.decode() for k, v in blind.items()}
    return summary
