"""The portal's forms for destinations and rules, each scoped to what the person may name."""

from __future__ import annotations

from django import forms

from serving.models import ModelDeployment
from tenants.access import Access
from tenants.models import Team

from .models import BUDGET_KINDS, AlertKind, AlertRule, BudgetScope, Destination, DestinationKind


def _numbers(raw: str, *, kind=int) -> list:
    try:
        return [kind(part) for part in raw.replace(";", ",").split(",") if part.strip()]
    except ValueError as exc:
        raise forms.ValidationError("Give numbers separated by commas, such as 50, 80, 100.") from exc


class DestinationForm(forms.Form):
    tenant = forms.ModelChoiceField(queryset=None, required=False, empty_label="Platform (operators)")
    name = forms.CharField(max_length=200)
    kind = forms.ChoiceField(choices=DestinationKind.choices)
    url = forms.URLField(
        required=False, max_length=1000, assume_scheme="https", help_text="Webhook: the incoming-webhook URL."
    )
    emails = forms.CharField(required=False, help_text="E-mail: addresses separated by commas.")

    def __init__(self, *args, access: Access, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["tenant"].queryset = access.manageable_tenants_qs()
        self.fields["tenant"].required = not access.is_operator
        if not access.is_operator:
            self.fields["tenant"].empty_label = None

    def clean_emails(self) -> list[str]:
        addresses = [a.strip() for a in self.cleaned_data["emails"].split(",") if a.strip()]
        field = forms.EmailField()
        return [field.clean(address) for address in addresses]

    def destination_fields(self) -> dict:
        return dict(self.cleaned_data)


class RuleForm(forms.Form):
    kind = forms.ChoiceField(choices=AlertKind.choices)
    tenant = forms.ModelChoiceField(
        queryset=None, required=False, empty_label="Platform (every tenant, or health)"
    )
    budget_scope = forms.ChoiceField(choices=BudgetScope.choices, initial=BudgetScope.TEAM)
    team = forms.ModelChoiceField(queryset=None, required=False, empty_label="Every team")
    percentages = forms.CharField(initial="50, 80, 100", required=False, help_text="Budget: percentages.")
    threshold = forms.FloatField(required=False, min_value=0, help_text="Health: empty for the default.")
    window_minutes = forms.IntegerField(initial=15, min_value=1)
    for_minutes = forms.IntegerField(initial=0, min_value=0)
    deployment = forms.ModelChoiceField(queryset=None, required=False, empty_label="Every deployment")
    destinations = forms.ModelMultipleChoiceField(queryset=None, widget=forms.CheckboxSelectMultiple)

    def __init__(self, *args, access: Access, **kwargs):
        super().__init__(*args, **kwargs)
        tenants = access.manageable_tenants_qs()
        self.fields["tenant"].queryset = tenants
        self.fields["team"].queryset = Team.objects.filter(tenant__in=tenants).select_related("tenant")
        self.fields["destinations"].queryset = (
            Destination.objects.all()
            if access.is_operator
            else Destination.objects.filter(tenant__in=tenants)
        )
        if access.is_operator:
            self.fields["deployment"].queryset = ModelDeployment.objects.all()
        else:
            self.fields["tenant"].required = True
            self.fields["tenant"].empty_label = None
            self.fields["kind"].choices = [(k, AlertKind(k).label) for k in BUDGET_KINDS]
            self.fields["deployment"].queryset = ModelDeployment.objects.none()

    def clean_percentages(self) -> list[int]:
        return _numbers(self.cleaned_data["percentages"])

    def clean(self):
        data = super().clean()
        tenant = data.get("tenant")
        for destination in data.get("destinations") or []:
            if destination.tenant_id != (tenant.pk if tenant else None):
                self.add_error(
                    "destinations", f"{destination} is not one of this rule's owner's destinations."
                )
        return data

    def rule_fields(self) -> dict:
        data = dict(self.cleaned_data)
        data.pop("destinations")
        if data["kind"] == AlertKind.BUDGET_FORECAST or data["kind"] not in BUDGET_KINDS:
            data["percentages"] = (
                data["percentages"] or AlertRule._meta.get_field("percentages").get_default()
            )
        return data
