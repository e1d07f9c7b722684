"""Who may use the platform, with which keys, under which limits and at which prices; and what they used.

Over 400 lines: Django keeps an app's models in one module, and these refer to one another (tenants, teams,
keys, quotas, prices, the ledger)."""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models import F, Q
from django.utils import timezone

from .limits import LIMITS

slug_validator = RegexValidator(
    r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$", "Use lower-case letters, digits and hyphens."
)
currency_validator = RegexValidator(r"^[A-Z]{3}$", "Use a three-letter ISO 4217 currency code, such as USD.")


class PriorityClass(models.TextChoices):
    """How urgently a request is served when a deployment is saturated and requests wait in the router: a
    higher class is always dispatched first (docs/flow-control.md)."""

    INTERACTIVE = "interactive", "Interactive"
    STANDARD = "standard", "Standard"
    BATCH = "batch", "Batch"


# Dispatch order under overload: lower first.
PRIORITY_RANK = {PriorityClass.INTERACTIVE: 0, PriorityClass.STANDARD: 1, PriorityClass.BATCH: 2}


def priority_within(value: str, ceiling: str) -> str:
    """`value`, lowered to `ceiling` when it ranks above it."""
    return value if PRIORITY_RANK[value] >= PRIORITY_RANK[ceiling] else ceiling


def weight_field(help_text: str) -> models.PositiveIntegerField:
    return models.PositiveIntegerField(
        default=1,
        db_default=1,
        validators=[MinValueValidator(1), MaxValueValidator(1000)],
        help_text=help_text,
    )


class BudgetPeriod(models.TextChoices):
    DAY = "day", "Day"
    WEEK = "week", "Week"
    MONTH = "month", "Month"


def _positive(field_name: str) -> Q:
    return Q(**{f"{field_name}__isnull": True}) | Q(**{f"{field_name}__gt": 0})


# A quota's limit (Quota's field) -> the tenant's ceiling for it (Tenant's field), which operators set.
QUOTA_CEILINGS = {limit.field: limit.ceiling for limit in LIMITS}
CEILING_HELP = "What all of the tenant's teams and keys may use together; no quota of theirs may allow more. Empty: none."


def ceiling_field(kind: type[models.Field], verbose_name: str) -> models.Field:
    return kind(
        verbose_name, null=True, blank=True, validators=[MinValueValidator(1)], help_text=CEILING_HELP
    )


