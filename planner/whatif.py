"""The operator's what-if: a recorded period of a deployment's traffic replayed by the fleet simulator on the
deployment as it is (the baseline) and on a fleet with changes, beside what the period actually measured.

What can change (`changes`, all optional):

    {"engines": {"<pool name>": 4},          engines of each pool (the simulator runs a deployment's decode-side
                                             pools, aggregated or decode, as one pool, and its prefill pools as
                                             one prefill pool: the router's prefill/decode plans between them)
     "mode": "least_loaded",                 the routing policy's mode (its weights stay the deployment's)
     "profile": "llama-3.3-70b-h100-tp4",    the GPU type: a profile in planner/profiles/
     "gpu_price_per_hour": 3.5,              the price of one GPU-hour
     "traffic": {"tenants": {"<id>": 2}, "teams": {"<id>": 0.5}, "all": 1}}   planner/whatif_traffic.py

The baseline runs the deployment's pools at their replicas, its routing policy, and `baseline_profile` (by
default the profile named after the deployment, else the simulator's measured profile for a simulated engine,
else the illustrative one) with the first decode-side pool's max_num_seqs and GPUs per replica and the configured
price of its accelerator (portal.AcceleratorPrice) where there is one (one profile for every engine). A changed profile is taken as it is, its price too
unless one is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import BigIntegerField, F, Sum
from django.utils import timezone

from portal.models import AcceleratorPrice
from routing.models import RoutingPolicy, TrafficTraceEntry, policy_fields
from serving.models import ModelDeployment, PoolRole
from tenants.models import Team, Tenant

from .models import RunStatus, WhatIfRun
from .profile import Profile, profile_names
from .report import summarize
from .sim import MODES, simulate
from .trace import TRACE_BLOCK_TOKENS, TraceRequest
from .whatif_traffic import RecordedTrace, Traffic, held_blocks, multiply, recorded_trace

MAX_ENGINES = 1024  # a pool's replicas are capped there too
MAX_FACTOR = 100.0
MAX_REQUESTS = 300_000  # requests one run may replay, multipliers included (about a minute of CPU)
CHANGE_KEYS = {"engines", "mode", "profile", "gpu_price_per_hour", "traffic"}
TRAFFIC_KEYS = {"tenants", "teams", "all"}
# The key of the PostgreSQL advisory lock under which a run takes one of the PLANNER_WHATIF_MAX_RUNNING slots.
SLOTS_LOCK = (0x3F1F, 0)


class WhatIfError(ValueError):
    """Input a what-if cannot run with, by field."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


class WhatIfBusy(Exception):
    """PLANNER_WHATIF_MAX_RUNNING runs are already pending or running: a new one must wait for one to end."""


@dataclass(frozen=True)
class Fleet:
    engines: dict[str, int]  # per pool
    mode: str
    policy: dict  # the routing policy's fields but its mode
    profile: Profile
    price: float  # per GPU-hour
    prefill_pools: frozenset[str] = frozenset()  # the pools of role prefill; the rest are decode-side

    @property
    def total_engines(self) -> int:
        return sum(self.engines.values())

    @property
    def prefill_engines(self) -> int:
        return sum(n for name, n in self.engines.items() if name in self.prefill_pools)

    def describe(self) -> dict:
        return {
            "engines": self.engines,
            "prefill_pools": sorted(self.prefill_pools),
            "mode": self.mode,
            "profile": self.profile.name,
            "gpus_per_engine": self.profile.gpus_per_engine,
            "gpu_price_per_hour": self.price,
        }


# --- input -------------------------------------------------------------------------------------------------


def _number(value, field: str, low: float, high: float) -> float:
    try:
        finite = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        raise WhatIfError({field: f"must be a number from {low:g} to {high:g}"})
    if not low <= value <= high:
        raise WhatIfError({field: f"must be from {low:g} to {high:g}, not {value:g}"})
    return float(value)


