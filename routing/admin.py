from django.contrib import admin

from tenants.admin_audit import AuditedAdmin

from .models import RoutingPolicy


@admin.register(RoutingPolicy)
class RoutingPolicyAdmin(AuditedAdmin):
    audit_name = "routing_policy"
    list_display = [
        "deployment",
        "mode",
        "prefix_weight",
        "queue_weight",
        "prefill_backlog_weight",
        "kv_utilization_weight",
        "session_affinity_weight",
        "pd_split_threshold_tokens",
        "updated_at",
    ]
    list_filter = ["mode"]
    search_fields = ["deployment__name", "deployment__served_model_name"]
