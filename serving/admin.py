from django.contrib import admin
from django.core.exceptions import ValidationError
from django.forms.models import BaseInlineFormSet

from tenants.admin_audit import AuditedAdmin, ReadOnlyAdmin

from . import services
from .model_length import max_model_len_check
from .models import AutoscalingPolicy, Endpoint, EndpointLifetime, ModelDeployment, Pool, ScalingEvent


class PoolFormSet(BaseInlineFormSet):
    def clean(self):
        """The deployment's max_model_len is checked here, where both it (the formset's instance, with the
        form's values) and the pools it will have (their engine arguments can lengthen the model) are known."""
        super().clean()
        pools = [
            form.cleaned_data
            for form in self.forms
            if form.cleaned_data and not self._should_delete_form(form)
        ]
        try:
            max_model_len_check(self.instance, pools)
        except ValidationError as exc:
            raise ValidationError(exc.messages) from exc


class PoolInline(admin.StackedInline):
    model = Pool
    formset = PoolFormSet
    extra = 0
    fieldsets = [
        (None, {"fields": [("name", "role", "replicas")]}),
        (
            "Parallelism",
            {
                "fields": [
                    (
                        "tensor_parallel_size",
                        "data_parallel_size",
                        "enable_expert_parallel",
                        "nodes_per_replica",
                    )
                ]
            },
        ),
        (
            "Engine options",
            {
                "fields": [
                    ("enable_prefix_caching", "enable_kv_events"),
                    ("kv_connector", "cpu_offload_bytes"),
                    ("speculative_method", "num_speculative_tokens"),
                    "max_num_seqs",
                    "extra_engine_args",
                ]
            },
        ),
        ("Resources", {"fields": [("accelerator", "gpus_per_replica", "cpu_request", "memory_request")]}),
    ]


class EndpointInline(admin.TabularInline):
    model = Endpoint
    extra = 0
    fields = ["name", "url", "role", "health", "last_seen_at", "restart_count"]
    readonly_fields = fields
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(ModelDeployment)
class ModelDeploymentAdmin(AuditedAdmin):
    audit_name = "deployment"
    list_display = [
        "name",
        "served_model_name",
        "engine_kind",
        "orchestrator",
        "desired_status",
        "observed_status",
        "pool_summary",
        "tool_calling_summary",
        "updated_at",
    ]
    list_filter = ["engine_kind", "orchestrator", "desired_status", "observed_status"]
    search_fields = ["name", "served_model_name", "model_source"]
    readonly_fields = [
        "tool_calling_effective",
        "observed_status",
        "status_message",
        "observed_at",
        "created_at",
        "updated_at",
    ]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    ("name", "served_model_name"),
                    "model_source",
                    ("revision", "tokenizer"),
                    ("engine_kind", "engine_image"),
                    ("orchestrator", "namespace"),
                    ("max_model_len", "block_size"),
                    "desired_status",
                ]
            },
        ),
        (
            "Tenants",
            {
                "fields": ["tenants"],
                "description": "A private deployment (a tenant's fine-tune) is limited to its tenants: the router "
                "answers every other tenant's keys that the model does not exist, whatever their teams may call.",
            },
        ),
        (
            "Tool calling and reasoning",
            {
                "fields": [
                    ("tool_call_parser", "reasoning_parser"),
                    "tool_calling_effective",
                    "chat_template",
                ],
                "description": 'Leave a parser blank for the model family\'s default, or set "none" to switch it off.',
            },
        ),
        (
            "Status",
            {"fields": [("observed_status", "observed_at"), "status_message", ("created_at", "updated_at")]},
        ),
    ]
    inlines = [PoolInline]
    filter_horizontal = ["tenants"]

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("pools")

    @admin.display(description="Pools")
    def pool_summary(self, obj: ModelDeployment) -> str:
        return ", ".join(f"{p.name} ({p.role}) x{p.replicas}" for p in obj.pools.all()) or "-"

    @admin.display(description="Tool calling")
    def tool_calling_summary(self, obj: ModelDeployment) -> str:
        tools = obj.tool_calling()
        if tools.tool_call_parser is None:
            return "off"
        reasoning = f", reasoning {tools.reasoning_parser}" if tools.reasoning_parser else ""
        return f"{tools.tool_call_parser}{reasoning}"

    @admin.display(description="In effect")
    def tool_calling_effective(self, obj: ModelDeployment | None) -> str:
        if obj is None or obj.pk is None:
            return "Shown once saved: the defaults depend on the model."
        tools = obj.tool_calling()
        tool = tools.tool_call_parser or "off"
        reasoning = tools.reasoning_parser or "none"
        return (
            f"Tool-call parser: {tool} ({tools.source}). Reasoning parser: {reasoning} ({tools.reasoning_source}). "
            f"{tools.note}"
        )

    def audit_snapshot(self, obj) -> dict:
        data = services.deployment_snapshot(obj)
        data["tenants"] = sorted(obj.tenants.values_list("pk", flat=True))
        return data

    def save_formset(self, request, form, formset, change):
        """A pool's replicas set here by hand pause its autoscaling, as everywhere else."""
        before = {
            f.instance.pk: Pool.objects.get(pk=f.instance.pk).replicas
            for f in formset.forms
            if isinstance(f.instance, Pool) and f.instance.pk and "replicas" in f.changed_data
        }
        super().save_formset(request, form, formset, change)
        for pool in Pool.objects.filter(pk__in=before):
            services.autoscaling_pause(actor=request.user, source="admin", pool=pool, before=before[pool.pk])

    # The admin saves the deployment and its pools in one transaction; reconcile once it commits.
    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        services.deployment_changed(deployment_id=obj.pk)

    def delete_model(self, request, obj):
        super().delete_model(request, obj)
        services.deployment_deleted()


