"""Portal pages. Thin: check who asks, call one selector or service, render.

Every tenant-owned lookup goes through the caller's Access scope: another tenant's object is not found.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
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

from serving.models import Endpoint, Health, ModelDeployment, Pool
from tenants.access import Access
from tenants.api.reports import csv_response
from tenants.billing import Period, PeriodError, period_parse, usage_report
from tenants.keys import api_key_create, api_key_revoke

from . import services
from .charts import bar_chart, column_chart
from .costs import cost_to_serve
from .forms import DeploymentCreateForm, KeyCreateForm, ReportForm, ScaleForm

signed_in = login_required(login_url="portal:login")


def _access(request) -> Access:
    if not hasattr(request, "_portal_access"):
        request._portal_access = Access.for_user(request.user)
    return request._portal_access


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
            deployment = services.deployment_create(actor=request.user, **form.cleaned_data)
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
    }
    return render(request, "portal/deployment.html", context)


def _prefix_health(deployment):
    """Whether prefix routing sees what the engines hold (the routers' per-minute counters in Redis), or None
    when Redis cannot be read."""
    import redis
    from django.conf import settings

    from routing.prefix_health import prefix_health_for

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
        if services.pool_scale(actor=request.user, pool=pool, replicas=form.cleaned_data["replicas"]):
            messages.success(request, f"{pool} scaled to {form.cleaned_data['replicas']} replicas.")
    else:
        messages.error(request, "Give a number of replicas from 0 to 1024.")
    return redirect("portal:deployment", pk=pk)


@operator_only
@require_POST
def deployment_remove(request, pk: int):
    deployment = get_object_or_404(ModelDeployment, pk=pk)
    services.deployment_delete(actor=request.user, deployment=deployment)
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
    return render(request, "portal/live.html", {"ws_url": getattr(settings, "PORTAL_LIVE_WEBSOCKET_URL", "")})


# Teams ---------------------------------------------------------------------------------------------------


@signed_in
def teams(request):
    access = _access(request)
    rows = access.teams_qs().annotate(keys=Count("api_keys", filter=Q(api_keys__revoked_at__isnull=True)))
    return render(request, "portal/teams.html", {"teams": rows})


def _quota_usage(team, quotas) -> list[dict]:
    """Each quota beside what the router's admission has counted against it now (its own Redis counters:
    this minute's requests and tokens, requests in flight, and the period's tokens and spend, reservations of
    running requests included)."""
    import redis
    from django.conf import settings

    from routing.admission import quota_counters

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
                    ("Requests per minute", quota.requests_per_minute, used["requests_per_minute"]),
                    (
                        "Input tokens per minute",
                        quota.input_tokens_per_minute,
                        used["input_tokens_per_minute"],
                    ),
                    (
                        "Output tokens per minute",
                        quota.output_tokens_per_minute,
                        used["output_tokens_per_minute"],
                    ),
                    ("Concurrent requests", quota.max_concurrent_requests, used["concurrent"]),
                    (f"Tokens this {quota.budget_period}", quota.token_budget, used["tokens"]),
                    (
                        f"Spend this {quota.budget_period} ({quota.currency})",
                        quota.spend_budget,
                        used["spend"],
                    ),
                ],
                "concurrency": quota.max_concurrent_requests,
            }
        )
    return out


def _team_context(request, team, **extra) -> dict:
    access = _access(request)
    period = period_parse(period="month")
    by_key = usage_report(access=access, period=period, group_by="key", team_id=team.pk)
    by_day = usage_report(access=access, period=period, group_by="day", team_id=team.pk)
    quotas = access.quotas_qs().filter(team=team)
    return {
        "team": team,
        "can_manage": access.can_manage_team(team),
        "keys": access.api_keys_qs().filter(team=team),
        "quotas": _quota_usage(team, quotas),
        "report": by_key,
        "cost_chart": column_chart(_day_series(by_day, period, "cost"), title="Cost per day", unit="USD"),
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


def _day_series(report, period: Period, metric: str) -> list[tuple[str, Decimal | int]]:
    values = {row.key: getattr(row, metric) for row in report.rows}
    day, out = period.start.date(), []
    last = (period.end - timedelta(microseconds=1)).date()
    while day <= last and len(out) < 400:
        out.append((day.isoformat(), values.get(day, 0)))
        day += timedelta(days=1)
    return out


@signed_in
def reports(request):
    access = _access(request)
    period, form = _period_from(request)
    group_by = form.cleaned_data.get("group_by", "team") if form.is_valid() else "team"
    report = usage_report(access=access, period=period, group_by=group_by)
    by_day = usage_report(access=access, period=period, group_by="day")
    by_team = usage_report(access=access, period=period, group_by="team")
    by_model = usage_report(access=access, period=period, group_by="model")
    charts = [
        column_chart(_day_series(by_day, period, "cost"), title="Cost per day", unit="USD"),
        column_chart(
            [(d, v) for d, v in _day_series(by_day, period, "input_tokens")], title="Input tokens per day"
        ),
        bar_chart([(r.label, r.cost) for r in by_team.rows], title="Cost by team", unit="USD"),
        bar_chart([(r.label, r.cost) for r in by_model.rows], title="Cost by model", unit="USD"),
        bar_chart([(r.label, r.output_tokens) for r in by_model.rows], title="Output tokens by model"),
    ]
    return render(
        request,
        "portal/reports.html",
        {"form": form, "report": report, "charts": charts, "query": request.GET.urlencode()},
    )


@signed_in
def reports_csv(request):
    period, form = _period_from(request)
    group_by = form.cleaned_data.get("group_by", "team") if form.is_valid() else "team"
    return csv_response(usage_report(access=_access(request), period=period, group_by=group_by))
