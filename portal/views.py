"""Portal pages. Thin: check who asks, call one selector or service, render.

Every tenant-owned lookup goes through the caller's Access scope: another tenant's object is not found.

Over 400 lines: thin views, one per page, sharing the access scope and its helpers; the what-if, alerts and
live pages have modules of their own.
"""

from __future__ import annotations

from functools import wraps

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Count, Prefetch, Q
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from serving import services as serving
from serving.models import Endpoint, Health, ModelDeployment, Pool
from tenants.access import TENANT_DEACTIVATED, Access
from tenants.api.reports import PERIOD_OUT_OF_RANGE, csv_response
from tenants.billing import Period, PeriodError, period_parse, usage_report
from tenants.entitlements import model_alias_delete, model_alias_save, team_entitlements_update
from tenants.keys import api_key_create, api_key_revoke
from tenants.models import ModelAlias

from .charts import report_days
from .costs import cost_to_serve
from .forms import (
    AliasForm,
    AliasMoveForm,
    DeploymentCreateForm,
    KeyCreateForm,
    ReportForm,
    ScaleForm,
    TeamSettingsForm,
)

# The audit rows' source for what the portal changes.
SOURCE = "portal"


def _access(request) -> Access:
    if not hasattr(request, "_portal_access"):
        request._portal_access = Access.for_user(request.user)
    return request._portal_access


def signed_in(view):
    """Signed in, and not locked out: someone whose every tenant is deactivated gets a page that says so."""

    @login_required(login_url="portal:login")
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if _access(request).locked_out:
            return render(request, "portal/deactivated.html", {"detail": TENANT_DEACTIVATED}, status=403)
        return view(request, *args, **kwargs)

    return wrapped


def operator_only(view):
    @signed_in
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if not _access(request).is_operator:
            raise PermissionDenied("Operators only.")
        return view(request, *args, **kwargs)

    return wrapped


@signed_in
def home(request):
    return redirect("portal:fleet" if _access(request).is_operator else "portal:teams")


# Fleet -------------------------------------------------------------------------------------------------


def _deployments():
    endpoints = Prefetch("endpoints", queryset=Endpoint.objects.order_by("name"))
    return ModelDeployment.objects.prefetch_related(
        Prefetch("pools", queryset=Pool.objects.order_by("name").prefetch_related(endpoints))
    )


def _progress(deployment: ModelDeployment) -> dict:
    want = sum(p.replicas for p in deployment.pools.all())
    endpoints = [e for p in deployment.pools.all() for e in p.endpoints.all()]
    healthy = sum(1 for e in endpoints if e.health == Health.HEALTHY)
    return {
        "status": deployment.observed_status,
        "message": deployment.status_message,
        "desired": want,
        "healthy": healthy,
        "starting": sum(1 for e in endpoints if e.health in (Health.STARTING, Health.UNKNOWN)),
        "percent": 100 if want == 0 else round(100 * min(healthy, want) / want),
    }


@operator_only
def fleet(request):
    deployments = [(d, _progress(d)) for d in _deployments()]
    return render(request, "portal/fleet.html", {"deployments": deployments})


@operator_only
def deployment_new(request):
    form = DeploymentCreateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            deployment = serving.deployment_create(
                actor=request.user, source=SOURCE, fields=form.deployment_fields(), pools=form.pools()
            )
        except ValidationError as exc:
            for field, errors in exc.message_dict.items():
                form.add_error(field if field in form.fields else None, errors)
        else:
            messages.success(request, f"Deployment {deployment.name} created; its engines are starting.")
            return redirect("portal:deployment", pk=deployment.pk)
    return render(request, "portal/deployment_new.html", {"form": form})


@operator_only
def deployment_detail(request, pk: int):
    deployment = get_object_or_404(_deployments(), pk=pk)
    context = {
        "deployment": deployment,
        "progress": _progress(deployment),
        "scale_form": ScaleForm(),
        "prefix_health": _prefix_health(deployment),
        "autoscaling": _autoscaling(deployment),
    }
    return render(request, "portal/deployment.html", context)


