"""A deactivated tenant is locked out everywhere: portal, REST API by session, personal token and API key."""

from __future__ import annotations

import pytest
from django.test import Client
from django.utils.html import escape
from knox.models import AuthToken

from tenants.access import TENANT_DEACTIVATED
from tenants.models import Membership, Role

from ..conftest import make_user


@pytest.fixture
def deactivated(world):
    world.tenant_a.is_active = False
    world.tenant_a.save()
    return world


def _signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _bearer(token: str) -> Client:
    return Client(headers={"Authorization": f"Bearer {token}"})


PEOPLE_OF_A = ["admin_a", "team_admin_a1", "member_a1"]


@pytest.mark.parametrize("who", PEOPLE_OF_A)
@pytest.mark.parametrize("path", ["/portal/teams/", "/portal/reports/", "/portal/reports/export.csv"])
def test_the_portal_refuses_people_of_a_deactivated_tenant(deactivated, who, path):
    response = _signed_in(getattr(deactivated, who)).get(path)
    assert response.status_code == 403
    assert escape(TENANT_DEACTIVATED) in response.content.decode()


def test_the_portal_refuses_a_team_page_and_key_creation(deactivated):
    client = _signed_in(deactivated.admin_a)
    assert client.get(f"/portal/teams/{deactivated.team_a1.pk}/").status_code == 403
    response = client.post(
        f"/portal/teams/{deactivated.team_a1.pk}/keys/", {"name": "x", "scopes": ["inference"]}
    )
    assert response.status_code == 403


def test_the_portal_sign_in_says_the_tenant_is_deactivated(deactivated):
    client = Client()
    response = client.post("/portal/login/", {"username": "mia", "password": "pw-mia-long-enough"})
    assert response.status_code == 200 and escape(TENANT_DEACTIVATED) in response.content.decode()
    assert "_auth_user_id" not in client.session


@pytest.mark.parametrize("who", PEOPLE_OF_A)
@pytest.mark.parametrize("path", ["/api/teams/", "/api/usage/", "/api/reports/usage/", "/api/keys/"])
def test_the_api_refuses_a_session_of_a_deactivated_tenant(deactivated, who, path):
    response = _signed_in(getattr(deactivated, who)).get(path)
    assert response.status_code == 403
    assert response.json()["detail"] == TENANT_DEACTIVATED


@pytest.mark.parametrize("path", ["/api/teams/", "/api/usage/", "/api/reports/usage.csv"])
def test_the_api_refuses_a_personal_token_of_a_deactivated_tenant(deactivated, path):
    _, token = AuthToken.objects.create(user=deactivated.admin_a)
    response = _bearer(token).get(path)
    assert response.status_code == 403
    assert response.json()["detail"] == TENANT_DEACTIVATED


def test_the_token_endpoint_gives_no_token_to_a_deactivated_tenant(deactivated):
    response = Client().post(
        "/api/auth/token/",
        {"username": "alice", "password": "pw-alice-long-enough"},
        content_type="application/json",
    )
    assert response.status_code == 403 and response.json()["detail"] == TENANT_DEACTIVATED
    assert not AuthToken.objects.filter(user=deactivated.admin_a).exists()


@pytest.mark.parametrize("path", ["/api/usage/", "/api/reports/usage/", "/api/reports/usage.csv"])
def test_the_api_refuses_a_read_usage_key_of_a_deactivated_tenant(deactivated, path):
    assert _bearer(deactivated.key_a1.secret).get(path).status_code == 403
    # Another tenant's key still reads its own usage.
    assert _bearer(deactivated.key_b1.secret).get(path).status_code == 200


def test_people_of_other_tenants_and_operators_keep_working(deactivated):
    assert _signed_in(deactivated.admin_b).get("/portal/teams/").status_code == 200
    assert _signed_in(deactivated.admin_b).get("/api/teams/").status_code == 200
    operator = _signed_in(deactivated.operator)
    assert operator.get("/portal/teams/").status_code == 200
    teams = operator.get("/api/teams/").json()["results"]
    assert deactivated.team_a1.pk in {t["id"] for t in teams}  # to reactivate it, operators see it


def test_someone_in_two_tenants_keeps_only_the_active_ones(deactivated):
    both = make_user("bea", Role.MEMBER, team=deactivated.team_a1)
    Membership.objects.create(
        user=both, role=Role.MEMBER, tenant=deactivated.tenant_b, team=deactivated.team_b1
    )
    client = _signed_in(both)
    assert {t["id"] for t in client.get("/api/teams/").json()["results"]} == {deactivated.team_b1.pk}
    assert client.get(f"/portal/teams/{deactivated.team_a1.pk}/").status_code == 404
    assert client.get(f"/portal/teams/{deactivated.team_b1.pk}/").status_code == 200


def test_reactivating_restores_access(deactivated):
    deactivated.tenant_a.is_active = True
    deactivated.tenant_a.save()
    assert _signed_in(deactivated.member_a1).get("/portal/teams/").status_code == 200
    assert _signed_in(deactivated.member_a1).get("/api/teams/").status_code == 200
    assert _bearer(deactivated.key_a1.secret).get("/api/usage/").status_code == 200
