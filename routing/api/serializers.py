from rest_framework import serializers

from inference_platform.model_validation import ModelCleanMixin

from ..models import RoutingPolicy


class RoutingPolicySerializer(ModelCleanMixin, serializers.ModelSerializer):
    class Meta:
        model = RoutingPolicy
        fields = [
            "id",
            "deployment",
            "mode",
            "prefix_weight",
            "queue_weight",
            "prefill_backlog_weight",
            "kv_utilization_weight",
            "session_affinity_weight",
            "gpu_tier_weight",
            "cpu_tier_weight",
            "load_guard_ratio",
            "pd_split_threshold_tokens",
            "updated_at",
        ]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.instance, RoutingPolicy):
            self.fields["deployment"].read_only = True
