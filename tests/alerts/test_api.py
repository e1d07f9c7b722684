"""The alerts API: a tenant's admins manage their tenant's destinations and budget rules, operators everything;
anyone else finds nothing. Every change is audited, never with the signing secret."""

from __future__ import annotations

from alerts.evaluate import rule_evaluate
from alerts.models import AlertKind, AlertRule, Destination
from serving.models import ObservedStatus
from tenants.models import AuditLog

from .conftest import rule_with

HOOK = {"name": "slack", "kind": "webhook", "url": "https://hooks.example.com/services/T0/B0/x"}


def test_it_lets_a_tenant_admin_add_a_destination_and_a_budget_rule(world, client_for):
    client = client_for(world.admin_a)
    response = client.post("/api/alert-destinations/", {**HOOK, "tenant": world.tenant_a.pk})
    assert response.status_code == 201, response.json()
    destination = response.json()
    assert destination["signing_secret"].startswith("whsec_")
    audit = AuditLog.objects.get(action="alert_destination.create")
    assert "signing_secret" not in audit.details["after"] and audit.tenant_id == world.tenant_a.pk

    response = client.post(
        "/api/alert-rules/",
        {
            "kind": "budget",
            "tenant": world.tenant_a.pk,
            "team": world.team_a1.pk,
            "percentages": [80, 100],
            "destinations": [destination["id"]],
        },
    )
    assert response.status_code == 201, response.json()
    assert AlertRule.objects.get(pk=response.json()["id"]).destinations.get().pk == destination["id"]
    assert AuditLog.objects.get(action="alert_rule.create").details["after"]["destinations"] == [
        destination["id"]
    ]

    rotated = client.post(f"/api/alert-destinations/{destination['id']}/rotate-secret/").json()
    assert rotated["signing_secret"] != destination["signing_secret"]
    assert AuditLog.objects.filter(action="alert_destination.rotate_secret").count() == 1


def test_it_refuses_what_a_tenant_admin_may_not_name(world, client_for, webhook_to):
    client = client_for(world.admin_a)
    platform = webhook_to()
    other = Destination.objects.create(tenant=world.tenant_b, **HOOK)
    assert client.post("/api/alert-destinations/", HOOK).status_code == 400  # no tenant: the platform's
    assert client.post("/api/alert-destinations/", {**HOOK, "tenant": world.tenant_b.pk}).status_code == 400
    own = Destination.objects.create(tenant=world.tenant_a, **HOOK)
    for body in (
        {"kind": "deployment_health", "tenant": world.tenant_a.pk, "destinations": [own.pk]},
        {"kind": "budget", "tenant": world.tenant_a.pk, "destinations": [platform.pk]},
        {"kind": "budget", "tenant": world.tenant_a.pk, "destinations": [other.pk]},
        {"kind": "budget", "tenant": world.tenant_a.pk, "team": world.team_b1.pk, "destinations": [own.pk]},
        {"kind": "budget", "tenant": world.tenant_a.pk, "percentages": [], "destinations": [own.pk]},
        {"kind": "budget", "destinations": [own.pk]},
    ):
        response = client.post("/api/alert-rules/", body)
        assert response.status_code == 400, (body, response.json())
    assert not AlertRule.objects.exists()


def test_others_find_nothing_and_change_nothing(world, client_for):
    destination = Destination.objects.create(tenant=world.tenant_a, **HOOK)
    rule = rule_with(destination, kind=AlertKind.BUDGET, tenant=world.tenant_a)
    for user in (world.admin_b, world.member_a1, world.team_admin_a1):
        client = client_for(user)
        assert client.get("/api/alert-destinations/").json()["results"] == []
        assert client.get(f"/api/alert-destinations/{destination.pk}/").status_code == 404
        assert client.patch(f"/api/alert-rules/{rule.pk}/", {"is_active": False}).status_code == 404
        assert client.get("/api/alerts/").json()["results"] == []
    assert client_for(world.member_a1).post("/api/alert-destinations/", HOOK).status_code == 403


def test_operators_keep_health_rules_and_see_their_deliveries(world, client_for, receiver, webhook_to):
    operator = client_for(world.operator)
    platform = webhook_to()
    response = operator.post(
        "/api/alert-rules/",
        {"kind": "deployment_health", "deployment": world.deployment.pk, "destinations": [platform.pk]},
    )
    assert response.status_code == 201, response.json()
    world.deployment.observed_status = ObservedStatus.DEGRADED
    world.deployment.save()
    rule_evaluate(rule_id=response.json()["id"])

    (alert,) = operator.get("/api/alerts/", {"firing": "true"}).json()["results"]
    assert alert["kind"] == "deployment_health" and alert["summary"] == "Deployment tiny is degraded"
    (delivery,) = operator.get("/api/alert-deliveries/").json()["results"]
    assert (delivery["alert"], delivery["status"], delivery["event"]) == (alert["id"], "pending", "firing")
    # A tenant admin sees none of the platform's.
    admin = client_for(world.admin_a)
    assert admin.get("/api/alerts/").json()["results"] == []
    assert admin.get("/api/alert-deliveries/").json()["results"] == []
    assert admin.get(f"/api/alert-rules/{response.json()['id']}/").status_code == 404
