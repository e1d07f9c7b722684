"""Filters: which of a deployment's endpoints (of the roles asked for) may take the request at all."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .framework import Candidate, RequestContext


def not_excluded(ctx: RequestContext, candidates: list[Candidate]) -> list[Candidate]:
    """Not an endpoint this request already tried."""
    return [c for c in candidates if c.endpoint.id not in ctx.exclude]
