"""What the operators' health rules watch: deployments, engines, prefix routing and usage metering.

Each check reads what the platform already records: the reconciler's observed status of each deployment
(serving/), the local orchestrator's restart count per engine, the routers' per-minute prefix counters in Redis
(routing/kvindex/prefix_health.py), the usage stream in Redis (tenants/usage_stream.py), and the routers' usage journals
(the journal directory when this machine has it, and the routers' /metrics where listed in
ALERT_ROUTER_METRICS_URLS).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import redis
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from routing.kvindex.prefix_health import MIN_REPORTED_TOKENS, prefix_health_for
from serving.models import DesiredStatus, Endpoint, ModelDeployment, ObservedStatus
from tenants.usage_stream import stream_key

from .models import AlertKind, AlertRule, AlertState
from .observations import Observation

log = logging.getLogger(__name__)

BAD_STATUSES = (ObservedStatus.DEGRADED, ObservedStatus.FAILED)
JOURNAL_METRIC = "router_usage_journal_bytes"


def health_observations(
    rule: AlertRule, now: datetime, previous: dict[str, AlertState]
) -> Iterator[Observation]:
    checks = {
        AlertKind.DEPLOYMENT_HEALTH: _deployment_health,
        AlertKind.ENGINE_CRASH_LOOP: _crash_loops,
        AlertKind.PREFIX_PREDICTION: _prefix_prediction,
        AlertKind.INGESTION_LAG: _ingestion_lag,
        AlertKind.USAGE_JOURNAL: _usage_journal,
    }
    yield from checks[rule.kind](rule, now, previous)


def _deployments(rule: AlertRule):
    qs = ModelDeployment.objects.filter(desired_status=DesiredStatus.RUNNING)
    return qs.filter(pk=rule.deployment_id) if rule.deployment_id else qs


def _deployment_health(rule, now, previous) -> Iterator[Observation]:
    for deployment in _deployments(rule):
        for status in BAD_STATUSES:
            holding = deployment.observed_status == status
            message = f": {deployment.status_message}" if deployment.status_message else ""
            yield Observation(
                key=f"deployment:{deployment.pk}:{status}",
                holding=holding,
                summary=f"Deployment {deployment.name} is {status}{message}"
                if holding
                else f"Deployment {deployment.name} is no longer {status} (now {deployment.observed_status}).",
                details={"deployment": deployment.name, "status": deployment.observed_status},
            )


def _crash_loops(rule, now, previous) -> Iterator[Observation]:
    """An engine restarted after exiting at least `threshold` times within `window_minutes`. The local
    orchestrator counts those restarts per engine (Endpoint.restart_count); each check keeps the counts it saw
    over the window in the condition's state, and the restarts in the window are the newest count less the
    oldest."""
    threshold = rule.threshold_value()
    window = timedelta(minutes=rule.window_minutes)
    endpoints = Endpoint.objects.filter(pool__deployment__in=_deployments(rule)).select_related(
        "pool__deployment"
    )
    for endpoint in endpoints:
        key = f"endpoint:{endpoint.pk}"
        state = previous.get(key)
        samples = [
            s
            for s in (state.details.get("samples", []) if state else [])
            if s[0] >= (now - window).timestamp()
        ]
        samples.append([now.timestamp(), endpoint.restart_count])
        restarts = endpoint.restart_count - min(count for _, count in samples)
        name = f"{endpoint.pool.deployment.name}/{endpoint.name}"
        yield Observation(
            key=key,
            holding=restarts >= threshold,
            summary=f"Engine {name} restarted {restarts} times in the last {rule.window_minutes} minutes "
            f"(health: {endpoint.health}); it is crash-looping."
            if restarts >= threshold
            else f"Engine {name} has stopped crash-looping ({restarts} restarts in the last {rule.window_minutes} "
            "minutes).",
            details={"samples": samples, "restarts": restarts, "engine": name, "url": endpoint.url},
        )


def _redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)


def _prefix_prediction(rule, now, previous) -> Iterator[Observation]:
    """Predicted over engine-reported cached prompt tokens, across every router, over the routers' window."""
    threshold = rule.threshold_value()
    client = _redis()
    for deployment in _deployments(rule):
        summary = prefix_health_for(client, deployment.pk)
        key = f"deployment:{deployment.pk}"
        if summary.reported < MIN_REPORTED_TOKENS or summary.ratio is None:
            yield Observation(key=key, holding=None)
            continue
        holding = summary.ratio < threshold
        yield Observation(
            key=key,
            holding=holding,
            summary=f"Prefix routing of {deployment.name} predicted {summary.ratio:.0%} of the cached tokens the "
            f"engines reported (below {threshold:.0%}): the router is partly blind to what the engines hold."
            if holding
            else f"Prefix routing of {deployment.name} predicts {summary.ratio:.0%} of the engines' cached tokens "
            "again.",
            details={
                "deployment": deployment.name,
                "ratio": round(summary.ratio, 4),
                "predicted": summary.predicted,
                "reported": summary.reported,
                "blind": summary.blind,
            },
        )


