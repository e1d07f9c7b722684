from rest_framework import serializers

from inference_platform.model_validation import ModelCleanMixin
from routing.models import RoutingPolicy, policy_fields


class RoutingPolicySerializer(ModelCleanMixin, serializers.ModelSerializer):
    class Meta:
        model = RoutingPolicy
        # Every field the router reads (policy_fields), between the deployment and the bookkeeping.
        fields = ["id", "deployment", *(f.name for f in policy_fields()), "updated_at"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.instance, RoutingPolicy):
            self.fields["deployment"].read_only = True