def _pools(deployment: ModelDeployment) -> list:
    """The deployment's pools, decode-side ones (aggregated or decode) first."""
    pools = sorted(deployment.pools.order_by("name"), key=lambda p: p.role == PoolRole.PREFILL)
    if not pools:
        raise WhatIfError({"deployment": "the deployment has no pools to simulate"})
    if all(p.role == PoolRole.PREFILL for p in pools):
        raise WhatIfError({"deployment": "the deployment has prefill pools only: nothing would decode"})
    return pools


def default_profile(deployment: ModelDeployment) -> str:
    names = profile_names()
    if deployment.name in names:
        return deployment.name
    return "sim-bench" if deployment.engine_kind == "sim" else "illustrative-8b-h100"


def profile_clean(name, field: str = "profile") -> str:
    if not isinstance(name, str) or name not in profile_names():
        raise WhatIfError({field: f"not a profile in planner/profiles/; one of {', '.join(profile_names())}"})
    return name


def _multipliers(raw, field: str, model) -> dict[str, float]:
    if not isinstance(raw, dict):
        raise WhatIfError({field: "must be an object of id: multiplier"})
    ids = {}
    for key, factor in raw.items():
        if not (str(key).isascii() and str(key).isdigit() and len(str(key)) <= 18):
            raise WhatIfError({field: f"{key!r} is not an id"})
        ids[str(int(key))] = _number(factor, f"{field}.{key}", 0, MAX_FACTOR)
    known = {
        str(pk) for pk in model.objects.filter(pk__in=[int(k) for k in ids]).values_list("pk", flat=True)
    }
    unknown = sorted(set(ids) - known, key=int)
    if unknown:
        raise WhatIfError({field: f"no {model._meta.verbose_name} with id {', '.join(unknown)}"})
    return ids


def changes_clean(deployment: ModelDeployment, changes) -> dict:
    """The changes in their stored form, or WhatIfError saying what is wrong."""
    if changes is None:
        return {}
    if not isinstance(changes, dict):
        raise WhatIfError({"changes": "must be an object"})
    unknown = sorted(set(changes) - CHANGE_KEYS)
    if unknown:
        raise WhatIfError(
            {"changes": f"unknown {', '.join(unknown)}; known: {', '.join(sorted(CHANGE_KEYS))}"}
        )
    out: dict = {}
    pools = {p.name for p in _pools(deployment)}
    if "engines" in changes:
        engines = changes["engines"]
        if not isinstance(engines, dict) or not engines:
            raise WhatIfError({"changes.engines": "must be an object of pool name: engines"})
        for name, n in engines.items():
            if name not in pools:
                raise WhatIfError({"changes.engines": f"no pool {name!r}; pools: {', '.join(sorted(pools))}"})
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_ENGINES:
                raise WhatIfError(
                    {f"changes.engines.{name}": f"must be a whole number from 0 to {MAX_ENGINES}"}
                )
        out["engines"] = dict(engines)
    if "mode" in changes:
        if changes["mode"] not in MODES:
            raise WhatIfError({"changes.mode": f"must be one of {', '.join(MODES)}"})
        out["mode"] = changes["mode"]
    if "profile" in changes:
        out["profile"] = profile_clean(changes["profile"], "changes.profile")
    if "gpu_price_per_hour" in changes:
        out["gpu_price_per_hour"] = _number(
            changes["gpu_price_per_hour"], "changes.gpu_price_per_hour", 0, 1e6
        )
    if "traffic" in changes:
        traffic = changes["traffic"]
        if not isinstance(traffic, dict) or set(traffic) - TRAFFIC_KEYS:
            raise WhatIfError(
                {"changes.traffic": f"must be an object with {', '.join(sorted(TRAFFIC_KEYS))}"}
            )
        clean: dict = {}
        if "tenants" in traffic:
            clean["tenants"] = _multipliers(traffic["tenants"], "changes.traffic.tenants", Tenant)
        if "teams" in traffic:
            clean["teams"] = _multipliers(traffic["teams"], "changes.traffic.teams", Team)
        if "all" in traffic:
            clean["all"] = _number(traffic["all"], "changes.traffic.all", 0, MAX_FACTOR)
        out["traffic"] = clean
    return out


