"""Cost arithmetic (properties over many inputs) and which price sheet is in force."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from hypothesis import given
from hypothesis import strategies as st

from tenants.models import PriceSheet
from tenants.pricing import COST_QUANTUM, cost_from_prices, cost_of, price_for, sheet_in_force

# Prices as the PriceSheet columns hold them: up to 6 integer digits and 6 decimals.
price = st.decimals(min_value=0, max_value=Decimal("999999.999999"), places=6)
tokens = st.integers(min_value=0, max_value=2_000_000)


@st.composite
def prices(draw) -> tuple[Decimal, Decimal, Decimal]:
    fresh = draw(price)
    cached = draw(st.decimals(min_value=0, max_value=fresh, places=6))
    return fresh, cached, draw(price)


@st.composite
def usage(draw) -> tuple[int, int, int]:
    prompt = draw(tokens)
    return prompt, draw(st.integers(min_value=0, max_value=prompt)), draw(tokens)


def test_it_prices_cached_input_apart_exactly():
    # 400 fresh at 0.5, 600 cached at 0.05, 50 out at 1.5 per million.
    cost = cost_from_prices(Decimal("0.5"), Decimal("0.05"), Decimal("1.5"), 1000, 600, 50)
    assert cost == Decimal("0.000305")
    assert cost.as_tuple().exponent == -8


def test_it_rounds_half_up_to_the_ledgers_eight_places():
    # 1000 tokens at 0.000005 per million is 0.000000005: exactly half of the last place.
    assert cost_from_prices(Decimal("0.000005"), 0, 0, 1000, 0, 0) == Decimal("0.00000001")
    assert cost_from_prices(Decimal("0.000005"), 0, 0, 999, 0, 0) == Decimal("0")


def test_it_refuses_more_cached_than_prompt_tokens_and_negative_counts():
    with pytest.raises(ValueError):
        cost_from_prices(Decimal(1), Decimal(1), Decimal(1), 10, 11, 0)
    with pytest.raises(ValueError):
        cost_from_prices(Decimal(1), Decimal(1), Decimal(1), 10, 0, -1)


@given(prices(), usage())
def test_it_never_costs_less_than_nothing(p, u):
    cost = cost_from_prices(*p, *u)
    assert isinstance(cost, Decimal)
    assert cost >= 0


@given(prices(), usage())
def test_it_never_charges_cached_input_more_than_fresh(p, u):
    prompt, cached, output = u
    assert cost_from_prices(*p, prompt, cached, output) <= cost_from_prices(*p, prompt, 0, output)


@given(prices(), usage(), tokens, tokens, tokens)
def test_it_never_costs_less_for_more_tokens(p, u, more_fresh, more_cached, more_output):
    prompt, cached, output = u
    before = cost_from_prices(*p, prompt, cached, output)
    after = cost_from_prices(
        *p, prompt + more_fresh + more_cached, cached + more_cached, output + more_output
    )
    assert after >= before


@given(prices(), st.lists(usage(), min_size=1, max_size=8))
def test_it_charges_the_whole_as_the_sum_of_its_parts_within_rounding(p, parts):
    whole = cost_from_prices(*p, *(sum(part[i] for part in parts) for i in range(3)))
    summed = sum(cost_from_prices(*p, *part) for part in parts)
    # Each part is rounded by at most half a quantum.
    assert abs(whole - summed) <= COST_QUANTUM * len(parts) / 2


def test_it_uses_the_list_sheet_unless_the_tenant_has_its_own(world):
    now = timezone.now()
    assert price_for(model="tiny-qwen", tenant_id=world.tenant_a.id, at=now) == world.price_list
    assert price_for(model="tiny-qwen", tenant_id=world.tenant_b.id, at=now) == world.price_b


def test_it_prefers_the_tenants_sheet_even_when_the_list_sheet_is_newer(world):
    newer_list = PriceSheet.objects.create(
        served_model_name="tiny-qwen",
        effective_from=timezone.now() - timedelta(hours=1),
        input_per_mtok=Decimal("9"),
        cached_input_per_mtok=Decimal("1"),
        output_per_mtok=Decimal("9"),
    )
    now = timezone.now()
    assert price_for(model="tiny-qwen", tenant_id=world.tenant_b.id, at=now) == world.price_b
    assert price_for(model="tiny-qwen", tenant_id=world.tenant_a.id, at=now) == newer_list


def test_it_uses_the_latest_sheet_started_by_then_and_never_a_future_one(world):
    start = world.price_list.effective_from
    later = PriceSheet.objects.create(
        served_model_name="tiny-qwen",
        effective_from=start + timedelta(hours=2),
        input_per_mtok=Decimal("0.7"),
        cached_input_per_mtok=Decimal("0.07"),
        output_per_mtok=Decimal("2"),
    )
    PriceSheet.objects.create(
        served_model_name="tiny-qwen",
        effective_from=timezone.now() + timedelta(days=1),
        input_per_mtok=Decimal("5"),
        cached_input_per_mtok=Decimal("0.5"),
        output_per_mtok=Decimal("5"),
    )
    a = world.tenant_a.id
    assert price_for(model="tiny-qwen", tenant_id=a, at=start + timedelta(hours=1)) == world.price_list
    assert price_for(model="tiny-qwen", tenant_id=a, at=start + timedelta(hours=2)) == later
    assert price_for(model="tiny-qwen", tenant_id=a, at=timezone.now()) == later


def test_it_finds_no_sheet_before_any_starts_or_for_an_unpriced_model(world):
    before = world.price_list.effective_from - timedelta(seconds=1)
    assert price_for(model="tiny-qwen", tenant_id=world.tenant_a.id, at=before) is None
    assert price_for(model="unpriced", tenant_id=world.tenant_a.id, at=timezone.now()) is None


def test_it_picks_the_same_sheet_from_loaded_sheets_as_from_the_database(world):
    start = world.price_list.effective_from
    PriceSheet.objects.create(
        served_model_name="tiny-qwen",
        tenant=world.tenant_a,
        effective_from=start + timedelta(hours=3),
        input_per_mtok=Decimal("0.3"),
        cached_input_per_mtok=Decimal("0.03"),
        output_per_mtok=Decimal("1"),
    )
    sheets = list(PriceSheet.objects.all())
    for tenant in (world.tenant_a, world.tenant_b):
        for hours in (-1, 0, 1, 3, 4, 48):
            at = start + timedelta(hours=hours)
            expected = price_for(model="tiny-qwen", tenant_id=tenant.id, at=at)
            assert sheet_in_force(sheets, model="tiny-qwen", tenant_id=tenant.id, at=at) == expected


def test_it_costs_a_request_from_a_sheet(world):
    cost = cost_of(sheet=world.price_b, prompt_tokens=1000, cached_prompt_tokens=600, output_tokens=50)
    # 400 * 0.4 + 600 * 0.04 + 50 * 1.2 = 244 per million
    assert cost == Decimal("0.000244")