def usage_stream_oldest_age(client: redis.Redis) -> tuple[int, float]:
    """Entries waiting in the usage stream, and the age in seconds of the oldest (its id starts with the
    millisecond it was added)."""
    with client.pipeline(transaction=False) as pipe:
        pipe.xlen(stream_key())
        pipe.xrange(stream_key(), count=1)
        length, first = pipe.execute()
    if not length or not first:
        return 0, 0.0
    entry_id = first[0][0]
    added_ms = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])
    return int(length), max(0.0, time.time() - added_ms / 1000)


def _ingestion_lag(rule, now, previous) -> Iterator[Observation]:
    threshold = rule.threshold_value()
    try:
        length, age = usage_stream_oldest_age(_redis())
    except redis.RedisError as exc:
        log.warning("alerts: cannot read the usage stream: %s", exc)
        yield Observation(key="usage-stream", holding=None)
        return
    holding = age > threshold
    yield Observation(
        key="usage-stream",
        holding=holding,
        summary=f"Usage ingestion is lagging: {length} usage events wait to be written to the ledger, the oldest "
        f"for {age:.0f} s (threshold {threshold:.0f} s). Is the Celery worker running?"
        if holding
        else "Usage ingestion has caught up.",
        details={"entries": length, "oldest_age_s": round(age, 1)},
    )


def _journal_bytes_on_disk() -> int:
    directory = Path(settings.ROUTER_USAGE_JOURNAL_DIR)
    if not directory.is_dir():
        return 0
    return sum(path.stat().st_size for path in directory.glob("*.jsonl"))


def _journal_bytes_of_router(url: str) -> int | None:
    headers = (
        {"Authorization": f"Bearer {settings.ROUTER_METRICS_TOKEN}"} if settings.ROUTER_METRICS_TOKEN else {}
    )
    try:
        response = httpx.get(url, headers=headers, timeout=5)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        log.warning("alerts: cannot read %s: %s", url, exc)
        return None
    total = 0
    for family in text_string_to_metric_families(response.text):
        if family.name == JOURNAL_METRIC:
            total += int(sum(sample.value for sample in family.samples))
    return total


def _usage_journal(rule, now, previous) -> Iterator[Observation]:
    """Usage a router could not hand to Redis waits in its journal: metering is late, and a full journal makes
    the router refuse new work."""
    sources = {"journal:local": _journal_bytes_on_disk()}
    for url in settings.ALERT_ROUTER_METRICS_URLS:
        sources[f"journal:{url}"[:200]] = _journal_bytes_of_router(url)
    for key, size in sources.items():
        where = key.removeprefix("journal:")
        where = "this machine's journal directory" if where == "local" else where
        yield Observation(
            key=key,
            holding=None if size is None else size > 0,
            summary=f"The usage journal is in use ({where}: {size} bytes): routers cannot write usage to Redis "
            "and keep it on disk until Redis takes it again."
            if size
            else f"The usage journal is empty again ({where}).",
            details={"bytes": size, "source": where},
        )
