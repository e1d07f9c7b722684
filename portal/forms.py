from __future__ import annotations

from django import forms

from serving.models import EngineKind
from tenants.billing import GROUPS, PERIODS
from tenants.models import Scope


class ReportForm(forms.Form):
    period = forms.ChoiceField(choices=[(p, p.title()) for p in PERIODS], initial="month")
    at = forms.DateField(
        required=False, help_text="A day in the period (UTC).", widget=forms.DateInput(attrs={"type": "date"})
    )
    since = forms.DateTimeField(required=False, help_text="Custom: from (UTC).")
    until = forms.DateTimeField(required=False, help_text="Custom: until, exclusive (UTC).")
    group_by = forms.ChoiceField(choices=[(g, g.title()) for g in GROUPS], initial="team")


class KeyCreateForm(forms.Form):
    name = forms.CharField(max_length=200)
    scopes = forms.MultipleChoiceField(
        choices=Scope.choices, initial=[Scope.INFERENCE], widget=forms.CheckboxSelectMultiple
    )
    expires_at = forms.DateTimeField(required=False, help_text="Optional, UTC.")


class DeploymentCreateForm(forms.Form):
    name = forms.SlugField(max_length=63)
    served_model_name = forms.CharField(max_length=200)
    model_source = forms.CharField(max_length=500, initial="models/tiny-qwen")
    engine_kind = forms.ChoiceField(choices=EngineKind.choices, initial=EngineKind.SIM)
    replicas = forms.IntegerField(min_value=0, max_value=64, initial=1)


class ScaleForm(forms.Form):
    replicas = forms.IntegerField(min_value=0, max_value=1024)
