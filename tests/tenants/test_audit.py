"""Every state change through the API or the admin writes exactly one audit row, in the same transaction."""

import pytest
from django.test import Client

from tenants.models import ApiKey, AuditLog, Quota, Team


def audit_rows_during(fn):
    before = set(AuditLog.objects.values_list("id", flat=True))
    result = fn()
    return result, list(AuditLog.objects.exclude(id__in=before))


@pytest.mark.parametrize(
    "method, route, payload, action",
    [
        ("post", "/api/tenants/", {"name": "Cobalt", "slug": "cobalt"}, "tenant.create"),
        ("patch", "/api/tenants/{tenant_a}/", {"name": "Acme Corp"}, "tenant.update"),
        ("post", "/api/teams/", {"tenant": "{tenant_a}", "name": "Ops", "slug": "ops"}, "team.create"),
        ("patch", "/api/teams/{team_a2}/", {"name": "R&D"}, "team.update"),
        ("delete", "/api/teams/{team_empty}/", None, "team.delete"),
        ("post", "/api/keys/", {"team": "{team_a1}", "name": "bot"}, "api_key.create"),
        ("patch", "/api/keys/{key_a1}/", {"name": "renamed"}, "api_key.update"),
        ("post", "/api/keys/{key_a1}/revoke/", None, "api_key.revoke"),
        ("patch", "/api/quotas/{quota_a1}/", {"requests_per_minute": 120}, "quota.update"),
        ("delete", "/api/quotas/{quota_a1}/", None, "quota.delete"),
        (
            "post",
            "/api/memberships/",
            {"user": "bob", "role": "member", "team": "{team_a2}"},
            "membership.create",
        ),
        ("patch", "/api/price-sheets/{price_list}/", {"output_per_mtok": "2.000000"}, "price_sheet.update"),
        ("patch", "/api/deployments/{deployment}/", {"max_model_len": 8192}, "deployment.update"),
        ("patch", "/api/routing-policies/{policy}/", {"mode": "least_loaded"}, "routing_policy.update"),
    ],
)
def test_it_writes_one_audit_row_per_api_change(world, client_for, method, route, payload, action):
    ids = {
        "tenant_a": world.tenant_a.pk,
        "team_a1": world.team_a1.pk,
        "team_a2": world.team_a2.pk,
        "team_empty": Team.objects.create(tenant=world.tenant_a, name="Empty", slug="empty").pk,
        "key_a1": world.key_a1.api_key.pk,
        "quota_a1": world.quota_a1.pk,
        "price_list": world.price_list.pk,
        "deployment": world.deployment.pk,
        "policy": world.policy.pk,
    }
    route = route.format(**ids)
    if payload:
        payload = {
            k: (int(v.format(**ids)) if isinstance(v, str) and v.startswith("{") else v)
            for k, v in payload.items()
        }
    client = client_for(world.operator)
    response, rows = audit_rows_during(lambda: getattr(client, method)(route, payload, format="json"))
    assert response.status_code in (200, 201, 204), response.content
    assert [row.action for row in rows] == [action]
    row = rows[0]
    assert row.actor == world.operator and row.source == "api" and row.details
    for issued in (world.key_a1, world.key_a2, world.key_b1):
        assert issued.secret.split("_", 2)[2] not in str(row.details)
    assert "secret_hmac" not in str(row.details)


def test_it_writes_no_audit_row_when_a_change_is_refused(world, client_for):
    response, rows = audit_rows_during(
        lambda: client_for(world.operator).post(
            "/api/teams/", {"tenant": world.tenant_a.pk, "name": "x", "slug": "agents"}, format="json"
        )
    )
    assert response.status_code == 400
    assert rows == []


def test_it_writes_no_audit_row_for_an_update_that_changes_nothing(world, client_for):
    response, rows = audit_rows_during(
        lambda: client_for(world.operator).patch(
            f"/api/teams/{world.team_a1.pk}/", {"name": "Agents"}, format="json"
        )
    )
    assert response.status_code == 200 and rows == []


