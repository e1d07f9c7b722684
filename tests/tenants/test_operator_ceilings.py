"""Limits a tenant cannot raise: the ceilings an operator sets on a tenant bound every quota its admins give a
team or a key (a 400 naming the ceiling), and the router counts all of the tenant's teams and keys against them
together (tests/routing/test_quotas.py); and personal API tokens die with the password they were signed in with."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.test import Client
from knox.models import AuthToken

from routing.snapshot import load_snapshot
from tenants.api.tokens import personal_token_create
from tenants.models import Quota, Tenant


def _ceilings(tenant: Tenant, **values) -> None:
    Tenant.objects.filter(pk=tenant.pk).update(**values)


# --- quotas within the tenant's ceilings ------------------------------------------------------------------


def test_a_tenant_admin_cannot_raise_a_quota_above_the_operators_ceiling(world, client_for):
    _ceilings(world.tenant_a, max_requests_per_minute=100, max_spend_budget=Decimal("50"))
    client = client_for(world.admin_a)
    url = f"/api/quotas/{world.quota_a1.pk}/"
    response = client.patch(url, {"requests_per_minute": 1000}, format="json")
    assert response.status_code == 400
    message = response.json()["requests_per_minute"][0]
    assert "most requests per minute at 100" in message and "at most 100" in message
    response = client.patch(url, {"spend_budget": "50.01"}, format="json")
    assert response.status_code == 400
    assert "largest spend budget at 50" in response.json()["spend_budget"][0]
    assert Quota.objects.get(pk=world.quota_a1.pk).requests_per_minute == 60
    # Within the ceilings, the tenant's admins set what they like.
    response = client.patch(url, {"requests_per_minute": 100, "spend_budget": "50"}, format="json")
    assert response.status_code == 200, response.content


def test_a_new_team_or_key_quota_is_held_to_the_ceiling_too(world, client_for):
    _ceilings(world.tenant_a, max_token_budget=1_000_000, max_concurrent_requests=4)
    client = client_for(world.admin_a)
    key_quota = {"team": world.team_a1.pk, "api_key": world.key_a1.api_key.pk, "token_budget": 2_000_000}
    response = client.post("/api/quotas/", key_quota, format="json")
    assert response.status_code == 400 and "largest token budget" in response.json()["token_budget"][0]
    team_quota = {"team": world.team_a2.pk, "max_concurrent_requests": 5}
    response = client.post("/api/quotas/", team_quota, format="json")
    assert response.status_code == 400
    assert "most concurrent requests at 4" in response.json()["max_concurrent_requests"][0]
    assert not Quota.objects.filter(team=world.team_a2).exists()
    assert not Quota.objects.filter(api_key=world.key_a1.api_key).exists()


def test_budgets_are_counted_over_the_ceilings_period_and_spent_in_its_currency(world, client_for):
    _ceilings(world.tenant_a, max_spend_budget=Decimal("100"), max_spend_currency="EUR")
    client = client_for(world.admin_a)
    url = f"/api/quotas/{world.quota_a1.pk}/"
    # A day's budget under a month's ceiling would allow thirty times the ceiling.
    response = client.patch(
        url, {"spend_budget": "90", "budget_period": "day", "currency": "EUR"}, format="json"
    )
    assert response.status_code == 400 and "per month" in response.json()["budget_period"][0]
    response = client.patch(url, {"spend_budget": "90", "currency": "USD"}, format="json")
    assert response.status_code == 400 and "in EUR" in response.json()["currency"][0]
    response = client.patch(url, {"spend_budget": "90", "currency": "EUR"}, format="json")
    assert response.status_code == 200, response.content


def test_another_tenants_ceilings_bind_nothing_here(world, client_for):
    _ceilings(world.tenant_a, max_requests_per_minute=10)
    response = client_for(world.admin_b).patch(
        f"/api/quotas/{world.quota_b1.pk}/", {"requests_per_minute": 5000}, format="json"
    )
    assert response.status_code == 200, response.content


def test_the_model_refuses_it_wherever_it_is_saved_from(world):
    """The admin's forms and the portal validate quotas with the model's own clean()."""
    _ceilings(world.tenant_a, max_output_tokens_per_minute=1000)
    world.quota_a1.refresh_from_db()
    world.quota_a1.output_tokens_per_minute = 5000
    with pytest.raises(ValidationError) as caught:
        world.quota_a1.full_clean()
    assert "at 1000" in caught.value.message_dict["output_tokens_per_minute"][0]


def test_only_operators_set_the_ceilings_and_tenant_admins_read_them(world, client_for):
    url = f"/api/tenants/{world.tenant_a.pk}/"
    response = client_for(world.admin_a).patch(url, {"max_spend_budget": "1000000"}, format="json")
    assert response.status_code == 403
    response = client_for(world.operator).patch(
        url, {"max_spend_budget": "500", "max_requests_per_minute": 120}, format="json"
    )
    assert response.status_code == 200, response.content
    body = client_for(world.admin_a).get(url).json()
    assert (body["max_spend_budget"], body["max_requests_per_minute"]) == ("500.0000", 120)
    assert (body["max_budget_period"], body["max_spend_currency"]) == ("month", "USD")
    response = client_for(world.operator).patch(url, {"max_requests_per_minute": 0}, format="json")
    assert response.status_code == 400 and "max_requests_per_minute" in response.json()


def test_the_router_counts_a_tenants_ceilings_over_all_its_teams_together(world):
    Quota.objects.filter(pk=world.quota_a1.pk).update(
        requests_per_minute=500, token_budget=None, budget_period="day"
    )
    _ceilings(
        world.tenant_a, max_requests_per_minute=100, max_token_budget=10_000, max_spend_budget=Decimal("5")
    )
    snapshot = load_snapshot()
    tenant = snapshot.tenant_quotas[world.tenant_a.pk]  # one scope for the tenant's teams and keys together
    assert (tenant.requests_per_minute, tenant.token_budget, tenant.spend_budget) == (
        100,
        10_000,
        Decimal("5"),
    )
    assert (tenant.input_tokens_per_minute, tenant.budget_period) == (None, "month")
    a1 = snapshot.team_quotas[world.team_a1.pk]  # a team's own quota stays as set: the tenant's bounds it
    assert (a1.requests_per_minute, a1.budget_period) == (500, "day")
    assert world.team_a2.pk not in snapshot.team_quotas  # no quota of its own: only the tenant's counts
    assert world.tenant_b.pk not in snapshot.tenant_quotas  # another tenant, no ceilings


# --- personal tokens and passwords ------------------------------------------------------------------------


def _works(token: str) -> bool:
    client = Client(headers={"Authorization": f"Bearer {token}"})
    return client.get("/api/teams/").status_code == 200


def test_a_password_change_revokes_every_personal_token(world):
    tokens = [personal_token_create(user=world.admin_a)[1] for _ in range(2)]
    other = personal_token_create(user=world.admin_b)[1]
    assert all(_works(token) for token in tokens)
    world.admin_a.set_password("a-brand-new-passphrase")
    world.admin_a.save()
    assert not any(_works(token) for token in tokens)
    assert not AuthToken.objects.filter(user=world.admin_a).exists()
    assert _works(other)  # someone else's stay


def test_a_password_changed_in_the_admin_revokes_them_too(world):
    world.operator.is_staff = world.operator.is_superuser = True
    world.operator.save()
    token = personal_token_create(user=world.member_a1)[1]
    client = Client()
    client.force_login(world.operator)
    response = client.post(
        f"/admin/auth/user/{world.member_a1.pk}/password/",
        {"password1": "another-long-passphrase-9", "password2": "another-long-passphrase-9"},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    assert not _works(token)


def test_saving_a_person_without_touching_the_password_keeps_their_tokens(world):
    token = personal_token_create(user=world.admin_a)[1]
    world.admin_a.email = "alice@example.com"
    world.admin_a.save()
    client = Client()
    client.force_login(world.admin_a)  # signing in saves last_login only
    assert _works(token)
