"""The REST API's serializers of tenants, teams, members, keys, quotas, prices and usage.

Over 400 lines: one serializer per resource of the tenants API, sharing their validation helpers.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework import serializers
from rest_framework.relations import MANY_RELATION_KWARGS

from inference_platform.model_validation import ModelCleanMixin
from serving.models import ModelDeployment

from ..access import Access
from ..entitlements import deployments_closed_to, deployments_outside_team
from ..limits import ceiling_fields, quota_fields
from ..models import (
    TEAM_ROLES,
    ApiKey,
    AuditLog,
    Membership,
    ModelAlias,
    PriceSheet,
    PriorityClass,
    Quota,
    Role,
    Scope,
    Team,
    Tenant,
    UsageRecord,
)


def _access(serializer: serializers.Serializer) -> Access:
    return serializer.context["access"]


class StrictBooleanField(serializers.BooleanField):
    """JSON true or false only: not 0, 1 or "yes", which DRF would otherwise take."""

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class JsonListRelatedField(serializers.ManyRelatedField):
    """A list of ids, as a JSON list only: DRF would take any iterable, so `{}` would clear the list."""

    def to_internal_value(self, data):
        if not isinstance(data, list):
            self.fail("not_a_list", input_type=type(data).__name__)
        return super().to_internal_value(data)


class StrictIdField(serializers.PrimaryKeyRelatedField):
    """An id as a JSON integer only, in a JSON list when `many` (where the type check of ModelCleanMixin does
    not reach)."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("incorrect_type", data_type=type(data).__name__)
        return super().to_internal_value(data)

    @classmethod
    def many_init(cls, *args, **kwargs):
        list_kwargs = {"child_relation": cls(*args, **kwargs)}
        list_kwargs.update({key: value for key, value in kwargs.items() if key in MANY_RELATION_KWARGS})
        return JsonListRelatedField(**list_kwargs)


class TenantIdField(StrictIdField):
    """A tenant's id, with a 400 that names an id no tenant has."""

    default_error_messages = {
        **serializers.PrimaryKeyRelatedField.default_error_messages,
        "does_not_exist": "No tenant has id {pk_value}.",
    }


class DeploymentIdField(StrictIdField):
    """A deployment's id, as a JSON integer only (in a list too, where the type check of ModelCleanMixin does
    not reach), with a 400 that names an id no deployment has."""

    default_error_messages = {
        **serializers.PrimaryKeyRelatedField.default_error_messages,
        "does_not_exist": "No deployment has id {pk_value}.",
    }

    def __init__(self, **kwargs):
        kwargs.setdefault("queryset", ModelDeployment.objects.all())
        super().__init__(**kwargs)


def _deployment_ids(help_text: str) -> serializers.ManyRelatedField:
    return DeploymentIdField(many=True, required=False, help_text=help_text)


def _scope_deployments(serializer: serializers.Serializer, name: str) -> None:
    """A deployment limited to other tenants than the caller's cannot be named: its id is one no deployment has."""
    if "access" in serializer.context:
        field = serializer.fields[name]
        field = getattr(field, "child_relation", field)
        field.queryset = _access(serializer).nameable_deployments_qs()


def _refuse_closed(tenant_id: int, deployments, field: str) -> None:
    closed = deployments_closed_to(tenant_id, deployments)
    if closed:
        raise serializers.ValidationError({field: f"No deployment has id {closed[0].pk}."})


class TenantSerializer(ModelCleanMixin, serializers.ModelSerializer):
    is_active = StrictBooleanField(
        required=False, help_text="Off: the tenant's people, tokens and API keys are refused everywhere."
    )

    class Meta:
        model = Tenant
        # A tenant is changed by operators only, so its weight, highest class and quota ceilings are theirs to
        # set; its admins read them.
        fields = [
            "id",
            "name",
            "slug",
            "is_active",
            "fair_share_weight",
            "max_priority_class",
            *ceiling_fields(),
            "created_at",
        ]