def period_clean(deployment: ModelDeployment, since: datetime, until: datetime, changes: dict) -> int:
    """The number of recorded requests in the period, or WhatIfError when there are none, too many, or too many
    block ids for the multipliers (PLANNER_WHATIF_MAX_BLOCKS), or the period is not over yet."""
    if until <= since:
        raise WhatIfError({"until": "must be after since"})
    if until > timezone.now():
        raise WhatIfError(
            {"until": "must not be in the future: a run replays a period already recorded (at most now)"}
        )
    entries = TrafficTraceEntry.objects.filter(
        deployment_id=deployment.pk, arrived_at__gte=since, arrived_at__lt=until
    )
    count = entries.count()
    if not count:
        raise WhatIfError(
            {
                "since": "no recorded traffic for this deployment in the period (the router records a share of "
                "requests when ROUTER_TRAFFIC_TRACE_RATIO is above 0)"
            }
        )
    traffic = Traffic.from_changes(changes)
    largest = max([1.0, traffic.everyone, *traffic.tenants.values(), *traffic.teams.values()])
    if count * largest > MAX_REQUESTS:
        raise WhatIfError(
            {
                "until": f"{count} recorded requests (x{largest:g} at most) exceed the {MAX_REQUESTS} a run may "
                "replay: choose a shorter period"
            }
        )
    _blocks_clean(_period_blocks(entries, traffic))
    return count


def _period_blocks(entries, traffic: Traffic) -> int:
    """At most the block ids a replay of the entries holds: each request's prompt blocks (one per
    TRACE_BLOCK_TOKENS, as the export numbers them) times its multiplier rounded up, at least once (the baseline
    replays the recording whatever the multiplier)."""
    blocks = (F("prompt_tokens") + (TRACE_BLOCK_TOKENS - 1)) / TRACE_BLOCK_TOKENS  # integer division
    groups = entries.values("tenant_id", "team_id").annotate(
        blocks=Sum(blocks, output_field=BigIntegerField())
    )
    return sum(
        g["blocks"] * max(1, math.ceil(traffic.factor(str(g["tenant_id"]), str(g["team_id"]))))
        for g in groups
    )


def _blocks_clean(blocks: int) -> None:
    limit = settings.PLANNER_WHATIF_MAX_BLOCKS
    if blocks > limit:
        raise WhatIfError(
            {
                "until": f"the period's prompts would hold {blocks} block ids in the replay (each copy a multiplier "
                f"makes counted), over the {limit} a run may hold (PLANNER_WHATIF_MAX_BLOCKS): choose a shorter "
                "period or smaller multipliers"
            }
        )


# --- the two fleets ----------------------------------------------------------------------------------------


def baseline_fleet(deployment: ModelDeployment, profile_name: str) -> Fleet:
    pools = _pools(deployment)
    first = pools[0]  # a decode-side pool
    profile = Profile.load(profile_name).with_(
        max_num_seqs=first.max_num_seqs, gpus_per_engine=max(1, first.gpus_per_replica)
    )
    configured = (
        AcceleratorPrice.objects.filter(accelerator=first.accelerator).first() if first.accelerator else None
    )
    price = float(configured.price_per_gpu_hour) if configured else profile.gpu_price_per_hour
    policy = RoutingPolicy.objects.filter(deployment=deployment).first()
    fields = {f.name: getattr(policy, f.name) for f in policy_fields()} if policy else {"mode": "round_robin"}
    mode = fields.pop("mode")
    return Fleet(
        {p.name: p.replicas for p in pools},
        mode,
        fields,
        profile.with_(gpu_price_per_hour=price),
        price,
        frozenset(p.name for p in pools if p.role == PoolRole.PREFILL),
    )


