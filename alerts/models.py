"""Alerts: where they go (destinations), what raises them (rules), each condition's state, and each delivery.

A rule with a tenant belongs to that tenant's admins and only watches budgets of that tenant; a rule without one
belongs to the operators (budgets of every tenant, and the platform's health). A condition is sent once when it
starts to hold (a crossing) and, for health alerts, once when it clears; never again while it holds.
"""

from __future__ import annotations

import secrets

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone

from tenants.models import Team, Tenant

from .addresses import webhook_url_problem

# A rule's percentages are checked on every pass, each a condition of its own: a handful is all a budget needs.
MAX_PERCENTAGES = 10


def new_signing_secret() -> str:
    return "whsec_" + secrets.token_urlsafe(32)


class DestinationKind(models.TextChoices):
    WEBHOOK = "webhook", "Webhook (Slack-compatible JSON)"
    EMAIL = "email", "E-mail"


class Destination(models.Model):
    """Where alerts are sent: a webhook URL (a Slack or Mattermost incoming webhook, or any HTTPS receiver) or
    e-mail addresses. Webhook bodies are signed with `signing_secret` (see alerts/delivery.py)."""

    tenant = models.ForeignKey(
        Tenant,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="alert_destinations",
        help_text="Empty: a platform destination, for the operators' rules.",
    )
    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=8, choices=DestinationKind.choices)
    url = models.URLField(
        max_length=1000, blank=True, help_text="Webhook only: where the JSON body is POSTed."
    )
    emails = ArrayField(
        models.EmailField(),
        default=list,
        blank=True,
        help_text="E-mail only: the addresses each alert goes to.",
    )
    signing_secret = models.CharField(
        max_length=100,
        default=new_signing_secret,
        editable=False,
        help_text="Webhook only: the key of the body's HMAC-SHA256 signature.",
    )
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant_id", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "name"],
                nulls_distinct=False,
                name="alert_destination_unique_name",
                violation_error_message="A destination of that name already exists here.",
            ),
            models.CheckConstraint(
                condition=Q(kind=DestinationKind.WEBHOOK, url__gt="")
                | Q(kind=DestinationKind.EMAIL, emails__len__gt=0),
                name="alert_destination_has_address",
                violation_error_message="A webhook needs a URL; an e-mail destination at least one address.",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        super().clean()
        if self.kind == DestinationKind.WEBHOOK and not self.url:
            raise ValidationError({"url": "Give the webhook's URL."})
        if self.kind == DestinationKind.WEBHOOK and (problem := webhook_url_problem(self.url)):
            raise ValidationError({"url": problem})
        if self.kind == DestinationKind.EMAIL and not self.emails:
            raise ValidationError({"emails": "Give at least one address."})
        if self._state.adding:
            _within_limit(
                Destination.objects.filter(tenant_id=self.tenant_id),
                self.tenant_id,
                settings.ALERT_MAX_DESTINATIONS_PER_TENANT,
                "alert destinations",
                "ALERT_MAX_DESTINATIONS_PER_TENANT",
            )


def _within_limit(
    existing: models.QuerySet, tenant_id: int | None, limit: int, what: str, setting: str
) -> None:
    """A tenant has at most `limit` of these (each is worked on every pass, for every tenant's alerts);
    the platform's own, the operators', are not counted."""
    if tenant_id is not None and existing.count() >= limit:
        raise ValidationError(
            f"The tenant already has {limit} {what}, the most allowed ({setting}): delete one first."
        )


class AlertKind(models.TextChoices):
    BUDGET = "budget", "Budget used"
    BUDGET_FORECAST = "budget_forecast", "Budget forecast to run out"
    DEPLOYMENT_HEALTH = "deployment_health", "Deployment degraded or failing"
    ENGINE_CRASH_LOOP = "engine_crash_loop", "Engine crash-looping"
    PREFIX_PREDICTION = "prefix_prediction", "Predicted/reported cached tokens low"
    INGESTION_LAG = "ingestion_lag", "Usage ingestion lagging"
    USAGE_JOURNAL = "usage_journal", "Usage journal in use"


BUDGET_KINDS = (AlertKind.BUDGET, AlertKind.BUDGET_FORECAST)
HEALTH_KINDS = tuple(kind for kind in AlertKind if kind not in BUDGET_KINDS)

# The health rules' threshold when none is given, and what it means.
DEFAULT_THRESHOLDS = {
    AlertKind.ENGINE_CRASH_LOOP: 3.0,  # restarts within window_minutes
    AlertKind.PREFIX_PREDICTION: 0.8,  # predicted over reported cached tokens below this
    AlertKind.INGESTION_LAG: 120.0,  # the oldest unwritten usage event older than this, in seconds
}


class BudgetScope(models.TextChoices):
    TEAM = "team", "Each team's budget (its team-wide quota)"
    TENANT = "tenant", "The tenant's budget ceiling"


def default_percentages() -> list[int]:
    return [50, 80, 100]


class AlertRule(models.Model):
    kind = models.CharField(max_length=20, choices=AlertKind.choices)
    tenant = models.ForeignKey(
        Tenant,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="alert_rules",
        help_text="A tenant's rule watches its own budgets. Empty: an operators' rule (every tenant's budgets, "
        "or the platform's health).",
    )
    budget_scope = models.CharField(
        max_length=6,
        choices=BudgetScope.choices,
        default=BudgetScope.TEAM,
        help_text="Budget rules: the teams' budgets or the tenants' ceilings.",
    )
    team = models.ForeignKey(
        Team,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="alert_rules",
        help_text="Budget rules of a tenant: only this team. Empty: every team.",
    )
    percentages = ArrayField(
        models.PositiveSmallIntegerField(validators=[MinValueValidator(1), MaxValueValidator(1000)]),
        default=default_percentages,
        blank=True,
        help_text="Budget rules: alert as usage crosses each of these percentages of the token or spend budget.",
    )
    threshold = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Health rules: restarts (crash loop), the lowest ratio (prediction), or seconds (ingestion "
        "lag). Empty: the default.",
    )
    window_minutes = models.PositiveIntegerField(
        default=15,
        validators=[MinValueValidator(1)],
        help_text="Crash loop: restarts counted over this long.",
    )
    for_minutes = models.PositiveIntegerField(
        default=0,
        help_text="Health rules: the condition must hold this long before the alert is sent.",
    )
    deployment = models.ForeignKey(
        "serving.ModelDeployment",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="+",
        help_text="Health rules: only this deployment. Empty: every deployment.",
    )
    destinations = models.ManyToManyField(Destination, related_name="rules")
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant_id", "kind", "id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(tenant__isnull=True) | Q(kind__in=BUDGET_KINDS),
                name="alert_rule_tenant_budget_only",
                violation_error_message="A tenant's rules watch budgets only; health rules are the operators'.",
            ),
            models.CheckConstraint(
                condition=Q(team__isnull=True) | Q(tenant__isnull=False, budget_scope=BudgetScope.TEAM),
                name="alert_rule_team_in_tenant_rule",
                violation_error_message="Only a tenant's team budget rule names a team.",
            ),
        ]

    def __str__(self) -> str:
        owner = self.tenant.slug if self.tenant_id else "platform"
        return f"{self.get_kind_display()} ({owner})"

    @property
    def is_budget(self) -> bool:
        return self.kind in BUDGET_KINDS

    def threshold_value(self) -> float | None:
        return self.threshold if self.threshold is not None else DEFAULT_THRESHOLDS.get(self.kind)

    def clean(self) -> None:
        super().clean()
        errors = {}
        if self.tenant_id is not None and self.kind and self.kind not in BUDGET_KINDS:
            errors["kind"] = "A tenant's rules watch budgets only; health rules are the operators'."
        if self.team_id is not None:
            if self.tenant_id is None or self.team.tenant_id != self.tenant_id:
                errors["team"] = "Name a team of the rule's tenant."
            elif self.budget_scope != BudgetScope.TEAM:
                errors["team"] = "Only a rule on the teams' budgets names a team."
        if self.kind == AlertKind.BUDGET and not self.percentages:
            errors["percentages"] = "Give at least one percentage, such as 80."
        if len(self.percentages or ()) > MAX_PERCENTAGES:
            errors["percentages"] = f"Give at most {MAX_PERCENTAGES} percentages, such as 50, 80, 100."
        if self.kind == AlertKind.PREFIX_PREDICTION and self.threshold is not None and self.threshold > 1:
            errors["threshold"] = "The ratio is at most 1: give a value such as 0.8."
        if errors:
            raise ValidationError(errors)
        if self._state.adding:
            _within_limit(
                AlertRule.objects.filter(tenant_id=self.tenant_id),
                self.tenant_id,
                settings.ALERT_MAX_RULES_PER_TENANT,
                "alert rules",
                "ALERT_MAX_RULES_PER_TENANT",
            )