class TeamSerializer(ModelCleanMixin, serializers.ModelSerializer):
    tenant = serializers.PrimaryKeyRelatedField(queryset=Tenant.objects.none())
    deployments = _deployment_ids(
        "Ids of the deployments the team may call when `restrict_models` is on. With it off the team may "
        "call every model served."
    )

    class Meta:
        model = Team
        fields = [
            "id",
            "tenant",
            "name",
            "slug",
            "priority_class",
            "fair_share_weight",
            "restrict_models",
            "deployments",
            "created_at",
        ]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "access" in self.context:
            self.fields["tenant"].queryset = _access(self).manageable_tenants_qs()
        _scope_deployments(self, "deployments")
        if (
            self.instance is not None
            and not isinstance(self.instance, list | tuple)
            and hasattr(self.instance, "pk")
        ):
            self.fields["tenant"].read_only = True  # a team never moves between tenants

    def validate(self, attrs):
        tenant = attrs.get("tenant", getattr(self.instance, "tenant", None))
        if tenant is not None and attrs.get("deployments"):
            _refuse_closed(tenant.pk, attrs["deployments"], "deployments")
        return super().validate(attrs)


class UsernameField(serializers.SlugRelatedField):
    """A user by username. A name with a NUL character names no one (PostgreSQL cannot even compare it)."""

    def to_internal_value(self, data):
        if isinstance(data, str) and "\x00" in data:
            self.fail("does_not_exist", slug_name=self.slug_field, value=data.replace("\x00", "\\0"))
        return super().to_internal_value(data)


