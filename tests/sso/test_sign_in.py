"""Signing in through a real OpenID Connect provider: the authorization-code flow over HTTP, end to end."""

from __future__ import annotations

import requests
from django.contrib.auth import get_user_model

from sso.models import GroupRule, Identity
from tenants.models import AuditLog, Membership, Role, Team, Tenant

from .conftest import sign_in


def _tenant_with_team() -> tuple[Tenant, Team]:
    tenant = Tenant.objects.create(name="Acme", slug="acme")
    return tenant, Team.objects.create(tenant=tenant, name="Agents", slug="agents")


def test_it_creates_the_person_with_the_mapped_tenant_and_role(provider, platform):
    tenant, team = _tenant_with_team()
    GroupRule.objects.create(group="acme-agents", role=Role.MEMBER, team=team)
    GroupRule.objects.create(group="acme-admins", role=Role.TENANT_ADMIN, tenant=tenant)
    provider.person("ada", ["acme-agents", "acme-admins", "unrelated"])

    landed = sign_in(platform, "ada")

    assert landed.status_code == 200 and landed.url == f"{platform}/portal/teams/"
    user = get_user_model().objects.get(username="ada")
    assert user.email == "ada@example.com" and not user.has_usable_password()
    assert not user.is_staff
    assert set(Membership.objects.filter(user=user).values_list("role", "tenant", "team")) == {
        (Role.MEMBER, tenant.pk, team.pk),
        (Role.TENANT_ADMIN, tenant.pk, None),
    }
    assert Identity.objects.get(user=user).groups == ["acme-admins", "acme-agents", "unrelated"]
    assert AuditLog.objects.filter(source="sso", action="membership.create").count() == 2


def test_a_second_sign_in_finds_the_same_person(provider, platform):
    _, team = _tenant_with_team()
    GroupRule.objects.create(group="acme-agents", role=Role.MEMBER, team=team)
    provider.person("ada", ["acme-agents"])
    sign_in(platform, "ada")
    sign_in(platform, "ada")
    assert get_user_model().objects.filter(username__startswith="ada").count() == 1
    assert Membership.objects.filter(user__username="ada").count() == 1


def test_the_session_reaches_the_browsable_api_and_the_admin(provider, platform):
    GroupRule.objects.create(group="platform-ops", role=Role.OPERATOR, admin_site=True)
    provider.person("olga", ["platform-ops"])
    browser = requests.Session()

    assert sign_in(platform, "olga", browser=browser).url == f"{platform}/portal/fleet/"

    user = get_user_model().objects.get(username="olga")
    assert user.is_staff and user.is_superuser
    api = browser.get(f"{platform}/api/tenants/", headers={"Accept": "text/html"})
    assert api.status_code == 200 and "Tenant List" in api.text
    admin = browser.get(f"{platform}/admin/sso/grouprule/")
    assert admin.status_code == 200 and admin.url == f"{platform}/admin/sso/grouprule/"


def test_it_refuses_a_person_in_no_mapped_group_with_a_page_that_says_why(provider, platform):
    _, team = _tenant_with_team()
    GroupRule.objects.create(group="acme-agents", role=Role.MEMBER, team=team)
    provider.person("eve", ["contractors"])

    refused = sign_in(platform, "eve")

    assert refused.status_code == 403 and refused.url.startswith(f"{platform}/sso/refused/")
    assert "Sign-in refused" in refused.text and "None of your groups" in refused.text
    assert not get_user_model().objects.filter(username="eve").exists()


def test_someone_removed_from_the_group_loses_access_at_the_next_sign_in(provider, platform):
    tenant, team = _tenant_with_team()
    GroupRule.objects.create(group="acme-agents", role=Role.MEMBER, team=team)
    provider.person("bob", ["acme-agents"])
    browser = requests.Session()
    assert sign_in(platform, "bob", browser=browser).url == f"{platform}/portal/teams/"
    user = get_user_model().objects.get(username="bob")
    handmade = Membership.objects.create(
        user=user, role=Role.TENANT_ADMIN, tenant=Tenant.objects.create(name="Other", slug="other")
    )

    provider.person("bob", ["contractors"])
    refused = sign_in(platform, "bob", browser=browser)

    assert refused.status_code == 403 and "None of your groups" in refused.text
    # The rule's membership is gone, the one made by hand stays, and this browser is signed out.
    assert list(Membership.objects.filter(user=user)) == [handmade]
    assert AuditLog.objects.filter(source="sso", action="membership.delete").count() == 1
    after = browser.get(f"{platform}/portal/teams/", allow_redirects=False)
    assert after.status_code == 302 and after.headers["Location"].startswith("/portal/login/")


def test_someone_removed_at_the_provider_cannot_sign_in_again(provider, platform):
    _, team = _tenant_with_team()
    GroupRule.objects.create(group="acme-agents", role=Role.MEMBER, team=team)
    provider.person("carl", ["acme-agents"])
    assert sign_in(platform, "carl").url == f"{platform}/portal/teams/"

    provider.remove("carl")
    stopped = sign_in(platform, "carl")

    assert "Wrong username or password" in stopped.text and stopped.url.startswith(provider.url)
    assert not any(c.name == "sessionid" for c in stopped.cookies)


def test_a_revoked_admin_rule_takes_the_admin_back(provider, platform):
    rule = GroupRule.objects.create(group="platform-ops", role=Role.OPERATOR, admin_site=True)
    provider.person("olga", ["platform-ops"])
    sign_in(platform, "olga")
    rule.admin_site = False
    rule.save()

    sign_in(platform, "olga")

    user = get_user_model().objects.get(username="olga")
    assert not user.is_staff and not user.is_superuser
    assert Membership.objects.get(user=user).role == Role.OPERATOR


def test_refused_sign_ins_do_not_lock_others_out(provider, platform, settings):
    _, team = _tenant_with_team()
    GroupRule.objects.create(group="acme-agents", role=Role.MEMBER, team=team)
    provider.person("eve", ["contractors"])
    provider.person("ada", ["acme-agents"])
    for _ in range(settings.AXES_FAILURE_LIMIT + 1):
        assert sign_in(platform, "eve").status_code == 403

    assert sign_in(platform, "ada").url == f"{platform}/portal/teams/"
