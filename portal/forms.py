from __future__ import annotations

from django import forms
from django.contrib.auth.forms import AuthenticationForm
from django.utils import timezone

from serving.models import EngineKind, ModelDeployment
from tenants.access import TENANT_DEACTIVATED, Access
from tenants.billing import GROUPS, PERIODS, group_label
from tenants.entitlements import TEAM_ADMIN_FIELDS
from tenants.models import PRIORITY_RANK, PriorityClass, Scope, Team


class SignInForm(AuthenticationForm):
    """The portal's sign-in: a person whose every tenant is deactivated is told so and not signed in."""

    def confirm_login_allowed(self, user) -> None:
        super().confirm_login_allowed(user)
        if Access.for_user(user).locked_out:
            raise forms.ValidationError(TENANT_DEACTIVATED, code="tenant_deactivated")


class ReportForm(forms.Form):
    period = forms.ChoiceField(choices=[(p, p.title()) for p in PERIODS], initial="month")
    at = forms.DateField(
        required=False, help_text="A day in the period (UTC).", widget=forms.DateInput(attrs={"type": "date"})
    )
    since = forms.DateTimeField(required=False, help_text="Custom: from (UTC).")
    until = forms.DateTimeField(required=False, help_text="Custom: until, exclusive (UTC).")
    group_by = forms.ChoiceField(choices=[(g, group_label(g)) for g in GROUPS], initial="team")


class KeyCreateForm(forms.Form):
    name = forms.CharField(max_length=200)
    scopes = forms.MultipleChoiceField(
        choices=Scope.choices, initial=[Scope.INFERENCE], widget=forms.CheckboxSelectMultiple
    )
    expires_at = forms.DateTimeField(required=False, help_text="Optional, UTC.")

    def clean_expires_at(self):
        value = self.cleaned_data["expires_at"]
        if value is not None and value <= timezone.now():
            raise forms.ValidationError("Give a time in the future, or leave it empty for no expiry.")
        return value


class DeploymentCreateForm(forms.Form):
    name = forms.SlugField(max_length=63)
    served_model_name = forms.CharField(max_length=200)
    model_source = forms.CharField(max_length=500, initial="models/tiny-qwen")
    engine_kind = forms.ChoiceField(choices=EngineKind.choices, initial=EngineKind.SIM)
    replicas = forms.IntegerField(min_value=0, max_value=64, initial=1)

    def deployment_fields(self) -> dict:
        return {name: value for name, value in self.cleaned_data.items() if name != "replicas"}

    def pools(self) -> list[dict]:
        """One pool serving both prefill and decode."""
        return [{"name": "main", "replicas": self.cleaned_data["replicas"]}]


class ScaleForm(forms.Form):
    replicas = forms.IntegerField(min_value=0, max_value=1024)


def _deployments(tenant_id: int):
    """What a tenant's teams and aliases may name: never a deployment limited to other tenants."""
    return ModelDeployment.objects.open_to([tenant_id]).order_by("served_model_name")


class DeploymentChoiceField(forms.ModelChoiceField):
    def label_from_instance(self, obj: ModelDeployment) -> str:
        return obj.served_model_name


class DeploymentsChoiceField(forms.ModelMultipleChoiceField):
    def label_from_instance(self, obj: ModelDeployment) -> str:
        return obj.served_model_name


class TeamSettingsForm(forms.Form):
    """A team's priority class, weight and the models it may call. Its tenant's admins change all of it; the
    team's own admins only its class (`full=False`). The classes offered stop at the tenant's highest."""

    priority_class = forms.ChoiceField(choices=PriorityClass.choices)
    fair_share_weight = forms.IntegerField(
        min_value=1,
        max_value=1000,
        label="Fair-share weight",
        help_text="Its share of the tenant's work on a saturated deployment, against the tenant's other teams.",
    )
    restrict_models = forms.BooleanField(
        required=False,
        label="Only the models ticked",
        help_text="Off: the team may call every model served.",
    )
    deployments = DeploymentsChoiceField(
        queryset=ModelDeployment.objects.none(),
        required=False,
        widget=forms.CheckboxSelectMultiple,
        label="Models it may call",
    )

    def __init__(self, *args, team: Team, full: bool, **kwargs):
        initial = {
            "priority_class": team.priority_class,
            "fair_share_weight": team.fair_share_weight,
            "restrict_models": team.restrict_models,
            "deployments": list(team.deployments.all()),
        }
        super().__init__(*args, initial=initial, **kwargs)
        ceiling = PRIORITY_RANK[team.tenant.max_priority_class]
        self.fields["priority_class"].choices = [
            (value, label) for value, label in PriorityClass.choices if PRIORITY_RANK[value] >= ceiling
        ]
        self.fields["priority_class"].help_text = (
            f"Its keys' class, unless a key has its own. The tenant allows at most "
            f"{team.tenant.get_max_priority_class_display().lower()}."
        )
        self.fields["deployments"].queryset = _deployments(team.tenant_id)
        if not full:
            for name in list(self.fields):
                if name not in TEAM_ADMIN_FIELDS:
                    del self.fields[name]

    def team_fields(self) -> dict:
        return {k: v for k, v in self.cleaned_data.items() if k != "deployments"}

    def team_deployments(self):
        return self.cleaned_data.get("deployments") if "deployments" in self.fields else None


class AliasForm(forms.Form):
    name = forms.CharField(max_length=200, help_text="The name agents put in `model`, such as coder.")
    deployment = DeploymentChoiceField(queryset=ModelDeployment.objects.none(), label="Serves")

    def __init__(self, *args, tenant_id: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["deployment"].queryset = _deployments(tenant_id)


class AliasMoveForm(forms.Form):
    deployment = DeploymentChoiceField(queryset=ModelDeployment.objects.none(), label="Serves")

    def __init__(self, *args, tenant_id: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["deployment"].queryset = _deployments(tenant_id)
