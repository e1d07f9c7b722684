"""What one tenant's alerts may cost everyone: a bounded number of rules, destinations and percentages (a 400 past
them, from the API and the portal), and a pass over every rule that reads the ledger once per tenant and period,
with a few queries per rule whatever its conditions."""

from __future__ import annotations

from decimal import Decimal

from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext

from alerts import tasks
from alerts.models import AlertKind, AlertRule, BudgetScope, Destination
from tenants.models import UsageRecord
from tests.conftest import make_usage

from .conftest import rule_with

HOOK = {"kind": "webhook", "url": "https://hooks.example.com/services/T0/B0/x"}
MODEL_BACKEND = "django.contrib.auth.backends.ModelBackend"


def test_a_tenant_has_at_most_its_destinations_and_rules(world, client_for, settings):
    settings.ALERT_MAX_DESTINATIONS_PER_TENANT = 2
    settings.ALERT_MAX_RULES_PER_TENANT = 2
    client = client_for(world.admin_a)
    ids = [
        client.post(
            "/api/alert-destinations/", {**HOOK, "name": f"d{n}", "tenant": world.tenant_a.pk}
        ).json()["id"]
        for n in range(2)
    ]
    response = client.post("/api/alert-destinations/", {**HOOK, "name": "d2", "tenant": world.tenant_a.pk})
    assert response.status_code == 400
    assert "ALERT_MAX_DESTINATIONS_PER_TENANT" in response.json()["non_field_errors"][0]

    rule = {"kind": "budget", "tenant": world.tenant_a.pk, "percentages": [80], "destinations": ids}
    for _ in range(2):
        assert client.post("/api/alert-rules/", rule).status_code == 201
    response = client.post("/api/alert-rules/", rule)
    assert response.status_code == 400
    assert "ALERT_MAX_RULES_PER_TENANT" in response.json()["non_field_errors"][0]
    assert AlertRule.objects.count() == 2 and Destination.objects.count() == 2
    # A rule still changes; another tenant, and the operators' own, are not counted.
    existing = AlertRule.objects.first()
    assert client.patch(f"/api/alert-rules/{existing.pk}/", {"percentages": [90]}).status_code == 200
    other = {**HOOK, "name": "theirs", "tenant": world.tenant_b.pk}
    assert client_for(world.admin_b).post("/api/alert-destinations/", other).status_code == 201
    operator = client_for(world.operator)
    for n in range(3):
        assert operator.post("/api/alert-destinations/", {**HOOK, "name": f"p{n}"}).status_code == 201


def test_the_portal_refuses_a_rule_past_the_limit(world, client, settings):
    settings.ALERT_MAX_RULES_PER_TENANT = 1
    destination = Destination.objects.create(tenant=world.tenant_a, name="ours", **HOOK)
    rule_with(destination, kind=AlertKind.BUDGET, tenant=world.tenant_a)
    client.force_login(world.admin_a, backend=MODEL_BACKEND)
    response = client.post(
        "/portal/alerts/rules/",
        {"kind": "budget", "tenant": world.tenant_a.pk, "budget_scope": "team", "percentages": "90",
         "window_minutes": 15, "for_minutes": 0, "destinations": [destination.pk]},
    )  # fmt: skip
    assert response.status_code == 400
    assert "ALERT_MAX_RULES_PER_TENANT" in response.content.decode()
    assert AlertRule.objects.count() == 1


def test_the_admin_refuses_a_destination_past_the_limit(world, client, settings):
    settings.ALERT_MAX_DESTINATIONS_PER_TENANT = 1
    Destination.objects.create(tenant=world.tenant_a, name="ours", **HOOK)
    root = get_user_model().objects.create_superuser("root", "root@example.com", "pw-root-long-enough")
    client.force_login(root, backend=MODEL_BACKEND)
    response = client.post(
        "/admin/alerts/destination/add/",
        {"tenant": world.tenant_a.pk, "name": "more", "emails": "", "is_active": "on", **HOOK},
    )
    assert response.status_code == 200  # the form again, with the error
    assert "ALERT_MAX_DESTINATIONS_PER_TENANT" in response.content.decode()
    assert Destination.objects.count() == 1


def test_a_rule_has_at_most_ten_percentages(world, client_for):
    client = client_for(world.admin_a)
    destination = Destination.objects.create(tenant=world.tenant_a, name="ours", **HOOK)
    body = {"kind": "budget", "tenant": world.tenant_a.pk, "destinations": [destination.pk]}
    response = client.post("/api/alert-rules/", {**body, "percentages": list(range(1, 12))})
    assert response.status_code == 400
    assert response.json()["percentages"] == ["Give at most 10 percentages, such as 50, 80, 100."]
    assert client.post("/api/alert-rules/", {**body, "percentages": list(range(1, 11))}).status_code == 201


def _rules(world, destination, count: int) -> None:
    """Budget rules of every shape on tenant a's budgets, ten percentages each, some of them crossed."""
    shapes = [
        {"tenant": world.tenant_a, "team": world.team_a1},
        {"tenant": world.tenant_a},
        {"tenant": world.tenant_a, "budget_scope": BudgetScope.TENANT},
        {"budget_scope": BudgetScope.TENANT},
        {},
    ]
    for n in range(count):
        owner = shapes[n % len(shapes)]
        rule = AlertRule.objects.create(kind=AlertKind.BUDGET, percentages=list(range(10, 101, 10)), **owner)
        rule.destinations.set([destination] if owner.get("tenant") else [])


def _pass() -> tuple[int, int]:
    """Queries of one pass over every rule: all of them, and those reading the ledger."""
    with CaptureQueriesContext(connection) as pass_queries:
        tasks.evaluate_alerts()
    ledger = [q for q in pass_queries.captured_queries if UsageRecord._meta.db_table in q["sql"]]
    return len(pass_queries), len(ledger)


def test_a_pass_reads_the_ledger_once_per_budget_and_a_few_queries_per_rule(world):
    world.quota_a1.spend_budget, world.quota_a1.token_budget = Decimal("0.001"), 10_000
    world.quota_a1.save()
    world.tenant_a.max_spend_budget = Decimal("0.01")
    world.tenant_a.save()
    make_usage(world.key_a1, "spend", cost=Decimal("0.0004"))
    destination = Destination.objects.create(tenant=world.tenant_a, name="ours", **HOOK)

    _rules(world, destination, 10)
    assert tasks.evaluate_alerts() > 0  # crossings told: 50 % of the team's spend, ...
    few, few_ledger = _pass()
    _rules(world, destination, 30)
    tasks.evaluate_alerts()  # the new rules' first pass
    many, many_ledger = _pass()

    assert many_ledger == few_ledger <= 4  # the team's and the tenant's usage, once each
    assert (many - few) / 30 <= 6, f"{few} queries for 10 rules, {many} for 40"
