"""The portal's alerts page: destinations, rules, what is firing and what was delivered. For operators (the
platform's and every tenant's) and tenant admins (their tenant's); anyone else is refused."""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from alerts import scopes
from alerts.forms import DestinationForm, RuleForm
from alerts.services import (
    alert_object_delete,
    destination_create,
    destination_rotate_secret,
    rule_create,
)
from tenants.access import Access

from .views import SOURCE, _access, _form_errors, signed_in

RECENT = 50


def _admin_access(request) -> Access:
    access = _access(request)
    if not (access.is_operator or access.admin_tenants):
        raise PermissionDenied("Alerts are for operators and tenant admins.")
    return access


def _render(request, access: Access, *, status: int = 200, **forms):
    context = {
        "destinations": scopes.destinations_qs(access),
        "rules": scopes.rules_qs(access),
        "firing": scopes.alert_states_qs(access).filter(firing=True).order_by("-fired_at"),
        "deliveries": scopes.deliveries_qs(access).select_related("state__rule")[:RECENT],
        "destination_form": forms.get("destination_form") or DestinationForm(access=access),
        "rule_form": forms.get("rule_form") or RuleForm(access=access),
        "is_operator": access.is_operator,
    }
    return render(request, "portal/alerts/index.html", context, status=status)


@signed_in
def alerts_index(request):
    return _render(request, _admin_access(request))


@signed_in
@require_POST
def destination_new(request):
    access = _admin_access(request)
    form = DestinationForm(request.POST, access=access)
    if form.is_valid():
        try:
            destination = destination_create(actor=request.user, source=SOURCE, **form.destination_fields())
        except ValidationError as exc:
            _form_errors(form, exc)
        else:
            messages.success(request, f"Destination {destination.name} added.")
            return redirect("portal:alerts")
    return _render(request, access, status=400, destination_form=form)


@signed_in
@require_POST
def rule_new(request):
    access = _admin_access(request)
    form = RuleForm(request.POST, access=access)
    if form.is_valid():
        try:
            rule = rule_create(
                actor=request.user,
                source=SOURCE,
                destinations=list(form.cleaned_data["destinations"]),
                **form.rule_fields(),
            )
        except ValidationError as exc:
            _form_errors(form, exc)
        else:
            messages.success(request, f"Rule {rule} added.")
            return redirect("portal:alerts")
    return _render(request, access, status=400, rule_form=form)


def _owned(access: Access, obj) -> None:
    if not scopes.can_manage(access, obj.tenant_id):
        raise PermissionDenied("Only the operators change the platform's alerts.")


@signed_in
@require_POST
def destination_delete(request, pk: int):
    access = _admin_access(request)
    destination = get_object_or_404(scopes.destinations_qs(access), pk=pk)
    _owned(access, destination)
    alert_object_delete(instance=destination, actor=request.user, source=SOURCE)
    messages.success(request, f"Destination {destination.name} deleted.")
    return redirect("portal:alerts")


@signed_in
@require_POST
def destination_rotate(request, pk: int):
    access = _admin_access(request)
    destination = get_object_or_404(scopes.destinations_qs(access), pk=pk)
    _owned(access, destination)
    destination_rotate_secret(destination=destination, actor=request.user, source=SOURCE)
    messages.success(
        request, f"Destination {destination.name} has a new signing secret: give it to the receiver."
    )
    return redirect("portal:alerts")


@signed_in
@require_POST
def rule_delete(request, pk: int):
    access = _admin_access(request)
    rule = get_object_or_404(scopes.rules_qs(access), pk=pk)
    _owned(access, rule)
    alert_object_delete(instance=rule, actor=request.user, source=SOURCE)
    messages.success(request, "Rule deleted.")
    return redirect("portal:alerts")
