"""Entitlements, priority classes, fair-share weights and model aliases through the REST API: what each field
accepts, the 400s that say what to fix, and the audit rows. Who may write what is in test_api_permissions.py."""

from __future__ import annotations

import pytest

from routing.models import RoutingPolicy
from routing.snapshot import load_snapshot
from serving.models import ModelDeployment
from tenants.models import ApiKey, AuditLog, ModelAlias, PriorityClass, Team, Tenant

from ..conftest import make_usage


@pytest.fixture
def other_deployment(db) -> ModelDeployment:
    return ModelDeployment.objects.create(
        name="coder-v2", served_model_name="coder-v2", model_source="models/coder-v2", engine_kind="sim"
    )


def _ceiling(tenant: Tenant, value: str) -> None:
    Tenant.objects.filter(pk=tenant.pk).update(max_priority_class=value)


# --- teams ------------------------------------------------------------------------------------------------


def test_a_tenant_admin_sets_a_teams_class_weight_and_models(world, client_for, other_deployment):
    _ceiling(world.tenant_a, PriorityClass.INTERACTIVE)
    body = {
        "priority_class": "interactive",
        "fair_share_weight": 3,
        "restrict_models": True,
        "deployments": [other_deployment.pk],
    }
    response = client_for(world.admin_a).patch(f"/api/teams/{world.team_a1.pk}/", body, format="json")
    assert response.status_code == 200, response.content
    assert {k: response.json()[k] for k in body} == body
    team = Team.objects.get(pk=world.team_a1.pk)
    assert (team.priority_class, team.fair_share_weight, team.restrict_models) == ("interactive", 3, True)
    assert list(team.deployments.all()) == [other_deployment]
    row = AuditLog.objects.filter(action="team.update", target_id=str(team.pk)).get()
    assert row.details["changes"]["deployments"] == [[], [other_deployment.pk]]
    assert row.details["changes"]["fair_share_weight"] == [1, 3]
    assert row.source == "api" and row.actor == world.admin_a


def test_a_team_reads_as_unrestricted_by_default(world, client_for):
    body = client_for(world.member_a1).get(f"/api/teams/{world.team_a1.pk}/").json()
    assert body["restrict_models"] is False and body["deployments"] == []
    assert (body["priority_class"], body["fair_share_weight"]) == ("standard", 1)


@pytest.mark.parametrize("actor", ["operator", "admin_a", "team_admin_a1"])
def test_a_class_above_the_tenants_ceiling_is_a_400_naming_it(world, client_for, actor):
    # The ceiling is standard by default.
    response = client_for(getattr(world, actor)).patch(
        f"/api/teams/{world.team_a1.pk}/", {"priority_class": "interactive"}, format="json"
    )
    assert response.status_code == 400
    assert "at most `standard`" in response.json()["priority_class"][0]
    assert Team.objects.get(pk=world.team_a1.pk).priority_class == "standard"


def test_a_new_team_cannot_start_above_the_ceiling_either(world, client_for):
    response = client_for(world.admin_a).post(
        "/api/teams/",
        {"tenant": world.tenant_a.pk, "name": "Ops", "slug": "ops", "priority_class": "interactive"},
        format="json",
    )
    assert response.status_code == 400 and "`standard`" in response.json()["priority_class"][0]


def test_a_team_admin_lowers_the_teams_class(world, client_for):
    response = client_for(world.team_admin_a1).patch(
        f"/api/teams/{world.team_a1.pk}/", {"priority_class": "batch"}, format="json"
    )
    assert response.status_code == 200
    assert Team.objects.get(pk=world.team_a1.pk).priority_class == "batch"
    assert AuditLog.objects.filter(action="team.update", actor=world.team_admin_a1).count() == 1


@pytest.mark.parametrize(
    "body",
    [
        {"priority_class": "batch", "fair_share_weight": 5},
        {"restrict_models": True},
        {"deployments": []},
    ],
)
def test_a_team_admin_may_change_nothing_else_of_the_team(world, client_for, body):
    response = client_for(world.team_admin_a1).patch(f"/api/teams/{world.team_a1.pk}/", body, format="json")
    assert response.status_code == 403
    assert "priority_class" in response.json()["detail"]
    team = Team.objects.get(pk=world.team_a1.pk)
    assert (team.priority_class, team.fair_share_weight, team.restrict_models) == ("standard", 1, False)