class MembershipSerializer(ModelCleanMixin, serializers.ModelSerializer):
    user = UsernameField(slug_field="username", queryset=get_user_model().objects.all())
    tenant = serializers.PrimaryKeyRelatedField(
        queryset=Tenant.objects.none(), required=False, allow_null=True
    )
    team = serializers.PrimaryKeyRelatedField(queryset=Team.objects.none(), required=False, allow_null=True)

    class Meta:
        model = Membership
        fields = ["id", "user", "role", "tenant", "team", "created_at"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "access" in self.context:
            access = _access(self)
            self.fields["tenant"].queryset = access.manageable_tenants_qs()
            self.fields["team"].queryset = access.manageable_teams_qs()
        if isinstance(self.instance, Membership):
            # Only the role changes in place; a new scope is a new membership.
            for name in ("user", "tenant", "team"):
                self.fields[name].read_only = True

    def validate(self, attrs):
        access = _access(self)
        role = attrs.get("role", getattr(self.instance, "role", None))
        tenant = attrs.get("tenant", getattr(self.instance, "tenant", None))
        team = attrs.get("team", getattr(self.instance, "team", None))
        if role == Role.OPERATOR:
            if not access.is_operator:
                raise serializers.ValidationError({"role": "Only an operator can grant the operator role."})
            if tenant or team:
                raise serializers.ValidationError(
                    {"role": "The operator role is platform-wide: leave tenant and team empty."}
                )
        elif role == Role.TENANT_ADMIN:
            if team:
                raise serializers.ValidationError({"team": "A tenant admin role takes a tenant, not a team."})
            if tenant is None:
                raise serializers.ValidationError({"tenant": "A tenant admin role needs a tenant."})
            if not access.can_admin_tenant(tenant.id):
                raise serializers.ValidationError(
                    {"role": "Only an operator or a tenant admin can grant this role."}
                )
        elif role in TEAM_ROLES:
            if team is None:
                raise serializers.ValidationError({"team": f"The {role} role needs a team."})
            if tenant is not None and tenant.id != team.tenant_id:
                raise serializers.ValidationError(
                    {"tenant": "The team belongs to another tenant; leave tenant empty."}
                )
            attrs["tenant"] = team.tenant
        return super().validate(attrs)


class ApiKeySerializer(ModelCleanMixin, serializers.ModelSerializer):
    team = serializers.PrimaryKeyRelatedField(queryset=Team.objects.none())
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=Scope.choices), allow_empty=False, default=[Scope.INFERENCE]
    )
    prefix = serializers.CharField(read_only=True)
    is_active = serializers.BooleanField(read_only=True)
    # Empty for keys made by the system (bootstrap, tests) or whose maker's account was deleted.
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    deployments = _deployment_ids(
        "Ids of deployments that narrow what the key may call, among its team's. Empty: all its team's."
    )

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "team",
            "name",
            "prefix",
            "scopes",
            "priority_class",
            "deployments",
            "expires_at",
            "revoked_at",
            "last_used_at",
            "is_active",
            "created_by",
            "created_at",
        ]
        read_only_fields = ["revoked_at", "last_used_at", "created_at"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "access" in self.context:
            self.fields["team"].queryset = _access(self).manageable_teams_qs()
        _scope_deployments(self, "deployments")
        if isinstance(self.instance, ApiKey):
            self.fields["team"].read_only = True

    def model_clean_exclude(self, instance) -> set[str]:
        return {"public_id", "secret_hmac"}  # made when the key is issued

    def validate_expires_at(self, value):
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("Give a time in the future, or leave it empty for no expiry.")
        return value

    def validate(self, attrs):
        team = attrs.get("team", getattr(self.instance, "team", None))
        if team is not None and attrs.get("deployments"):
            _refuse_closed(team.tenant_id, attrs["deployments"], "deployments")
        outside = deployments_outside_team(team, attrs.get("deployments") or ()) if team else []
        if outside:
            names = ", ".join(sorted(d.served_model_name for d in outside))
            raise serializers.ValidationError(
                {
                    "deployments": f"Team {team} may not call {names}: a key can only narrow its team's "
                    "models. Ask a tenant admin to allow them for the team first."
                }
            )
        return super().validate(attrs)


class IssuedApiKeySerializer(ApiKeySerializer):
    key = serializers.CharField(
        read_only=True, help_text="The full key. Shown once, now; it cannot be shown again."
    )

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


class QuotaSerializer(ModelCleanMixin, serializers.ModelSerializer):
    team = serializers.PrimaryKeyRelatedField(queryset=Team.objects.none())
    api_key = serializers.PrimaryKeyRelatedField(
        queryset=ApiKey.objects.none(), required=False, allow_null=True
    )
    resets_at = serializers.DateTimeField(read_only=True)

    class Meta:
        model = Quota
        fields = [
            "id",
            "team",
            "api_key",
            *quota_fields(),
            "resets_at",
            "updated_at",
        ]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "access" in self.context:
            access = _access(self)
            teams = (
                access.teams_qs()
                if access.is_operator
                else access.teams_qs().filter(tenant_id__in=access.admin_tenants)
            )
            self.fields["team"].queryset = teams
            self.fields["api_key"].queryset = ApiKey.objects.filter(team__in=teams)
        if isinstance(self.instance, Quota):
            self.fields["team"].read_only = True
            self.fields["api_key"].read_only = True

    def validate(self, attrs):
        team = attrs.get("team", getattr(self.instance, "team", None))
        api_key = attrs.get("api_key", getattr(self.instance, "api_key", None))
        if api_key is not None and api_key.team_id != team.id:
            raise serializers.ValidationError({"api_key": "This key belongs to another team."})
        return super().validate(attrs)


class PriceSheetSerializer(ModelCleanMixin, serializers.ModelSerializer):
    class Meta:
        model = PriceSheet
        fields = [
            "id",
            "served_model_name",
            "tenant",
            "effective_from",
            "currency",
            "input_per_mtok",
            "cached_input_per_mtok",
            "output_per_mtok",
            "created_at",
        ]


class ModelAliasSerializer(ModelCleanMixin, serializers.ModelSerializer):
    tenant = serializers.PrimaryKeyRelatedField(queryset=Tenant.objects.none())
    deployment = DeploymentIdField(help_text="The deployment the alias serves.")

    class Meta:
        model = ModelAlias
        fields = ["id", "tenant", "name", "deployment", "created_at", "updated_at"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "access" in self.context:
            self.fields["tenant"].queryset = _access(self).manageable_tenants_qs()
        _scope_deployments(self, "deployment")
        if isinstance(self.instance, ModelAlias):
            self.fields["tenant"].read_only = True  # an alias never moves between tenants

    def validate(self, attrs):
        tenant = attrs.get("tenant", getattr(self.instance, "tenant", None))
        if tenant is not None and attrs.get("deployment") is not None:
            _refuse_closed(tenant.pk, [attrs["deployment"]], "deployment")
        return super().validate(attrs)


class UsageRecordSerializer(serializers.ModelSerializer):
    priority_class = serializers.ChoiceField(
        choices=PriorityClass.choices,
        allow_blank=True,
        read_only=True,
        help_text="The class it was served in; empty for requests metered before classes existed.",
    )

    class Meta:
        model = UsageRecord
        fields = [
            "request_id",
            "tenant",
            "team",
            "api_key",
            "deployment",
            "model",
            "endpoint",
            "prompt_tokens",
            "cached_prompt_tokens",
            "output_tokens",
            "cost",
            "currency",
            "ttft_ms",
            "latency_ms",
            "status",
            "priority_class",
            "queued_ms",
            "created_at",
        ]
        read_only_fields = fields


class AuditLogSerializer(serializers.ModelSerializer):
    class Meta:
        model = AuditLog
        fields = [
            "id",
            "actor_label",
            "tenant",
            "action",
            "target_type",
            "target_id",
            "target_repr",
            "details",
            "source",
            "created_at",
        ]
        read_only_fields = fields
