"""The what-if page: pick a deployment and a recorded period, set the changes, start; the run's page shows its
progress, then the predicted figures of the deployment as it is and of the changed fleet beside the period's
actual ones (planner/whatif.py computes them; planner/tasks.py runs it). Operators only."""

from __future__ import annotations

from datetime import timedelta

from django import forms
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone

from planner.models import WhatIfRun
from planner.profile import profile_names
from planner.sim import MODES
from planner.whatif import WhatIfBusy, WhatIfError, whatif_create
from serving.models import ModelDeployment, Pool, PoolRole
from tenants.models import Team, Tenant

from .views import operator_only


def _choices(names, blank: str) -> list[tuple[str, str]]:
    return [("", blank), *((n, n) for n in names)]


def _multipliers(text: str, field: str, lookup) -> dict[str, float]:
    """`name=factor, name=factor` to {id: factor}; `lookup(name)` gives the id, or None."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.replace("\n", ",").split(","))):
        name, sep, factor = part.partition("=")
        if not sep:
            raise forms.ValidationError(f"{field}: write name=multiplier, as in acme=2 ({part!r})")
        pk = lookup(name.strip())
        if pk is None:
            raise forms.ValidationError(f"{field}: no {name.strip()!r}")
        try:
            out[str(pk)] = float(factor)
        except ValueError:
            raise forms.ValidationError(f"{field}: {factor.strip()!r} is not a number") from None
    return out


def _tenant_id(slug: str) -> int | None:
    return Tenant.objects.filter(slug=slug).values_list("pk", flat=True).first()


def _team_id(path: str) -> int | None:
    tenant, _, team = path.partition("/")
    return Team.objects.filter(tenant__slug=tenant, slug=team).values_list("pk", flat=True).first()


class WhatIfForm(forms.Form):
    deployment = forms.ModelChoiceField(queryset=ModelDeployment.objects.order_by("name"))
    since = forms.DateTimeField(help_text="UTC", widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))
    until = forms.DateTimeField(help_text="UTC", widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))
    baseline_profile = forms.ChoiceField(required=False, label="Engines' profile now")
    mode = forms.ChoiceField(required=False, label="Routing mode", choices=_choices(MODES, "unchanged"))
    profile = forms.ChoiceField(required=False, label="GPU type (profile)")
    gpu_price_per_hour = forms.FloatField(required=False, min_value=0, label="Price per GPU-hour")
    tenant_traffic = forms.CharField(
        required=False, label="Tenant traffic", help_text="tenant-slug=multiplier, e.g. acme=2, bolt=0.5"
    )
    team_traffic = forms.CharField(
        required=False, label="Team traffic", help_text="tenant-slug/team-slug=multiplier"
    )
    all_traffic = forms.FloatField(required=False, min_value=0, label="All traffic ×")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        names = profile_names()
        self.fields["baseline_profile"].choices = _choices(names, "the deployment's default")
        self.fields["profile"].choices = _choices(names, "unchanged")
        self.pools = list(Pool.objects.select_related("deployment").order_by("deployment__name", "name"))
        for pool in self.pools:
            role = "" if pool.role == PoolRole.BOTH else f" ({pool.get_role_display().lower()})"
            self.fields[f"engines_{pool.pk}"] = forms.IntegerField(
                required=False,
                min_value=0,
                max_value=1024,
                label=f"{pool.deployment.name}/{pool.name}{role} engines",
                widget=forms.NumberInput(
                    attrs={"data-deployment": pool.deployment_id, "placeholder": f"{pool.replicas} now"}
                ),
            )

    def general_fields(self) -> list:
        return [self[name] for name in self.fields if not name.startswith("engines_")]

    def engine_fields(self) -> list:
        """(field, deployment id) for every pool's engines."""
        return [(self[f"engines_{p.pk}"], p.deployment_id) for p in self.pools]

    def changes(self) -> dict:
        data = self.cleaned_data
        deployment = data["deployment"]
        changes: dict = {}
        engines = {
            p.name: data[f"engines_{p.pk}"]
            for p in self.pools
            if p.deployment_id == deployment.pk and data.get(f"engines_{p.pk}") is not None
        }
        if engines:
            changes["engines"] = engines
        for name in ("mode", "profile"):
            if data[name]:
                changes[name] = data[name]
        if data["gpu_price_per_hour"] is not None:
            changes["gpu_price_per_hour"] = data["gpu_price_per_hour"]
        traffic = {}
        if data["tenant_traffic"]:
            traffic["tenants"] = _multipliers(data["tenant_traffic"], "Tenant traffic", _tenant_id)
        if data["team_traffic"]:
            traffic["teams"] = _multipliers(data["team_traffic"], "Team traffic", _team_id)
        if data["all_traffic"] is not None:
            traffic["all"] = data["all_traffic"]
        if traffic:
            changes["traffic"] = traffic
        return changes


