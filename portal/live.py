"""Live traffic per deployment and per tenant over the last few seconds.

Fed from the usage stream and the ledger together: an event stays in the stream until its ledger row has
committed, so every recent request is in one or the other (or both, counted once by request id).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta

from serving.models import ModelDeployment
from tenants.models import Tenant, UsageRecord
from tenants.usage_stream import FIELD, MalformedEvent, UsageEvent, stream_key, usage_redis

WINDOW_S = 10


def _recent_events(since: datetime) -> dict[str, dict]:
    seen: dict[str, dict] = {}
    for r in UsageRecord.objects.filter(created_at__gte=since).values(
        "request_id", "tenant_id", "deployment_id", "prompt_tokens", "cached_prompt_tokens", "output_tokens",
        "ttft_ms", "status",
    ):  # fmt: skip
        seen[r["request_id"]] = r
    for _, fields in usage_redis().xrange(stream_key(), min=f"{int(since.timestamp() * 1000)}-0"):
        try:
            event = UsageEvent.decode(fields.get(FIELD, ""))
        except MalformedEvent:
            continue
        if event.created_at >= since:
            seen.setdefault(event.request_id, {k: getattr(event, k) for k in _KEYS})
    return seen


_KEYS = ("request_id", "tenant_id", "deployment_id", "prompt_tokens", "cached_prompt_tokens", "output_tokens",
         "ttft_ms", "status")  # fmt: skip


def _summarise(events: list[dict], window_s: int) -> dict:
    ttfts = [e["ttft_ms"] for e in events if e["ttft_ms"] is not None]
    prompt = sum(e["prompt_tokens"] for e in events)
    cached = sum(e["cached_prompt_tokens"] for e in events)
    return {
        "requests": len(events),
        "rps": round(len(events) / window_s, 2),
        "ttft_ms": round(sum(ttfts) / len(ttfts)) if ttfts else None,
        "input_tokens_per_s": round(prompt / window_s, 1),
        "output_tokens_per_s": round(sum(e["output_tokens"] for e in events) / window_s, 1),
        "prefix_hit_rate": round(cached / prompt, 3) if prompt else None,
        "errors": sum(1 for e in events if e["status"] != "completed"),
    }


def live_traffic(*, window_s: int = WINDOW_S, now: datetime | None = None) -> dict:
    """Requests/s, mean TTFT, tokens/s, prefix-hit rate and errors per deployment and per tenant."""
    now = now or datetime.now(UTC)
    events = list(_recent_events(now - timedelta(seconds=window_s)).values())
    by_deployment: dict = defaultdict(list)
    by_tenant: dict = defaultdict(list)
    for e in events:
        by_deployment[e["deployment_id"]].append(e)
        by_tenant[e["tenant_id"]].append(e)
    names = dict(ModelDeployment.objects.values_list("id", "name"))
    tenants = dict(Tenant.objects.values_list("id", "slug"))
    return {
        "at": now.isoformat(),
        "window_s": window_s,
        "total": _summarise(events, window_s),
        "deployments": [
            {"name": names.get(k, "(none)"), **_summarise(v, window_s)}
            for k, v in sorted(by_deployment.items(), key=lambda kv: names.get(kv[0], ""))
        ],
        "tenants": [
            {"name": tenants.get(k, str(k)), **_summarise(v, window_s)}
            for k, v in sorted(by_tenant.items(), key=lambda kv: tenants.get(kv[0], ""))
        ],
    }