def _autoscaling(deployment) -> dict:
    """Per pool with a policy, the policy; and the recent scaling events (the charts of replicas against the
    signals and of latency against the objectives come from the history, portal/charts.py)."""
    from serving.models import AutoscalingPolicy, ScalingEvent

    policies = AutoscalingPolicy.objects.filter(pool__deployment=deployment).select_related("pool")
    events = ScalingEvent.objects.filter(pool__deployment=deployment).select_related("pool")[:20]
    return {"pools": [{"policy": policy} for policy in policies], "events": list(events)}


def _prefix_health(deployment):
    """Whether prefix routing sees what the engines hold (the routers' per-minute counters in Redis), or None
    when Redis cannot be read."""
    import redis
    from django.conf import settings

    from routing.kvindex.prefix_health import prefix_health_for

    try:
        return prefix_health_for(redis.Redis.from_url(settings.REDIS_URL), deployment.pk)
    except redis.RedisError:
        return None


@operator_only
def deployment_status(request, pk: int):
    deployment = get_object_or_404(_deployments(), pk=pk)
    endpoints = [
        {"name": e.name, "url": e.url, "pool": p.name, "health": e.health}
        for p in deployment.pools.all()
        for e in p.endpoints.all()
    ]
    return JsonResponse({**_progress(deployment), "endpoints": endpoints})


@operator_only
@require_POST
def deployment_scale(request, pk: int, pool_pk: int):
    pool = get_object_or_404(Pool.objects.select_related("deployment"), pk=pool_pk, deployment_id=pk)
    form = ScaleForm(request.POST)
    if form.is_valid():
        replicas = form.cleaned_data["replicas"]
        if serving.pool_scale(actor=request.user, source=SOURCE, pool=pool, replicas=replicas):
            messages.success(request, f"{pool} scaled to {replicas} replicas.")
    else:
        messages.error(request, "Give a number of replicas from 0 to 1024.")
    return redirect("portal:deployment", pk=pk)


@operator_only
@require_POST
def deployment_remove(request, pk: int):
    deployment = get_object_or_404(ModelDeployment, pk=pk)
    serving.deployment_delete(actor=request.user, source=SOURCE, deployment=deployment)
    messages.success(request, f"Deployment {deployment.name} deleted; its engines are stopping.")
    return redirect("portal:fleet")


@operator_only
def deployment_cost(request, pk: int):
    deployment = get_object_or_404(_deployments(), pk=pk)
    period, form = _period_from(request, default_group="deployment")
    cost = cost_to_serve(access=_access(request), deployment=deployment, period=period)
    return render(request, "portal/deployment_cost.html", {"cost": cost, "form": form})


@operator_only
def live(request):
    return render(request, "portal/live.html", {"ws_url": settings.PORTAL_LIVE_WEBSOCKET_URL})


# Teams ---------------------------------------------------------------------------------------------------


@signed_in
def teams(request):
    access = _access(request)
    rows = (
        access.teams_qs()
        .annotate(keys=Count("api_keys", filter=Q(api_keys__revoked_at__isnull=True)))
        .prefetch_related("deployments")
    )
    return render(request, "portal/teams.html", {"teams": rows})


def _quota_usage(team, quotas) -> list[dict]:
    """Each quota beside what the router's admission has counted against it now (its own Redis counters:
    this minute's requests and tokens, requests in flight, and the period's tokens and spend, reservations of
    running requests included)."""
    import redis
    from django.conf import settings

    from routing.contracts import quota_counters
    from tenants.limits import LIMITS, row_label

    client = redis.Redis.from_url(settings.REDIS_URL)
    out = []
    now = timezone.now()
    for quota in quotas:
        start, end = quota.period_bounds(now)
        kind, ident = ("key", quota.api_key_id) if quota.api_key_id else ("team", team.pk)
        used = quota_counters(client, kind=kind, ident=ident, quota=quota)
        out.append(
            {
                "quota": quota,
                "start": start,
                "end": end,
                "limits": [
                    (
                        row_label(limit, quota.budget_period, quota.currency),
                        getattr(quota, limit.field),
                        used[limit.field],
                        limit.money,
                    )
                    for limit in LIMITS
                ],
                "concurrency": quota.max_concurrent_requests,
            }
        )
    return out


