"""The team page's priority class, weight, allowed models and the tenant's aliases: who sees them, who changes
them, and that every change is validated and audited as through the API."""

from __future__ import annotations

import pytest
from django.test import Client

from serving.models import ModelDeployment
from tenants.models import AuditLog, ModelAlias, Team, Tenant


@pytest.fixture
def browser():
    def make(user) -> Client:
        client = Client()
        client.force_login(user)
        return client

    return make


@pytest.fixture
def coder(db) -> ModelDeployment:
    return ModelDeployment.objects.create(
        name="coder-v2", served_model_name="coder-v2", model_source="models/coder-v2", engine_kind="sim"
    )


def _page(client, team) -> str:
    response = client.get(f"/portal/teams/{team.pk}/")
    assert response.status_code == 200
    return response.content.decode()


def _between(page: str, start: str, end: str) -> str:
    at = page.index(start)
    return page[at : page.index(end, at)]


def test_the_team_page_shows_class_weight_models_and_the_tenants_aliases(world, browser, coder):
    ModelAlias.objects.create(tenant=world.tenant_a, name="coder", deployment=coder)
    ModelAlias.objects.create(tenant=world.tenant_b, name="b-only", deployment=coder)
    page = _page(browser(world.member_a1), world.team_a1)
    assert "every model served" in _between(page, 'id="team-models"', "</td>")
    assert "Standard" in _between(page, 'id="team-class"', "</td>")
    assert "1" in _between(page, 'id="team-weight"', "</td>")
    aliases = _between(page, 'id="aliases"', "</section>")
    assert "coder" in aliases and "b-only" not in aliases
    # A member reads, and is offered no form.
    assert 'id="team-settings-form"' not in page and 'id="alias-form"' not in page
    assert "Move</button>" not in aliases

    Team.objects.filter(pk=world.team_a1.pk).update(restrict_models=True, fair_share_weight=7)
    world.team_a1.deployments.set([world.deployment])
    page = _page(browser(world.member_a1), world.team_a1)
    assert "tiny-qwen" in _between(page, 'id="team-models"', "</td>")
    assert "7" in _between(page, 'id="team-weight"', "</td>")
    assert "this team may not call it" in _between(page, 'id="aliases"', "</section>")
    teams = browser(world.admin_a).get("/portal/teams/").content.decode()
    assert "tiny-qwen" in teams and "every model served" in teams  # team A1 restricted, A2 not


def test_a_tenant_admin_sets_class_weight_and_models(world, browser, coder):
    Tenant.objects.filter(pk=world.tenant_a.pk).update(max_priority_class="interactive")
    client = browser(world.admin_a)
    assert 'name="deployments"' in _page(client, world.team_a1)
    response = client.post(
        f"/portal/teams/{world.team_a1.pk}/settings/",
        {
            "priority_class": "interactive",
            "fair_share_weight": "3",
            "restrict_models": "on",
            "deployments": [coder.pk],
        },
    )
    assert response.status_code == 302
    team = Team.objects.get(pk=world.team_a1.pk)
    assert (team.priority_class, team.fair_share_weight, team.restrict_models) == ("interactive", 3, True)
    assert list(team.deployments.all()) == [coder]
    (row,) = AuditLog.objects.filter(action="team.update", source="portal")
    assert row.details["changes"]["deployments"] == [[], [coder.pk]]
    assert row.actor == world.admin_a and row.tenant_id == world.tenant_a.pk


def test_the_settings_form_offers_no_class_above_the_ceiling_and_refuses_one(world, browser):
    client = browser(world.admin_a)
    form = _between(_page(client, world.team_a1), 'id="team-settings-form"', "</form>")
    assert 'value="standard"' in form and 'value="interactive"' not in form
    assert "allows at most standard" in form
    response = client.post(
        f"/portal/teams/{world.team_a1.pk}/settings/",
        {"priority_class": "interactive", "fair_share_weight": "1"},
    )
    assert response.status_code == 400
    assert Team.objects.get(pk=world.team_a1.pk).priority_class == "standard"


@pytest.mark.parametrize("weight", ["0", "1001", "two"])
def test_a_weight_outside_1_to_1000_is_refused(world, browser, weight):
    response = browser(world.admin_a).post(
        f"/portal/teams/{world.team_a1.pk}/settings/",
        {"priority_class": "batch", "fair_share_weight": weight},
    )
    assert response.status_code == 400
    assert Team.objects.get(pk=world.team_a1.pk).priority_class == "standard"


