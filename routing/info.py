"""What the request path knows of keys, deployments, endpoints, routing policies, quotas and prices: the plain,
frozen records a snapshot (routing/snapshot.py) is made of. Nothing here imports Django, so the scheduler, the
planner and a benchmark build them without a database."""

from __future__ import annotations

from dataclasses import dataclass, make_dataclass
from datetime import datetime
from decimal import Decimal

from tenants.limits import LIMITS


@dataclass(frozen=True, slots=True)
class KeyInfo:
    id: int
    prefix: str
    team_id: int
    tenant_id: int
    scopes: frozenset[str]
    expires_at: datetime | None
    # vLLM's `cache_salt` for this key's tenant: its requests hit only KV blocks its own tenant (or the tenants of
    # its shared cache group) computed.
    cache_salt: str = ""
    # The deployments it may call (ids), or None for every one served (tenants.models.Team.restrict_models).
    deployments: frozenset[int] | None = None
    priority_class: str = "standard"  # its requests' class: the key's, else its team's, within the tenant's
    tenant_weight: int = 1  # fair share of its tenant among tenants, and of its team within the tenant
    team_weight: int = 1

    def may_call(self, deployment_id: int) -> bool:
        return self.deployments is None or deployment_id in self.deployments


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    id: int
    name: str
    url: str
    role: str
    pool_id: int
    kv_both: bool = False  # produces and consumes KV over NIXL: can take part in peer pulls
    max_num_seqs: int = 256  # requests it runs at once; beyond them requests wait in its queue


# Endpoint roles: the decode side (an aggregated engine does both) and the prefill side of a P/D deployment.
DECODE_ROLES = ("both", "decode")
PREFILL_ROLES = ("prefill",)


@dataclass(frozen=True, slots=True)
class PolicyInfo:
    """A deployment's routing policy as the request path reads it: routing.models.RoutingPolicy's fields the
    router reads (`policy_fields`), with the model's defaults (a test holds the two equal)."""

    mode: str = "precise"  # routing.models.RoutingMode
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    prefill_backlog_weight: float = 1.0
    kv_utilization_weight: float = 1.0
    session_affinity_weight: float = 1.0
    gpu_tier_weight: float = 1.0
    cpu_tier_weight: float = 0.8
    load_guard_ratio: float = 1.3
    pd_split_threshold_tokens: int = 1024
    flow_control: bool = True
    saturation_waiting_per_engine: float = 0.0
    saturation_spare_slots_per_engine: float = 2.0
    saturation_kv_utilization: float = 0.95
    saturation_prefill_tokens_per_engine: int = 65536
    max_wait_interactive_s: float = 30.0
    max_wait_standard_s: float = 60.0
    max_wait_batch_s: float = 300.0


# A deployment without a routing policy is routed round-robin.
NO_POLICY = PolicyInfo(mode="round_robin")


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
    first_token_timeout: float = 600.0
    stall_timeout: float = 120.0
    engine_key: str = ""  # the bearer token its engines accept (serving/engine_keys.py)
    # The tenants it is limited to (ids), or None for every tenant (serving.models.ModelDeployment.tenants).
    tenants: frozenset[int] | None = None

    def open_to(self, tenant_id: int) -> bool:
        return self.tenants is None or tenant_id in self.tenants

    @property
    def has_prefill_pool(self) -> bool:
        return any(e.role in PREFILL_ROLES for e in self.endpoints)


# A quota as admission reads it: one attribute per quota kind (tenants/limits.py, None for no limit), and the period
# its budgets count over.
QuotaInfo = make_dataclass(
    "QuotaInfo",
    [*((limit.field, int | Decimal | None) for limit in LIMITS), ("budget_period", str)],
    frozen=True,
    slots=True,
)
QuotaInfo.__module__ = __name__


@dataclass(frozen=True, slots=True)
class Prices:
    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal
    currency: str
