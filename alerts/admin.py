from django.contrib import admin
from django.db import models

from tenants.admin_audit import AuditedAdmin, ReadOnlyAdmin

from .models import AlertRule, AlertState, Delivery, Destination
from .services import alert_snapshot


@admin.register(Destination)
class DestinationAdmin(AuditedAdmin):
    audit_name = "alert_destination"
    list_display = ["name", "tenant", "kind", "url", "is_active", "created_at"]
    list_filter = ["kind", "is_active", "tenant"]
    search_fields = ["name", "url"]
    readonly_fields = ["signing_secret", "created_at"]
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}
    fields = ["tenant", "name", "kind", "url", "emails", "is_active", "signing_secret", "created_at"]

    def audit_snapshot(self, obj):
        return alert_snapshot(obj)


@admin.register(AlertRule)
class AlertRuleAdmin(AuditedAdmin):
    audit_name = "alert_rule"
    list_display = [
        "__str__",
        "kind",
        "tenant",
        "budget_scope",
        "team",
        "percentages",
        "threshold",
        "is_active",
    ]
    list_filter = ["kind", "is_active", "tenant"]
    filter_horizontal = ["destinations"]
    fieldsets = [
        (None, {"fields": ["kind", "tenant", "destinations", "is_active"]}),
        (
            "Budget rules",
            {
                "fields": ["budget_scope", "team", "percentages"],
                "description": "Alert as a team's or tenant's token or spend budget crosses each percentage, or "
                "(forecast) when the period's rate so far would use it up before the period ends.",
            },
        ),
        (
            "Health rules",
            {
                "fields": ["deployment", "threshold", "window_minutes", "for_minutes"],
                "description": "Threshold: restarts within the window (crash loop, default 3), the lowest "
                "predicted/reported ratio (default 0.8), or seconds of ingestion lag (default 120).",
            },
        ),
    ]

    def audit_snapshot(self, obj):
        return alert_snapshot(obj)


@admin.register(AlertState)
class AlertStateAdmin(ReadOnlyAdmin):
    list_display = ["rule", "key", "holding", "firing", "fired_at", "resolved_at", "checked_at"]
    list_filter = ["firing", "holding", "rule__kind"]
    search_fields = ["key", "summary"]


@admin.register(Delivery)
class DeliveryAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "destination", "event", "status", "attempts", "response_status", "sent_at"]
    list_filter = ["status", "event", "destination"]
    search_fields = ["last_error"]