def _team_context(request, team, **extra) -> dict:
    access = _access(request)
    period = period_parse(period="month")
    by_key = usage_report(access=access, period=period, group_by="key", team_id=team.pk)
    quotas = access.quotas_qs().filter(team=team)
    is_tenant_admin = access.can_admin_tenant(team.tenant_id)
    can_set_class = is_tenant_admin or team.id in access.admin_teams
    allowed = list(team.deployments.order_by("served_model_name")) if team.restrict_models else None
    aliases = [
        {"alias": alias, "callable": allowed is None or alias.deployment in allowed, "form": None}
        for alias in access.model_aliases_qs().filter(tenant_id=team.tenant_id)
    ]
    if is_tenant_admin:
        for row in aliases:
            row["form"] = AliasMoveForm(
                initial={"deployment": row["alias"].deployment_id}, tenant_id=team.tenant_id
            )
    return {
        "team": team,
        "can_manage": access.can_manage_team(team),
        "can_admin_tenant": is_tenant_admin,
        "keys": access.api_keys_qs().filter(team=team).prefetch_related("deployments"),
        "quotas": _quota_usage(team, quotas),
        "allowed_models": allowed,
        "aliases": aliases,
        "settings_form": TeamSettingsForm(team=team, full=is_tenant_admin) if can_set_class else None,
        "alias_form": AliasForm(tenant_id=team.tenant_id) if is_tenant_admin else None,
        "report": by_key,
        "key_form": KeyCreateForm(),
        **extra,
    }


@signed_in
def team_detail(request, pk: int):
    team = get_object_or_404(_access(request).teams_qs(), pk=pk)
    return render(request, "portal/team.html", _team_context(request, team))


@signed_in
@require_POST
def key_create(request, pk: int):
    access = _access(request)
    team = get_object_or_404(access.teams_qs(), pk=pk)
    if not access.can_manage_team(team):
        raise PermissionDenied("Only the team's admins can create keys.")
    form = KeyCreateForm(request.POST)
    if not form.is_valid():
        return render(request, "portal/team.html", _team_context(request, team, key_form=form), status=400)
    issued = api_key_create(team=team, actor=request.user, source="portal", **form.cleaned_data)
    # The secret is in this response only: never stored, never in a redirect or a message.
    response = render(request, "portal/team.html", _team_context(request, team, issued=issued))
    response["Cache-Control"] = "no-store"
    return response


@signed_in
@require_POST
def key_revoke(request, pk: int):
    access = _access(request)
    api_key = get_object_or_404(access.api_keys_qs(), pk=pk)
    if not access.can_manage_team(api_key.team):
        raise PermissionDenied("Only the team's admins can revoke keys.")
    if api_key_revoke(api_key=api_key, actor=request.user, source="portal"):
        messages.success(request, f"Key {api_key.prefix} revoked.")
    return redirect("portal:team", pk=api_key.team_id)


def _form_errors(form, exc: ValidationError) -> None:
    for field, errors in exc.message_dict.items():
        form.add_error(field if field in form.fields else None, errors)


@signed_in
@require_POST
def team_settings(request, pk: int):
    """A team's priority class, weight and the models it may call (its tenant's admins), or its class alone
    (its own admins)."""
    access = _access(request)
    team = get_object_or_404(access.teams_qs(), pk=pk)
    full = access.can_admin_tenant(team.tenant_id)
    if not full and team.id not in access.admin_teams:
        raise PermissionDenied("Only the team's admins can change its priority class.")
    form = TeamSettingsForm(request.POST, team=team, full=full)
    if form.is_valid():
        try:
            team_entitlements_update(
                team=team,
                actor=request.user,
                source=SOURCE,
                fields=form.team_fields(),
                deployments=form.team_deployments(),
            )
        except ValidationError as exc:
            _form_errors(form, exc)
        else:
            messages.success(request, f"{team} updated.")
            return redirect("portal:team", pk=team.pk)
    return render(request, "portal/team.html", _team_context(request, team, settings_form=form), status=400)


