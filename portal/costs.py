"""Cost to serve a deployment: GPU-hours at the configured price, divided among the tokens it served.

    GPU cost = sum over the engines that ran in the period (up to now) of
               price per GPU-hour of the engine's accelerator x its GPUs x the hours it ran in the period,
from each engine's recorded lifetime (serving.EndpointLifetime: started to stopped, draining included), so
replicas that autoscaling added or removed count for the time they really ran.

The GPU cost is shared among fresh input, cached input and output tokens in proportion to what the price
sheet charges for them (its weights), so that cost per million of each kind is comparable with the price:
    cost per Mtok of kind k = GPU cost x weight_k / sum_j(tokens_j x weight_j) x 1,000,000.
Without a price sheet the weights are 1 : 0.1 : 4. Every input appears on the page.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.utils import timezone

from serving.models import EndpointLifetime, ModelDeployment
from tenants.access import Access
from tenants.billing import Period, usage_report
from tenants.models import PriceSheet
from tenants.pricing import price_for

from .models import AcceleratorPrice, CommercialPrice

DEFAULT_WEIGHTS = (Decimal(1), Decimal("0.1"), Decimal(4))
MILLION = Decimal(1_000_000)


@dataclass
class PoolCost:
    name: str
    accelerator: str
    price_per_gpu_hour: Decimal | None  # None: no price configured for this accelerator
    currency: str  # the price's
    gpus: int  # per replica
    engines: int  # engines that ran in the period
    gpu_hours: Decimal  # measured: each engine's GPUs x the hours it ran in the period
    cost: Decimal


@dataclass
class CostToServe:
    deployment: ModelDeployment
    period: Period
    hours: Decimal
    pools: list[PoolCost]
    gpu_cost: Decimal
    currency: str  # the GPU prices' currency; empty when they are in several
    fresh_input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    billed: Decimal  # what the ledger charged for these tokens
    billed_currency: str  # the ledger's currency for them; empty when several
    weights: tuple[Decimal, Decimal, Decimal]
    weights_from: str
    per_mtok: tuple[Decimal, Decimal, Decimal] | None  # fresh input, cached input, output
    price_sheet: PriceSheet | None
    commercial: list[CommercialPrice]

    @property
    def stale_commercial(self) -> list[CommercialPrice]:
        return [price for price in self.commercial if price.is_stale]


def _hours(period: Period, now: datetime) -> Decimal:
    end = min(period.end, max(now, period.start))
    return Decimal((end - period.start).total_seconds()) / Decimal(3600)


def _pool_costs(
    deployment: ModelDeployment, period: Period, now: datetime, prices: dict[str, AcceleratorPrice]
) -> list[PoolCost]:
    """GPU-hours and their cost per pool (and accelerator), from the lifetimes that overlap the period."""
    end = min(period.end, now)
    lifetimes = EndpointLifetime.objects.filter(deployment_name=deployment.name, started_at__lt=end).exclude(
        stopped_at__lte=period.start
    )
    per_pool: dict[tuple[str, str], list] = {}
    for life in lifetimes:
        ran = min(life.stopped_at or end, end) - max(life.started_at, period.start)
        seconds = Decimal(max(ran.total_seconds(), 0))
        entry = per_pool.setdefault((life.pool_name, life.accelerator), [0, 0, Decimal(0)])
        entry[0] = max(entry[0], life.gpus)
        entry[1] += 1
        entry[2] += life.gpus * seconds / Decimal(3600)
    for pool in deployment.pools.all():  # pools that ran nothing in the period still get a row
        per_pool.setdefault((pool.name, pool.accelerator), [pool.gpus_per_replica, 0, Decimal(0)])
    rows = []
    for (name, accelerator), (gpus, engines, gpu_hours) in sorted(per_pool.items()):
        known = prices.get(accelerator)
        price, currency = (known.price_per_gpu_hour, known.currency) if known else (None, "")
        rows.append(
            PoolCost(
                name,
                accelerator or "(none)",
                price,
                currency,
                gpus,
                engines,
                gpu_hours,
                (price or 0) * gpu_hours,
            )
        )
    return rows


def _one(currencies: set[str]) -> str:
    return next(iter(currencies)) if len(currencies) == 1 else ""


def cost_to_serve(*, access: Access, deployment: ModelDeployment, period: Period) -> CostToServe:
    now = timezone.now()
    hours = _hours(period, now)
    prices = {p.accelerator: p for p in AcceleratorPrice.objects.all()}
    pools = _pool_costs(deployment, period, now, prices)
    gpu_cost = sum((p.cost for p in pools), Decimal(0))
    rows = [
        r
        for r in usage_report(access=access, period=period, group_by="deployment").rows
        if r.key == deployment.pk
    ]
    prompt = sum(r.input_tokens for r in rows)
    cached = sum(r.cached_input_tokens for r in rows)
    output = sum(r.output_tokens for r in rows)
    sheet = (
        PriceSheet.objects.filter(
            served_model_name=deployment.served_model_name,
            tenant__isnull=True,
            effective_from__lte=timezone.now(),
        )
        .order_by("-effective_from")
        .first()
    )
    if sheet and sheet.input_per_mtok > 0:
        weights = (sheet.input_per_mtok, sheet.cached_input_per_mtok, sheet.output_per_mtok)
        weights_from = f"the list price sheet from {sheet.effective_from:%Y-%m-%d}"
    else:
        weights, weights_from = DEFAULT_WEIGHTS, "the default weights 1 : 0.1 : 4 (no list price sheet)"
    weighted = (prompt - cached) * weights[0] + cached * weights[1] + output * weights[2]
    per_mtok = tuple(gpu_cost * w / weighted * MILLION for w in weights) if weighted else None
    return CostToServe(
        deployment=deployment,
        period=period,
        hours=hours,
        pools=pools,
        gpu_cost=gpu_cost,
        currency=_one({p.currency for p in pools if p.price_per_gpu_hour is not None}),
        fresh_input_tokens=prompt - cached,
        cached_input_tokens=cached,
        output_tokens=output,
        billed=sum((r.cost for r in rows), Decimal(0)),
        billed_currency=_one({r.currency for r in rows}),
        weights=weights,
        weights_from=weights_from,
        per_mtok=per_mtok,
        price_sheet=sheet,
        commercial=list(CommercialPrice.objects.all()),
    )


__all__ = ["CostToServe", "cost_to_serve", "price_for"]