class Tenant(models.Model):
    """A customer organisation. Everything a tenant owns is reached through it."""

    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=63, unique=True, validators=[slug_validator])
    is_active = models.BooleanField(default=True)
    kv_cache_group = models.CharField(
        "shared KV-cache group",
        max_length=63,
        blank=True,
        default="",
        db_default="",
        validators=[slug_validator],
        help_text=(
            "Blank (the default): the engines' prefix cache is this tenant's own; no other tenant can hit it or "
            "learn from cached-token counts what this tenant sent. Tenants given the same group share one cache "
            "on purpose (one organisation split into several tenants)."
        ),
    )
    # Set by operators only.
    fair_share_weight = weight_field(
        "This tenant's share of a saturated deployment against other tenants waiting for it, in tokens of work: "
        "a tenant of weight 3 gets three times the work of a tenant of weight 1 while both wait."
    )
    max_priority_class = models.CharField(
        "highest priority class",
        max_length=12,
        choices=PriorityClass.choices,
        default=PriorityClass.STANDARD,
        db_default=PriorityClass.STANDARD,
        help_text="The highest class this tenant's admins may give a team or a key. Lowering it lowers the teams "
        "and keys above it.",
    )
    # Quota ceilings, set by operators only, so that they can serve as a credit limit: what the tenant's teams and
    # keys may use together (the router counts them as one scope, routing/metering/admission.py), and what its admins may
    # give any one team or key at most.
    max_requests_per_minute = ceiling_field(models.PositiveIntegerField, "most requests per minute")
    max_input_tokens_per_minute = ceiling_field(
        models.PositiveBigIntegerField, "most input tokens per minute"
    )
    max_output_tokens_per_minute = ceiling_field(
        models.PositiveBigIntegerField, "most output tokens per minute"
    )
    max_concurrent_requests = ceiling_field(models.PositiveIntegerField, "most concurrent requests")
    max_budget_period = models.CharField(
        "period of the budget ceilings",
        max_length=5,
        choices=BudgetPeriod.choices,
        default=BudgetPeriod.MONTH,
        db_default=BudgetPeriod.MONTH,
        help_text="With a budget ceiling, the tenant's quotas count their budgets over this period too.",
    )
    max_token_budget = ceiling_field(models.PositiveBigIntegerField, "largest token budget")
    max_spend_budget = models.DecimalField(
        "largest spend budget",
        max_digits=14,
        decimal_places=4,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal("0"))],
        help_text=CEILING_HELP,
    )
    max_spend_currency = models.CharField(
        "currency of the spend ceiling",
        max_length=3,
        default="USD",
        db_default="USD",
        validators=[currency_validator],
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]
        constraints = [
            *[
                models.CheckConstraint(
                    condition=_positive(f),
                    name=f"tenant_{f}_positive",
                    violation_error_message=f"{f} must be at least 1, or empty for no ceiling.",
                )
                for f in QUOTA_CEILINGS.values()
                if f != "max_spend_budget"
            ],
            models.CheckConstraint(
                condition=Q(max_spend_budget__isnull=True) | Q(max_spend_budget__gte=0),
                name="tenant_max_spend_budget_not_negative",
                violation_error_message="The spend ceiling cannot be negative.",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def save(self, *args, **kwargs) -> None:
        super().save(*args, **kwargs)
        if self.pk is not None:
            # A lowered ceiling lowers the teams and keys above it with it, so none is left with a class it may
            # no longer have (and every later edit of one would be refused for it).
            above = [c for c, rank in PRIORITY_RANK.items() if rank < PRIORITY_RANK[self.max_priority_class]]
            if above:
                Team.objects.filter(tenant=self, priority_class__in=above).update(
                    priority_class=self.max_priority_class
                )
                ApiKey.objects.filter(team__tenant=self, priority_class__in=above).update(
                    priority_class=self.max_priority_class
                )

    @property
    def has_budget_ceiling(self) -> bool:
        return self.max_token_budget is not None or self.max_spend_budget is not None


class Team(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="teams")
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=63, validators=[slug_validator])
    fair_share_weight = weight_field(
        "This team's share of its tenant's work on a saturated deployment, against the tenant's other teams."
    )
    priority_class = models.CharField(
        max_length=12,
        choices=PriorityClass.choices,
        default=PriorityClass.STANDARD,
        db_default=PriorityClass.STANDARD,
        help_text="Its keys' class, unless a key has its own. At most the tenant's highest class.",
    )
    restrict_models = models.BooleanField(
        "only the models listed",
        default=False,
        db_default=False,
        help_text="Off: the team may call every model served. On: only the deployments listed (none if empty).",
    )
    deployments = models.ManyToManyField(
        "serving.ModelDeployment",
        blank=True,
        related_name="entitled_teams",
        help_text="The deployments the team may call, when restricted to the models listed.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant__slug", "slug"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "slug"], name="team_slug_unique_in_tenant"),
            # Target of the composite foreign keys that keep a row's tenant equal to its team's tenant.
            models.UniqueConstraint(fields=["id", "tenant"], name="team_id_tenant_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.slug}"

    def clean(self) -> None:
        super().clean()
        if self.tenant_id and self.priority_class:
            ceiling = self.tenant.max_priority_class
            if priority_within(self.priority_class, ceiling) != self.priority_class:
                raise ValidationError(
                    {
                        "priority_class": f"The tenant allows at most `{ceiling}`: choose `{ceiling}` or a "
                        "lower class."
                    }
                )


class Role(models.TextChoices):
    OPERATOR = "operator", "Operator (platform-wide)"
    TENANT_ADMIN = "tenant_admin", "Tenant admin"
    TEAM_ADMIN = "team_admin", "Team admin"
    MEMBER = "member", "Member"


TEAM_ROLES = (Role.TEAM_ADMIN, Role.MEMBER)


class Membership(models.Model):
    """A user's role: platform-wide (operator), over one tenant, or in one team.

    The scope columns must match the role, and a team role's tenant is its team's tenant (a composite
    foreign key added in the migration enforces that in the database).
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=20, choices=Role.choices)
    tenant = models.ForeignKey(
        Tenant, on_delete=models.CASCADE, null=True, blank=True, related_name="memberships"
    )
    team = models.ForeignKey(
        Team, on_delete=models.CASCADE, null=True, blank=True, related_name="memberships"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["user__username", "role"]
        constraints = [
            models.CheckConstraint(
                condition=(
                    Q(role=Role.OPERATOR, tenant__isnull=True, team__isnull=True)
                    | Q(role=Role.TENANT_ADMIN, tenant__isnull=False, team__isnull=True)
                    | Q(role__in=TEAM_ROLES, tenant__isnull=False, team__isnull=False)
                ),
                name="membership_scope_matches_role",
                violation_error_message="An operator role has no tenant or team; a tenant admin role has a tenant and no team; a team role has a team.",
            ),
            models.UniqueConstraint(
                fields=["user"],
                condition=Q(role=Role.OPERATOR),
                name="membership_one_operator_role",
                violation_error_message="This user is already an operator.",
            ),
            models.UniqueConstraint(
                fields=["user", "tenant"],
                condition=Q(role=Role.TENANT_ADMIN),
                name="membership_one_tenant_admin_role_per_tenant",
                violation_error_message="This user is already a tenant admin of this tenant.",
            ),
            models.UniqueConstraint(
                fields=["user", "team"],
                condition=Q(team__isnull=False),
                name="membership_one_role_per_team",
                violation_error_message="This user already has a role in this team; change that membership instead.",
            ),
        ]

    def __str__(self) -> str:
        scope = self.team or self.tenant or "platform"
        return f"{self.user} is {self.get_role_display()} of {scope}"


class Scope(models.TextChoices):
    INFERENCE = "inference", "Inference (/v1)"
    READ_USAGE = "read-usage", "Read usage"


class ApiKey(models.Model):
    """An agent's credential. Only an HMAC of the secret with the server pepper is stored.

    The full key reads `ipk_<public_id>_<secret>`; `ipk_<public_id>` is the visible prefix shown in lists.
    """

    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="api_keys")
    name = models.CharField(max_length=200)
    public_id = models.CharField(max_length=16, unique=True, editable=False)
    secret_hmac = models.CharField(max_length=64, editable=False)
    scopes = ArrayField(models.CharField(max_length=20, choices=Scope.choices), default=list)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    priority_class = models.CharField(
        max_length=12,
        choices=PriorityClass.choices,
        blank=True,
        default="",
        db_default="",
        help_text="Blank: the team's class. At most the tenant's highest class.",
    )
    deployments = models.ManyToManyField(
        "serving.ModelDeployment",
        blank=True,
        related_name="entitled_keys",
        help_text="Narrows what the key may call to these deployments (among its team's). Empty: all its team's.",
    )

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(scopes__len__gte=1) & Q(scopes__contained_by=list(Scope.values)),
                name="api_key_scopes_known_and_not_empty",
                violation_error_message="Give at least one scope: inference, read-usage.",
            ),
            models.CheckConstraint(
                condition=Q(expires_at__isnull=True) | Q(expires_at__gt=F("created_at")),
                name="api_key_expires_after_creation",
                violation_error_message="A key must expire after it was created.",
            ),
            models.CheckConstraint(
                condition=Q(secret_hmac__regex=r"^[0-9a-f]{64}$"), name="api_key_hmac_is_sha256"
            ),
            models.UniqueConstraint(fields=["id", "team"], name="api_key_id_team_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix})"

    @property
    def prefix(self) -> str:
        return f"{settings.API_KEY_PREFIX}_{self.public_id}"

    def clean(self) -> None:
        super().clean()
        if self.team_id and self.priority_class:
            ceiling = self.team.tenant.max_priority_class
            if priority_within(self.priority_class, ceiling) != self.priority_class:
                raise ValidationError(
                    {
                        "priority_class": f"The tenant allows at most `{ceiling}`: choose `{ceiling}` or a "
                        "lower class, or leave it blank for the team's."
                    }
                )

    @property
    def is_active(self) -> bool:
        now = timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


# The limits counted in whole numbers (the spend budget is money).
LIMIT_FIELDS = tuple(limit.field for limit in LIMITS if not limit.money)


class Quota(models.Model):
    """Limits for a team, or for one of its keys when `api_key` is set. An empty limit means no limit.

    Budgets reset at the start of each period in UTC: midnight, Monday, or the first of the month.
    """

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="quotas")
    api_key = models.ForeignKey(
        ApiKey, on_delete=models.CASCADE, null=True, blank=True, related_name="quotas"
    )
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)]
    )
    input_tokens_per_minute = models.PositiveBigIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)]
    )
    output_tokens_per_minute = models.PositiveBigIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)]
    )
    max_concurrent_requests = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)]
    )
    budget_period = models.CharField(max_length=5, choices=BudgetPeriod.choices, default=BudgetPeriod.MONTH)
    token_budget = models.PositiveBigIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Tokens (input + output)."
    )
    spend_budget = models.DecimalField(
        max_digits=14, decimal_places=4, null=True, blank=True, validators=[MinValueValidator(Decimal("0"))]
    )
    currency = models.CharField(max_length=3, default="USD", validators=[currency_validator])
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["team_id", "api_key_id"]
        constraints = [
            *[
                models.CheckConstraint(
                    condition=_positive(f),
                    name=f"quota_{f}_positive",
                    violation_error_message=f"{f} must be at least 1, or empty for no limit.",
                )
                for f in LIMIT_FIELDS
            ],
            models.CheckConstraint(
                condition=Q(spend_budget__isnull=True) | Q(spend_budget__gte=0),
                name="quota_spend_budget_not_negative",
                violation_error_message="The spend budget cannot be negative.",
            ),
            models.CheckConstraint(
                condition=Q(currency__regex=r"^[A-Z]{3}$"),
                name="quota_currency_iso",
                violation_error_message="Use a three-letter ISO 4217 currency code, such as USD.",
            ),
            models.UniqueConstraint(
                fields=["team"],
                condition=Q(api_key__isnull=True),
                name="quota_one_per_team",
                violation_error_message="This team already has a team-wide quota; change that one.",
            ),
            models.UniqueConstraint(fields=["api_key"], name="quota_one_per_key"),
        ]

    def __str__(self) -> str:
        return f"Quota for {self.api_key or self.team}"

    def clean(self) -> None:
        super().clean()
        if self.team_id:
            errors = quota_ceiling_errors(self, self.team.tenant)
            if errors:
                raise ValidationError(errors)

    def period_bounds(self, at=None):
        from .periods import period_bounds

        return period_bounds(self.budget_period, at or timezone.now())

    @property
    def resets_at(self):
        return self.period_bounds()[1]


def quota_ceiling_errors(quota: Quota, tenant: Tenant) -> dict[str, str]:
    """What of `quota` goes beyond its tenant's ceilings, by field, each message naming the ceiling."""
    errors = {}
    for name, ceiling_name in QUOTA_CEILINGS.items():
        value, ceiling = getattr(quota, name), getattr(tenant, ceiling_name)
        if value is not None and ceiling is not None and value > ceiling:
            label = Tenant._meta.get_field(ceiling_name).verbose_name
            errors[name] = (
                f"The platform operator set tenant {tenant.slug}'s {label} at {ceiling}: give at most {ceiling}, "
                "or leave it empty for the ceiling."
            )
    has_budget = quota.token_budget is not None or quota.spend_budget is not None
    if has_budget and tenant.has_budget_ceiling and quota.budget_period != tenant.max_budget_period:
        errors["budget_period"] = (
            f"Tenant {tenant.slug}'s budget ceilings are per {tenant.max_budget_period}, set by the platform "
            f"operator: count this quota's budgets per {tenant.max_budget_period} too."
        )
    spend_ceiling = tenant.max_spend_budget is not None
    if spend_ceiling and quota.spend_budget is not None and quota.currency != tenant.max_spend_currency:
        errors["currency"] = (
            f"Tenant {tenant.slug}'s spend ceiling is in {tenant.max_spend_currency}, set by the platform "
            f"operator: give the spend budget in {tenant.max_spend_currency}."
        )
    return errors


class PriceSheet(models.Model):
    """Prices per million tokens for one served model, in force from `effective_from`.

    A sheet with no tenant is the platform's list price; a tenant's own sheet overrides it.
    """

    served_model_name = models.CharField(max_length=200)
    tenant = models.ForeignKey(
        Tenant, on_delete=models.CASCADE, null=True, blank=True, related_name="price_sheets"
    )
    effective_from = models.DateTimeField()
    currency = models.CharField(max_length=3, default="USD", validators=[currency_validator])
    input_per_mtok = models.DecimalField(max_digits=12, decimal_places=6, validators=[MinValueValidator(0)])
    cached_input_per_mtok = models.DecimalField(
        max_digits=12, decimal_places=6, validators=[MinValueValidator(0)]
    )
    output_per_mtok = models.DecimalField(max_digits=12, decimal_places=6, validators=[MinValueValidator(0)])
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["served_model_name", "-effective_from"]
        constraints = [
            models.UniqueConstraint(
                fields=["served_model_name", "tenant", "effective_from"],
                nulls_distinct=False,
                name="price_sheet_unique_start",
                violation_error_message="A price sheet for this model and tenant already starts at that time.",
            ),
            models.CheckConstraint(
                condition=Q(input_per_mtok__gte=0, cached_input_per_mtok__gte=0, output_per_mtok__gte=0),
                name="price_sheet_prices_not_negative",
                violation_error_message="Prices cannot be negative.",
            ),
            models.CheckConstraint(
                condition=Q(cached_input_per_mtok__lte=F("input_per_mtok")),
                name="price_sheet_cached_not_above_input",
                violation_error_message="Cached input cannot cost more than fresh input.",
            ),
            models.CheckConstraint(
                condition=Q(currency__regex=r"^[A-Z]{3}$"),
                name="price_sheet_currency_iso",
                violation_error_message="Use a three-letter ISO 4217 currency code, such as USD.",
            ),
        ]

    def __str__(self) -> str:
        who = self.tenant.slug if self.tenant_id else "list"
        return f"{self.served_model_name} ({who}) from {self.effective_from:%Y-%m-%d}"


class ModelAlias(models.Model):
    """A name a tenant's agents call (`coder`) for a deployment: moving the alias moves every agent that calls
    it to another model or revision, without touching the agents. An alias may not be a served model's name."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="model_aliases")
    name = models.CharField(
        max_length=200,
        validators=[
            RegexValidator(
                r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
                "Use letters, digits and . _ : / - (starting with a letter or digit).",
            )
        ],
    )
    deployment = models.ForeignKey(
        "serving.ModelDeployment", on_delete=models.CASCADE, related_name="aliases"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["tenant__slug", "name"]
        verbose_name_plural = "model aliases"
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "name"],
                name="model_alias_unique_in_tenant",
                violation_error_message="This tenant already has an alias of that name; change that one.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} -> {self.deployment}"

    def clean(self) -> None:
        super().clean()
        from serving.models import ModelDeployment

        if self.name and ModelDeployment.objects.filter(served_model_name=self.name).exists():
            raise ValidationError(
                {"name": f"`{self.name}` is a served model's name: an alias must be a name of its own."}
            )


class UsageStatus(models.TextChoices):
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
    REJECTED = "rejected", "Rejected"


class UsageRecord(models.Model):
    """One request's metered usage: the ledger that billing adds up. Written once per request id."""

    request_id = models.CharField(max_length=64, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="usage_records")
    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="usage_records")
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="usage_records")
    deployment = models.ForeignKey(
        "serving.ModelDeployment",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="usage_records",
    )
    model = models.CharField(max_length=200, help_text="The served model name the client asked for.")
    endpoint = models.CharField(max_length=255, blank=True, help_text="Address of the engine that served it.")
    prompt_tokens = models.PositiveIntegerField(default=0)
    cached_prompt_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField(default=0)
    cost = models.DecimalField(max_digits=16, decimal_places=8, default=Decimal("0"))
    currency = models.CharField(max_length=3, default="USD")
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    latency_ms = models.PositiveIntegerField(null=True, blank=True)
    status = models.CharField(max_length=10, choices=UsageStatus.choices)
    priority_class = models.CharField(
        max_length=12, choices=PriorityClass.choices, blank=True, default="", db_default=""
    )
    queued_ms = models.PositiveIntegerField(
        null=True, blank=True, help_text="Time it waited in the router for a saturated deployment."
    )
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["tenant", "created_at"], name="usage_tenant_time"),
            models.Index(fields=["team", "created_at"], name="usage_team_time"),
            models.Index(fields=["api_key", "created_at"], name="usage_key_time"),
            models.Index(fields=["model", "created_at"], name="usage_model_time"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(cached_prompt_tokens__lte=F("prompt_tokens")),
                name="usage_cached_within_prompt",
                violation_error_message="Cached prompt tokens cannot exceed prompt tokens.",
            ),
            models.CheckConstraint(
                condition=Q(cost__gte=0),
                name="usage_cost_not_negative",
                violation_error_message="Cost cannot be negative.",
            ),
        ]

    def __str__(self) -> str:
        return self.request_id


