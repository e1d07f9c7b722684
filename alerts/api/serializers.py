from __future__ import annotations

from rest_framework import serializers

from inference_platform.model_validation import ModelCleanMixin
from serving.models import ModelDeployment
from tenants.access import Access
from tenants.api.serializers import StrictIdField
from tenants.models import Team, Tenant

from ..models import AlertRule, AlertState, Delivery, Destination


def _access(serializer: serializers.Serializer) -> Access | None:
    return serializer.context.get("access")


class DestinationSerializer(ModelCleanMixin, serializers.ModelSerializer):
    tenant = StrictIdField(
        queryset=Tenant.objects.none(),
        required=False,
        allow_null=True,
        help_text="The tenant whose destination this is. Empty (operators only): a platform destination.",
    )

    class Meta:
        model = Destination
        fields = [
            "id",
            "tenant",
            "name",
            "kind",
            "url",
            "emails",
            "signing_secret",
            "is_active",
            "created_at",
        ]
        read_only_fields = ["signing_secret", "created_at"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        access = _access(self)
        if access is not None:
            self.fields["tenant"].queryset = access.manageable_tenants_qs()
        if isinstance(self.instance, Destination):
            self.fields["tenant"].read_only = True

    def validate(self, attrs):
        access = _access(self)
        if (
            self.instance is None
            and access is not None
            and not access.is_operator
            and attrs.get("tenant") is None
        ):
            raise serializers.ValidationError(
                {"tenant": "Give the id of the tenant whose destination this is."}
            )
        return super().validate(attrs)


class AlertRuleSerializer(ModelCleanMixin, serializers.ModelSerializer):
    tenant = StrictIdField(
        queryset=Tenant.objects.none(),
        required=False,
        allow_null=True,
        help_text="A tenant's rule watches its budgets. Empty (operators only): every tenant, or the platform's health.",
    )
    team = StrictIdField(queryset=Team.objects.none(), required=False, allow_null=True)
    deployment = StrictIdField(queryset=ModelDeployment.objects.none(), required=False, allow_null=True)
    destinations = StrictIdField(queryset=Destination.objects.none(), many=True)

    class Meta:
        model = AlertRule
        fields = [
            "id",
            "kind",
            "tenant",
            "budget_scope",
            "team",
            "percentages",
            "threshold",
            "window_minutes",
            "for_minutes",
            "deployment",
            "destinations",
            "is_active",
            "created_at",
        ]
        read_only_fields = ["created_at"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        access = _access(self)
        if access is not None:
            tenants = access.manageable_tenants_qs()
            self.fields["tenant"].queryset = tenants
            self.fields["team"].queryset = Team.objects.filter(tenant__in=tenants)
            self.fields["destinations"].child_relation.queryset = Destination.objects.filter(
                tenant__in=tenants
            ) | (
                Destination.objects.filter(tenant__isnull=True)
                if access.is_operator
                else Destination.objects.none()
            )
            if access.is_operator:
                self.fields["deployment"].queryset = ModelDeployment.objects.all()
        if isinstance(self.instance, AlertRule):
            self.fields["tenant"].read_only = True

    def validate(self, attrs):
        access = _access(self)
        tenant = attrs["tenant"] if "tenant" in attrs else getattr(self.instance, "tenant", None)
        if self.instance is None and access is not None and not access.is_operator and tenant is None:
            raise serializers.ValidationError({"tenant": "Give the id of the tenant whose rule this is."})
        tenant_id = tenant.pk if tenant is not None else None
        for destination in attrs.get("destinations", []):
            if destination.tenant_id != tenant_id:
                owner = f"tenant {tenant.slug}" if tenant is not None else "the platform"
                raise serializers.ValidationError(
                    {"destinations": f"Destination {destination.pk} is not one of {owner}'s destinations."}
                )
        return super().validate(attrs)


class AlertStateSerializer(serializers.ModelSerializer):
    kind = serializers.CharField(source="rule.kind", read_only=True)

    class Meta:
        model = AlertState
        fields = [
            "id",
            "rule",
            "kind",
            "key",
            "tenant",
            "holding",
            "firing",
            "holding_since",
            "fired_at",
            "resolved_at",
            "checked_at",
            "summary",
            "details",
        ]
        read_only_fields = fields


class DeliverySerializer(serializers.ModelSerializer):
    alert = serializers.PrimaryKeyRelatedField(source="state", read_only=True)

    class Meta:
        model = Delivery
        fields = [
            "id",
            "alert",
            "destination",
            "event",
            "status",
            "attempts",
            "next_attempt_at",
            "last_attempt_at",
            "response_status",
            "last_error",
            "sent_at",
            "created_at",
            "payload",
        ]
        read_only_fields = fields
