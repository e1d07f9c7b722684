"""What the router needs from Postgres, held in memory so the request path makes no database query.

A snapshot holds the active keys (by HMAC), the deployments with their healthy endpoints and policies, quotas
and price sheets; each replica reloads it when the shared config version in Redis changes and at least every
`ROUTER_SNAPSHOT_MAX_AGE` seconds. See docs/routing.md#the-snapshot.
"""

from __future__ import annotations

import bisect
import hmac
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from routing.info import (
    NO_POLICY,
    DeploymentInfo,
    EndpointInfo,
    KeyInfo,
    PolicyInfo,
    Prices,
    QuotaInfo,
)
from routing.models import RoutingPolicy, policy_fields
from tenants.limits import LIMITS


def policy_info(policy: RoutingPolicy) -> PolicyInfo:
    return PolicyInfo(**{f.name: getattr(policy, f.name) for f in policy_fields()})


@dataclass
class Snapshot:
    keys: dict[str, KeyInfo] = field(default_factory=dict)
    deployments: dict[str, DeploymentInfo] = field(default_factory=dict)
    team_quotas: dict[int, QuotaInfo] = field(default_factory=dict)
    # tenant id -> its ceilings, set by operators, counted for all its teams and keys together
    tenant_quotas: dict[int, QuotaInfo] = field(default_factory=dict)
    key_quotas: dict[int, QuotaInfo] = field(default_factory=dict)
    # (model, tenant id or None) -> sorted start times and the prices that start then
    prices: dict[tuple[str, int | None], tuple[list[datetime], list[Prices]]] = field(default_factory=dict)
    # (tenant id, alias) -> the served model name it stands for
    aliases: dict[tuple[int, str], str] = field(default_factory=dict)
    version: str = ""

    def deployment_for_key(self, key: KeyInfo, model: str) -> DeploymentInfo | None:
        """What `model` (a served model's name, or one of the key's tenant's aliases) names for this key: None
        when nothing of that name is served, or it is limited to other tenants, or the key may not call it (the
        same answer, so a key cannot learn what other tenants or teams are served)."""
        deployment = self.deployments.get(self.aliases.get((key.tenant_id, model), model))
        if deployment is None or not _callable(key, deployment):
            return None
        return deployment

    def models_for_key(self, key: KeyInfo) -> list[tuple[str, DeploymentInfo]]:
        """The names the key may call, sorted: the served models it is entitled to and its tenant's aliases of
        them."""
        names = [(name, d) for name, d in self.deployments.items() if _callable(key, d)]
        for (tenant_id, alias), target in self.aliases.items():
            deployment = self.deployments.get(target)
            if tenant_id == key.tenant_id and deployment is not None and _callable(key, deployment):
                names.append((alias, deployment))
        return sorted(names, key=lambda item: item[0])

    def prices_for(self, model: str, tenant_id: int, at: datetime) -> Prices | None:
        for owner in (tenant_id, None):
            entry = self.prices.get((model, owner))
            if entry:
                index = bisect.bisect_right(entry[0], at) - 1
                if index >= 0:
                    return entry[1][index]
        return None


def _callable(key: KeyInfo, deployment: DeploymentInfo) -> bool:
    """The deployment's limit to tenants first (the operator's), then the key's and its team's entitlements."""
    return deployment.open_to(key.tenant_id) and key.may_call(deployment.id)


def cache_salt(owner: str) -> str:
    """The `cache_salt` of a cache owner (a tenant, or a group of tenants sharing one cache): an HMAC under the
    platform's pepper, so it can be neither guessed nor chosen by a client."""
    return hmac.new(
        settings.API_KEY_PEPPER.encode(), f"kv-cache-salt\x00{owner}".encode(), "sha256"
    ).hexdigest()[:32]


def _quota(q) -> QuotaInfo:
    return QuotaInfo(
        **{limit.field: getattr(q, limit.field) for limit in LIMITS}, budget_period=q.budget_period
    )


def _ceilings(tenant) -> QuotaInfo:
    """A tenant's ceilings as the quota of the tenant as a whole: every team and key of the tenant counts against
    them together, so no number of teams or keys gets more than the operator allowed."""
    limits = {limit.field: getattr(tenant, limit.ceiling) for limit in LIMITS}
    return QuotaInfo(**limits, budget_period=tenant.max_budget_period)


