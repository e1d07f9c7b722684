"""What a request costs: the price sheet in force, and the arithmetic on it.

`cost_from_prices` needs no database, so the router can price requests for spend budgets from the sheets it
caches in memory, with exactly the arithmetic the ledger uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from decimal import ROUND_HALF_UP, Context, Decimal

from django.db.models import F, Q

from .models import PriceSheet, UsageRecord

# The ledger's precision: UsageRecord.cost has 8 decimal places.
COST_QUANTUM = Decimal(1).scaleb(-UsageRecord._meta.get_field("cost").decimal_places)
TOKENS_PER_PRICE_UNIT = Decimal(1_000_000)
# Wide enough that no intermediate product is ever rounded: prices have 12 digits, token counts 10.
_EXACT = Context(prec=60)


def cost_from_prices(
    input_per_mtok: Decimal,
    cached_input_per_mtok: Decimal,
    output_per_mtok: Decimal,
    prompt_tokens: int,
    cached_prompt_tokens: int,
    output_tokens: int,
) -> Decimal:
    """The cost of one request, rounded half-up to the ledger's 8 decimal places.

    Cached prompt tokens are part of the prompt tokens and are priced at the cached-input rate; the rest of
    the prompt at the input rate.
    """
    if min(prompt_tokens, cached_prompt_tokens, output_tokens) < 0:
        raise ValueError("token counts cannot be negative")
    if cached_prompt_tokens > prompt_tokens:
        raise ValueError("cached prompt tokens cannot exceed prompt tokens")
    fresh = Decimal(prompt_tokens - cached_prompt_tokens)
    total = _EXACT.add(
        _EXACT.add(
            _EXACT.multiply(fresh, Decimal(input_per_mtok)),
            _EXACT.multiply(Decimal(cached_prompt_tokens), Decimal(cached_input_per_mtok)),
        ),
        _EXACT.multiply(Decimal(output_tokens), Decimal(output_per_mtok)),
    )
    return _EXACT.divide(total, TOKENS_PER_PRICE_UNIT).quantize(COST_QUANTUM, rounding=ROUND_HALF_UP)


def cost_of(
    *, sheet: PriceSheet, prompt_tokens: int, cached_prompt_tokens: int, output_tokens: int
) -> Decimal:
    return cost_from_prices(
        sheet.input_per_mtok,
        sheet.cached_input_per_mtok,
        sheet.output_per_mtok,
        prompt_tokens,
        cached_prompt_tokens,
        output_tokens,
    )


def price_for(*, model: str, tenant_id: int, at: datetime) -> PriceSheet | None:
    """The tenant's own sheet for `model` in force at `at`, else the list sheet in force, else None.

    In force means the latest `effective_from` not after `at`. A tenant's sheet wins over the list sheet
    whatever their start dates.
    """
    return (
        PriceSheet.objects.filter(served_model_name=model, effective_from__lte=at)
        .filter(Q(tenant_id=tenant_id) | Q(tenant__isnull=True))
        .order_by(F("tenant_id").asc(nulls_last=True), "-effective_from")
        .first()
    )


def price_sheets_for(
    *, models: Iterable[str], tenant_ids: Iterable[int], until: datetime
) -> list[PriceSheet]:
    """Every sheet that `sheet_in_force` may pick for these models and tenants up to `until`: one query."""
    return list(
        PriceSheet.objects.filter(served_model_name__in=set(models), effective_from__lte=until).filter(
            Q(tenant_id__in=set(tenant_ids)) | Q(tenant__isnull=True)
        )
    )


def sheet_in_force(
    sheets: Iterable[PriceSheet], *, model: str, tenant_id: int, at: datetime
) -> PriceSheet | None:
    """`price_for`'s choice, made among sheets already loaded (the batch ingester prices many events)."""
    own: PriceSheet | None = None
    listed: PriceSheet | None = None
    for sheet in sheets:
        if sheet.served_model_name != model or sheet.effective_from > at:
            continue
        if sheet.tenant_id == tenant_id:
            if own is None or sheet.effective_from > own.effective_from:
                own = sheet
        elif sheet.tenant_id is None and (listed is None or sheet.effective_from > listed.effective_from):
            listed = sheet
    return own or listed
