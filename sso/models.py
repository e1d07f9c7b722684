"""Single sign-on with OpenID Connect: who signed in through the identity provider, and the operators' rules that
turn the provider's groups into platform roles."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q

from tenants.models import TEAM_ROLES, Membership, Role, Team, Tenant


class GroupRule(models.Model):
    """Someone in `group` at the identity provider gets `role`: over the platform (operator), over `tenant`
    (tenant admin), or in `team` (team admin, member). Someone in no group that a rule names is refused."""

    group = models.CharField(
        max_length=255, help_text="The group's name exactly as the provider's groups claim gives it."
    )
    role = models.CharField(max_length=20, choices=Role.choices)
    tenant = models.ForeignKey(
        Tenant,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="+",
        help_text="For the tenant admin role.",
    )
    team = models.ForeignKey(
        Team,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="+",
        help_text="For the team admin and member roles.",
    )
    admin_site = models.BooleanField(
        "Django admin",
        default=False,
        help_text="Operators only: also let them into the Django admin (staff and superuser).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["group", "role"]
        constraints = [
            models.CheckConstraint(
                condition=(
                    Q(role=Role.OPERATOR, tenant__isnull=True, team__isnull=True)
                    | Q(role=Role.TENANT_ADMIN, tenant__isnull=False, team__isnull=True, admin_site=False)
                    | Q(role__in=TEAM_ROLES, tenant__isnull=True, team__isnull=False, admin_site=False)
                ),
                name="group_rule_scope_matches_role",
                violation_error_message="An operator rule names no tenant or team; a tenant admin rule names a "
                "tenant; a team rule names a team and no tenant. Only an operator rule may give the Django admin.",
            ),
            models.UniqueConstraint(
                fields=["group", "role", "tenant", "team"],
                nulls_distinct=False,
                name="group_rule_unique",
                violation_error_message="This group already has this role there.",
            ),
        ]

    def __str__(self) -> str:
        scope = self.team or self.tenant or "platform"
        return f"{self.group} -> {self.get_role_display()} of {scope}"

    def grant(self) -> tuple[str, int | None, int | None]:
        """The membership this rule gives: (role, tenant id, team id)."""
        tenant_id = self.team.tenant_id if self.team_id else self.tenant_id
        return self.role, tenant_id, self.team_id


class Identity(models.Model):
    """The provider's account behind a platform user: found again by issuer and subject, never by e-mail or
    username, so that an account at the provider can never take over a local one."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="sso_identity"
    )
    issuer = models.CharField(max_length=255)
    subject = models.CharField(max_length=255)
    groups = models.JSONField(default=list, blank=True, help_text="The groups at the last sign-in.")
    admin_granted = models.BooleanField(
        default=False, help_text="Staff and superuser were given by a rule (and are taken back with it)."
    )
    last_sign_in_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name_plural = "identities"
        constraints = [models.UniqueConstraint(fields=["issuer", "subject"], name="sso_identity_unique")]

    def __str__(self) -> str:
        return f"{self.user} ({self.subject} at {self.issuer})"


class Grant(models.Model):
    """A membership given by a group rule: taken back at a sign-in when no rule gives it any more. Memberships
    made by hand have none and are never touched."""

    membership = models.OneToOneField(Membership, on_delete=models.CASCADE, related_name="sso_grant")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return str(self.membership)