def test_a_team_admin_cannot_put_the_whole_team(world, client_for):
    response = client_for(world.team_admin_a1).put(
        f"/api/teams/{world.team_a1.pk}/",
        {"tenant": world.tenant_a.pk, "name": "Agents", "slug": "agents", "priority_class": "batch"},
        format="json",
    )
    assert response.status_code == 403


@pytest.mark.parametrize(
    ("deployments", "says"),
    [
        ([999999], "No deployment has id 999999."),
        (["1"], "Incorrect type"),
        ([True], "Incorrect type"),
        ("1", "Expected a list"),
    ],
)
def test_an_unknown_or_mistyped_deployment_id_is_a_400(world, client_for, deployments, says):
    response = client_for(world.admin_a).patch(
        f"/api/teams/{world.team_a1.pk}/",
        {"restrict_models": True, "deployments": deployments},
        format="json",
    )
    assert response.status_code == 400
    assert says in str(response.json()["deployments"])
    assert Team.objects.get(pk=world.team_a1.pk).restrict_models is False


@pytest.mark.parametrize("weight", [0, 1001, "3", 2.5])
def test_a_weight_outside_1_to_1000_or_not_an_integer_is_a_400(world, client_for, weight):
    response = client_for(world.admin_a).patch(
        f"/api/teams/{world.team_a1.pk}/", {"fair_share_weight": weight}, format="json"
    )
    assert response.status_code == 400 and "fair_share_weight" in response.json()


# --- tenants ----------------------------------------------------------------------------------------------


def test_an_operator_sets_a_tenants_weight_and_ceiling_and_its_admins_read_them(world, client_for):
    response = client_for(world.operator).patch(
        f"/api/tenants/{world.tenant_a.pk}/",
        {"fair_share_weight": 3, "max_priority_class": "interactive"},
        format="json",
    )
    assert response.status_code == 200
    body = client_for(world.admin_a).get(f"/api/tenants/{world.tenant_a.pk}/").json()
    assert (body["fair_share_weight"], body["max_priority_class"]) == (3, "interactive")
    row = AuditLog.objects.filter(action="tenant.update").get()
    assert row.details["changes"]["max_priority_class"] == ["standard", "interactive"]
    # With the ceiling raised, the tenant's admins may give a team the top class.
    response = client_for(world.admin_a).patch(
        f"/api/teams/{world.team_a1.pk}/", {"priority_class": "interactive"}, format="json"
    )
    assert response.status_code == 200


def test_a_tenant_admin_cannot_raise_their_own_ceiling(world, client_for):
    response = client_for(world.admin_a).patch(
        f"/api/tenants/{world.tenant_a.pk}/", {"max_priority_class": "interactive"}, format="json"
    )
    assert response.status_code == 403
    assert Tenant.objects.get(pk=world.tenant_a.pk).max_priority_class == "standard"


# --- keys -------------------------------------------------------------------------------------------------


def test_a_key_narrows_to_some_of_its_restricted_teams_models(world, client_for, other_deployment):
    team = world.team_a1
    Team.objects.filter(pk=team.pk).update(restrict_models=True)
    team.deployments.set([world.deployment])
    client = client_for(world.team_admin_a1)
    response = client.patch(
        f"/api/keys/{world.key_a1.api_key.pk}/",
        {"deployments": [world.deployment.pk, other_deployment.pk]},
        format="json",
    )
    assert response.status_code == 400
    message = response.json()["deployments"][0]
    assert "coder-v2" in message and "tiny-qwen" not in message
    response = client.patch(
        f"/api/keys/{world.key_a1.api_key.pk}/",
        {"deployments": [world.deployment.pk], "priority_class": "batch"},
        format="json",
    )
    assert response.status_code == 200, response.content
    api_key = world.key_a1.api_key
    assert list(api_key.deployments.all()) == [world.deployment]
    api_key.refresh_from_db()
    assert api_key.priority_class == "batch"
    row = AuditLog.objects.filter(action="api_key.update").get()
    assert row.details["changes"]["deployments"] == [[], [world.deployment.pk]]


