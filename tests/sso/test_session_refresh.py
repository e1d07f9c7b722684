"""Single sign-on sessions are checked with the provider again once OIDC_SESSION_REFRESH_S have passed: a page
load goes to the provider with prompt=none and back through the callback, which applies the group rules to the
new claims. Time passing is played by moving the session's next check into the past."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib import import_module

import pytest
import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client

from sso.models import GroupRule
from tenants.models import Membership, Role, Team, Tenant

from ..conftest import make_user
from .conftest import REPO, sign_in

PAGE = {"Accept": "text/html,application/xhtml+xml"}  # what a browser's address bar sends
JSON = {"Accept": "application/json"}


def _interval_passes(browser: requests.Session) -> None:
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key=browser.cookies["sessionid"])
    assert "oidc_id_token_expiration" in store  # the callback scheduled the next check
    store["oidc_id_token_expiration"] = time.time() - 1
    store.save()


def _asked_provider(answer: requests.Response, provider) -> bool:
    return any(hop.url.startswith(provider.url) and "prompt=none" in hop.url for hop in answer.history)


def _team() -> Team:
    return Team.objects.create(
        tenant=Tenant.objects.create(name="Acme", slug="acme"), name="Agents", slug="agents"
    )


def _signed_in(browser: requests.Session, platform: str) -> bool:
    return browser.get(f"{platform}/portal/teams/", headers=PAGE, allow_redirects=False).status_code == 200


def test_someone_removed_from_the_operators_loses_operator_and_admin_at_the_next_check(provider, platform):
    team = _team()
    GroupRule.objects.create(group="platform-ops", role=Role.OPERATOR, admin_site=True)
    GroupRule.objects.create(group="acme-agents", role=Role.MEMBER, team=team)
    provider.person("olga", ["platform-ops", "acme-agents"])
    browser = requests.Session()
    assert sign_in(platform, "olga", browser=browser).url == f"{platform}/portal/fleet/"
    user = get_user_model().objects.get(username="olga")
    assert user.is_superuser
    # Within the interval, pages are served without asking the provider.
    admin = browser.get(f"{platform}/admin/", headers=PAGE)
    assert admin.status_code == 200 and not _asked_provider(admin, provider)

    provider.regroup("olga", ["acme-agents"])
    _interval_passes(browser)
    landed = browser.get(f"{platform}/portal/teams/", headers=PAGE)

    assert _asked_provider(landed, provider)
    assert landed.status_code == 200 and landed.url == f"{platform}/portal/teams/"
    user.refresh_from_db()
    assert not user.is_staff and not user.is_superuser
    assert list(Membership.objects.filter(user=user).values_list("role", "team")) == [(Role.MEMBER, team.pk)]
    refused = browser.get(f"{platform}/admin/", headers=PAGE, allow_redirects=False)
    assert refused.status_code == 302 and refused.headers["Location"].startswith("/admin/login/")
    # The check is done for another interval.
    again = browser.get(f"{platform}/portal/teams/", headers=PAGE)
    assert again.status_code == 200 and not _asked_provider(again, provider)


def test_someone_in_no_mapped_group_any_more_is_signed_out_at_the_next_check(provider, platform):
    GroupRule.objects.create(group="acme-agents", role=Role.MEMBER, team=_team())
    provider.person("bob", ["acme-agents"])
    browser = requests.Session()
    sign_in(platform, "bob", browser=browser)

    provider.regroup("bob", ["contractors"])
    _interval_passes(browser)
    refused = browser.get(f"{platform}/portal/teams/", headers=PAGE)

    assert _asked_provider(refused, provider)
    assert refused.status_code == 403 and refused.url.startswith(f"{platform}/sso/refused/")
    assert "None of your groups" in refused.text
    assert not Membership.objects.filter(user__username="bob").exists()
    assert not _signed_in(browser, platform)


@pytest.mark.parametrize("ended", ["signed out at the provider", "removed at the provider"])
def test_a_check_the_provider_does_not_answer_with_a_sign_in_signs_the_person_out(provider, platform, ended):
    GroupRule.objects.create(group="acme-agents", role=Role.MEMBER, team=_team())
    provider.person("carl", ["acme-agents"])
    browser = requests.Session()
    sign_in(platform, "carl", browser=browser)
    if ended == "signed out at the provider":
        for cookie in [c for c in browser.cookies if c.name == "provider_sessionid"]:
            browser.cookies.clear(cookie.domain, cookie.path, cookie.name)
    else:
        provider.remove("carl")

    _interval_passes(browser)
    refused = browser.get(f"{platform}/portal/teams/", headers=PAGE)

    assert _asked_provider(refused, provider) and "error=login_required" in refused.history[-1].url
    assert refused.status_code == 403 and "Your sign-in at the identity provider has ended" in refused.text
    assert not _signed_in(browser, platform)


def test_a_session_due_for_its_check_is_refused_changes_and_the_api_until_a_page_renews_it(
    provider, platform
):
    GroupRule.objects.create(group="platform-ops", role=Role.OPERATOR)
    provider.person("olga", ["platform-ops"])
    browser = requests.Session()
    sign_in(platform, "olga", browser=browser)
    csrf = {"X-CSRFToken": browser.cookies["csrftoken"]}
    # An operator who signed in with a password is never sent to the provider.
    make_user("olive", Role.OPERATOR)
    local = Client()
    local.post("/portal/login/", {"username": "olive", "password": "pw-olive-long-enough"})
    assert local.get("/api/tenants/", HTTP_ACCEPT="application/json").status_code == 200

    _interval_passes(browser)
    api = browser.get(f"{platform}/api/tenants/", headers=JSON)
    xhr = browser.get(f"{platform}/portal/fleet/", headers={**PAGE, "X-Requested-With": "XMLHttpRequest"})
    post = browser.post(
        f"{platform}/api/tenants/", json={"name": "Beta", "slug": "beta"}, headers={**JSON, **csrf}
    )
    form = browser.post(
        f"{platform}/api/tenants/", data={"name": "Beta", "slug": "beta"}, headers={**PAGE, **csrf}
    )

    assert api.status_code == 403 and "check with Test IdP" in api.json()["detail"]
    assert (
        xhr.status_code == 403 and post.status_code == 403 and "check with Test IdP" in post.json()["detail"]
    )
    assert form.status_code == 403 and "check with Test IdP" in form.text
    assert not Tenant.objects.filter(slug="beta").exists()
    assert local.get("/api/tenants/", HTTP_ACCEPT="application/json").status_code == 200
    made = local.post("/api/tenants/", {"name": "Gamma", "slug": "gamma"}, content_type="application/json")
    assert made.status_code == 201

    renewed = browser.get(f"{platform}/portal/fleet/", headers=PAGE)
    assert _asked_provider(renewed, provider) and renewed.url == f"{platform}/portal/fleet/"
    assert browser.get(f"{platform}/api/tenants/", headers=JSON).status_code == 200
    post = browser.post(
        f"{platform}/api/tenants/", json={"name": "Beta", "slug": "beta"}, headers={**JSON, **csrf}
    )
    assert post.status_code == 201
    # Signing out always works, due or not.
    _interval_passes(browser)
    out = browser.post(
        f"{platform}/portal/logout/", headers={**PAGE, "X-CSRFToken": browser.cookies["csrftoken"]}
    )
    assert out.status_code == 200 and out.url.startswith(f"{platform}/portal/login/")
    assert not _asked_provider(out, provider) and not _signed_in(browser, platform)


def test_a_check_interval_under_a_minute_is_refused_at_start():
    started = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "inference_platform.settings",
            "OIDC_SESSION_REFRESH_S": "5",
        },
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert started.returncode != 0 and "OIDC_SESSION_REFRESH_S must be 60 or more" in started.stderr
