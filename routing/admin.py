from django.contrib import admin

from routing.models import RoutingPolicy, policy_fields
from routing.scheduling import REGISTRY
from tenants.admin_audit import AuditedAdmin

# The flow-control settings (routing/scheduling/flow.py): when a deployment counts as saturated, and how long each class
# may wait in the router.
FLOW_CONTROL_FIELDS = [
    f.name
    for f in policy_fields()
    if f.name == "flow_control" or f.name.startswith(("saturation_", "max_wait_"))
]


@admin.register(RoutingPolicy)
class RoutingPolicyAdmin(AuditedAdmin):
    audit_name = "routing_policy"
    # The scorers' weights, as registered (routing/scheduling/__init__.py).
    list_display = [
        "deployment",
        "mode",
        *REGISTRY.weight_fields,
        "pd_split_threshold_tokens",
        "flow_control",
        "updated_at",
    ]
    list_filter = ["mode", "flow_control"]
    search_fields = ["deployment__name", "deployment__served_model_name"]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "deployment",
                    *(f.name for f in policy_fields() if f.name not in FLOW_CONTROL_FIELDS),
                ]
            },
        ),
        (
            "Flow control",
            {
                "fields": FLOW_CONTROL_FIELDS,
                "description": "While the deployment is saturated (any threshold below crossed), new requests "
                "wait in the router instead of in the engines' queues, and are served by priority class, then "
                "by fair share of work across tenants and their teams. A request that waits past its class's "
                "limit gets a 429 with Retry-After.",
            },
        ),
    ]
