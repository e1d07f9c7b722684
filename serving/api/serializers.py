from __future__ import annotations

import copy

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from inference_platform.model_validation import ModelCleanMixin
from tenants.api.serializers import TenantIdField
from tenants.models import Tenant

from .. import services
from ..model_length import LENGTH_FIELDS, max_model_len_check
from ..models import AutoscalingPolicy, Endpoint, ModelDeployment, Pool, ScalingEvent


class PoolSerializer(ModelCleanMixin, serializers.ModelSerializer):
    class Meta:
        model = Pool
        fields = [
            "id",
            "name",
            "role",
            "replicas",
            "tensor_parallel_size",
            "data_parallel_size",
            "enable_expert_parallel",
            "nodes_per_replica",
            "enable_prefix_caching",
            "enable_kv_events",
            "kv_connector",
            "cpu_offload_bytes",
            "speculative_method",
            "num_speculative_tokens",
            "max_num_seqs",
            "accelerator",
            "gpus_per_replica",
            "cpu_request",
            "memory_request",
            "extra_engine_args",
        ]

    def validate(self, attrs):
        # Nested pools are validated on their own; the deployment is set when the parent saves.
        self.instance = None
        return super().validate(attrs)

    def model_clean_exclude(self, instance) -> set[str]:
        return {"deployment"}

    def validate_extra_engine_args(self, value):
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise serializers.ValidationError('Give a list of strings, such as ["--enforce-eager"].')
        return value


class EndpointSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Endpoint
        fields = [
            "id",
            "pool",
            "name",
            "url",
            "role",
            "health",
            "last_seen_at",
            "kv_events_endpoint",
            "kv_side_channel",
        ]
        read_only_fields = fields


class ToolCallingSerializer(serializers.Serializer):
    """What the engines run with: the deployment's own parser settings, else its model family's defaults."""

    tool_call_parser = serializers.CharField(allow_null=True, help_text="Null: tool calling is off.")
    reasoning_parser = serializers.CharField(allow_null=True, help_text="Null: no reasoning parser.")
    source = serializers.CharField(
        help_text='Of the tool-call parser: "deployment", "family <name>" or "none".'
    )
    reasoning_source = serializers.CharField()
    family = serializers.CharField(allow_null=True, help_text="The model family matched, if any.")
    note = serializers.CharField()


class ModelDeploymentSerializer(ModelCleanMixin, serializers.ModelSerializer):
    """A deployment as operators see and change it."""

    pools = PoolSerializer(many=True, required=False)
    endpoints = serializers.SerializerMethodField()
    tool_calling = serializers.SerializerMethodField()
    tenants = TenantIdField(
        many=True,
        required=False,
        queryset=Tenant.objects.all(),
        help_text="Ids of the only tenants that may call it (and see it), checked before their teams' "
        "entitlements. Empty: every tenant.",
    )

    class Meta:
        model = ModelDeployment
        fields = [
            "id",
            "name",
            "served_model_name",
            "model_source",
            "revision",
            "tokenizer",
            "engine_kind",
            "engine_image",
            "orchestrator",
            "namespace",
            "max_model_len",
            "block_size",
            "tool_call_parser",
            "reasoning_parser",
            "chat_template",
            "tool_calling",
            "desired_status",
            "observed_status",
            "status_message",
            "observed_at",
            "tenants",
            "pools",
            "endpoints",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["observed_status", "status_message", "observed_at"]

    def get_endpoints(self, obj) -> list[dict]:
        endpoints = Endpoint.objects.filter(pool__deployment=obj).select_related("pool")
        return EndpointSerializer(endpoints, many=True).data

    @extend_schema_field(ToolCallingSerializer)
    def get_tool_calling(self, obj) -> dict:
        return obj.tool_calling().as_dict()

    def validate_pools(self, pools):
        services.pools_check(pools)
        return pools

    def validate(self, attrs):
        pools = attrs.pop("pools", None)
        attrs = super().validate(attrs)
        self._max_model_len_check(attrs, pools)
        if pools is not None:
            attrs["pools"] = pools
        return attrs

    def _max_model_len_check(self, attrs, pools) -> None:
        """The deployment as it would be saved, with the pools it would have, must be one its engines start."""
        if self.instance is not None and pools is None and not LENGTH_FIELDS & attrs.keys():
            return
        deployment = ModelDeployment() if self.instance is None else copy.copy(self.instance)
        for name in LENGTH_FIELDS:
            if name in attrs:
                setattr(deployment, name, attrs[name])
        if pools is None:
            pools = self.instance.pools.all() if self.instance is not None else []
        max_model_len_check(deployment, pools)

    # Writes go through serving.services (the view calls them): this serializer validates and renders only.
    def create(self, validated_data):
        raise NotImplementedError("deployments are created by serving.services.deployment_create")

    def update(self, instance, validated_data):
        raise NotImplementedError("deployments are changed by serving.services.deployment_update")


class DeploymentForCallersSerializer(serializers.ModelSerializer):
    """A deployment as a tenant's people see it: what to put in `model` and what it serves, never how or where
    it runs (no engine addresses, model sources, engine flags or chat templates)."""

    supports_tools = serializers.SerializerMethodField(help_text="Whether it takes tools (function calling).")
    supports_reasoning = serializers.SerializerMethodField(
        help_text="Whether it returns its reasoning apart."
    )

    class Meta:
        model = ModelDeployment
        fields = [
            "id",
            "name",
            "served_model_name",
            "max_model_len",
            "observed_status",
            "supports_tools",
            "supports_reasoning",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields

    def get_supports_tools(self, obj) -> bool:
        return obj.tool_calling().tool_call_parser is not None

    def get_supports_reasoning(self, obj) -> bool:
        return obj.tool_calling().reasoning_parser is not None


class AutoscalingPolicySerializer(ModelCleanMixin, serializers.ModelSerializer):
    """A pool's autoscaling policy. Turning it on again after a manual edit paused it clears the pause."""

    class Meta:
        model = AutoscalingPolicy
        fields = [
            "id",
            "pool",
            "enabled",
            "min_replicas",
            "max_replicas",
            "ttft_p90_s",
            "queued_prompt_tokens_per_replica",
            "itl_p90_s",
            "kv_cache_utilization",
            "running_requests_per_replica",
            "scale_up_window_s",
            "scale_down_window_s",
            "max_scale_up_step",
            "max_scale_down_step",
            "paused_reason",
            "updated_at",
        ]
        read_only_fields = ["paused_reason", "updated_at"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.instance, AutoscalingPolicy):
            self.fields["pool"].read_only = True


class ScalingEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = ScalingEvent
        fields = ["id", "pool", "at", "from_replicas", "to_replicas", "actor", "signals", "reason"]
        read_only_fields = fields
