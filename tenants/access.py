"""Who can see and change what. Every tenant-owned lookup goes through these scopes.

Visibility decides existence: an object outside a user's scope is simply not found (404). Inside it,
write rights decide between allowed and 403.

A deactivated tenant's memberships grant nothing: its people cannot see or change its data anywhere (portal,
API), and someone whose every membership is in deactivated tenants is locked out (`locked_out`), which the
portal and the API refuse with a 403 that says so. Operators are never locked out.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Q, QuerySet

from .models import (
    ApiKey,
    AuditLog,
    Membership,
    ModelAlias,
    PriceSheet,
    Quota,
    Role,
    Team,
    Tenant,
    UsageDaily,
    UsageRecord,
)

TENANT_DEACTIVATED = (
    "Your organisation's account on this platform is deactivated; ask the platform operator to reactivate it."
)


@dataclass(frozen=True)
class Access:
    is_operator: bool
    admin_tenants: frozenset[int]  # tenant admin of these
    admin_teams: frozenset[int]  # team admin of these
    teams: frozenset[int]  # any role in these teams
    tenants: frozenset[int]  # any role in these tenants
    # Every membership this person has is in a deactivated tenant: refused everywhere, not just shown nothing.
    locked_out: bool = False

    @classmethod
    def for_user(cls, user) -> Access:
        if not user or not user.is_authenticated:
            return cls(False, frozenset(), frozenset(), frozenset(), frozenset())
        rows = list(
            Membership.objects.filter(user=user).values_list(
                "role", "tenant_id", "team_id", "tenant__is_active"
            )
        )
        is_operator = user.is_superuser or any(role == Role.OPERATOR for role, *_ in rows)
        live = [(role, tenant, team) for role, tenant, team, active in rows if tenant is None or active]
        return cls(
            is_operator=is_operator,
            admin_tenants=frozenset(tenant for role, tenant, _ in live if role == Role.TENANT_ADMIN),
            admin_teams=frozenset(team for role, _, team in live if role == Role.TEAM_ADMIN),
            teams=frozenset(team for _, _, team in live if team is not None),
            tenants=frozenset(tenant for _, tenant, _ in live if tenant is not None),
            locked_out=bool(rows) and not live and not is_operator,
        )

    # --- what a user can see -------------------------------------------------------------------
    def _team_scoped(self, qs: QuerySet, team_path: str) -> QuerySet:
        if self.is_operator:
            return qs
        return qs.filter(
            Q(**{f"{team_path}__tenant_id__in": self.admin_tenants})
            | Q(**{f"{team_path}_id__in": self.teams})
        )

    def tenants_qs(self) -> QuerySet[Tenant]:
        qs = Tenant.objects.all()
        return qs if self.is_operator else qs.filter(id__in=self.tenants)

    def teams_qs(self) -> QuerySet[Team]:
        qs = Team.objects.select_related("tenant")
        return (
            qs if self.is_operator else qs.filter(Q(tenant_id__in=self.admin_tenants) | Q(id__in=self.teams))
        )

    def memberships_qs(self) -> QuerySet[Membership]:
        qs = Membership.objects.select_related("user", "tenant", "team")
        if self.is_operator:
            return qs
        return qs.filter(Q(tenant_id__in=self.admin_tenants) | Q(team_id__in=self.teams))

    def api_keys_qs(self) -> QuerySet[ApiKey]:
        return self._team_scoped(ApiKey.objects.select_related("team__tenant"), "team")

    def quotas_qs(self) -> QuerySet[Quota]:
        return self._team_scoped(Quota.objects.select_related("team", "api_key"), "team")

    def price_sheets_qs(self) -> QuerySet[PriceSheet]:
        qs = PriceSheet.objects.select_related("tenant")
        return qs if self.is_operator else qs.filter(Q(tenant__isnull=True) | Q(tenant_id__in=self.tenants))

    def model_aliases_qs(self) -> QuerySet[ModelAlias]:
        """A tenant's aliases are read by everyone in the tenant: they are the names its agents call."""
        qs = ModelAlias.objects.select_related("tenant", "deployment")
        return qs if self.is_operator else qs.filter(tenant_id__in=self.tenants)

    def deployments_qs(self) -> QuerySet:
        """The deployments this person may see: operators every one; a tenant admin those open to the tenant
        (the ones it may give its teams); anyone else those their teams may call. A deployment limited to other
        tenants is never among them."""
        from serving.models import ModelDeployment

        qs = ModelDeployment.objects.all()
        if self.is_operator:
            return qs
        visible = (
            Q(pk__in=qs.open_to(self.admin_tenants).values("pk")) if self.admin_tenants else Q(pk__in=[])
        )
        for team in Team.objects.filter(id__in=self.teams).exclude(tenant_id__in=self.admin_tenants):
            open_to_team = qs.open_to([team.tenant_id])
            if team.restrict_models:
                open_to_team = open_to_team.filter(entitled_teams=team)
            visible |= Q(pk__in=open_to_team.values("pk"))
        return qs.filter(visible)

    def nameable_deployments_qs(self) -> QuerySet:
        """The deployments this person may name in a team's, key's or alias's settings: every one for operators,
        else those open to their tenants (whether each team may call them is the settings' own check)."""
        from serving.models import ModelDeployment

        qs = ModelDeployment.objects.all()
        return qs if self.is_operator else qs.open_to(self.tenants)

    def usage_qs(self) -> QuerySet[UsageRecord]:
        return self._team_scoped(UsageRecord.objects.all(), "team")

    def usage_daily_qs(self) -> QuerySet[UsageDaily]:
        """The daily roll-ups of the usage this user can see (the same rows as usage_qs, summed by day)."""
        return self._team_scoped(UsageDaily.objects.all(), "team")

    def audit_qs(self) -> QuerySet[AuditLog]:
        qs = AuditLog.objects.all()
        return qs if self.is_operator else qs.filter(tenant_id__in=self.admin_tenants)

    # --- what a user can change ----------------------------------------------------------------
    def manageable_tenants_qs(self) -> QuerySet[Tenant]:
        """Tenants in which this user may create teams and memberships."""
        qs = Tenant.objects.all()
        return qs if self.is_operator else qs.filter(id__in=self.admin_tenants)

    def manageable_teams_qs(self) -> QuerySet[Team]:
        """Teams whose keys and members this user may manage."""
        qs = Team.objects.select_related("tenant")
        if self.is_operator:
            return qs
        return qs.filter(Q(tenant_id__in=self.admin_tenants) | Q(id__in=self.admin_teams))

    def can_manage_team(self, team: Team) -> bool:
        return self.is_operator or team.tenant_id in self.admin_tenants or team.id in self.admin_teams

    def can_admin_tenant(self, tenant_id: int | None) -> bool:
        return self.is_operator or (tenant_id is not None and tenant_id in self.admin_tenants)

    @property
    def administers_anything(self) -> bool:
        return self.is_operator or bool(self.admin_tenants or self.admin_teams)
