"""What one tenant can see and call of the deployments: tenants' people read only the deployments they may call,
and of those only what a caller needs; a deployment an operator limited to some tenants is, for every other
tenant, a model that does not exist (API, router snapshot and router alike)."""

from __future__ import annotations

import httpx
import pytest

from routing.snapshot import load_snapshot
from serving.models import Endpoint, Health, ModelDeployment, Pool
from tenants.models import AuditLog, ModelAlias, Team

from ..routing.conftest import fleet, router_process, sim_pair  # noqa: F401  (the router's fixtures)

ENGINE_URL = "http://10.1.2.3:8123"
TEMPLATE = "{% for m in messages %}SECRET-TEMPLATE{{ m.content }}{% endfor %}"
CALLER_FIELDS = {
    "id",
    "name",
    "served_model_name",
    "max_model_len",
    "observed_status",
    "supports_tools",
    "supports_reasoning",
    "created_at",
    "updated_at",
}


@pytest.fixture
def private(world) -> ModelDeployment:
    """Tenant B's fine-tune, limited to tenant B."""
    deployment = ModelDeployment.objects.create(
        name="bolt-ft", served_model_name="bolt-ft", model_source="models/bolt-ft", engine_kind="sim"
    )
    deployment.tenants.set([world.tenant_b])
    return deployment


@pytest.fixture
def engine_details(world) -> None:
    """What only operators may read: an engine address, engine flags and a chat template."""
    ModelDeployment.objects.filter(pk=world.deployment.pk).update(chat_template=TEMPLATE)
    pool = Pool.objects.get(deployment=world.deployment)
    Pool.objects.filter(pk=pool.pk).update(extra_engine_args=["--secret-flag"])
    Endpoint.objects.create(pool=pool, name="tiny-main-0", url=ENGINE_URL, role="both", health=Health.HEALTHY)


def _names(response) -> list[str]:
    assert response.status_code == 200, response.content
    return sorted(d["served_model_name"] for d in response.json()["results"])


# --- what tenants' people read ----------------------------------------------------------------------------


@pytest.mark.parametrize("who", ["admin_a", "team_admin_a1", "member_a1", "admin_b"])
def test_it_shows_tenants_people_only_what_a_caller_needs(world, client_for, engine_details, who):
    client = client_for(getattr(world, who))
    listing = client.get("/api/deployments/")
    detail = client.get(f"/api/deployments/{world.deployment.pk}/")
    for response in (listing, detail):
        assert response.status_code == 200, response.content
        body = response.content.decode()
        for secret in (ENGINE_URL, "10.1.2.3", "models/tiny-qwen", "--secret-flag", "SECRET-TEMPLATE"):
            assert secret not in body
    (entry,) = listing.json()["results"]
    assert set(entry) == CALLER_FIELDS == set(detail.json())
    assert (entry["served_model_name"], entry["max_model_len"]) == ("tiny-qwen", 4096)


def test_it_shows_operators_everything(world, client_for, engine_details, private):
    response = client_for(world.operator).get(f"/api/deployments/{world.deployment.pk}/")
    assert response.status_code == 200
    body = response.json()
    assert body["model_source"] == "models/tiny-qwen" and body["chat_template"] == TEMPLATE
    assert body["endpoints"][0]["url"] == ENGINE_URL
    assert body["pools"][0]["extra_engine_args"] == ["--secret-flag"]
    assert body["tenants"] == []
    assert _names(client_for(world.operator).get("/api/deployments/")) == ["bolt-ft", "tiny-qwen"]
    assert client_for(world.operator).get(f"/api/deployments/{private.pk}/").json()["tenants"] == [
        world.tenant_b.pk
    ]


def test_a_teams_people_see_only_what_their_team_may_call(world, client_for):
    other = ModelDeployment.objects.create(
        name="coder", served_model_name="coder", model_source="models/coder", engine_kind="sim"
    )
    Team.objects.filter(pk=world.team_a1.pk).update(restrict_models=True)
    world.team_a1.deployments.set([other])
    for who in ("member_a1", "team_admin_a1"):
        client = client_for(getattr(world, who))
        assert _names(client.get("/api/deployments/")) == ["coder"]
        assert client.get(f"/api/deployments/{world.deployment.pk}/").status_code == 404
    # The tenant's admins give its teams the deployments: they see every one open to the tenant.
    assert _names(client_for(world.admin_a).get("/api/deployments/")) == ["coder", "tiny-qwen"]