class AlertState(models.Model):
    """One condition of one rule (a deployment failing, a team past 80 % of this month's spend): whether it holds,
    since when, and whether it was sent. Kept after it clears, so a crossing is told once."""

    rule = models.ForeignKey(AlertRule, on_delete=models.CASCADE, related_name="states")
    key = models.CharField(
        max_length=200, help_text="Which condition of the rule, e.g. team:4:spend:80:2025-06-01."
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, null=True, blank=True, related_name="+")
    holding = models.BooleanField(default=False, help_text="The condition held at the last check.")
    firing = models.BooleanField(default=False, help_text="Sent as firing and not yet cleared.")
    holding_since = models.DateTimeField(null=True, blank=True)
    fired_at = models.DateTimeField(null=True, blank=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    checked_at = models.DateTimeField(default=timezone.now)
    summary = models.CharField(max_length=500, blank=True)
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-checked_at"]
        constraints = [
            models.UniqueConstraint(fields=["rule", "key"], name="alert_state_one_per_condition"),
        ]
        indexes = [models.Index(fields=["firing", "fired_at"], name="alert_state_firing")]

    def __str__(self) -> str:
        return f"{self.rule}: {self.key}"


class DeliveryEvent(models.TextChoices):
    FIRING = "firing", "Firing"
    RESOLVED = "resolved", "Resolved"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    SENT = "sent", "Sent"
    FAILED = "failed", "Failed"


class Delivery(models.Model):
    """One alert event to one destination: tried until sent, with backoff, up to ALERT_DELIVERY_ATTEMPTS times."""

    state = models.ForeignKey(AlertState, on_delete=models.CASCADE, related_name="deliveries")
    destination = models.ForeignKey(Destination, on_delete=models.CASCADE, related_name="deliveries")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, null=True, blank=True, related_name="+")
    event = models.CharField(max_length=8, choices=DeliveryEvent.choices)
    status = models.CharField(max_length=8, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    payload = models.JSONField(help_text="The alert as sent: the webhook's JSON body, the e-mail's text.")
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now, db_index=True)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    response_status = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "deliveries"
        indexes = [models.Index(fields=["status", "next_attempt_at"], name="alert_delivery_due")]

    def __str__(self) -> str:
        return f"{self.event} to {self.destination} ({self.status})"