def test_a_key_of_an_unrestricted_team_may_narrow_to_any_model(world, client_for, other_deployment):
    response = client_for(world.team_admin_a1).post(
        "/api/keys/",
        {
            "team": world.team_a1.pk,
            "name": "batch agent",
            "scopes": ["inference"],
            "priority_class": "batch",
            "deployments": [other_deployment.pk],
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["priority_class"], body["deployments"]) == ("batch", [other_deployment.pk])
    row = AuditLog.objects.filter(action="api_key.create", target_id=str(body["id"])).get()
    assert row.details["after"]["deployments"] == [other_deployment.pk]
    assert row.details["after"]["priority_class"] == "batch"


def test_a_new_key_of_a_restricted_team_cannot_reach_beyond_it(world, client_for, other_deployment):
    Team.objects.filter(pk=world.team_a1.pk).update(restrict_models=True)  # allowed nothing
    response = client_for(world.admin_a).post(
        "/api/keys/",
        {
            "team": world.team_a1.pk,
            "name": "x",
            "scopes": ["inference"],
            "deployments": [other_deployment.pk],
        },
        format="json",
    )
    assert response.status_code == 400 and "coder-v2" in response.json()["deployments"][0]


def test_a_keys_class_above_the_ceiling_is_a_400_and_blank_means_the_teams(world, client_for):
    client = client_for(world.team_admin_a1)
    url = f"/api/keys/{world.key_a1.api_key.pk}/"
    response = client.patch(url, {"priority_class": "interactive"}, format="json")
    assert response.status_code == 400 and "`standard`" in response.json()["priority_class"][0]
    assert client.patch(url, {"priority_class": "batch"}, format="json").status_code == 200
    response = client.patch(url, {"priority_class": ""}, format="json")
    assert response.status_code == 200 and response.json()["priority_class"] == ""


def test_the_router_gives_a_key_its_own_class_else_its_teams_never_above_its_tenants(world):
    Team.objects.filter(pk=world.team_a1.pk).update(priority_class="batch")
    ApiKey.objects.filter(pk=world.key_b1.api_key.pk).update(priority_class="batch")
    # Above the tenant's highest (standard): written behind the checks' back, still served no higher.
    ApiKey.objects.filter(pk=world.key_a2.api_key.pk).update(priority_class="interactive")
    snapshot = load_snapshot()
    classes = [
        snapshot.keys[k.api_key.secret_hmac].priority_class
        for k in (world.key_a1, world.key_b1, world.key_a2)
    ]
    assert classes == ["batch", "batch", "standard"]  # its team's; its own; its own, lowered


# --- model aliases ----------------------------------------------------------------------------------------


def test_a_tenant_admin_creates_moves_and_deletes_an_alias(world, client_for, other_deployment):
    client = client_for(world.admin_a)
    response = client.post(
        "/api/model-aliases/",
        {"tenant": world.tenant_a.pk, "name": "coder", "deployment": world.deployment.pk},
        format="json",
    )
    assert response.status_code == 201, response.content
    alias_id = response.json()["id"]
    response = client.patch(
        f"/api/model-aliases/{alias_id}/",
        {"deployment": other_deployment.pk, "tenant": world.tenant_b.pk},
        format="json",
    )
    assert response.status_code == 200
    alias = ModelAlias.objects.get(pk=alias_id)
    assert (alias.deployment, alias.tenant) == (other_deployment, world.tenant_a)  # the tenant stays
    assert client_for(world.member_a1).get(f"/api/model-aliases/{alias_id}/").json()["name"] == "coder"
    assert client.delete(f"/api/model-aliases/{alias_id}/").status_code == 204
    actions = list(
        AuditLog.objects.filter(target_type="tenants.modelalias")
        .order_by("id")
        .values_list("action", "tenant")
    )
    assert actions == [
        ("model_alias.create", world.tenant_a.pk),
        ("model_alias.update", world.tenant_a.pk),
        ("model_alias.delete", world.tenant_a.pk),
    ]


@pytest.mark.parametrize(
    ("name", "deployment", "field", "says"),
    [
        ("tiny-qwen", None, "name", "is a served model's name"),
        ("coder", 999999, "deployment", "No deployment has id 999999."),
        ("has space", None, "name", "Use letters, digits"),
        ("taken", None, "non_field_errors", "already has an alias of that name"),
    ],
)
def test_an_alias_that_cannot_be_is_a_400_that_says_why(world, client_for, name, deployment, field, says):
    ModelAlias.objects.create(tenant=world.tenant_a, name="taken", deployment=world.deployment)
    response = client_for(world.admin_a).post(
        "/api/model-aliases/",
        {"tenant": world.tenant_a.pk, "name": name, "deployment": deployment or world.deployment.pk},
        format="json",
    )
    assert response.status_code == 400
    assert says in str(response.json()[field])


def test_two_tenants_may_use_the_same_alias_for_different_models(world, client_for, other_deployment):
    ModelAlias.objects.create(tenant=world.tenant_a, name="coder", deployment=world.deployment)
    response = client_for(world.admin_b).post(
        "/api/model-aliases/",
        {"tenant": world.tenant_b.pk, "name": "coder", "deployment": other_deployment.pk},
        format="json",
    )
    assert response.status_code == 201


# --- usage and routing policies ---------------------------------------------------------------------------


def test_usage_shows_the_class_and_the_wait_and_filters_by_class(world, client_for):
    make_usage(world.key_a1, "req-queued", priority_class="batch", queued_ms=1200, status="rejected")
    client = client_for(world.member_a1)
    body = client.get("/api/usage/req-queued/").json()
    assert (body["priority_class"], body["queued_ms"], body["status"]) == ("batch", 1200, "rejected")
    rows = client.get("/api/usage/", {"priority_class": "batch"}).json()["results"]
    assert [row["request_id"] for row in rows] == ["req-queued"]
    assert client.get("/api/usage/", {"priority_class": "urgent"}).status_code == 400


def test_routing_policies_carry_the_flow_control_settings(world, client_for):
    url = f"/api/routing-policies/{world.policy.pk}/"
    body = client_for(world.operator).get(url).json()
    for name in (
        "flow_control",
        "saturation_waiting_per_engine",
        "saturation_spare_slots_per_engine",
        "saturation_kv_utilization",
        "saturation_prefill_tokens_per_engine",
        "max_wait_interactive_s",
        "max_wait_standard_s",
        "max_wait_batch_s",
    ):
        assert name in body, name
    response = client_for(world.operator).patch(
        url, {"flow_control": False, "max_wait_batch_s": 600.0}, format="json"
    )
    assert response.status_code == 200
    policy = RoutingPolicy.objects.get(pk=world.policy.pk)
    assert (policy.flow_control, policy.max_wait_batch_s) == (False, 600.0)
    response = client_for(world.operator).patch(url, {"saturation_kv_utilization": 1.5}, format="json")
    assert response.status_code == 400


def test_lowering_a_tenants_ceiling_lowers_its_teams_and_keys_above_it(world, client_for):
    _ceiling(world.tenant_a, PriorityClass.INTERACTIVE)
    Team.objects.filter(pk=world.team_a1.pk).update(priority_class="interactive")
    ApiKey.objects.filter(pk=world.key_a1.api_key.pk).update(priority_class="interactive")
    response = client_for(world.operator).patch(
        f"/api/tenants/{world.tenant_a.pk}/", {"max_priority_class": "batch"}, format="json"
    )
    assert response.status_code == 200
    assert Team.objects.get(pk=world.team_a1.pk).priority_class == "batch"
    assert ApiKey.objects.get(pk=world.key_a1.api_key.pk).priority_class == "batch"
    # ... so a later edit of the team is not refused for a class it was given before.
    response = client_for(world.admin_a).patch(
        f"/api/teams/{world.team_a1.pk}/", {"name": "Renamed"}, format="json"
    )
    assert response.status_code == 200, response.content


def test_a_deployment_cannot_take_a_name_some_tenant_calls_as_an_alias(world, client_for, other_deployment):
    ModelAlias.objects.create(tenant=world.tenant_a, name="coder", deployment=other_deployment)
    response = client_for(world.operator).post(
        "/api/deployments/",
        {
            "name": "coder",
            "served_model_name": "coder",
            "model_source": "models/tiny-qwen",
            "engine_kind": "sim",
        },
        format="json",
    )
    assert response.status_code == 400
    assert "alias of tenant" in response.json()["served_model_name"][0]
