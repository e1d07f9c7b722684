"""What the router needs from Postgres, held in memory so the request path makes no database query.

A snapshot holds the active keys (by HMAC), the deployments with their healthy endpoints and policies, quotas
and price sheets. Each replica reloads it when the shared config version in Redis changes (every committed change
to these tables bumps it) and at least every `ROUTER_SNAPSHOT_MAX_AGE` seconds, so a revocation reaches every
replica within the poll interval.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from django.db.models import Q
from django.utils import timezone


@dataclass(frozen=True, slots=True)
class KeyInfo:
    id: int
    prefix: str
    team_id: int
    tenant_id: int
    scopes: frozenset[str]
    expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    id: int
    name: str
    url: str
    role: str
    pool_id: int
    kv_both: bool = False  # produces and consumes KV over NIXL: can take part in peer pulls


@dataclass(frozen=True, slots=True)
class PolicyInfo:
    mode: str = "round_robin"
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    prefill_backlog_weight: float = 1.0
    kv_utilization_weight: float = 1.0
    session_affinity_weight: float = 1.0
    gpu_tier_weight: float = 1.0
    cpu_tier_weight: float = 0.8
    load_guard_ratio: float = 1.3
    pd_split_threshold_tokens: int = 1024


@dataclass(frozen=True, slots=True)
class DeploymentInfo:
    id: int
    name: str
    served_model_name: str
    max_model_len: int
    block_size: int
    policy: PolicyInfo
    endpoints: tuple[EndpointInfo, ...]
    created: int
    tokenizer_path: str = ""
    chat_template: str = ""  # the deployment's override of the model's own template

    @property
    def has_prefill_pool(self) -> bool:
        return any(e.role == "prefill" for e in self.endpoints)


@dataclass(frozen=True, slots=True)
class QuotaInfo:
    requests_per_minute: int | None
    input_tokens_per_minute: int | None
    output_tokens_per_minute: int | None
    max_concurrent_requests: int | None
    token_budget: int | None
    spend_budget: Decimal | None
    budget_period: str


@dataclass(frozen=True, slots=True)
class Prices:
    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal
    currency: str


@dataclass
class Snapshot:
    keys: dict[str, KeyInfo] = field(default_factory=dict)
    deployments: dict[str, DeploymentInfo] = field(default_factory=dict)
    team_quotas: dict[int, QuotaInfo] = field(default_factory=dict)
    key_quotas: dict[int, QuotaInfo] = field(default_factory=dict)
    # (model, tenant id or None) -> sorted start times and the prices that start then
    prices: dict[tuple[str, int | None], tuple[list[datetime], list[Prices]]] = field(default_factory=dict)
    version: str = ""

    def prices_for(self, model: str, tenant_id: int, at: datetime) -> Prices | None:
        for owner in (tenant_id, None):
            entry = self.prices.get((model, owner))
            if entry:
                index = bisect.bisect_right(entry[0], at) - 1
                if index >= 0:
                    return entry[1][index]
        return None


def _quota(q) -> QuotaInfo:
    return QuotaInfo(
        q.requests_per_minute,
        q.input_tokens_per_minute,
        q.output_tokens_per_minute,
        q.max_concurrent_requests,
        q.token_budget,
        q.spend_budget,
        q.budget_period,
    )


def load_snapshot(version: str = "") -> Snapshot:
    """Read everything the request path needs. Runs in a thread (sync ORM), a handful of queries."""
    from routing.models import RoutingPolicy
    from serving.models import DesiredStatus, Endpoint, Health, ModelDeployment
    from tenants.models import ApiKey, PriceSheet, Quota

    now = timezone.now()
    snapshot = Snapshot(version=version)
    active_keys = ApiKey.objects.filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=now),
        revoked_at__isnull=True,
        team__tenant__is_active=True,
    ).values_list("id", "public_id", "secret_hmac", "team_id", "team__tenant_id", "scopes", "expires_at")
    for key_id, public_id, secret_hmac, team_id, tenant_id, scopes, expires_at in active_keys:
        snapshot.keys[secret_hmac] = KeyInfo(
            key_id, f"ipk_{public_id}", team_id, tenant_id, frozenset(scopes), expires_at
        )

    policies = {p.deployment_id: p for p in RoutingPolicy.objects.all()}
    endpoints: dict[int, list[EndpointInfo]] = {}
    for endpoint in Endpoint.objects.filter(health=Health.HEALTHY).select_related("pool").order_by("name"):
        endpoints.setdefault(endpoint.pool.deployment_id, []).append(
            EndpointInfo(
                endpoint.id,
                endpoint.name,
                endpoint.url.rstrip("/"),
                endpoint.role,
                endpoint.pool_id,
                kv_both=endpoint.role == "both"
                and endpoint.pool.kv_connector in ("NixlConnector", "MultiConnector"),
            )
        )
    for deployment in ModelDeployment.objects.filter(desired_status=DesiredStatus.RUNNING):
        policy = policies.get(deployment.id)
        snapshot.deployments[deployment.served_model_name] = DeploymentInfo(
            id=deployment.id,
            name=deployment.name,
            served_model_name=deployment.served_model_name,
            max_model_len=deployment.max_model_len,
            block_size=deployment.block_size,
            policy=PolicyInfo(
                mode=policy.mode,
                prefix_weight=policy.prefix_weight,
                queue_weight=policy.queue_weight,
                prefill_backlog_weight=policy.prefill_backlog_weight,
                kv_utilization_weight=policy.kv_utilization_weight,
                session_affinity_weight=policy.session_affinity_weight,
                gpu_tier_weight=policy.gpu_tier_weight,
                cpu_tier_weight=policy.cpu_tier_weight,
                load_guard_ratio=policy.load_guard_ratio,
                pd_split_threshold_tokens=policy.pd_split_threshold_tokens,
            )
            if policy
            else PolicyInfo(),
            endpoints=tuple(endpoints.get(deployment.id, ())),
            created=int(deployment.created_at.timestamp()),
            tokenizer_path=deployment.tokenizer or deployment.model_source,
            chat_template=deployment.chat_template,
        )

    for quota in Quota.objects.all():
        if quota.api_key_id:
            snapshot.key_quotas[quota.api_key_id] = _quota(quota)
        else:
            snapshot.team_quotas[quota.team_id] = _quota(quota)

    for sheet in PriceSheet.objects.order_by("effective_from"):
        starts, prices = snapshot.prices.setdefault((sheet.served_model_name, sheet.tenant_id), ([], []))
        starts.append(sheet.effective_from)
        prices.append(
            Prices(sheet.input_per_mtok, sheet.cached_input_per_mtok, sheet.output_per_mtok, sheet.currency)
        )
    return snapshot
