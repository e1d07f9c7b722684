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

from .audit import audit_record, changes, snapshot
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


def deployment_tenants_set(*, deployment, tenants: Iterable[Tenant], actor, source: str) -> None:
    """Limit a deployment to these tenants (none: every tenant), as operators do. Audited when it changed; the
    routers reload on the commit (tenants/signals.py)."""
    with transaction.atomic():
        before = sorted(deployment.tenants.values_list("pk", flat=True))
        deployment.tenants.set(tenants)
        after = sorted(deployment.tenants.values_list("pk", flat=True))
        if before != after:
            audit_record(
                actor=actor,
                action="deployment.update",
                instance=deployment,
                source=source,
                details={"changes": {"tenants": [before, after]}},
            )


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
        before = entitlement_snapshot(team)
        for name, value in fields.items():
            setattr(team, name, value)
        team.full_clean()
        team.save()
        if deployments is not None:
            team.deployments.set(deployments)
        diff = changes(before, entitlement_snapshot(team))
        if diff:
            audit_record(
                actor=actor, action="team.update", instance=team, source=source, details={"changes": diff}
            )
    return team


def model_alias_save(*, alias: ModelAlias, actor, source: str) -> ModelAlias:
    """Create an alias, or move an existing one to another deployment. Raises ValidationError for a name
    that is a served model's, or one the tenant already has."""
    with transaction.atomic():
        before = snapshot(ModelAlias.objects.get(pk=alias.pk)) if alias.pk else None
        alias.full_clean()
        alias.save()
        if before is None:
            audit_record(
                actor=actor,
                action="model_alias.create",
                instance=alias,
                source=source,
                details={"after": snapshot(alias)},
            )
        else:
            diff = changes(before, snapshot(alias))
            if diff:
                audit_record(
                    actor=actor,
                    action="model_alias.update",
                    instance=alias,
                    source=source,
                    details={"changes": diff},
                )
    return alias


def model_alias_delete(*, alias: ModelAlias, actor, source: str) -> None:
    with transaction.atomic():
        audit_record(
            actor=actor,
            action="model_alias.delete",
            instance=alias,
            source=source,
            details={"before": snapshot(alias)},
        )
        alias.delete()
