"""The Redis layouts that more than one process writes or reads, and their readers, in one place: the router
replicas, the Celery worker (scraper, drain, autoscaler), the KV-event ingester and the portal agree through what
is here. Nothing in this module imports Django, so any of them (and a benchmark) can read it.

Each layout names its writer and its readers. Layouts one process keeps to itself (the index's own Lua scripts'
bookkeeping, the quota scripts' counters) stay with the code that owns them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import NamedTuple, TypeVar

import orjson

from tenants.limits import LIMITS, Limit
from tenants.periods import period_bounds

# --- configuration ------------------------------------------------------------------------------------------
# A counter; bumped by every configuration change (inference_platform/config_version.py), polled by the router
# replicas and the ingester, which reload their snapshots when it moves.
CONFIG_VERSION_KEY = "platform:config:version"

# --- the engines' load, scraped ------------------------------------------------------------------------------
# A hash per endpoint: running, waiting, kv_usage, prefix_hits, prefix_queries (routing/scheduling/load_scraper.py writes it
# from the engine's /metrics every second; the router replicas, the drain, the autoscaler and the portal read it).
LOAD_KEY = "endpoint:load:{}"
LOAD_TTL_S = 10

# --- what the router replicas share --------------------------------------------------------------------------
# A hash per endpoint or deployment, a field per replica, each stamped with the unix time its replica wrote it,
# every ROUTER_LOAD_SHARE_SECONDS. A field older than MAX_AGE_S is a replica gone.
TTL_S = 10  # a hash outlives the last replica that wrote it by this long
MAX_AGE_S = 3.0
# Per endpoint: "<own load> <in flight> <unix time> <prefill backlog>" (routing/scheduling/load.py; read by the drain, the
# autoscaler and the portal too).
REPLICA_LOAD_KEY = "endpoint:replica-load:{}"
# Per deployment: {"at": unix time, "work": {"t<tenant id>" | "m<team id>": decayed work}} (routing/scheduling/flow.py).
SERVED_KEY = "flow:served:{}"
# Per deployment: {"at": unix time, "saturated": bool, "queued": [[class, tenant id, count], ...]} (routing/scheduling/flow.py;
# read by the portal's live page).
QUEUE_KEY = "flow:queue:{}"

T = TypeVar("T")


def others_fields(
    published: dict[bytes, bytes], replica_id: str, wall: float, read: Callable[[bytes], tuple[float, T]]
) -> tuple[list[tuple[float, T]], list[bytes]]:
    """The fields of the replicas other than `replica_id` ("": every replica's) in a hash as HGETALL returns it,
    each read by `read` into its unix time and its value: (age, value) of each fresh one, and the names of the
    others, older than MAX_AGE_S (a replica gone) or unreadable."""
    fresh: list[tuple[float, T]] = []
    stale: list[bytes] = []
    mine = replica_id.encode()
    for name, raw in published.items():
        if name == mine:
            continue
        try:
            at, value = read(raw)
        except (ValueError, KeyError, TypeError, AttributeError):
            stale.append(name)
            continue
        age = wall - at
        if age <= MAX_AGE_S:
            fresh.append((age, value))
        else:
            stale.append(name)
    return fresh, stale


class OthersLoad(NamedTuple):
    load: float  # their weighted load (EndpointLoad.own) there
    active: int  # their requests in flight there
    prefill: float  # their prefill backlog there, in uncached prompt tokens
    # Fields to delete: older than MAX_AGE_S (a replica that died) or unreadable.
    stale: list[bytes]


def _read_load(raw: bytes) -> tuple[float, tuple[float, int, float]]:
    weighted, in_flight, at, backlog = raw.split()
    return float(at), (float(weighted), int(in_flight), float(backlog))


def others_load(published: dict, replica_id: str, now: float) -> OthersLoad:
    """What the other replicas have at an endpoint, from their fields in its hash (REPLICA_LOAD_KEY)."""
    fresh, stale = others_fields(published, replica_id, now, _read_load)
    loads = [value for _, value in fresh]
    return OthersLoad(
        sum((load for load, _, _ in loads), 0.0),
        sum(active for _, active, _ in loads),
        sum((prefill for _, _, prefill in loads), 0.0),
        stale,
    )


def read_queue(raw: bytes) -> tuple[float, tuple[bool, dict[tuple[str, int], int]]]:
    """A replica's published queue (QUEUE_KEY): its unix time, and whether the replica finds the deployment
    saturated and the requests waiting there per (class, tenant id)."""
    data = orjson.loads(raw)
    at = float(data["at"])
    queued: dict[tuple[str, int], int] = {}
    for priority, tenant, count in data["queued"]:
        group = (str(priority), int(tenant))
        queued[group] = queued.get(group, 0) + int(count)
    return at, (bool(data.get("saturated")), queued)


def others_queued(published: dict, replica_id: str, wall: float) -> set[tuple[str, int]]:
    """(class, tenant id) of what waits at the other replicas, from their published queues."""
    fresh, _ = others_fields(published, replica_id, wall, read_queue)
    return {group for _, (_, queued) in fresh for group, count in queued.items() if count}


def _read_work(raw: bytes) -> tuple[float, dict[str, float]]:
    data = orjson.loads(raw)
    return float(data["at"]), {str(who): float(work) for who, work in data["work"].items()}


def others_work(published: dict, replica_id: str, wall: float, tau: float) -> dict[str, float]:
    """The other replicas' decayed work per tenant ("t<id>") and team ("m<id>"), decayed to now."""
    total: dict[str, float] = {}
    for age, work in others_fields(published, replica_id, wall, _read_work)[0]:
        factor = math.exp(-max(0.0, age) / tau)
        for who, value in work.items():
            total[who] = total.get(who, 0.0) + value * factor
    return total


# --- the prefix index ----------------------------------------------------------------------------------------
# Written by the KV-event ingester (routing/kvindex/kv_ingest.py) and the routers' speculative entries
# (routing/kvindex/prefix_index.py), read by the routers; the drain removes a drained endpoint's entries.


def block_hash_key(deployment_id: int, block_key: str) -> str:
    """A hash per block: a field per endpoint holding it ("g" on the GPU, "c" in the CPU tier, "s" speculative)."""
    return f"px:{deployment_id}:{block_key}"


def endpoint_map_key(endpoint_id: int) -> str:
    """A hash per endpoint: each engine block hash (decimal) to "<deployment id>:<block key>" it is indexed under."""
    return f"pxe:{endpoint_id}"


# --- prefix routing's health ---------------------------------------------------------------------------------
# Per deployment and minute since the epoch: the cached tokens the routers predicted and the engines reported, and
# the requests they could not render (the routers add, routing/kvindex/prefix_health.py; the portal and its history read).
PREFIX_HEALTH_KEY = "prefix:health:{}:{}"
# Per deployment: {endpoint id: why the ingester cannot key its blocks} (the KV-event ingester writes; the routers
# and the portal read).
PREFIX_BLIND_KEY = "prefix:blind:{}"

# --- token ids shared across replicas ------------------------------------------------------------------------
# "tok:<tokenizer fingerprint>:<piece digest>": a piece's token ids (routing/rendering/shared_tokens.py; every replica and
# its tokenizing workers write and read).
SHARED_TOKENS_PREFIX = "tok"

# --- the autoscaler ------------------------------------------------------------------------------------------
# Per pool: its latest recommendation, and each pass's replicas and signals, newest first (serving/autoscaling.py
# writes; the portal reads).
AUTOSCALE_RECOMMENDATIONS_KEY = "autoscale:recs:{}"
AUTOSCALE_HISTORY_KEY = "autoscale:history:{}"


# --- quotas ------------------------------------------------------------------------------------------------
# A counter per scope ("tenant", "team", "key") and limit of the limits table (tenants/limits.py): a minute's named
# by its minute (minutes since the epoch), a budget's by its period and start; the running requests' slots one
# sorted set (member: request id, score: its lease deadline). The routers' admission scripts write them
# (routing/metering/admission.py); the worker restores them from the ledger (routing/metering/quota_restore.py) and the portal shows
# them. Money is counted in units of 1/MONEY_SCALE of the currency.
MONEY_SCALE = Decimal("100000000")


def quota_counter_key(
    limit: Limit, kind: str, ident: int, period: str, minute: int, budget_start: int
) -> str:
    base = f"q:{kind}:{ident}:{limit.counter}"
    if limit.window == "minute":
        return f"{base}:{minute}"
    if limit.window == "budget":
        return f"{base}:{period}:{budget_start}"
    return base


def quota_keys(kind: str, ident: int, budget_period: str, minute: int, budget_start: int) -> list[str]:
    """A scope's counters, one per limit in the table's order."""
    return [quota_counter_key(limit, kind, ident, budget_period, minute, budget_start) for limit in LIMITS]


def quota_counters(redis_client, *, kind: str, ident: int, quota) -> dict:
    """What admission has counted against a quota right now (sync client), by limit field: the keys the admission
    script checks, so a page shows what the next request will be judged against. Budgets include the reservations
    of requests still running; spend is in the currency."""
    now = time.time()
    start, _ = period_bounds(quota.budget_period, datetime.fromtimestamp(now, UTC))
    keys = quota_keys(kind, ident, quota.budget_period, int(now // 60), int(start.timestamp()))
    with redis_client.pipeline(transaction=False) as pipe:
        for limit, key in zip(LIMITS, keys, strict=True):
            if limit.counts == "slot":
                pipe.zcount(key, now, "+inf")
            else:
                pipe.get(key)
        values = pipe.execute()
    counted = {}
    for limit, value in zip(LIMITS, values, strict=True):
        value = int(value or 0)
        counted[limit.field] = Decimal(value) / MONEY_SCALE if limit.money else value
    return counted


# --- usage ---------------------------------------------------------------------------------------------------
# Redis's identity for the usage stream: a random value set when missing. A new value means Redis lost its data
# (restarted empty, or failed over to a replica that had not got the latest writes), and with it the events not
# yet in the ledger; each router replica then appends again what it wrote lately (routing/metering/finisher.py; the
# ledger ignores a request id it holds).
USAGE_EPOCH_KEY = "usage:epoch"
