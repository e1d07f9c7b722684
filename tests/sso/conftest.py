"""A real OpenID Connect provider (Django OAuth Toolkit, tests/sso/provider) in its own process, and the platform
served by pytest-django's live server, so that each test drives the authorization-code flow over HTTP as a
browser would: following redirects between the two with a cookie jar."""

from __future__ import annotations

import html
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from django.db import connections

REPO = Path(__file__).resolve().parents[2]
CLIENT_ID = "inference-platform"
HIDDEN = re.compile(r'<input type="hidden" name="(?P<name>[^"]+)" value="(?P<value>[^"]*)"')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Provider:
    url: str

    def control(self, **body) -> None:
        requests.post(f"{self.url}/control/", json=body, timeout=10).raise_for_status()

    def person(self, username: str, groups: list[str]) -> None:
        self.control(
            action="person",
            username=username,
            password=f"pw-{username}",
            email=f"{username}@example.com",
            groups=groups,
        )

    def regroup(self, username: str, groups: list[str]) -> None:
        """Changes someone's groups without signing them out at the provider (person() does)."""
        self.control(action="groups", username=username, groups=groups)

    def remove(self, username: str) -> None:
        self.control(action="remove", username=username)


@pytest.fixture(scope="session")
def provider(tmp_path_factory) -> Iterator[Provider]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.sso.provider.settings",
        "PROVIDER_DB": str(tmp_path_factory.mktemp("provider") / "provider.sqlite3"),
        "PROVIDER_RSA_KEY": pem,
        "PROVIDER_SECRET_KEY": secrets.token_urlsafe(32),
        "PYTHONPATH": str(REPO),
    }
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"], env=env, cwd=REPO, check=True
    )
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "django", "runserver", f"127.0.0.1:{port}", "--noreload"],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=open(Path(env["PROVIDER_DB"]).with_name("provider.log"), "w"),  # noqa: SIM115
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            requests.get(f"{url}/o/.well-known/openid-configuration", timeout=1).raise_for_status()
            break
        except requests.RequestException:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                pytest.fail("the OpenID Connect provider did not start")
            time.sleep(0.2)
    yield Provider(url)
    process.terminate()
    process.wait(10)


@pytest.fixture
def platform(provider, live_server, settings, transactional_db, monkeypatch) -> Iterator[str]:
    """The platform's URL, signed in through `provider` as its README says to connect one."""
    # The live server's threads close their connections after each request, so the test database can be dropped.
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    secret = secrets.token_urlsafe(32)
    provider.control(
        action="client",
        client_id=CLIENT_ID,
        client_secret=secret,
        redirect_uri=f"{live_server.url}/sso/callback/",
    )
    discovery = requests.get(f"{provider.url}/o/.well-known/openid-configuration", timeout=10).json()
    settings.OIDC_RP_CLIENT_ID = CLIENT_ID
    settings.OIDC_RP_CLIENT_SECRET = secret
    settings.OIDC_OP_AUTHORIZATION_ENDPOINT = discovery["authorization_endpoint"]
    settings.OIDC_OP_TOKEN_ENDPOINT = discovery["token_endpoint"]
    settings.OIDC_OP_USER_ENDPOINT = discovery["userinfo_endpoint"]
    settings.OIDC_OP_JWKS_ENDPOINT = discovery["jwks_uri"]
    settings.OIDC_RP_SCOPES = "openid email profile groups"
    settings.OIDC_PROVIDER_NAME = "Test IdP"
    settings.AUTHENTICATION_BACKENDS = [*settings.AUTHENTICATION_BACKENDS, "sso.backends.OidcBackend"]
    yield live_server.url
    with connections["default"].cursor() as cursor:  # what the live server's threads left open
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


def sign_in(platform: str, username: str, *, browser: requests.Session | None = None) -> requests.Response:
    """Start at the platform's single sign-on, sign in at the provider's own form, and follow the redirects back
    to wherever the platform sends the browser: the page it ends on."""
    browser = browser or requests.Session()
    page = browser.get(f"{platform}/sso/authenticate/?next=/portal/", timeout=30)
    assert "Identity provider: sign in" in page.text, page.url
    fields = {m["name"]: html.unescape(m["value"]) for m in HIDDEN.finditer(page.text)}
    return browser.post(
        page.url, data={**fields, "username": username, "password": f"pw-{username}"}, timeout=30
    )
