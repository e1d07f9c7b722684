"""The portal's alerts page: operators and tenant admins add destinations and rules; others are refused."""

from __future__ import annotations

from alerts.models import AlertKind, AlertRule, Destination
from tenants.models import AuditLog

from .conftest import rule_with

MODEL_BACKEND = "django.contrib.auth.backends.ModelBackend"


def test_a_tenant_admin_adds_a_destination_and_a_rule(world, client):
    client.force_login(world.admin_a, backend=MODEL_BACKEND)
    response = client.post(
        "/portal/alerts/destinations/",
        {
            "tenant": world.tenant_a.pk,
            "name": "finance",
            "kind": "email",
            "emails": "a@acme.example, b@acme.example",
        },
    )
    assert response.status_code == 302
    destination = Destination.objects.get(name="finance")
    assert destination.emails == ["a@acme.example", "b@acme.example"]
    response = client.post(
        "/portal/alerts/rules/",
        {
            "kind": "budget",
            "tenant": world.tenant_a.pk,
            "budget_scope": "team",
            "percentages": "50, 90",
            "window_minutes": 15,
            "for_minutes": 0,
            "destinations": [destination.pk],
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    rule = AlertRule.objects.get()
    assert (rule.tenant_id, rule.percentages) == (world.tenant_a.pk, [50, 90])
    assert AuditLog.objects.filter(action="alert_rule.create", source="portal").exists()

    page = client.get("/portal/alerts/").content.decode()
    assert "finance" in page and "Each team&#x27;s budget" in page
    # A health rule is the operators': a tenant admin is not offered it, nor given it.
    assert "deployment_health" not in page
    response = client.post(
        "/portal/alerts/rules/",
        {"kind": "deployment_health", "tenant": world.tenant_a.pk, "budget_scope": "team", "window_minutes": 15,
         "for_minutes": 0, "destinations": [destination.pk]},
    )  # fmt: skip
    assert response.status_code == 400 and AlertRule.objects.count() == 1


def test_a_tenant_admin_sees_and_deletes_only_their_own(world, client):
    own = Destination.objects.create(
        tenant=world.tenant_a, name="ours", kind="webhook", url="https://a.example/h"
    )
    theirs = Destination.objects.create(
        tenant=world.tenant_b, name="theirs", kind="webhook", url="https://b.example/h"
    )
    rule = rule_with(own, kind=AlertKind.BUDGET, tenant=world.tenant_a)
    client.force_login(world.admin_a, backend=MODEL_BACKEND)
    page = client.get("/portal/alerts/").content.decode()
    assert "ours" in page and "theirs" not in page and own.signing_secret in page
    assert client.post(f"/portal/alerts/destinations/{theirs.pk}/delete/").status_code == 404
    assert client.post(f"/portal/alerts/destinations/{own.pk}/delete/").status_code == 302
    assert not Destination.objects.filter(pk=own.pk).exists()
    assert not rule.destinations.exists()  # the rule stays, sending nowhere until given a destination
    assert "nowhere" in client.get("/portal/alerts/").content.decode()


def test_members_are_refused_and_operators_see_everything(world, client):
    Destination.objects.create(
        tenant=world.tenant_b, name="theirs", kind="webhook", url="https://b.example/h"
    )
    client.force_login(world.member_a1, backend=MODEL_BACKEND)
    assert client.get("/portal/alerts/").status_code == 403
    client.force_login(world.operator, backend=MODEL_BACKEND)
    page = client.get("/portal/alerts/").content.decode()
    assert "theirs" in page and "Engine crash-looping" in page