def test_it_records_the_tenant_of_the_changed_object(world, client_for):
    _, rows = audit_rows_during(
        lambda: client_for(world.admin_a).patch(
            f"/api/keys/{world.key_a1.api_key.pk}/", {"name": "n"}, format="json"
        )
    )
    assert [row.tenant_id for row in rows] == [world.tenant_a.pk]


@pytest.fixture
def admin_client(world):
    world.operator.is_staff = True
    world.operator.is_superuser = True
    world.operator.save()
    client = Client()
    client.force_login(world.operator)
    return client


def test_it_shows_an_admin_created_key_once_and_audits_it_once(world, admin_client):
    response, rows = audit_rows_during(
        lambda: admin_client.post(
            "/admin/tenants/apikey/add/",
            {"team": world.team_a1.pk, "name": "admin-made", "scopes": ["inference"]},
        )
    )
    assert response.status_code == 200, response.content[:2000]
    page = response.content.decode()
    key = ApiKey.objects.get(name="admin-made")
    assert 'id="issued-api-key"' in page
    secret = page.split('id="issued-api-key"')[1].split('value="')[1].split('"')[0]
    assert secret.startswith(key.prefix + "_")
    assert "no-store" in response["Cache-Control"]
    assert [row.action for row in rows] == ["api_key.create"]
    for url in (f"/admin/tenants/apikey/{key.pk}/change/", "/admin/tenants/apikey/"):
        again = admin_client.get(url)
        assert again.status_code == 200 and secret not in again.content.decode()


def test_it_revokes_keys_from_the_admin_in_one_action(world, admin_client):
    keys = [world.key_a1.api_key.pk, world.key_a2.api_key.pk]
    response, rows = audit_rows_during(
        lambda: admin_client.post(
            "/admin/tenants/apikey/", {"action": "revoke_keys", "_selected_action": keys}, follow=True
        )
    )
    assert response.status_code == 200
    assert sorted(row.action for row in rows) == ["api_key.revoke", "api_key.revoke"]
    assert ApiKey.objects.filter(pk__in=keys, revoked_at__isnull=False).count() == 2


def test_it_audits_admin_changes_and_deletions_once(world, admin_client):
    team = world.team_a2
    url = f"/admin/tenants/team/{team.pk}/change/"
    response, rows = audit_rows_during(
        lambda: admin_client.post(
            url,
            {
                "tenant": world.tenant_a.pk,
                "name": "Renamed",
                "slug": team.slug,
                "priority_class": team.priority_class,
                "fair_share_weight": team.fair_share_weight,
            },
        )
    )
    assert response.status_code == 302, response.content[:3000]
    assert [row.action for row in rows] == ["team.update"]
    assert rows[0].details["changes"]["name"] == ["Research", "Renamed"]
    assert rows[0].source == "admin"

    quota_url = f"/admin/tenants/quota/{world.quota_a1.pk}/delete/"
    response, rows = audit_rows_during(lambda: admin_client.post(quota_url, {"post": "yes"}))
    assert response.status_code == 302
    assert [row.action for row in rows] == ["quota.delete"]


def test_the_rows_the_platform_writes_are_read_in_the_admin_never_added_or_deleted(world, admin_client):
    for model in ("tenants/usagerecord", "tenants/auditlog", "serving/endpoint", "serving/scalingevent"):
        assert admin_client.get(f"/admin/{model}/").status_code == 200, model
        assert admin_client.get(f"/admin/{model}/add/").status_code == 403, model
    row = AuditLog.objects.first()
    response = admin_client.post(f"/admin/tenants/auditlog/{row.pk}/delete/", {"post": "yes"})
    assert response.status_code == 403 and AuditLog.objects.filter(pk=row.pk).exists()


def test_it_audits_each_row_of_a_bulk_deletion_in_the_admin(world, admin_client):
    quotas = [world.quota_a1.pk, world.quota_b1.pk]
    form = {"action": "delete_selected", "_selected_action": quotas, "post": "yes"}
    response, rows = audit_rows_during(lambda: admin_client.post("/admin/tenants/quota/", form))
    assert response.status_code == 302
    assert sorted(row.action for row in rows) == ["quota.delete", "quota.delete"]
    assert not Quota.objects.filter(pk__in=quotas).exists()
