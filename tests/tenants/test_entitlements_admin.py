"""The Django admin for issue 21's settings: every page renders, changes are validated as in the API and
audited with the deployments a team or key may call."""

from __future__ import annotations

import pytest
from django.test import Client

from tenants.models import ApiKey, AuditLog, ModelAlias, Team, Tenant


@pytest.fixture
def admin_client(world):
    world.operator.is_staff = True
    world.operator.is_superuser = True
    world.operator.save()
    client = Client()
    client.force_login(world.operator)
    return client


def _team_form(team: Team, **changes) -> dict:
    return {
        "tenant": team.tenant_id,
        "name": team.name,
        "slug": team.slug,
        "priority_class": team.priority_class,
        "fair_share_weight": team.fair_share_weight,
        **changes,
    }


def test_every_page_renders(world, admin_client):
    alias = ModelAlias.objects.create(tenant=world.tenant_a, name="coder", deployment=world.deployment)
    pages = {
        "/admin/tenants/tenant/": ["Highest priority class", "Fair share weight"],
        f"/admin/tenants/tenant/{world.tenant_a.pk}/change/": ["Priority and fair share"],
        "/admin/tenants/team/": ["every model served"],
        f"/admin/tenants/team/{world.team_a1.pk}/change/": [
            "Models it may call",
            "may call every model served",
        ],
        "/admin/tenants/apikey/add/": ["Priority class", "among its team"],
        f"/admin/tenants/apikey/{world.key_a1.api_key.pk}/change/": ["Priority class"],
        "/admin/tenants/modelalias/": ["coder"],
        "/admin/tenants/modelalias/add/": ["Deployment"],
        f"/admin/tenants/modelalias/{alias.pk}/change/": ["coder"],
        "/admin/tenants/usagerecord/": ["Priority class", "Queued ms"],
        "/admin/routing/routingpolicy/": ["Flow control"],
        f"/admin/routing/routingpolicy/{world.policy.pk}/change/": [
            "Flow control",
            "saturation_kv_utilization",
            "max_wait_batch_s",
            "prefix_weight",
        ],
    }
    for url, texts in pages.items():
        response = admin_client.get(url)
        assert response.status_code == 200, url
        page = response.content.decode()
        for text in texts:
            assert text in page, (url, text)


def test_the_flow_control_fields_have_a_fieldset_of_their_own(world, admin_client):
    from routing.models import policy_fields

    page = admin_client.get(f"/admin/routing/routingpolicy/{world.policy.pk}/change/").content.decode()
    start = page.index(">Flow control<")
    fieldset = page[start : page.index("</fieldset>", start)]
    flow = {"flow_control", "saturation_waiting_per_engine", "saturation_kv_utilization"}
    flow |= {"saturation_prefill_tokens_per_engine", "max_wait_interactive_s", "max_wait_standard_s"}
    flow |= {"max_wait_batch_s", "saturation_spare_slots_per_engine"}
    for field in policy_fields():
        assert f'name="{field.name}"' in page, field.name  # every field the router reads is editable
        assert (f'name="{field.name}"' in fieldset) == (field.name in flow), field.name


def test_a_team_restricted_in_the_admin_is_audited_with_its_models(world, admin_client):
    team = world.team_a1
    response = admin_client.post(
        f"/admin/tenants/team/{team.pk}/change/",
        _team_form(team, restrict_models="on", deployments=[world.deployment.pk], fair_share_weight=4),
    )
    assert response.status_code == 302, response.content[:2000]
    team.refresh_from_db()
    assert team.restrict_models and list(team.deployments.all()) == [world.deployment]
    (row,) = AuditLog.objects.filter(action="team.update", source="admin")
    assert row.details["changes"]["deployments"] == [[], [world.deployment.pk]]
    assert row.details["changes"]["fair_share_weight"] == [1, 4]


def test_the_admin_refuses_a_class_above_the_tenants_ceiling(world, admin_client):
    response = admin_client.post(
        f"/admin/tenants/team/{world.team_a1.pk}/change/",
        _team_form(world.team_a1, priority_class="interactive"),
    )
    assert response.status_code == 200
    assert "The tenant allows at most `standard`" in response.content.decode()
    assert Team.objects.get(pk=world.team_a1.pk).priority_class == "standard"
    Tenant.objects.filter(pk=world.tenant_a.pk).update(max_priority_class="interactive")
    response = admin_client.post(
        f"/admin/tenants/team/{world.team_a1.pk}/change/",
        _team_form(world.team_a1, priority_class="interactive"),
    )
    assert response.status_code == 302


def test_an_admin_made_key_gets_its_class_and_models_and_stays_within_its_team(world, admin_client):
    from serving.models import ModelDeployment

    other = ModelDeployment.objects.create(
        name="coder-v2", served_model_name="coder-v2", model_source="models/coder-v2", engine_kind="sim"
    )
    Team.objects.filter(pk=world.team_a1.pk).update(restrict_models=True)
    world.team_a1.deployments.set([world.deployment])
    body = {"team": world.team_a1.pk, "name": "narrow", "scopes": ["inference"], "priority_class": "batch"}
    response = admin_client.post("/admin/tenants/apikey/add/", {**body, "deployments": [other.pk]})
    assert response.status_code == 200
    assert "may not call coder-v2" in response.content.decode()
    assert not ApiKey.objects.filter(name="narrow").exists()
    response = admin_client.post("/admin/tenants/apikey/add/", {**body, "deployments": [world.deployment.pk]})
    assert response.status_code == 200 and 'id="issued-api-key"' in response.content.decode()
    key = ApiKey.objects.get(name="narrow")
    assert key.priority_class == "batch" and list(key.deployments.all()) == [world.deployment]
    (row,) = AuditLog.objects.filter(action="api_key.create", target_id=str(key.pk))
    assert row.details["after"]["deployments"] == [world.deployment.pk]


def test_the_admin_manages_aliases_and_refuses_a_served_models_name(world, admin_client):
    body = {"tenant": world.tenant_a.pk, "deployment": world.deployment.pk}
    response = admin_client.post("/admin/tenants/modelalias/add/", {**body, "name": "tiny-qwen"})
    assert response.status_code == 200 and "is a served model&#x27;s name" in response.content.decode()
    response = admin_client.post("/admin/tenants/modelalias/add/", {**body, "name": "coder"})
    assert response.status_code == 302
    alias = ModelAlias.objects.get(name="coder")
    assert AuditLog.objects.filter(
        action="model_alias.create", target_id=str(alias.pk), source="admin"
    ).exists()
