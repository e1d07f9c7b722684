"""Scorer of an engine's KV-cache use, as its /metrics last said."""

from __future__ import annotations


class KvUtilizationScorer:
    """The share of the engine's KV cache still free."""

    def score(self, ctx, candidates, policy):
        return [1.0 - min(1.0, max(0.0, c.load.kv_usage)) for c in candidates]