def test_a_team_admin_changes_only_the_teams_class(world, browser, coder):
    client = browser(world.team_admin_a1)
    form = _between(_page(client, world.team_a1), 'id="team-settings-form"', "</form>")
    assert 'name="priority_class"' in form and 'name="fair_share_weight"' not in form
    response = client.post(
        f"/portal/teams/{world.team_a1.pk}/settings/",
        {
            "priority_class": "batch",
            "fair_share_weight": "9",
            "restrict_models": "on",
            "deployments": [coder.pk],
        },
    )
    assert response.status_code == 302
    team = Team.objects.get(pk=world.team_a1.pk)
    assert (team.priority_class, team.fair_share_weight, team.restrict_models) == ("batch", 1, False)
    assert not team.deployments.exists()


@pytest.mark.parametrize(("actor", "status"), [("member_a1", 403), ("admin_b", 404)])
def test_others_cannot_change_a_teams_settings(world, browser, actor, status):
    response = browser(getattr(world, actor)).post(
        f"/portal/teams/{world.team_a1.pk}/settings/", {"priority_class": "batch", "fair_share_weight": "2"}
    )
    assert response.status_code == status
    assert Team.objects.get(pk=world.team_a1.pk).priority_class == "standard"


def test_a_tenant_admin_adds_moves_and_deletes_an_alias(world, browser, coder):
    client = browser(world.admin_a)
    base = f"/portal/teams/{world.team_a1.pk}/aliases/"
    response = client.post(base, {"name": "coder", "deployment": world.deployment.pk})
    assert response.status_code == 302
    alias = ModelAlias.objects.get(tenant=world.tenant_a, name="coder")
    assert alias.deployment == world.deployment
    assert client.post(f"{base}{alias.pk}/", {"deployment": coder.pk}).status_code == 302
    alias.refresh_from_db()
    assert alias.deployment == coder
    assert "coder-v2" in _between(_page(client, world.team_a2), 'id="aliases"', "</section>")  # tenant-wide
    assert client.post(f"{base}{alias.pk}/delete/").status_code == 302
    assert not ModelAlias.objects.filter(pk=alias.pk).exists()
    actions = list(
        AuditLog.objects.filter(target_type="tenants.modelalias", source="portal")
        .order_by("id")
        .values_list("action", flat=True)
    )
    assert actions == ["model_alias.create", "model_alias.update", "model_alias.delete"]


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("tiny-qwen", "is a served model&#x27;s name"),
        ("taken", "already has an alias"),
        ("a b", "Use letters"),
    ],
)
def test_an_alias_that_cannot_be_is_refused_with_why(world, browser, name, says):
    ModelAlias.objects.create(tenant=world.tenant_a, name="taken", deployment=world.deployment)
    response = browser(world.admin_a).post(
        f"/portal/teams/{world.team_a1.pk}/aliases/", {"name": name, "deployment": world.deployment.pk}
    )
    assert response.status_code == 400
    assert says in response.content.decode()
    assert ModelAlias.objects.count() == 1


def test_only_tenant_admins_manage_aliases(world, browser, coder):
    alias = ModelAlias.objects.create(tenant=world.tenant_a, name="coder", deployment=world.deployment)
    base = f"/portal/teams/{world.team_a1.pk}/aliases/"
    for actor, status in (("team_admin_a1", 403), ("member_a1", 403), ("admin_b", 404)):
        client = browser(getattr(world, actor))
        assert client.post(base, {"name": "x", "deployment": coder.pk}).status_code == status
        assert client.post(f"{base}{alias.pk}/", {"deployment": coder.pk}).status_code == status
        assert client.post(f"{base}{alias.pk}/delete/").status_code == status
    # Tenant B's admin cannot reach A's alias through B's own team either.
    b_base = f"/portal/teams/{world.team_b1.pk}/aliases/"
    client = browser(world.admin_b)
    assert client.post(f"{b_base}{alias.pk}/", {"deployment": coder.pk}).status_code == 404
    assert client.post(f"{b_base}{alias.pk}/delete/").status_code == 404
    alias.refresh_from_db()
    assert alias.deployment == world.deployment and ModelAlias.objects.count() == 1


def test_the_keys_table_shows_each_keys_class_and_models(world, browser, coder):
    api_key = world.key_a1.api_key
    api_key.priority_class = "batch"
    api_key.save()
    api_key.deployments.set([coder])
    keys = _between(_page(browser(world.member_a1), world.team_a1), 'id="keys"', "</table>")
    assert "Batch" in keys and "coder-v2" in keys
