"""What the operator wants served (deployments and their pools) and what is really running (endpoints).

Over 400 lines: Django keeps an app's models in one module; deployments, pools and endpoints refer to one
another."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q

from tenants.models import slug_validator

from .model_families import (
    ToolCalling,
    tool_calling_for,
    validate_chat_template,
    validate_reasoning_parser,
    validate_tool_call_parser,
)


class EngineKind(models.TextChoices):
    VLLM = "vllm", "vLLM"
    SIM = "sim", "Simulator"


class OrchestratorKind(models.TextChoices):
    LOCAL = "local", "Local processes"
    KUBERNETES = "kubernetes", "Kubernetes"


class DesiredStatus(models.TextChoices):
    RUNNING = "running", "Running"
    STOPPED = "stopped", "Stopped"


class ObservedStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    PROGRESSING = "progressing", "Progressing"
    READY = "ready", "Ready"
    DEGRADED = "degraded", "Degraded"
    STOPPED = "stopped", "Stopped"
    FAILED = "failed", "Failed"


def not_an_alias(name: str) -> None:
    """A served model's name may not be a name some tenant's agents already call as an alias: the alias would
    hide the model from that tenant."""
    from django.core.exceptions import ValidationError

    from tenants.models import ModelAlias

    alias = ModelAlias.objects.filter(name=name).select_related("tenant").first()
    if alias is not None:
        raise ValidationError(
            f"`{name}` is an alias of tenant `{alias.tenant.slug}` for another deployment: choose another name, "
            "or delete or rename that alias first."
        )


class DeploymentQuerySet(models.QuerySet):
    def open_to(self, tenant_ids) -> models.QuerySet:
        """The deployments any of these tenants may call (before its teams' own entitlements): those limited
        to no tenant, and those limited to one of them."""
        limits = ModelDeployment.tenants.through.objects.filter(modeldeployment=models.OuterRef("pk"))
        return self.filter(
            ~models.Exists(limits) | models.Exists(limits.filter(tenant_id__in=list(tenant_ids)))
        )


class ModelDeployment(models.Model):
    """One served model: where its weights come from, which engine serves it and where it runs."""

    name = models.SlugField(max_length=63, unique=True, validators=[slug_validator])
    served_model_name = models.CharField(
        max_length=200,
        unique=True,
        validators=[not_an_alias],
        help_text="The `model` clients put in their requests.",
    )
    model_source = models.CharField(max_length=500, help_text="A model hub id or a path to a model folder.")
    revision = models.CharField(max_length=100, blank=True)
    tokenizer = models.CharField(max_length=500, blank=True, help_text="Defaults to the model source.")
    engine_kind = models.CharField(max_length=8, choices=EngineKind.choices, default=EngineKind.VLLM)
    engine_image = models.CharField(
        max_length=300, blank=True, help_text="Container image (Kubernetes only)."
    )
    orchestrator = models.CharField(
        max_length=12, choices=OrchestratorKind.choices, default=OrchestratorKind.LOCAL
    )
    namespace = models.CharField(
        max_length=63, blank=True, help_text="Kubernetes namespace; default from settings."
    )
    max_model_len = models.PositiveIntegerField(default=4096, validators=[MinValueValidator(16)])
    block_size = models.PositiveIntegerField(
        default=128, validators=[MinValueValidator(1), MaxValueValidator(4096)]
    )
    # Tool calling and reasoning (serving/model_families.py): blank takes the model family's default, "none"
    # switches it off, anything else is one of vLLM's parser names.
    tool_call_parser = models.CharField(
        max_length=64,
        blank=True,
        default="",
        db_default="",
        validators=[validate_tool_call_parser],
        help_text='vLLM tool-call parser. Blank: the model family\'s default; "none": no tool calling.',
    )
    reasoning_parser = models.CharField(
        max_length=64,
        blank=True,
        default="",
        db_default="",
        validators=[validate_reasoning_parser],
        help_text='vLLM reasoning parser. Blank: the model family\'s default; "none": no reasoning parser.',
    )
    chat_template = models.TextField(
        blank=True,
        default="",
        db_default="",
        validators=[validate_chat_template],
        help_text="A Jinja chat template that replaces the model's own. Blank: the model's own.",
    )
    # How long the router waits on an engine (routing/server/app.py): for the first token of a streamed answer (the
    # whole of an answer not streamed), then between two pieces of a stream. An engine that sends nothing in
    # time is given up: for another engine while nothing has reached the client, with an error event after.
    first_token_timeout_s = models.PositiveIntegerField(
        "first-token timeout (s)",
        default=600,
        db_default=600,
        validators=[MinValueValidator(1)],
        help_text="Longest wait for an engine's first token (for an answer not streamed: the whole answer).",
    )
    stall_timeout_s = models.PositiveIntegerField(
        "stall timeout (s)",
        default=120,
        db_default=120,
        validators=[MinValueValidator(1)],
        help_text="Longest silence between two pieces of a streamed answer.",
    )
    # Set by operators only: a tenant's private deployment (a fine-tune) is limited to it. The router checks it
    # before any team's entitlements; a key of another tenant is told the model does not exist.
    tenants = models.ManyToManyField(
        "tenants.Tenant",
        blank=True,
        related_name="limited_deployments",
        verbose_name="only for tenants",
        help_text="Empty: every tenant may call it (within each team's models). Otherwise only these tenants "
        "may call it or see it.",
    )
    desired_status = models.CharField(
        max_length=8, choices=DesiredStatus.choices, default=DesiredStatus.RUNNING
    )
    observed_status = models.CharField(
        max_length=12, choices=ObservedStatus.choices, default=ObservedStatus.PENDING, editable=False
    )
    status_message = models.TextField(blank=True, editable=False)
    observed_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = DeploymentQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(max_model_len__gte=16),
                name="deployment_max_model_len_min",
                violation_error_message="max_model_len must be at least 16.",
            ),
            models.CheckConstraint(
                condition=Q(block_size__gte=1),
                name="deployment_block_size_positive",
                violation_error_message="block_size must be at least 1.",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def tool_calling(self) -> ToolCalling:
        """The parsers its engines run with: its own settings, else its model family's (read from the model)."""
        return tool_calling_for(
            model_source=self.model_source,
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
        )


class PoolRole(models.TextChoices):
    BOTH = "both", "Prefill and decode"
    PREFILL = "prefill", "Prefill"
    DECODE = "decode", "Decode"


class KvConnector(models.TextChoices):
    NONE = "", "None"
    NIXL = "NixlConnector", "NIXL"
    OFFLOADING = "OffloadingConnector", "CPU offloading"
    MULTI = "MultiConnector", "NIXL + CPU offloading"


class SpeculativeMethod(models.TextChoices):
    NONE = "", "None"
    NGRAM = "ngram", "n-gram"
    MTP = "mtp", "MTP"
    EAGLE = "eagle", "EAGLE"


class Pool(models.Model):
    """A set of identical engine replicas with one role."""

    deployment = models.ForeignKey(ModelDeployment, on_delete=models.CASCADE, related_name="pools")
    name = models.SlugField(max_length=40, validators=[slug_validator])
    role = models.CharField(max_length=8, choices=PoolRole.choices, default=PoolRole.BOTH)
    replicas = models.PositiveIntegerField(default=1, validators=[MaxValueValidator(1024)])
    tensor_parallel_size = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1)])
    data_parallel_size = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1)])
    enable_expert_parallel = models.BooleanField(default=False)
    nodes_per_replica = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1)])
    enable_prefix_caching = models.BooleanField(default=True)
    enable_kv_events = models.BooleanField(default=True)
    kv_connector = models.CharField(max_length=24, choices=KvConnector.choices, blank=True, default="")
    cpu_offload_bytes = models.PositiveBigIntegerField(
        default=0, help_text="CPU memory for evicted KV blocks."
    )
    speculative_method = models.CharField(
        max_length=8, choices=SpeculativeMethod.choices, blank=True, default=""
    )
    num_speculative_tokens = models.PositiveSmallIntegerField(null=True, blank=True)
    max_num_seqs = models.PositiveIntegerField(default=256, validators=[MinValueValidator(1)])
    accelerator = models.CharField(
        max_length=64, blank=True, help_text="Accelerator type, e.g. nvidia-h100-80gb."
    )
    gpus_per_replica = models.PositiveSmallIntegerField(default=1)
    cpu_request = models.CharField(max_length=16, blank=True, help_text="Kubernetes quantity, e.g. 8.")
    memory_request = models.CharField(max_length=16, blank=True, help_text="Kubernetes quantity, e.g. 64Gi.")
    extra_engine_args = models.JSONField(
        default=list, blank=True, help_text="Extra engine arguments, a list."
    )

    class Meta:
        ordering = ["deployment__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["deployment", "name"], name="pool_name_unique_in_deployment"),
            models.CheckConstraint(
                condition=Q(role__in=PoolRole.values),
                name="pool_role_known",
                violation_error_message="Role must be both, prefill or decode.",
            ),
            models.CheckConstraint(
                condition=Q(tensor_parallel_size__gte=1, data_parallel_size__gte=1, nodes_per_replica__gte=1),
                name="pool_parallelism_positive",
                violation_error_message="Parallel sizes and nodes per replica must be at least 1.",
            ),
            models.CheckConstraint(
                condition=(
                    Q(speculative_method="", num_speculative_tokens__isnull=True)
                    | (
                        ~Q(speculative_method="")
                        & Q(num_speculative_tokens__isnull=False, num_speculative_tokens__gte=1)
                    )
                ),
                name="pool_speculative_method_and_tokens_together",
                violation_error_message="Speculative decoding needs both a method and num_speculative_tokens of at least 1, or neither.",
            ),
            models.CheckConstraint(
                condition=Q(cpu_offload_bytes=0)
                | Q(kv_connector__in=["OffloadingConnector", "MultiConnector"]),
                name="pool_cpu_offload_needs_offloading_connector",
                violation_error_message="CPU offload bytes need the OffloadingConnector or MultiConnector.",
            ),
            models.CheckConstraint(
                condition=Q(role="both") | Q(kv_connector__in=["NixlConnector", "MultiConnector"]),
                name="pool_split_role_needs_nixl",
                violation_error_message="A prefill or decode pool needs the NixlConnector (or MultiConnector) to hand KV blocks over.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.deployment.name}/{self.name}"


class Health(models.TextChoices):
    UNKNOWN = "unknown", "Unknown"
    STARTING = "starting", "Starting"
    HEALTHY = "healthy", "Healthy"
    UNHEALTHY = "unhealthy", "Unhealthy"


class Endpoint(models.Model):
    """One running engine, as the orchestrator found it."""

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="endpoints")
    name = models.CharField(max_length=120, help_text="Process or pod name.")
    url = models.URLField(help_text="Base URL of the engine's HTTP server.")
    role = models.CharField(max_length=8, choices=PoolRole.choices)
    kv_events_endpoint = models.CharField(max_length=255, blank=True)
    kv_side_channel = models.CharField(max_length=255, blank=True, help_text="NIXL side channel host:port.")
    health = models.CharField(max_length=10, choices=Health.choices, default=Health.UNKNOWN)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    # Supervision of a local engine process (the local orchestrator fills these in).
    pid = models.PositiveIntegerField(null=True, blank=True)
    config_hash = models.CharField(
        max_length=64, blank=True, help_text="Hash of the engine command it was started with."
    )
    started_at = models.DateTimeField(null=True, blank=True)
    restart_count = models.PositiveIntegerField(default=0)
    next_restart_at = models.DateTimeField(
        null=True, blank=True, help_text="A crashed engine is not restarted before this time."
    )
    draining_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Set when chosen for removal: routers send it nothing new; it stops once its requests end.",
    )
    lifetime = models.ForeignKey(
        "EndpointLifetime", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["pool__deployment__name", "pool__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["pool", "name"], name="endpoint_name_unique_in_pool"),
            models.UniqueConstraint(fields=["url"], name="endpoint_url_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.url})"


# Which autoscaling targets each role can have: a prefill pool has no decode to measure, and the reverse.
PREFILL_TARGETS = ("ttft_p90_s", "queued_prompt_tokens_per_replica")
DECODE_TARGETS = ("itl_p90_s", "kv_cache_utilization", "running_requests_per_replica")
TARGETS_OF_ROLE = {
    PoolRole.PREFILL: PREFILL_TARGETS,
    PoolRole.DECODE: DECODE_TARGETS,
    PoolRole.BOTH: PREFILL_TARGETS + DECODE_TARGETS,
}


class AutoscalingPolicy(models.Model):
    """How one pool's replicas follow demand (serving/autoscaling.py applies it). Each target is optional; the
    pool gets the replicas the most demanding of its targets needs, within [min_replicas, max_replicas]."""

    pool = models.OneToOneField(Pool, on_delete=models.CASCADE, related_name="autoscaling")
    enabled = models.BooleanField(default=False)
    min_replicas = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(1024)]
    )
    max_replicas = models.PositiveIntegerField(
        default=4, validators=[MinValueValidator(1), MaxValueValidator(1024)]
    )
    # Prefill and aggregated pools.
    ttft_p90_s = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.001)],
        help_text="Objective for the 90th percentile of time to first token, in seconds.",
    )
    queued_prompt_tokens_per_replica = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Uncached prompt tokens waiting for prefill, per replica.",
    )
    # Decode and aggregated pools.
    itl_p90_s = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.0001)],
        help_text="Objective for the 90th percentile of inter-token latency, in seconds.",
    )
    kv_cache_utilization = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.01), MaxValueValidator(1.0)],
        help_text="Mean KV-cache use across replicas, a fraction (0.01 to 1).",
    )
    running_requests_per_replica = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Sequences decoding, per replica."
    )
    scale_up_window_s = models.PositiveIntegerField(
        default=15, help_text="Scale up only to what every recommendation over this window asked for."
    )
    scale_down_window_s = models.PositiveIntegerField(
        default=300, help_text="Scale down only to what every recommendation over this window allowed."
    )
    max_scale_up_step = models.PositiveIntegerField(default=4, validators=[MinValueValidator(1)])
    max_scale_down_step = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    paused_reason = models.CharField(
        max_length=200, blank=True, editable=False, help_text="Why it was turned off (a manual edit)."
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "autoscaling policies"
        constraints = [
            models.CheckConstraint(
                condition=Q(min_replicas__lte=models.F("max_replicas")),
                name="autoscaling_min_not_above_max",
                violation_error_message="The minimum replicas cannot be above the maximum.",
            ),
        ]

    def __str__(self) -> str:
        return f"autoscaling of {self.pool}"

    def save(self, *args, **kwargs):
        if self.enabled:
            self.paused_reason = ""  # turned back on
        super().save(*args, **kwargs)

    def targets(self) -> dict[str, float]:
        """The targets set, by field name."""
        return {
            name: value
            for name in PREFILL_TARGETS + DECODE_TARGETS
            if (value := getattr(self, name)) is not None
        }

    def clean(self) -> None:
        from django.core.exceptions import ValidationError

        errors: dict[str, str] = {}
        if self.min_replicas is not None and self.max_replicas is not None:
            if self.min_replicas > self.max_replicas:
                errors["min_replicas"] = (
                    f"The minimum ({self.min_replicas}) is above the maximum ({self.max_replicas})."
                )
        role = self.pool.role if self.pool_id else None
        if role is not None:
            allowed = TARGETS_OF_ROLE[role]
            for name in self.targets():
                if name not in allowed:
                    errors[name] = (
                        f"A {PoolRole(role).label.lower()} pool has no {name.replace('_', ' ')} signal; "
                        f"its targets are: {', '.join(allowed)}."
                    )
        if self.enabled and not self.targets():
            errors["enabled"] = "Set at least one target before turning autoscaling on."
        if errors:
            raise ValidationError(errors)


class ScalingEvent(models.Model):
    """One change of a pool's replicas by the autoscaler, or an operator's edit that paused it."""

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="scaling_events")
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    from_replicas = models.PositiveIntegerField()
    to_replicas = models.PositiveIntegerField()
    actor = models.CharField(max_length=40, default="autoscaler")
    signals = models.JSONField(default=dict, help_text="The signal values the decision read.")
    reason = models.TextField()

    class Meta:
        ordering = ["-at"]

    def __str__(self) -> str:
        return f"{self.pool}: {self.from_replicas} -> {self.to_replicas} ({self.reason})"


class EndpointLifetime(models.Model):
    """When one engine ran: started, ready, draining, stopped. Cost to serve sums these GPU-hours, and the
    autoscaler reads a pool's start-up time (ready - started) from them. Kept after the endpoint and pool go."""

    pool = models.ForeignKey(Pool, on_delete=models.SET_NULL, null=True, related_name="lifetimes")
    deployment_name = models.CharField(max_length=63)
    pool_name = models.CharField(max_length=40)
    endpoint_name = models.CharField(max_length=120)
    accelerator = models.CharField(max_length=64, blank=True)
    gpus = models.PositiveSmallIntegerField(default=0)
    started_at = models.DateTimeField(db_index=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    draining_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return f"{self.endpoint_name} from {self.started_at:%Y-%m-%d %H:%M:%S}"
