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
