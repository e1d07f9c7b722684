"""Scorers of the work queued at an engine: requests (queue depth) and prompt tokens still to prefill."""

from __future__ import annotations

QUEUE_DEPTH_SCALE = 4


class QueueScorer:
    """Fewer queued and running requests score higher: the requests in flight there from every router replica
    plus the engine's queue, against the deepest queue or QUEUE_DEPTH_SCALE, whichever is more: one or two
    requests in flight is not a queue worth giving a cached prefix up for."""

    def score(self, ctx, candidates, policy):
        depths = [c.load.active + c.load.others_active + c.load.waiting for c in candidates]
        worst = max(max(depths), QUEUE_DEPTH_SCALE)
        return [1.0 - depth / worst for depth in depths]


class PrefillBacklogScorer:
    """Less prefill queued ahead scores higher: the uncached prompt tokens of the requests sent there (by every
    router replica) that have not had a first token yet, against this prompt's length or the longest backlog,
    whichever is more. Counted in the prompt's own length, as the prefix score is, the two trade like for like:
    the time to first token is the prefill waited for plus the prefill the request brings. The queue score counts
    requests; this counts the work in front of this one."""

    def score(self, ctx, candidates, policy):
        now = ctx.now
        backlogs = [c.load.prefill_left(now) + c.load.others_prefill for c in candidates]
        scale = max(max(backlogs), ctx.prompt_tokens_estimate, 1)
        return [1.0 - b / scale for b in backlogs]
