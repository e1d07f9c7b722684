"""The router's /metrics as its operator's scraper reads them: with `Authorization: Bearer <ROUTER_METRICS_TOKEN>`
(routing/server/app.py refuses anyone else)."""

from __future__ import annotations

import httpx
from django.conf import settings


def metrics_headers() -> dict[str, str]:
    return {"authorization": f"Bearer {settings.ROUTER_METRICS_TOKEN}"}


def router_metrics(url: str, timeout: float = 10) -> str:
    """The text of the router's /metrics at `url` (the router's base URL)."""
    reply = httpx.get(f"{url}/metrics", headers=metrics_headers(), timeout=timeout)
    reply.raise_for_status()
    return reply.text
