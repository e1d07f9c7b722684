"""Entitlements, priority and fair share, as the portal changes them: a team's priority class, weight and the
deployments it may call, and a tenant's model aliases; and, for operators, the tenants a deployment is limited
to, which the router checks before any team's entitlements. Each change is validated by the model, saved and
audited in one transaction; the routers reload on the commit (routing/apps.py).

The REST API makes the same changes through its audited viewsets, and the admin through AuditedAdmin; both
audit the deployments a team or key may call with `entitlement_snapshot`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.db import models, transaction

from .audit import audited, snapshot
from .models import ModelAlias, Team, Tenant

# What a team's admins may change on their team (tenant admins and operators change all of it).
TEAM_ADMIN_FIELDS = frozenset({"priority_class"})


def entitlement_snapshot(instance: models.Model) -> dict[str, Any]:
    """The audit snapshot of a team or key, with the ids of the deployments it is allowed (its own columns
    leave the many-to-many out)."""
    data = snapshot(instance)
    if instance.pk:
        data["deployments"] = sorted(instance.deployments.values_list("pk", flat=True))
    return data


def deployments_outside_team(team: Team, deployments: Iterable) -> list:
    """Those of `deployments` a key of `team` may not be narrowed to: the ones its team may not call."""
    if not team.restrict_models:
        return []
    allowed = set(team.deployments.values_list("pk", flat=True))
    return [d for d in deployments if d.pk not in allowed]


def deployments_closed_to(tenant_id: int, deployments: Iterable) -> list:
    """Those of `deployments` limited to other tenants than this one: no team or alias of it may name them."""
    from serving.models import ModelDeployment

    deployments = list(deployments)
    ids = [d.pk for d in deployments]
    open_ids = set(
        ModelDeployment.objects.filter(pk__in=ids).open_to([tenant_id]).values_list("pk", flat=True)
    )
    return [d for d in deployments if d.pk not in open_ids]


def _tenants_of(deployment) -> dict[str, Any]:
    return {"tenants": sorted(deployment.tenants.values_list("pk", flat=True))}


def deployment_tenants_set(*, deployment, tenants: Iterable[Tenant], actor, source: str) -> None:
    """Limit a deployment to these tenants (none: every tenant), as operators do. Audited when it changed; the
    routers reload on the commit (tenants/signals.py)."""
    with audited("deployment", deployment, actor=actor, source=source, snapshot_of=_tenants_of):
        deployment.tenants.set(tenants)


def team_entitlements_update(
    *,
    team: Team,
    actor,
    source: str,
    fields: Mapping[str, Any],
    deployments: Iterable | None = None,
) -> Team:
    """Change a team's priority class, weight or model restriction (`fields`) and, when given, the whole set
    of deployments it may call. Raises ValidationError for what the model refuses (a class above the tenant's
    highest)."""
    with transaction.atomic():
        team = Team.objects.select_for_update().select_related("tenant").get(pk=team.pk)
        with audited("team", team, actor=actor, source=source, snapshot_of=entitlement_snapshot):
            for name, value in fields.items():
                setattr(team, name, value)
            team.full_clean()
            team.save()
            if deployments is not None:
                team.deployments.set(deployments)
    return team


def model_alias_save(*, alias: ModelAlias, actor, source: str) -> ModelAlias:
    """Create an alias, or move an existing one to another deployment. Raises ValidationError for a name
    that is a served model's, or one the tenant already has."""
    stored = ModelAlias.objects.get(pk=alias.pk) if alias.pk else None
    with audited("model_alias", stored, actor=actor, source=source) as change:
        alias.full_clean()
        alias.save()
        change.instance = alias
    return alias


def model_alias_delete(*, alias: ModelAlias, actor, source: str) -> None:
    with audited("model_alias", alias, actor=actor, source=source, delete=True):
        alias.delete()