def changed_fleet(baseline: Fleet, changes: dict) -> Fleet:
    profile = baseline.profile
    price = baseline.price
    if "profile" in changes and changes["profile"] != baseline.profile.name:
        profile = Profile.load(changes["profile"])
        price = profile.gpu_price_per_hour
    price = changes.get("gpu_price_per_hour", price)
    return Fleet(
        {**baseline.engines, **changes.get("engines", {})},
        changes.get("mode", baseline.mode),
        baseline.policy,
        profile.with_(gpu_price_per_hour=price),
        price,
        baseline.prefill_pools,
    )


# --- running -----------------------------------------------------------------------------------------------


def _plain(value):
    """JSON for Postgres: no NaN or infinity (jsonb has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def fleet_clean(fleet: Fleet) -> None:
    if fleet.total_engines - fleet.prefill_engines < 1:
        raise WhatIfError(
            {
                "changes.engines": "the fleet has no engines to decode on: give an aggregated or decode pool one"
            }
        )


def simulate_fleet(
    requests: list[TraceRequest], fleet: Fleet, on_progress: Callable[[float], None] | None = None
) -> dict:
    """The fleet's summary (planner.report.Summary as JSON). `on_progress` hears the share of requests routed,
    about fifty times over the run."""
    fleet_clean(fleet)
    every = max(1, len(requests) // 50)
    routed = 0

    def on_pick(request: TraceRequest, endpoint: int) -> None:
        nonlocal routed
        routed += 1
        if on_progress is not None and routed % every == 0:
            on_progress(routed / len(requests))

    result = simulate(
        requests,
        fleet.total_engines - fleet.prefill_engines,
        fleet.profile,
        fleet.mode,
        policy=fleet.policy,
        on_pick=on_pick,
        prefill_engines=fleet.prefill_engines,
    )
    summary = asdict(summarize(result))
    tenants = {r.tenant for r in requests}
    if not summary["per_tenant"] and len(tenants) == 1:  # the report splits only two tenants or more
        summary["per_tenant"] = {
            tenants.pop(): {
                **{
                    k: summary[k]
                    for k in ("requests", "ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "hit_share")
                },
                "work_share": 1.0,
            }
        }
    return {"fleet": fleet.describe(), **_plain(summary)}


def _over_the_period(fleet: Fleet, requests: list[TraceRequest], hours: float) -> dict:
    """The fleet's GPUs held for the whole period (as the actual engines are counted), and that cost over the
    replayed tokens: comparable with the period's actual GPU-hours and cost per million tokens."""
    gpu_hours = fleet.total_engines * fleet.profile.gpus_per_engine * hours
    tokens = sum(r.input_tokens + r.output_tokens for r in requests)
    cost = gpu_hours * fleet.price
    return {
        "period_gpu_hours": gpu_hours,
        "period_cost": cost,
        "period_cost_per_mtok": cost / tokens * 1_000_000 if tokens else None,
    }


def whatif_execute(run: WhatIfRun, progress: Callable[[int, str], None]) -> dict:
    """Load the period, simulate both fleets, read the period's actual figures: the run's result."""
    from .whatif_actuals import objectives, period_actuals

    deployment = run.deployment
    progress(1, "loading the recorded trace")
    trace = _run_trace(run)
    if not trace.requests:
        raise WhatIfError({"since": "no recorded traffic for this deployment in the period"})
    baseline = baseline_fleet(deployment, run.baseline_profile)
    changed = changed_fleet(baseline, run.changes)
    traffic = Traffic.from_changes(run.changes)
    _blocks_clean(held_blocks(trace, traffic))  # before any copy is made
    replayed = multiply(trace, traffic)
    if not replayed:
        raise WhatIfError({"changes.traffic": "the multipliers leave no requests to replay"})

    def stage(low: int, high: int, label: str) -> Callable[[float], None]:
        return lambda share: progress(low + round((high - low) * share), label)

    progress(5, "simulating the deployment as it is")
    before = simulate_fleet(trace.requests, baseline, stage(5, 50, "simulating the deployment as it is"))
    progress(50, "simulating the changed fleet")
    after = simulate_fleet(replayed, changed, stage(50, 95, "simulating the changed fleet"))
    hours = (min(run.until, timezone.now()) - run.since).total_seconds() / 3600
    for summary, fleet, requests in ((before, baseline, trace.requests), (after, changed, replayed)):
        summary.update(_over_the_period(fleet, requests, max(hours, 0.0)))
    progress(95, "reading the period's actual figures")
    actual = period_actuals(deployment=deployment, since=run.since, until=run.until)
    tenants = {t for s in (before, after) for t in s["per_tenant"]} | set(actual["per_tenant"])
    names = dict(
        Tenant.objects.filter(pk__in=[int(t) for t in tenants if t.isdigit()]).values_list("pk", "name")
    )
    return {
        "trace": {
            "recorded_requests": len(trace.requests),
            "replayed_requests": len(replayed),
            # The router records a share of requests: the trace against the ledger's count for the period.
            "sampled_share": len(trace.requests) / actual["requests"] if actual["requests"] else None,
        },
        "objectives": objectives(deployment),
        "baseline": before,
        "changed": after,
        "actual": actual,
        "tenant_names": {t: names.get(int(t), t) if t.isdigit() else t for t in sorted(tenants)},
    }


