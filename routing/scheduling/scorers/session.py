"""Scorer of session affinity: the engine that served this conversation's last turn."""

from __future__ import annotations


class SessionAffinityScorer:
    """1 for the engine that served this session last (`x-session-id`, or an agent's own id: routing/server/sessions.py)."""

    def score(self, ctx, candidates, policy):
        return [1.0 if c.endpoint.id == ctx.session_endpoint else 0.0 for c in candidates]
