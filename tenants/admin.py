from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.template.response import TemplateResponse
from django.utils.translation import ngettext

from .admin_audit import AuditedAdmin, ReadOnlyAdmin
from .entitlements import deployments_outside_team, entitlement_snapshot
from .keys import api_key_create, api_key_revoke
from .limits import ceiling_fields, quota_fields
from .models import (
    ApiKey,
    AuditLog,
    Membership,
    ModelAlias,
    PriceSheet,
    Quota,
    Scope,
    Team,
    Tenant,
    UsageRecord,
)

MODELS_HELP = (
    "A team not restricted to the models listed may call every model served. Restricted, it may call only "
    "the deployments listed (nothing, if none is), and its tenant's aliases of them."
)


class TeamInline(admin.TabularInline):
    model = Team
    extra = 0
    fields = ["name", "slug"]
    show_change_link = True


@admin.register(Tenant)
class TenantAdmin(AuditedAdmin):
    list_display = ["name", "slug", "is_active", "fair_share_weight", "max_priority_class", "created_at"]
    list_filter = ["is_active", "max_priority_class"]
    search_fields = ["name", "slug"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [TeamInline]
    fieldsets = [
        (None, {"fields": ["name", "slug", "is_active", "kv_cache_group"]}),
        (
            "Priority and fair share",
            {
                "fields": ["max_priority_class", "fair_share_weight"],
                "description": "While a deployment is saturated, requests wait in the router and are served by "
                "priority class first, then by fair share of work across tenants.",
            },
        ),
        (
            "Quota ceilings",
            {
                "fields": ceiling_fields(),
                "description": "What all of the tenant's teams and keys may use together, and the most its admins "
                "may give any one of them. Empty: no ceiling.",
            },
        ),
    ]


@admin.register(Team)
class TeamAdmin(AuditedAdmin):
    list_display = [
        "name",
        "slug",
        "tenant",
        "priority_class",
        "fair_share_weight",
        "allowed_models",
        "created_at",
    ]
    list_filter = ["tenant", "priority_class", "restrict_models"]
    search_fields = ["name", "slug", "tenant__name"]
    list_select_related = ["tenant"]
    prepopulated_fields = {"slug": ["name"]}
    filter_horizontal = ["deployments"]
    fieldsets = [
        (None, {"fields": ["tenant", "name", "slug"]}),
        ("Priority and fair share", {"fields": ["priority_class", "fair_share_weight"]}),
        ("Models it may call", {"fields": ["restrict_models", "deployments"], "description": MODELS_HELP}),
    ]

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("deployments")

    @admin.display(description="Models")
    def allowed_models(self, obj: Team) -> str:
        if not obj.restrict_models:
            return "every model served"
        return ", ".join(d.served_model_name for d in obj.deployments.all()) or "none"

    def audit_snapshot(self, obj):
        return entitlement_snapshot(obj)


@admin.register(Membership)
class MembershipAdmin(AuditedAdmin):
    list_display = ["user", "role", "tenant", "team", "created_at"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__username", "user__email", "tenant__name", "team__name"]
    list_select_related = ["user", "tenant", "team__tenant"]
    autocomplete_fields = ["user", "tenant", "team"]


class ApiKeyForm(forms.ModelForm):
    scopes = forms.MultipleChoiceField(
        choices=Scope.choices, widget=forms.CheckboxSelectMultiple, initial=[Scope.INFERENCE]
    )

    class Meta:
        model = ApiKey
        fields = ["team", "name", "scopes", "expires_at", "priority_class", "deployments"]
        help_texts = {
            "deployments": "Narrows what the key may call to these deployments, among its team's. Empty: all "
            "its team's. " + MODELS_HELP
        }

    def clean(self):
        cleaned = super().clean()
        team = cleaned.get("team") or (self.instance.team if self.instance.team_id else None)
        outside = deployments_outside_team(team, cleaned.get("deployments") or ()) if team else []
        if outside:
            names = ", ".join(sorted(d.served_model_name for d in outside))
            self.add_error(
                "deployments", f"Team {team} may not call {names}: a key can only narrow its team's."
            )
        return cleaned


@admin.register(ApiKey)
class ApiKeyAdmin(AuditedAdmin):
    """Keys are issued through the key service: the secret is shown once, on the page after saving."""

    form = ApiKeyForm
    audit_name = "api_key"
    list_display = ["name", "prefix", "team", "scopes", "state", "expires_at", "last_used_at", "created_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter), "scopes", "team__tenant"]
    search_fields = ["name", "public_id", "team__name", "team__tenant__name"]
    list_select_related = ["team__tenant"]
    readonly_fields = ["prefix", "revoked_at", "last_used_at", "created_by", "created_at"]
    filter_horizontal = ["deployments"]
    actions = ["revoke_keys"]

    def audit_snapshot(self, obj):
        return entitlement_snapshot(obj)

    def get_readonly_fields(self, request, obj=None):
        return [*self.readonly_fields, "team"] if obj else self.readonly_fields

    @admin.display(description="State")
    def state(self, obj: ApiKey) -> str:
        if obj.revoked_at:
            return "revoked"
        return "active" if obj.is_active else "expired"

    def save_model(self, request, obj, form, change):
        if change:
            return super().save_model(request, obj, form, change)
        issued = api_key_create(
            team=form.cleaned_data["team"],
            name=form.cleaned_data["name"],
            scopes=form.cleaned_data["scopes"],
            expires_at=form.cleaned_data.get("expires_at"),
            priority_class=form.cleaned_data.get("priority_class", ""),
            deployments=form.cleaned_data.get("deployments") or (),
            actor=request.user,
            source="admin",
        )
        obj.__dict__.update({k: v for k, v in issued.api_key.__dict__.items() if k != "_state"})
        obj._state.adding = False
        request._issued_api_key = issued.secret

    def log_addition(self, request, obj, message):
        # The key service already wrote the audit row for this creation.
        return admin.ModelAdmin.log_addition(self, request, obj, message)

    def response_add(self, request, obj, post_url_continue=None):
        secret = getattr(request, "_issued_api_key", None)
        if secret is None:
            return super().response_add(request, obj, post_url_continue)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "api_key": obj,
            "secret": secret,
        }
        response = TemplateResponse(request, "admin/tenants/apikey/issued.html", context)
        response["Cache-Control"] = "no-store"
        return response

    @admin.action(description="Revoke selected keys")
    def revoke_keys(self, request, queryset):
        revoked = sum(api_key_revoke(api_key=key, actor=request.user, source="admin") for key in queryset)
        self.message_user(
            request, ngettext("%d key revoked.", "%d keys revoked.", revoked) % revoked, messages.SUCCESS
        )


@admin.register(Quota)
class QuotaAdmin(AuditedAdmin):
    list_display = ["team", "api_key", *quota_fields()]
    list_filter = ["budget_period", "team__tenant"]
    search_fields = ["team__name", "api_key__name", "api_key__public_id"]
    list_select_related = ["team__tenant", "api_key"]
    autocomplete_fields = ["team", "api_key"]


@admin.register(ModelAlias)
class ModelAliasAdmin(AuditedAdmin):
    """A tenant's name for a deployment: changing the deployment moves every agent that calls the name."""

    audit_name = "model_alias"
    list_display = ["name", "tenant", "deployment", "updated_at"]
    list_filter = ["tenant"]
    search_fields = ["name", "tenant__name", "deployment__served_model_name"]
    list_select_related = ["tenant", "deployment"]
    autocomplete_fields = ["tenant", "deployment"]


@admin.register(PriceSheet)
class PriceSheetAdmin(AuditedAdmin):
    audit_name = "price_sheet"
    list_display = [
        "served_model_name",
        "tenant",
        "effective_from",
        "currency",
        "input_per_mtok",
        "cached_input_per_mtok",
        "output_per_mtok",
    ]
    list_filter = ["currency", "tenant", "served_model_name"]
    search_fields = ["served_model_name", "tenant__name"]
    date_hierarchy = "effective_from"


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    list_display = [
        "request_id",
        "created_at",
        "tenant",
        "team",
        "api_key",
        "model",
        "prompt_tokens",
        "cached_prompt_tokens",
        "output_tokens",
        "cost",
        "currency",
        "status",
        "priority_class",
        "queued_ms",
    ]
    list_filter = ["status", "priority_class", "model", "tenant"]
    search_fields = ["request_id", "api_key__public_id", "team__name"]
    list_select_related = ["tenant", "team", "api_key"]
    date_hierarchy = "created_at"


@admin.register(AuditLog)
class AuditLogAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "actor_label", "source", "action", "target_type", "target_repr", "tenant"]
    list_filter = ["source", "action", "target_type"]
    search_fields = ["actor_label", "target_repr", "target_id", "action"]
    date_hierarchy = "created_at"