def _tenant_admins_team(request, pk: int):
    access = _access(request)
    team = get_object_or_404(access.teams_qs(), pk=pk)
    if not access.can_admin_tenant(team.tenant_id):
        raise PermissionDenied("Only the tenant's admins can change its model aliases.")
    return team


@signed_in
@require_POST
def alias_create(request, pk: int):
    team = _tenant_admins_team(request, pk)
    form = AliasForm(request.POST, tenant_id=team.tenant_id)
    if form.is_valid():
        alias = ModelAlias(tenant_id=team.tenant_id, **form.cleaned_data)
        try:
            model_alias_save(alias=alias, actor=request.user, source=SOURCE)
        except ValidationError as exc:
            _form_errors(form, exc)
        else:
            messages.success(request, f"Alias {alias.name} now serves {alias.deployment.served_model_name}.")
            return redirect("portal:team", pk=team.pk)
    return render(request, "portal/team.html", _team_context(request, team, alias_form=form), status=400)


@signed_in
@require_POST
def alias_move(request, pk: int, alias_pk: int):
    team = _tenant_admins_team(request, pk)
    alias = get_object_or_404(ModelAlias, pk=alias_pk, tenant_id=team.tenant_id)
    form = AliasMoveForm(request.POST, tenant_id=team.tenant_id)
    if form.is_valid():
        alias.deployment = form.cleaned_data["deployment"]
        model_alias_save(alias=alias, actor=request.user, source=SOURCE)
        messages.success(request, f"Alias {alias.name} now serves {alias.deployment.served_model_name}.")
    else:
        messages.error(request, "Choose a deployment for the alias.")
    return redirect("portal:team", pk=team.pk)


@signed_in
@require_POST
def alias_delete(request, pk: int, alias_pk: int):
    team = _tenant_admins_team(request, pk)
    alias = get_object_or_404(ModelAlias, pk=alias_pk, tenant_id=team.tenant_id)
    model_alias_delete(alias=alias, actor=request.user, source=SOURCE)
    messages.success(request, f"Alias {alias.name} deleted.")
    return redirect("portal:team", pk=team.pk)


# Reports -------------------------------------------------------------------------------------------------


def _period_from(request, default_group: str = "team") -> tuple[Period, ReportForm]:
    form = ReportForm(request.GET or {"period": "month", "group_by": default_group})
    if not form.is_valid():
        return period_parse(period="month"), form
    data = form.cleaned_data
    try:
        return period_parse(
            period=data["period"], at=data["at"], since=data["since"], until=data["until"]
        ), form
    except PeriodError as exc:
        form.add_error(None, str(exc))
        return period_parse(period="month"), form
    except (ValueError, OverflowError):  # the period's bounds fall outside the years 1 to 9999
        form.add_error(None, PERIOD_OUT_OF_RANGE)
        return period_parse(period="month"), form


@signed_in
def reports(request):
    access = _access(request)
    period, form = _period_from(request)
    group_by = form.cleaned_data.get("group_by", "team") if form.is_valid() else "team"
    report = usage_report(access=access, period=period, group_by=group_by)
    by_day = usage_report(access=access, period=period, group_by="day")
    # Beside any grouping, the same usage by the class it was served in (unless that is the grouping).
    by_class = (
        None
        if group_by == "priority_class"
        else usage_report(access=access, period=period, group_by="priority_class")
    )
    return render(
        request,
        "portal/reports.html",
        {
            "form": form,
            "report": report,
            "by_class": by_class,
            "days": report_days(by_day, period),
            "query": request.GET.urlencode(),
        },
    )


@signed_in
def reports_csv(request):
    period, form = _period_from(request)
    group_by = form.cleaned_data.get("group_by", "team") if form.is_valid() else "team"
    return csv_response(usage_report(access=_access(request), period=period, group_by=group_by))
