"""The inputs of cost to serve that operators configure: GPU-hour prices and commercial list prices."""

from __future__ import annotations

from datetime import timedelta

from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

# A list price older than this is flagged where it is shown: commercial prices change every few months.
PRICE_STALE_AFTER = timedelta(days=90)


class AcceleratorPrice(models.Model):
    """What one GPU of a type costs per hour (owned hardware amortised, or a cloud rate)."""

    accelerator = models.CharField(
        max_length=64, unique=True, help_text="As in a pool's accelerator field, e.g. nvidia-h100-80gb."
    )
    price_per_gpu_hour = models.DecimalField(
        max_digits=12, decimal_places=6, validators=[MinValueValidator(0)]
    )
    currency = models.CharField(max_length=3, default="USD")

    class Meta:
        ordering = ["accelerator"]

    def __str__(self) -> str:
        return f"{self.accelerator}: {self.price_per_gpu_hour} {self.currency}/GPU-hour"


class CommercialPrice(models.Model):
    """A commercial API's list price per million tokens, shown for comparison. Keep it current:
    `manage.py update_commercial_prices FILE` (portal/prices.py)."""

    name = models.CharField(max_length=100, unique=True)
    input_per_mtok = models.DecimalField(max_digits=12, decimal_places=6, validators=[MinValueValidator(0)])
    cached_input_per_mtok = models.DecimalField(
        max_digits=12, decimal_places=6, validators=[MinValueValidator(0)]
    )
    output_per_mtok = models.DecimalField(max_digits=12, decimal_places=6, validators=[MinValueValidator(0)])
    currency = models.CharField(max_length=3, default="USD")
    as_of = models.DateField(help_text="When this list price was read.")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_stale(self) -> bool:
        return timezone.now().date() - self.as_of > PRICE_STALE_AFTER


class PoolSeries(models.Model):
    """What the engines of a pool looked like over one step (portal/history.py samples them every few seconds
    from the load the worker scrapes into Redis). Sums over the samples, so that means hold for any step:
    replicas = replicas / samples, KV-cache use = kv_sum / kv_samples (one per engine that reported it)."""

    step_s = models.PositiveIntegerField(help_text="60 (a minute) or 3600 (an hour).")
    start = models.DateTimeField()
    pool_id = models.BigIntegerField()
    deployment_id = models.BigIntegerField()
    samples = models.PositiveIntegerField(default=0)
    replicas = models.BigIntegerField(
        default=0, help_text="Replicas wanted (set by an operator or the autoscaler)."
    )
    ready = models.BigIntegerField(default=0, help_text="Healthy engines, not draining.")
    running = models.FloatField(default=0)
    waiting = models.FloatField(default=0)
    queued_prompt_tokens = models.FloatField(
        default=0, help_text="The routers' prefill backlog for the pool."
    )
    kv_samples = models.PositiveIntegerField(default=0)
    kv_sum = models.FloatField(default=0)
    kv_max = models.FloatField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["step_s", "start", "pool_id"], name="pool_series_one_row_per_step"
            )
        ]
        indexes = [models.Index(fields=["deployment_id", "step_s", "start"], name="pool_series_deployment")]

    def __str__(self) -> str:
        return f"{self.start:%Y-%m-%d %H:%M} +{self.step_s}s pool {self.pool_id}"


class PrefixSeries(models.Model):
    """Cached tokens the routers predicted for a deployment, and those its engines reported, per step (the
    routers' per-minute counters in Redis, routing/kvindex/prefix_health.py, copied here before they expire)."""

    step_s = models.PositiveIntegerField()
    start = models.DateTimeField()
    deployment_id = models.BigIntegerField()
    predicted = models.BigIntegerField(default=0)
    reported = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["step_s", "start", "deployment_id"], name="prefix_series_one_row_per_step"
            )
        ]

    def __str__(self) -> str:
        return f"{self.start:%Y-%m-%d %H:%M} +{self.step_s}s deployment {self.deployment_id}"
