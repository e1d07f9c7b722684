"""People's credentials: sign-ins throttled everywhere; personal tokens stored hashed, with an expiry."""

from __future__ import annotations

from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.core.cache import cache
from django.test import Client
from django.utils import timezone
from knox.models import AuthToken

PASSWORD = "pw-alice-long-enough"


def _post_login(client: Client, path: str, password: str, username: str = "alice"):
    return client.post(path, {"username": username, "password": password})


@pytest.mark.parametrize("path", ["/portal/login/", "/admin/login/", "/api/auth/login/"])
def test_form_sign_ins_lock_a_username_out_after_five_failures(world, settings, path):
    for person in (world.admin_a, world.admin_b):
        person.is_staff = True  # so that the admin would let them in
        person.save()
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert _post_login(client, path, "wrong").status_code == 200  # the form again, with its error
    response = _post_login(client, path, "wrong")
    assert response.status_code == 429
    assert "Too many failed sign-ins" in response.content.decode()
    # Locked: even the right password is refused now, and the session stays anonymous.
    assert _post_login(client, path, PASSWORD).status_code == 429
    assert "_auth_user_id" not in client.session
    # Another username from the same address is not locked.
    assert _post_login(client, path, "pw-bob-long-enough", username="bob").status_code == 302


def test_a_success_clears_the_failures(world):
    client = Client()
    for _ in range(3):
        _post_login(client, "/portal/login/", "wrong")
    assert _post_login(client, "/portal/login/", PASSWORD).status_code == 302
    assert not AccessAttempt.objects.filter(username="alice").exists()


def test_a_lock_ends_after_the_cool_off(world, settings):
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT):
        _post_login(client, "/portal/login/", "wrong")
    assert _post_login(client, "/portal/login/", PASSWORD).status_code == 429
    AccessAttempt.objects.update(
        attempt_time=timezone.now() - settings.AXES_COOLOFF_TIME - timedelta(seconds=1)
    )
    assert _post_login(client, "/portal/login/", PASSWORD).status_code == 302


def _token_request(client: Client, password: str, **extra):
    return client.post(
        "/api/auth/token/",
        {"username": "alice", "password": password},
        content_type="application/json",
        **extra,
    )


@pytest.fixture
def fresh_throttle():
    cache.clear()  # the throttle's counters live in the shared cache (Redis)
    yield
    cache.clear()


def test_the_token_endpoint_issues_a_hashed_expiring_token(world, fresh_throttle, settings):
    response = _token_request(Client(), PASSWORD)
    assert response.status_code == 201 and response["Cache-Control"] == "no-store"
    token = response.json()["token"]
    assert token.startswith("ipt_")
    stored = AuthToken.objects.get(user=world.admin_a)
    assert token not in (stored.digest, stored.token_key) and len(stored.digest) == 128
    ttl = settings.REST_KNOX["TOKEN_TTL"]
    assert abs(stored.expiry - (timezone.now() + ttl)) < timedelta(minutes=1)
    # The token works, until it expires.
    client = Client(headers={"Authorization": f"Bearer {token}"})
    assert client.get("/api/teams/").status_code == 200
    AuthToken.objects.filter(pk=stored.pk).update(expiry=timezone.now() - timedelta(seconds=1))
    assert client.get("/api/teams/").status_code == 401


def test_a_token_is_revoked_by_its_holder(world, fresh_throttle):
    first, second = (_token_request(Client(), PASSWORD).json()["token"] for _ in range(2))
    one = Client(headers={"Authorization": f"Bearer {first}"})
    assert one.post("/api/auth/token/revoke/").status_code == 204
    assert one.get("/api/teams/").status_code == 401
    two = Client(headers={"Authorization": f"Bearer {second}"})
    assert two.get("/api/teams/").status_code == 200
    assert two.post("/api/auth/token/revoke-all/").status_code == 204
    assert not AuthToken.objects.filter(user=world.admin_a).exists()


def test_the_token_endpoint_refuses_a_wrong_password_clearly(world, fresh_throttle):
    response = _token_request(Client(), "wrong")
    assert response.status_code == 400
    assert "Unable to sign in" in response.json()["detail"]


def test_the_token_endpoint_is_throttled_per_address(world, fresh_throttle):
    client = Client()
    statuses = [_token_request(client, "wrong").status_code for _ in range(11)]
    assert statuses[:4] == [400] * 4 and statuses[-1] == 429
    # Another address is not throttled by this one's failures.
    assert _token_request(client, PASSWORD, REMOTE_ADDR="10.9.8.7").status_code == 201


def test_the_token_endpoint_counts_failures_with_the_form_sign_ins(world, fresh_throttle, settings):
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT):
        _post_login(client, "/portal/login/", "wrong")
    response = _token_request(client, PASSWORD)
    assert response.status_code == 429
    assert "Too many failed sign-ins" in response.json()["detail"]
    assert not AuthToken.objects.exists()


def test_a_spoofed_forwarded_for_does_not_escape_the_throttle(world, fresh_throttle):
    client = Client()
    statuses = [
        _token_request(client, "wrong", HTTP_X_FORWARDED_FOR=f"10.0.0.{n}").status_code for n in range(11)
    ]
    assert statuses[-1] == 429


def test_undecodable_bearer_tokens_are_a_401(world):
    response = Client(headers={"Authorization": "Bearer \xff\xfe"}).get("/api/teams/")
    assert response.status_code == 401