def _run_trace(run: WhatIfRun) -> RecordedTrace:
    """The period's trace as counted when the run was created: requests drained into the period since are left
    out, so that the replay stays within the limits it was checked against."""
    limit = MAX_REQUESTS if run.trace_requests is None else run.trace_requests
    return recorded_trace(deployment_id=run.deployment_id, since=run.since, until=run.until, limit=limit)


def whatif_create(
    *,
    deployment: ModelDeployment,
    since: datetime,
    until: datetime,
    changes,
    baseline_profile=None,
    user=None,
) -> WhatIfRun:
    """Check the what-if and start it (the task runs once the run is committed), or WhatIfBusy when
    PLANNER_WHATIF_MAX_RUNNING runs are pending or running already."""
    from .tasks import run_what_if

    profile = (
        default_profile(deployment) if baseline_profile in (None, "") else profile_clean(baseline_profile)
    )
    clean = changes_clean(deployment, changes)
    fleet_clean(changed_fleet(baseline_fleet(deployment, profile), clean))  # both fleets can be simulated
    recorded = period_clean(deployment, since, until, clean)
    with transaction.atomic():
        _take_slot()
        run = WhatIfRun.objects.create(
            deployment=deployment,
            since=since,
            until=until,
            baseline_profile=profile,
            changes=clean,
            trace_requests=recorded,
            requested_by=user if user is not None and user.is_authenticated else None,
        )
        # Routed by CELERY_TASK_ROUTES to the what-if queue, apart from the platform's own tasks.
        transaction.on_commit(lambda: run_what_if.delay(run.pk))
    return run


def _take_slot() -> None:
    """Inside the creating transaction: fail the runs taken as lost, then refuse when the slots are full. The
    advisory lock (held to the commit) makes two starts count one after the other, so that neither misses the
    other's run."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", list(SLOTS_LOCK))
    active = WhatIfRun.objects.filter(status__in=[RunStatus.PENDING, RunStatus.RUNNING])
    timeout = settings.PLANNER_WHATIF_TIMEOUT_S
    active.filter(created_at__lt=timezone.now() - timedelta(seconds=timeout)).update(
        status=RunStatus.FAILED,
        stage="",
        message=f"not finished {timeout} s after it was created (PLANNER_WHATIF_TIMEOUT_S): taken as lost",
        finished_at=timezone.now(),
    )
    limit = settings.PLANNER_WHATIF_MAX_RUNNING
    running = active.count()
    if running >= limit:
        raise WhatIfBusy(
            f"what-if runs already pending or running: {running}, the most at once (PLANNER_WHATIF_MAX_RUNNING "
            f"is {limit}); start this one when one of them has finished"
        )


def whatif_progress(run_id: int, percent: int, stage: str) -> None:
    WhatIfRun.objects.filter(pk=run_id).update(progress=max(0, min(100, percent)), stage=stage)