class AuditLog(models.Model):
    """One row per state change, written in the same transaction as the change. Never holds a secret."""

    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    actor_label = models.CharField(max_length=150, help_text="Who acted, kept if the user is deleted.")
    tenant = models.ForeignKey(Tenant, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    action = models.CharField(max_length=64)
    target_type = models.CharField(max_length=64)
    target_id = models.CharField(max_length=64)
    target_repr = models.CharField(max_length=255)
    details = models.JSONField(default=dict, blank=True)
    source = models.CharField(max_length=16, help_text="api, admin or system")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "created_at"], name="audit_tenant_time")]

    def __str__(self) -> str:
        return f"{self.actor_label} {self.action} {self.target_type} {self.target_id}"


class UsageDaily(models.Model):
    """Usage records summed per UTC day and per (tenant, team, key, deployment, model, priority class, currency).

    Written only by the roll-up (tenants/billing.py), which adds every record up to the watermark in
    `UsageRollupState` exactly once; billing reports read these rows for whole days and the ledger for the
    rest. `deployment_id` is kept as a plain number: the ledger clears its link when a deployment is deleted.
    """

    day = models.DateField()
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="+")
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="+")
    deployment_id = models.BigIntegerField(null=True, blank=True)
    model = models.CharField(max_length=200)
    priority_class = models.CharField(
        max_length=12, choices=PriorityClass.choices, blank=True, default="", db_default=""
    )
    currency = models.CharField(max_length=3)
    requests = models.BigIntegerField(default=0)
    errors = models.BigIntegerField(default=0, help_text="Requests that failed or were cancelled.")
    prompt_tokens = models.BigIntegerField(default=0)
    cached_prompt_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cost = models.DecimalField(max_digits=24, decimal_places=8, default=Decimal("0"))

    class Meta:
        ordering = ["day"]
        constraints = [
            models.UniqueConstraint(
                fields=[
                    "day",
                    "tenant",
                    "team",
                    "api_key",
                    "deployment_id",
                    "model",
                    "priority_class",
                    "currency",
                ],
                nulls_distinct=False,
                name="usage_daily_one_row_per_group",
            ),
        ]
        indexes = [
            models.Index(fields=["tenant", "day"], name="usage_daily_tenant_day"),
            models.Index(fields=["team", "day"], name="usage_daily_team_day"),
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.team_id} {self.model}"