def test_a_deployment_limited_to_a_tenant_does_not_exist_for_the_others(world, client_for, private):
    for who in ("admin_a", "team_admin_a1", "member_a1"):
        client = client_for(getattr(world, who))
        assert _names(client.get("/api/deployments/")) == ["tiny-qwen"]
        assert client.get(f"/api/deployments/{private.pk}/").status_code == 404
    assert _names(client_for(world.admin_b).get("/api/deployments/")) == ["bolt-ft", "tiny-qwen"]


def test_a_member_of_a_restricted_team_does_not_see_another_tenants_deployment_it_lists(
    world, client_for, private
):
    # Listed for the team by mistake, a deployment limited to another tenant stays out of sight (and of reach).
    Team.objects.filter(pk=world.team_a1.pk).update(restrict_models=True)
    world.team_a1.deployments.set([private, world.deployment])
    assert _names(client_for(world.member_a1).get("/api/deployments/")) == ["tiny-qwen"]


# --- who limits a deployment to tenants ---------------------------------------------------------------------


def test_an_operator_limits_a_deployment_to_tenants_and_it_is_audited(world, client_for):
    client = client_for(world.operator)
    url = f"/api/deployments/{world.deployment.pk}/"
    response = client.patch(url, {"tenants": [world.tenant_b.pk]}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["tenants"] == [world.tenant_b.pk]
    assert list(world.deployment.tenants.all()) == [world.tenant_b]
    row = AuditLog.objects.filter(action="deployment.update", target_id=str(world.deployment.pk)).latest("id")
    assert row.details["changes"]["tenants"] == [[], [world.tenant_b.pk]]
    assert row.actor == world.operator and row.source == "api"
    assert client_for(world.member_a1).get(url).status_code == 404
    response = client.patch(url, {"tenants": []}, format="json")
    assert response.status_code == 200 and not world.deployment.tenants.exists()
    assert client_for(world.member_a1).get(url).status_code == 200


def test_an_operator_creates_a_deployment_limited_to_a_tenant(world, client_for):
    body = {
        "name": "acme-ft",
        "served_model_name": "acme-ft",
        "model_source": "models/acme-ft",
        "engine_kind": "sim",
        "tenants": [world.tenant_a.pk],
    }
    response = client_for(world.operator).post("/api/deployments/", body, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["tenants"] == [world.tenant_a.pk]
    created = ModelDeployment.objects.get(name="acme-ft")
    assert _names(client_for(world.admin_b).get("/api/deployments/")) == ["tiny-qwen"]
    assert "acme-ft" in _names(client_for(world.admin_a).get("/api/deployments/"))
    assert list(created.tenants.all()) == [world.tenant_a]


@pytest.mark.parametrize(
    "tenants, message",
    [(["1"], "Incorrect type"), ([999999], "No tenant has id 999999."), ("acme", "a list"), ({}, "a list")],
)
def test_a_bad_tenant_list_is_a_400_that_says_what_to_fix(world, client_for, tenants, message):
    response = client_for(world.operator).patch(
        f"/api/deployments/{world.deployment.pk}/", {"tenants": tenants}, format="json"
    )
    assert response.status_code == 400, response.content
    assert message in str(response.json()["tenants"])
    assert not world.deployment.tenants.exists()


def test_a_list_of_deployments_must_be_a_json_list(world, client_for):
    Team.objects.filter(pk=world.team_a1.pk).update(restrict_models=True)
    world.team_a1.deployments.set([world.deployment])
    response = client_for(world.admin_a).patch(
        f"/api/teams/{world.team_a1.pk}/", {"deployments": {}}, format="json"
    )
    assert response.status_code == 400 and "a list" in str(response.json()["deployments"])
    assert list(world.team_a1.deployments.all()) == [world.deployment]


def test_tenants_people_cannot_limit_or_open_a_deployment(world, client_for, private):
    response = client_for(world.admin_b).patch(
        f"/api/deployments/{private.pk}/", {"tenants": []}, format="json"
    )
    assert response.status_code == 403
    response = client_for(world.admin_a).patch(
        f"/api/deployments/{world.deployment.pk}/", {"tenants": [world.tenant_a.pk]}, format="json"
    )
    assert response.status_code == 403
    assert list(private.tenants.all()) == [world.tenant_b] and not world.deployment.tenants.exists()


def test_another_tenants_deployment_cannot_be_given_to_a_team_a_key_or_an_alias(world, client_for, private):
    client = client_for(world.admin_a)
    team = client.patch(
        f"/api/teams/{world.team_a1.pk}/",
        {"restrict_models": True, "deployments": [private.pk]},
        format="json",
    )
    key = client.patch(f"/api/keys/{world.key_a1.api_key.pk}/", {"deployments": [private.pk]}, format="json")
    alias = client.post(
        "/api/model-aliases/",
        {"tenant": world.tenant_a.pk, "name": "ft", "deployment": private.pk},
        format="json",
    )
    for response, field in ((team, "deployments"), (key, "deployments"), (alias, "deployment")):
        assert response.status_code == 400, response.content
        assert f"{private.pk}" in str(response.json()[field]) and "bolt-ft" not in response.content.decode()
    assert not world.team_a1.deployments.exists() and not ModelAlias.objects.exists()
    # Even an operator cannot give one tenant's team a deployment limited to another.
    response = client_for(world.operator).patch(
        f"/api/teams/{world.team_a1.pk}/", {"deployments": [private.pk]}, format="json"
    )
    assert response.status_code == 400


def test_the_portal_offers_a_tenants_admins_none_of_another_tenants_deployments(world, private):
    from django.test import Client

    client = Client()
    client.force_login(world.admin_a)
    page = client.get(f"/portal/teams/{world.team_a1.pk}/").content.decode()
    assert "tiny-qwen" in page and "bolt-ft" not in page
    response = client.post(
        f"/portal/teams/{world.team_a1.pk}/aliases/", {"name": "ft", "deployment": str(private.pk)}
    )
    assert response.status_code == 400 and not ModelAlias.objects.exists()


# --- what the router answers ------------------------------------------------------------------------------


def _key(snapshot, issued):
    return snapshot.keys[issued.api_key.secret_hmac]


def test_the_routers_snapshot_checks_the_tenants_before_the_teams(world, private):
    ModelAlias.objects.create(tenant=world.tenant_a, name="ft", deployment=private)
    snapshot = load_snapshot()
    key_a, key_b = _key(snapshot, world.key_a1), _key(snapshot, world.key_b1)
    assert snapshot.deployment_for_key(key_a, "bolt-ft") is None
    assert snapshot.deployment_for_key(key_a, "ft") is None  # nor through its tenant's alias
    assert [name for name, _ in snapshot.models_for_key(key_a)] == ["tiny-qwen"]
    assert snapshot.deployment_for_key(key_b, "bolt-ft").id == private.pk
    assert [name for name, _ in snapshot.models_for_key(key_b)] == ["bolt-ft", "tiny-qwen"]
    # A team entitled to it by name gets no further: the tenants are checked first.
    Team.objects.filter(pk=world.team_a1.pk).update(restrict_models=True)
    world.team_a1.deployments.set([private, world.deployment])
    snapshot = load_snapshot()
    assert snapshot.deployment_for_key(_key(snapshot, world.key_a1), "bolt-ft") is None


def _chat(router_fleet, model: str) -> httpx.Response:
    return httpx.post(
        f"{router_fleet.router.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {router_fleet.key.secret}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=30,
    )


def _listed(router_fleet) -> list[str]:
    key = router_fleet.key.secret
    reply = httpx.get(
        f"{router_fleet.router.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    assert reply.status_code == 200
    return [entry["id"] for entry in reply.json()["data"]]


def test_the_router_answers_another_tenants_key_that_a_limited_model_does_not_exist(fleet):  # noqa: F811
    from tenants.models import Tenant

    name = fleet.deployment.served_model_name
    assert _chat(fleet, name).status_code == 200
    other = Tenant.objects.create(name="Other", slug="other")
    fleet.deployment.tenants.set([other])
    fleet.sync()
    refused, unknown = _chat(fleet, name), _chat(fleet, "no-such-model")
    assert refused.status_code == unknown.status_code == 404
    assert refused.text.replace(name, "X") == unknown.text.replace("no-such-model", "X")
    assert _listed(fleet) == []
    reply = httpx.get(
        f"{fleet.router.url}/v1/models/{name}", headers={"Authorization": f"Bearer {fleet.key.secret}"}
    )
    assert reply.status_code == 404
    # Limited to the key's own tenant too, it is served again.
    fleet.deployment.tenants.add(fleet.team.tenant)
    fleet.sync()
    assert _chat(fleet, name).status_code == 200 and _listed(fleet) == [name]