@admin.register(Endpoint)
class EndpointAdmin(ReadOnlyAdmin):
    """Endpoints are what the orchestrators found running; they are read here, not edited."""

    list_display = ["name", "url", "role", "pool", "health", "last_seen_at", "pid", "restart_count"]
    list_filter = ["health", "role", "pool__deployment"]
    search_fields = ["name", "url"]
    list_select_related = ["pool__deployment"]


@admin.register(AutoscalingPolicy)
class AutoscalingPolicyAdmin(AuditedAdmin):
    audit_name = "autoscaling_policy"
    list_display = ["pool", "enabled", "min_replicas", "max_replicas", "paused_reason", "updated_at"]
    list_filter = ["enabled", "pool__role"]
    list_select_related = ["pool__deployment"]
    readonly_fields = ["paused_reason", "updated_at"]
    fieldsets = [
        (None, {"fields": ["pool", "enabled", ("min_replicas", "max_replicas"), "paused_reason"]}),
        (
            "Prefill and aggregated pools",
            {"fields": [("ttft_p90_s", "queued_prompt_tokens_per_replica")]},
        ),
        (
            "Decode and aggregated pools",
            {"fields": [("itl_p90_s", "kv_cache_utilization", "running_requests_per_replica")]},
        ),
        (
            "Pace",
            {
                "fields": [
                    ("scale_up_window_s", "scale_down_window_s"),
                    ("max_scale_up_step", "max_scale_down_step"),
                ]
            },
        ),
    ]


@admin.register(ScalingEvent)
class ScalingEventAdmin(ReadOnlyAdmin):
    list_display = ["at", "pool", "from_replicas", "to_replicas", "actor", "reason"]
    list_filter = ["actor", "pool__deployment"]
    list_select_related = ["pool__deployment"]


@admin.register(EndpointLifetime)
class EndpointLifetimeAdmin(ReadOnlyAdmin):
    list_display = [
        "endpoint_name",
        "deployment_name",
        "pool_name",
        "accelerator",
        "gpus",
        "started_at",
        "ready_at",
        "draining_at",
        "stopped_at",
    ]
    list_filter = ["deployment_name", "accelerator"]