class UsageRollupState(models.Model):
    """One row: every usage record with an id up to `last_record_id` is summed in UsageDaily."""

    last_record_id = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"rolled up to record {self.last_record_id}"


class UsageSeries(models.Model):
    """What the ledger's records of one time step add up to (tenants/usage_series.py writes and reads these).

    `step_s` is 60 (a row per minute, kept HISTORY_MINUTES_KEEP_DAYS) or 3600 (a row per hour, kept
    HISTORY_HOURS_KEEP_DAYS); `start` is the step's first instant (UTC). Written only by the billing roll-up, in the
    same transaction and for the same records as the daily rows, so every record is counted exactly once.
    """

    step_s = models.PositiveIntegerField()
    start = models.DateTimeField()
    currency = models.CharField(max_length=3)
    requests = models.BigIntegerField(default=0)
    failed = models.BigIntegerField(default=0)
    cancelled = models.BigIntegerField(default=0)
    rejected = models.BigIntegerField(
        default=0, help_text="Waited in a router's queue past its class's limit."
    )
    prompt_tokens = models.BigIntegerField(default=0)
    cached_prompt_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cost = models.DecimalField(max_digits=24, decimal_places=8, default=Decimal("0"))

    class Meta:
        abstract = True


class LatencyHistograms(models.Model):
    """The latencies of a series row's completed requests as histograms.

    A histogram is a list of counts per bucket of milliseconds (`tenants.usage_series.bucket_bounds`: the bucket of
    0 ms, then buckets a third of a power of two wide), cut after its last non-empty bucket; NULL when no request
    had the value. Histograms add up, so percentiles hold for any sum of rows (classes, deployments, hours).
    """

    ttft_ms = ArrayField(models.IntegerField(), null=True, blank=True, help_text="Completed requests' TTFT.")
    itl_ms = ArrayField(
        models.IntegerField(),
        null=True,
        blank=True,
        help_text="Completed requests' mean inter-token latency.",
    )

    class Meta:
        abstract = True


