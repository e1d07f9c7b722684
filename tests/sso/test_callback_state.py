"""The sign-in callback acts only on an answer to a sign-in this browser started (its state is in the session):
anything else, a plain link to it included, is refused and changes nothing."""

from __future__ import annotations

import pytest
import requests
from django.test import Client

from sso.models import GroupRule
from tenants.models import Role

from ..conftest import make_user
from .conftest import sign_in

FORGED = [
    "",
    "?state=forged",
    "?code=stolen&state=forged",
    "?code=stolen",
    "?error=login_required",
    "?error=access_denied&state=forged",
]


def _still_signed_in(get) -> bool:
    return get("/portal/fleet/").status_code == 200


@pytest.mark.parametrize("query", FORGED)
def test_a_callback_this_browser_did_not_start_leaves_the_single_sign_on_session_alone(
    provider, platform, query
):
    GroupRule.objects.create(group="platform-ops", role=Role.OPERATOR)
    provider.person("olga", ["platform-ops"])
    browser = requests.Session()
    sign_in(platform, "olga", browser=browser)

    answer = browser.get(f"{platform}/sso/callback/{query}", allow_redirects=False)

    assert answer.status_code == 400 and "does not answer a sign-in started in this browser" in answer.text
    assert _still_signed_in(lambda path: browser.get(f"{platform}{path}", allow_redirects=False))


@pytest.mark.parametrize("query", FORGED)
def test_a_callback_this_browser_did_not_start_leaves_a_password_session_alone(provider, platform, query):
    make_user("olive", Role.OPERATOR)
    client = Client()
    client.post("/portal/login/", {"username": "olive", "password": "pw-olive-long-enough"})

    answer = client.get(f"/sso/callback/{query}")

    assert answer.status_code == 400 and "Nothing was changed" in answer.content.decode()
    assert _still_signed_in(client.get)
