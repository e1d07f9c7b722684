"""Signing in without a `next` lands on the portal's home, from each of the three sign-in forms."""

from __future__ import annotations

import re

import pytest
from django.test import Client

HIDDEN = re.compile(r'<input type="hidden" name="(?P<name>[^"]+)" value="(?P<value>[^"]*)"')


def _form_as_sent(client: Client, path: str, username: str) -> dict:
    """What a browser posts from the form as the page renders it: its hidden fields and the credentials."""
    page = client.get(path).content.decode()
    fields = {m["name"]: m["value"] for m in HIDDEN.finditer(page)}
    return {**fields, "username": username, "password": f"pw-{username}-long-enough"}


@pytest.mark.parametrize("path", ["/portal/login/", "/api/auth/login/", "/admin/login/"])
def test_it_lands_on_the_portals_home_when_posted_without_next(world, path):
    world.operator.is_staff = True  # so that the admin lets them in
    world.operator.save()
    response = Client().post(path, {"username": "olive", "password": "pw-olive-long-enough"})
    assert response.status_code == 302 and response["Location"] == "/portal/"


def test_it_lands_on_the_portals_home_from_the_portals_own_form(world):
    client = Client()
    response = client.post("/portal/login/", _form_as_sent(client, "/portal/login/", "mia"), follow=True)
    assert response.redirect_chain[0][0] == "/portal/"
    assert response.request["PATH_INFO"] == "/portal/teams/" and response.status_code == 200


def test_it_still_follows_a_next(world):
    client = Client()
    asked = client.get("/portal/reports/")
    assert asked["Location"] == "/portal/login/?next=/portal/reports/"
    data = _form_as_sent(client, asked["Location"], "mia")
    assert client.post(asked["Location"], data)["Location"] == "/portal/reports/"


def test_the_admins_form_lands_on_the_admin(world):
    world.operator.is_staff = True
    world.operator.save()
    client = Client()
    response = client.post("/admin/login/", _form_as_sent(client, "/admin/login/", "olive"))
    assert response["Location"] == "/admin/"