def load_snapshot(version: str = "") -> Snapshot:
    """Read everything the request path needs. Runs in a thread (sync ORM), a handful of queries."""
    from django.db import close_old_connections, connection

    from serving.engine_keys import engine_api_key
    from serving.models import DesiredStatus, Endpoint, Health, ModelDeployment
    from tenants.models import (
        ApiKey,
        ModelAlias,
        PriceSheet,
        Quota,
        Team,
        Tenant,
        priority_within,
    )

    # This thread's connection may be one PostgreSQL dropped (a restart): no request cycle closes it here, so
    # without this every reload after a restart failed with it, and the router refused every key once its
    # snapshot was older than ROUTER_SNAPSHOT_FAIL_CLOSED_SECONDS.
    # (Not inside a transaction, as a test's: that connection is the caller's, and open on purpose.)
    if not connection.in_atomic_block:
        close_old_connections()
    now = timezone.now()
    snapshot = Snapshot(version=version)
    team_models: dict[int, set[int]] = {}
    for team_id, deployment_id in Team.deployments.through.objects.values_list(
        "team_id", "modeldeployment_id"
    ):
        team_models.setdefault(team_id, set()).add(deployment_id)
    key_models: dict[int, set[int]] = {}
    for key_id, deployment_id in ApiKey.deployments.through.objects.values_list(
        "apikey_id", "modeldeployment_id"
    ):
        key_models.setdefault(key_id, set()).add(deployment_id)
    active_keys = ApiKey.objects.filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=now),
        revoked_at__isnull=True,
        team__tenant__is_active=True,
    ).values_list(
        "id",
        "public_id",
        "secret_hmac",
        "team_id",
        "team__tenant_id",
        "scopes",
        "expires_at",
        "team__tenant__kv_cache_group",
        "priority_class",
        "team__priority_class",
        "team__tenant__max_priority_class",
        "team__restrict_models",
        "team__fair_share_weight",
        "team__tenant__fair_share_weight",
    )
    salts: dict[str, str] = {}
    for row in active_keys:
        key_id, public_id, secret_hmac, team_id, tenant_id, scopes, expires_at, group = row[:8]
        own_class, team_class, max_class, restricted, team_weight, tenant_weight = row[8:]
        owner = f"group:{group}" if group else f"tenant:{tenant_id}"
        salt = salts.get(owner) or salts.setdefault(owner, cache_salt(owner))
        allowed = frozenset(team_models.get(team_id, ())) if restricted else None
        if key_id in key_models:  # a key's own list narrows its team's
            allowed = frozenset(key_models[key_id] if allowed is None else key_models[key_id] & allowed)
        snapshot.keys[secret_hmac] = KeyInfo(
            key_id,
            f"ipk_{public_id}",
            team_id,
            tenant_id,
            frozenset(scopes),
            expires_at,
            salt,
            deployments=allowed,
            priority_class=priority_within(own_class or team_class, max_class),
            tenant_weight=tenant_weight,
            team_weight=team_weight,
        )

    policies = {p.deployment_id: p for p in RoutingPolicy.objects.all()}
    endpoints: dict[int, list[EndpointInfo]] = {}
    # A draining endpoint (serving/drain.py) gets no new requests: it finishes what it has, then stops.
    serving = Endpoint.objects.filter(health=Health.HEALTHY, draining_since__isnull=True)
    for endpoint in serving.select_related("pool").order_by("name"):
        endpoints.setdefault(endpoint.pool.deployment_id, []).append(
            EndpointInfo(
                endpoint.id,
                endpoint.name,
                endpoint.url.rstrip("/"),
                endpoint.role,
                endpoint.pool_id,
                kv_both=endpoint.role == "both"
                and endpoint.pool.kv_connector in ("NixlConnector", "MultiConnector"),
                max_num_seqs=endpoint.pool.max_num_seqs,
            )
        )
    limited_to: dict[int, set[int]] = {}
    for deployment_id, tenant_id in ModelDeployment.tenants.through.objects.values_list(
        "modeldeployment_id", "tenant_id"
    ):
        limited_to.setdefault(deployment_id, set()).add(tenant_id)
    for deployment in ModelDeployment.objects.filter(desired_status=DesiredStatus.RUNNING):
        policy = policies.get(deployment.id)
        tenants = limited_to.get(deployment.id)
        snapshot.deployments[deployment.served_model_name] = DeploymentInfo(
            id=deployment.id,
            name=deployment.name,
            served_model_name=deployment.served_model_name,
            max_model_len=deployment.max_model_len,
            block_size=deployment.block_size,
            policy=policy_info(policy) if policy else NO_POLICY,
            endpoints=tuple(endpoints.get(deployment.id, ())),
            created=int(deployment.created_at.timestamp()),
            tokenizer_path=deployment.tokenizer or deployment.model_source,
            chat_template=deployment.chat_template,
            first_token_timeout=float(deployment.first_token_timeout_s),
            stall_timeout=float(deployment.stall_timeout_s),
            engine_key=engine_api_key(deployment.id),
            tenants=frozenset(tenants) if tenants else None,
        )

    served = {d.id: name for name, d in snapshot.deployments.items()}
    for tenant_id, alias, deployment_id in ModelAlias.objects.values_list(
        "tenant_id", "name", "deployment_id"
    ):
        if deployment_id in served:
            snapshot.aliases[(tenant_id, alias)] = served[deployment_id]

    for quota in Quota.objects.all():
        if quota.api_key_id:
            snapshot.key_quotas[quota.api_key_id] = _quota(quota)
        else:
            snapshot.team_quotas[quota.team_id] = _quota(quota)
    # A tenant with ceilings is a scope of its own: its teams and keys count against them together.
    any_ceiling = Q()
    for limit in LIMITS:
        any_ceiling |= Q(**{f"{limit.ceiling}__isnull": False})
    for tenant in Tenant.objects.filter(any_ceiling):
        snapshot.tenant_quotas[tenant.id] = _ceilings(tenant)

    for sheet in PriceSheet.objects.order_by("effective_from"):
        starts, prices = snapshot.prices.setdefault((sheet.served_model_name, sheet.tenant_id), ([], []))
        starts.append(sheet.effective_from)
        prices.append(
            Prices(sheet.input_per_mtok, sheet.cached_input_per_mtok, sheet.output_per_mtok, sheet.currency)
        )
    return snapshot
