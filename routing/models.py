"""How the router chooses among a deployment's endpoints. Data, editable live."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q

unit_interval = [MinValueValidator(0.0), MaxValueValidator(1.0)]


# The policy's fields that weigh a scorer: each is named by one scorer's registration (routing/scheduling/__init__.py), and the
# database holds them to at least 0. Kept here, not read off the registry, so the model and its migrations depend on
# nothing registered at run time; a test holds the two equal.
SCORER_WEIGHT_FIELDS = (
    "prefix_weight",
    "queue_weight",
    "prefill_backlog_weight",
    "kv_utilization_weight",
    "session_affinity_weight",
)


class RoutingMode(models.TextChoices):
    ROUND_ROBIN = "round_robin", "Round-robin"
    LEAST_LOADED = "least_loaded", "Least loaded"
    APPROXIMATE = "approximate", "Approximate prefix (router's own record)"
    PRECISE = "precise", "Precise prefix (engines' KV events)"


class RoutingPolicy(models.Model):
    """Scorer weights and thresholds for one deployment.

    Each scorer returns a score in [0, 1] per endpoint; the weights combine them and the best total wins. Which
    field weighs which scorer is registered with the scorer (routing/scheduling/__init__.py). The router reads every field
    but the deployment and updated_at (policy_fields), with these defaults: routing.info.PolicyInfo holds them
    again for the request path, without Django, and a test holds the two equal.
    """

    deployment = models.OneToOneField(
        "serving.ModelDeployment", on_delete=models.CASCADE, related_name="routing_policy"
    )
    mode = models.CharField(max_length=16, choices=RoutingMode.choices, default=RoutingMode.PRECISE)
    prefix_weight = models.FloatField(default=3.0, validators=[MinValueValidator(0.0)])
    queue_weight = models.FloatField(default=2.0, validators=[MinValueValidator(0.0)])
    prefill_backlog_weight = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(0.0)],
        help_text="Weight of the prefill already queued at an endpoint (uncached prompt tokens still waiting for "
        "a first token), against this prompt's length.",
    )
    kv_utilization_weight = models.FloatField(default=1.0, validators=[MinValueValidator(0.0)])
    session_affinity_weight = models.FloatField(default=1.0, validators=[MinValueValidator(0.0)])
    gpu_tier_weight = models.FloatField(default=1.0, validators=unit_interval)
    cpu_tier_weight = models.FloatField(default=0.8, validators=unit_interval)
    load_guard_ratio = models.FloatField(
        default=1.3,
        validators=[MinValueValidator(1.0)],
        help_text="An endpoint whose load exceeds this multiple of the mean loses its prefix score.",
    )
    pd_split_threshold_tokens = models.PositiveIntegerField(
        default=1024, help_text="Split prefill from decode when the uncached prompt reaches this many tokens."
    )
    # Flow control (routing/scheduling/flow.py, docs/flow-control.md): while the deployment is saturated, new requests wait in
    # the router, served by priority class, then by weighted fair share of work across tenants and their teams.
    flow_control = models.BooleanField(
        default=True,
        help_text="Hold requests in the router while the deployment is saturated, instead of in the engines' "
        "queues, and serve them by priority and fair share.",
    )
    saturation_waiting_per_engine = models.FloatField(
        default=0.0,
        validators=[MinValueValidator(0.0)],
        help_text="Saturated when the requests queued in the engines (beyond each one's max_num_seqs) exceed this "
        "many per engine.",
    )
    saturation_spare_slots_per_engine = models.FloatField(
        default=2.0,
        validators=[MinValueValidator(0.0)],
        help_text="While saturated, a tenant ahead of its fair share may not take an engine's last this many slots: "
        "they are kept spare for the tenants behind theirs, whose next request then need not wait for one to free.",
    )
    saturation_kv_utilization = models.FloatField(
        default=0.95,
        validators=unit_interval,
        help_text="Saturated when every engine's KV cache is at least this full (0 to 1).",
    )
    saturation_prefill_tokens_per_engine = models.PositiveIntegerField(
        default=65536,
        help_text="Saturated when the uncached prompt tokens awaiting a first token exceed this many per engine.",
    )
    max_wait_interactive_s = models.FloatField(
        default=30.0,
        validators=[MinValueValidator(0.0)],
        help_text="An interactive request waiting longer in the router is refused (429, Retry-After).",
    )
    max_wait_standard_s = models.FloatField(default=60.0, validators=[MinValueValidator(0.0)])
    max_wait_batch_s = models.FloatField(default=300.0, validators=[MinValueValidator(0.0)])
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "routing policies"
        constraints = [
            models.CheckConstraint(
                condition=Q(**{f"{weight}__gte": 0 for weight in SCORER_WEIGHT_FIELDS}),
                name="routing_policy_weights_not_negative",
                violation_error_message="Scorer weights cannot be negative.",
            ),
            models.CheckConstraint(
                condition=Q(gpu_tier_weight__gte=0, gpu_tier_weight__lte=1, cpu_tier_weight__gte=0)
                & Q(cpu_tier_weight__lte=models.F("gpu_tier_weight")),
                name="routing_policy_tier_weights_ordered",
                violation_error_message="Tier weights lie in [0, 1] and a CPU block cannot weigh more than a GPU block.",
            ),
            models.CheckConstraint(
                condition=Q(load_guard_ratio__gte=1),
                name="routing_policy_load_guard_min",
                violation_error_message="The load guard ratio must be at least 1.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.deployment.name}: {self.get_mode_display()}"


def policy_fields() -> tuple[models.Field, ...]:
    """The routing policy's fields the router reads, in the order declared: all but the deployment it belongs to
    and the bookkeeping ones."""
    return tuple(
        f for f in RoutingPolicy._meta.local_fields if f.editable and not f.primary_key and not f.is_relation
    )


class TrafficTraceEntry(models.Model):
    """One sampled request of our own traffic, as a replay needs it (routing/metering/traffic_trace.py): when it arrived,
    whose it was (ids), its session and prompt blocks as keyed hashes, and its token counts. No text, no token ids.
    Ids are plain numbers, not relations: the trace outlives a deleted key, and the worker's drain never fails on
    one. Rows older than ROUTER_TRAFFIC_TRACE_KEEP_DAYS are pruned."""

    request_id = models.CharField(max_length=64, unique=True)  # the drain writes each entry once
    arrived_at = models.DateTimeField(db_index=True)
    deployment_id = models.BigIntegerField()
    endpoint = models.CharField(max_length=255, blank=True)  # the engine that served it
    tenant_id = models.BigIntegerField()
    team_id = models.BigIntegerField()
    api_key_id = models.BigIntegerField()
    priority_class = models.CharField(max_length=16, blank=True)
    session = models.CharField(max_length=32, blank=True)  # keyed hash of the router's session id
    prompt_tokens = models.PositiveIntegerField()
    cached_tokens = models.PositiveIntegerField()
    output_tokens = models.PositiveIntegerField()
    # Output tokens made before the client saw any of the answer (a tool call held by the engine's parser until
    # its name is complete; all but the last of an answer not streamed): a replay's TTFT is the client's.
    output_before_visible = models.PositiveIntegerField(default=0)
    block_size = models.PositiveIntegerField()  # the deployment's, which the block hashes are of
    # The prompt's full blocks in order, 8 bytes each: keyed hashes of the router's block keys.
    block_hashes = models.BinaryField(default=b"")

    class Meta:
        indexes = [models.Index(fields=["deployment_id", "arrived_at"], name="traffic_trace_period")]

    def __str__(self) -> str:
        return self.request_id
