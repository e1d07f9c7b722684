from django.contrib import admin

from tenants.admin_audit import AuditedAdmin, ReadOnlyAdmin

from .models import GroupRule, Identity


@admin.register(GroupRule)
class GroupRuleAdmin(AuditedAdmin):
    list_display = ["group", "role", "tenant", "team", "admin_site", "created_at"]
    list_filter = ["role", "admin_site"]
    search_fields = ["group", "tenant__name", "team__name"]
    list_select_related = ["tenant", "team__tenant"]
    autocomplete_fields = ["tenant", "team"]


@admin.register(Identity)
class IdentityAdmin(ReadOnlyAdmin):
    list_display = ["user", "issuer", "subject", "groups", "last_sign_in_at"]
    search_fields = ["user__username", "subject"]
    list_select_related = ["user"]
