from __future__ import annotations

from django.db import transaction
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from inference_platform.model_validation import ModelCleanMixin

from ..models import Endpoint, ModelDeployment, Pool, PoolRole


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
    pools = PoolSerializer(many=True, required=False)
    endpoints = serializers.SerializerMethodField()
    tool_calling = serializers.SerializerMethodField()

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
        names = [pool["name"] for pool in pools]
        if len(names) != len(set(names)):
            raise serializers.ValidationError("Pool names must be unique within a deployment.")
        roles = {pool.get("role", PoolRole.BOTH) for pool in pools}
        if (PoolRole.PREFILL in roles) != (PoolRole.DECODE in roles):
            raise serializers.ValidationError(
                "A disaggregated deployment needs both a prefill and a decode pool."
            )
        return pools

    def validate(self, attrs):
        pools = attrs.pop("pools", None)
        attrs = super().validate(attrs)
        if pools is not None:
            attrs["pools"] = pools
        return attrs

    @transaction.atomic
    def create(self, validated_data):
        pools = validated_data.pop("pools", [])
        deployment = ModelDeployment.objects.create(**validated_data)
        for pool in pools:
            Pool.objects.create(deployment=deployment, **pool)
        return deployment

    @transaction.atomic
    def update(self, instance, validated_data):
        pools = validated_data.pop("pools", None)
        instance = super().update(instance, validated_data)
        if pools is not None:
            # The given list is the whole desired set of pools, matched by name.
            instance.pools.exclude(name__in=[pool["name"] for pool in pools]).delete()
            for pool in pools:
                Pool.objects.update_or_create(deployment=instance, name=pool["name"], defaults=pool)
        return instance