@operator_only
def whatif_index(request):
    status = 200
    if request.method == "POST":
        form = WhatIfForm(request.POST)
        status = 400
        if form.is_valid():
            try:
                run = whatif_create(
                    deployment=form.cleaned_data["deployment"],
                    since=form.cleaned_data["since"],
                    until=form.cleaned_data["until"],
                    changes=form.changes(),
                    baseline_profile=form.cleaned_data["baseline_profile"],
                    user=request.user,
                )
                return redirect("portal:whatif-run", pk=run.pk)
            except forms.ValidationError as exc:
                form.add_error(None, exc)
            except WhatIfError as exc:
                for field, message in exc.errors.items():
                    form.add_error(None, f"{field}: {message}")
            except WhatIfBusy as exc:
                form.add_error(None, str(exc))
                status = 429
    else:
        now = timezone.now().replace(second=0, microsecond=0)
        form = WhatIfForm(initial={"since": now - timedelta(hours=1), "until": now})
    runs = WhatIfRun.objects.select_related("deployment", "requested_by")[:50]
    return render(request, "portal/whatif.html", {"form": form, "runs": runs}, status=status)


def _status(run: WhatIfRun) -> dict:
    return {
        "status": run.status,
        "progress": run.progress,
        "stage": run.stage,
        "message": run.message,
        "done": run.done,
    }


@operator_only
def whatif_status(request, pk: int):
    return JsonResponse(_status(get_object_or_404(WhatIfRun, pk=pk)))


LATENCIES = (  # label, the result's key, the objective's key, unit, its scale from seconds, places
    ("TTFT p50", "ttft_p50", None, "s", 1, 3),
    ("TTFT p90", "ttft_p90", "ttft_p90_s", "s", 1, 3),
    ("ITL p50", "itl_p50", None, "ms", 1000, 1),
    ("ITL p90", "itl_p90", "itl_p90_s", "ms", 1000, 1),
)


def _latency_rows(result: dict) -> list[dict]:
    """Actual, baseline and changed latencies against the deployment's objective, each flagged when over it."""
    rows = []
    for label, key, objective, unit, scale, places in LATENCIES:
        goal = result["objectives"].get(objective) if objective else None
        cells = [result["actual"].get(key), result["baseline"].get(key), result["changed"].get(key)]
        rows.append(
            {
                "label": f"{label} ({unit})",
                "places": places,
                "objective": None if goal is None else goal * scale,
                "cells": [
                    {
                        "value": None if v is None else v * scale,
                        "over": goal is not None and v is not None and v > goal,
                    }
                    for v in cells
                ],
            }
        )
    return rows


def _tenant_rows(result: dict) -> list[dict]:
    """Each tenant's actual share of the period beside its share of each simulated fleet's work."""
    names = result["tenant_names"]
    rows = []
    for tenant, name in names.items():
        row = {"name": name, "actual": result["actual"]["per_tenant"].get(tenant)}
        for fleet in ("baseline", "changed"):
            row[fleet] = result[fleet]["per_tenant"].get(tenant)
        rows.append(row)
    return rows


@operator_only
def whatif_run(request, pk: int):
    run = get_object_or_404(WhatIfRun.objects.select_related("deployment", "requested_by"), pk=pk)
    context = {"run": run, "status": _status(run)}
    if run.result:
        context.update(latency=_latency_rows(run.result), tenants=_tenant_rows(run.result), r=run.result)
    return render(request, "portal/whatif_run.html", context)
