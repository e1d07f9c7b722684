"""The group rules, applied by the sign-in service to the claims a provider vouched for."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.db import IntegrityError

from sso.models import GroupRule
from sso.services import SignInRefused, sso_sign_in
from tenants.models import Membership, Role, Team, Tenant

from ..conftest import make_user

ISSUER = "https://idp.example.com"


def claims(sub: str, groups: list[str], username: str = "") -> dict:
    return {"iss": ISSUER, "sub": sub, "preferred_username": username or sub, "groups": groups}


@pytest.fixture
def team(db) -> Team:
    return Team.objects.create(
        tenant=Tenant.objects.create(name="Acme", slug="acme"), name="Agents", slug="agents"
    )


def test_a_team_admin_rule_wins_over_a_member_rule_for_the_same_team(team):
    GroupRule.objects.create(group="agents", role=Role.MEMBER, team=team)
    GroupRule.objects.create(group="leads", role=Role.TEAM_ADMIN, team=team)
    user = sso_sign_in(claims=claims("s1", ["agents", "leads"]))
    assert list(Membership.objects.filter(user=user).values_list("role", "team")) == [
        (Role.TEAM_ADMIN, team.pk)
    ]


def test_it_never_takes_over_a_local_account_of_the_same_name(team):
    local = make_user("ada")
    GroupRule.objects.create(group="agents", role=Role.MEMBER, team=team)
    user = sso_sign_in(claims=claims("s1", ["agents"], username="ada"))
    assert user.pk != local.pk and user.username.startswith("ada-")
    assert not Membership.objects.filter(user=local).exists()


def test_a_membership_made_by_hand_stands_and_is_never_taken_back(team):
    GroupRule.objects.create(group="agents", role=Role.MEMBER, team=team)
    user = sso_sign_in(claims=claims("s1", ["agents"]))
    Membership.objects.filter(user=user).delete()
    handmade = Membership.objects.create(user=user, role=Role.TEAM_ADMIN, tenant=team.tenant, team=team)

    sso_sign_in(claims=claims("s1", ["agents"]))
    assert list(Membership.objects.filter(user=user)) == [handmade]
    with pytest.raises(SignInRefused):
        sso_sign_in(claims=claims("s1", []))
    assert list(Membership.objects.filter(user=user)) == [handmade]


def test_it_refuses_someone_whose_only_tenant_is_deactivated(team):
    GroupRule.objects.create(group="agents", role=Role.MEMBER, team=team)
    Tenant.objects.filter(pk=team.tenant_id).update(is_active=False)
    with pytest.raises(SignInRefused) as refused:
        sso_sign_in(claims=claims("s1", ["agents"]))
    assert refused.value.code == "deactivated"


def test_the_same_subject_at_another_issuer_is_another_person(team):
    GroupRule.objects.create(group="agents", role=Role.MEMBER, team=team)
    first = sso_sign_in(claims=claims("s1", ["agents"]))
    second = sso_sign_in(claims={**claims("s1", ["agents"]), "iss": "https://other.example.com"})
    assert first.pk != second.pk and get_user_model().objects.count() == 2


def test_a_rule_must_name_the_scope_its_role_needs(team):
    with pytest.raises(IntegrityError):
        GroupRule.objects.create(group="agents", role=Role.MEMBER, tenant=team.tenant)


def test_only_an_operator_rule_gives_the_admin(team):
    with pytest.raises(IntegrityError):
        GroupRule.objects.create(group="leads", role=Role.TEAM_ADMIN, team=team, admin_site=True)