class TeamUsageSeries(UsageSeries, LatencyHistograms):
    """Per step, team and currency (a tenant's series is the sum of its teams'), with the team's latencies."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="+")

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["step_s", "start", "tenant", "team", "currency"], name="team_series_one_row_per_group"
            ),
        ]
        indexes = [
            models.Index(fields=["team", "step_s", "start"], name="team_series_team_time"),
            models.Index(fields=["tenant", "step_s", "start"], name="team_series_tenant_time"),
        ]

    def __str__(self) -> str:
        return f"{self.start:%Y-%m-%d %H:%M} +{self.step_s}s team {self.team_id}"


class DeploymentUsageSeries(UsageSeries, LatencyHistograms):
    """Per step, deployment, priority class and currency, with the latencies of its requests as histograms."""

    deployment_id = models.BigIntegerField(null=True, blank=True)
    priority_class = models.CharField(max_length=12, choices=PriorityClass.choices, blank=True, default="")
    queued_ms = ArrayField(
        models.IntegerField(),
        null=True,
        blank=True,
        help_text="Wait in a router's queue, where there was one.",
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["step_s", "start", "deployment_id", "priority_class", "currency"],
                nulls_distinct=False,
                name="deployment_series_one_row_per_group",
            ),
        ]
        indexes = [models.Index(fields=["deployment_id", "step_s", "start"], name="deployment_series_time")]

    def __str__(self) -> str:
        return f"{self.start:%Y-%m-%d %H:%M} +{self.step_s}s deployment {self.deployment_id}"


class PoolUsageSeries(UsageSeries, LatencyHistograms):
    """Per step, pool and currency, the requests its engines served: their counts, tokens, cost and latencies.

    A record is the pool's when the engine it names (`UsageRecord.endpoint`, the engine's URL) is still one of the
    pool's endpoints when the roll-up reads it, seconds later; a record of an engine already gone is in no pool's
    row (it stays in its deployment's and team's), nor is one that reached no engine (a rejected request, say).
    `pool_id` is kept without a key: the rows outlive the pool until they are pruned, like the deployment
    series'.
    """

    pool_id = models.BigIntegerField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["step_s", "start", "pool_id", "currency"], name="pool_series_one_row_per_group"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.start:%Y-%m-%d %H:%M} +{self.step_s}s pool {self.pool_id}"
