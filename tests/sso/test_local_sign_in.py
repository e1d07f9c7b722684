"""Username-and-password sign-in: still there beside single sign-on, switched off by LOCAL_SIGN_IN, and nothing
changes while single sign-on is not configured."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.test import Client

from sso.models import GroupRule
from tenants.models import Role

from ..conftest import make_user
from .conftest import REPO, sign_in

FORMS = ["/portal/login/", "/api/auth/login/", "/admin/login/"]


@pytest.fixture
def configured(settings):
    settings.OIDC_RP_CLIENT_ID = "inference-platform"
    settings.OIDC_OP_AUTHORIZATION_ENDPOINT = "https://idp.example.com/authorize"
    settings.OIDC_PROVIDER_NAME = "Example IdP"


def _post_password(path: str, username: str) -> Client:
    client = Client()
    client.post(path, {"username": username, "password": f"pw-{username}-long-enough"})
    return client


@pytest.mark.parametrize("path", FORMS)
def test_it_refuses_a_right_password_on_every_form_when_switched_off(db, settings, configured, path):
    user = make_user("olive", Role.OPERATOR)
    user.is_staff = True
    user.save()
    settings.LOCAL_SIGN_IN = False
    client = _post_password(path, "olive")
    assert "_auth_user_id" not in client.session


def test_it_refuses_a_personal_token_for_a_password_when_switched_off(db, settings, configured):
    make_user("mia")
    settings.LOCAL_SIGN_IN = False
    answer = Client().post(
        "/api/auth/token/",
        {"username": "mia", "password": "pw-mia-long-enough"},
        content_type="application/json",
    )
    assert answer.status_code in (400, 403) and "token" not in answer.json()


@pytest.mark.parametrize("path", FORMS)
def test_the_sign_in_pages_offer_the_provider_and_no_password_when_switched_off(
    db, settings, configured, path
):
    settings.LOCAL_SIGN_IN = False
    page = Client().get(path).content.decode()
    assert "Sign in with Example IdP" in page and 'href="/sso/authenticate/' in page
    if path != "/api/auth/login/":  # the browsable API's form stays on its page, and is refused (above)
        assert 'name="password"' not in page


@pytest.mark.parametrize("path", FORMS)
def test_local_accounts_still_sign_in_beside_the_provider(db, configured, path):
    user = make_user("olive", Role.OPERATOR)
    user.is_staff = True
    user.save()
    page = Client().get(path).content.decode()
    assert "Sign in with Example IdP" in page and 'name="password"' in page
    assert "_auth_user_id" in _post_password(path, "olive").session


@pytest.mark.parametrize("path", FORMS)
def test_nothing_changes_when_single_sign_on_is_not_configured(db, path):
    page = Client().get(path).content.decode()
    assert "Sign in with" not in page and 'name="password"' in page
    assert Client().get("/sso/authenticate/").status_code == 404
    assert Client().get("/sso/callback/?code=x&state=y").status_code == 404


def test_switching_passwords_off_without_a_provider_is_refused_at_start():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OIDC_")}
    started = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env={**env, "DJANGO_SETTINGS_MODULE": "inference_platform.settings", "LOCAL_SIGN_IN": "off"},
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert started.returncode != 0 and "LOCAL_SIGN_IN=off needs single sign-on" in started.stderr


def test_single_sign_on_works_with_passwords_switched_off(provider, platform, settings):
    settings.LOCAL_SIGN_IN = False
    GroupRule.objects.create(group="platform-ops", role=Role.OPERATOR)
    provider.person("olga", ["platform-ops"])
    assert sign_in(platform, "olga").url == f"{platform}/portal/fleet/"
