"""Live traffic per deployment and per tenant over the last few seconds, and flow control's queues.

Fed from the usage stream and the ledger together: an event stays in the stream until its ledger row has
committed, so every recent request is in one or the other (or both, counted once by request id).

Flow control (routing/scheduling/flow.py) per deployment, by priority class and tenant: the requests waiting in the
routers now (each router replica publishes its queue in the hash `flow:queue:<deployment id>`, a field per
replica; a replica's entry gone stale is left out, routing/contracts.py), and from the window's usage events
the dispatches (the requests not rejected) and the wait in the queue (`queued_ms`, of every request that has one:
a rejected request waited its class's whole limit).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import redis

from routing.contracts import QUEUE_KEY, others_fields, read_queue
from serving.models import ModelDeployment
from tenants.models import PRIORITY_RANK, Tenant, UsageRecord, UsageStatus
from tenants.usage_stream import FIELD, MalformedEvent, UsageEvent, stream_key, usage_redis

WINDOW_S = 10
_KEYS = ("request_id", "tenant_id", "deployment_id", "prompt_tokens", "cached_prompt_tokens", "output_tokens",
         "ttft_ms", "status", "priority_class", "queued_ms")  # fmt: skip


def _recent_events(since: datetime) -> dict[str, dict]:
    seen: dict[str, dict] = {}
    for r in UsageRecord.objects.filter(created_at__gte=since).values(*_KEYS):
        seen[r["request_id"]] = r
    for _, fields in usage_redis().xrange(stream_key(), min=f"{int(since.timestamp() * 1000)}-0"):
        try:
            event = UsageEvent.decode(fields.get(FIELD, ""))
        except MalformedEvent:
            continue
        if event.created_at >= since:
            seen.setdefault(event.request_id, {k: getattr(event, k) for k in _KEYS})
    return seen


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


def queued_now(deployment_ids, *, wall: float | None = None) -> dict[int, dict]:
    """Per deployment with a fresh queue report: whether any router finds it saturated, and the requests
    waiting per (class, tenant id), summed over the router replicas."""
    wall = time.time() if wall is None else wall
    ids = list(deployment_ids)
    try:
        with usage_redis().pipeline(transaction=False) as pipe:
            for deployment_id in ids:
                pipe.hgetall(QUEUE_KEY.format(deployment_id))
            replies = pipe.execute()
    except redis.RedisError:
        return {}
    out: dict[int, dict] = {}
    for deployment_id, replicas in zip(ids, replies, strict=True):
        # A replica's entry this page cannot read does not hide the others'.
        fresh, _ = others_fields(replicas, "", wall, read_queue)
        if not fresh:
            continue
        queued: dict[tuple[str, int], int] = defaultdict(int)
        for _, (_, waiting) in fresh:
            for group, count in waiting.items():
                queued[group] += count
        out[deployment_id] = {
            "saturated": any(saturated for _, (saturated, _) in fresh),
            "queued": dict(queued),
        }
    return out


def _p90(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def _flow(events: list[dict], queued: dict[tuple[str, int], int], tenants: dict[int, str]) -> list[dict]:
    """One row per (class, tenant) with requests waiting now or in the window's events."""
    by_group: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for e in events:
        if e.get("priority_class"):
            by_group[(e["priority_class"], e["tenant_id"])].append(e)
    rows = []
    for priority, tenant_id in set(by_group) | {group for group, count in queued.items() if count}:
        group = by_group.get((priority, tenant_id), [])
        waits = [e["queued_ms"] for e in group if e.get("queued_ms") is not None]
        rows.append(
            {
                "priority_class": priority,
                "tenant": tenants.get(tenant_id, str(tenant_id)),
                "queued": queued.get((priority, tenant_id), 0),
                "dispatches": sum(1 for e in group if e["status"] != UsageStatus.REJECTED),
                "rejected": sum(1 for e in group if e["status"] == UsageStatus.REJECTED),
                "wait_ms_mean": round(sum(waits) / len(waits)) if waits else None,
                "wait_ms_p90": _p90(waits) if waits else None,
                "wait_ms_max": max(waits) if waits else None,
            }
        )
    return sorted(rows, key=lambda r: (PRIORITY_RANK.get(r["priority_class"], 9), r["tenant"]))


def live_traffic(*, window_s: int = WINDOW_S, now: datetime | None = None) -> dict:
    """Requests/s, mean TTFT, tokens/s, prefix-hit rate and errors per deployment and per tenant; per deployment
    also flow control's queue, dispatches and wait per priority class and tenant."""
    now = now or datetime.now(UTC)
    events = list(_recent_events(now - timedelta(seconds=window_s)).values())
    by_deployment: dict = defaultdict(list)
    by_tenant: dict = defaultdict(list)
    for e in events:
        by_deployment[e["deployment_id"]].append(e)
        by_tenant[e["tenant_id"]].append(e)
    names = dict(ModelDeployment.objects.values_list("id", "name"))
    tenants = dict(Tenant.objects.values_list("id", "slug"))
    queues = queued_now(names, wall=now.timestamp())
    for deployment_id in queues:
        by_deployment.setdefault(deployment_id, [])
    deployments = []
    for k, v in sorted(by_deployment.items(), key=lambda kv: names.get(kv[0], "")):
        queue = queues.get(k, {"saturated": None, "queued": {}})
        deployments.append(
            {
                "name": names.get(k, "(none)"),
                **_summarise(v, window_s),
                "saturated": queue["saturated"],
                "queued": sum(queue["queued"].values()),
                "flow": _flow(v, queue["queued"], tenants),
            }
        )
    return {
        "at": now.isoformat(),
        "window_s": window_s,
        "total": _summarise(events, window_s),
        "deployments": deployments,
        "tenants": [
            {"name": tenants.get(k, str(k)), **_summarise(v, window_s)}
            for k, v in sorted(by_tenant.items(), key=lambda kv: tenants.get(kv[0], ""))
        ],
    }
