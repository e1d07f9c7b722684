"""The admin's alerts pages: destinations and rules are edited (and audited, never with the secret); what the
platform writes (alert states, deliveries) is only read."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from alerts.models import Destination
from tenants.models import AuditLog

MODEL_BACKEND = "django.contrib.auth.backends.ModelBackend"


@pytest.fixture
def superuser_client(db, client):
    user = get_user_model().objects.create_superuser("root", "root@example.com", "pw-root-long-enough")
    client.force_login(user, backend=MODEL_BACKEND)
    return client


def test_it_edits_destinations_and_rules_and_only_reads_the_rest(world, superuser_client):
    for page in ("destination", "alertrule"):
        assert superuser_client.get(f"/admin/alerts/{page}/add/").status_code == 200, page
    for page in ("alertstate", "delivery"):
        assert superuser_client.get(f"/admin/alerts/{page}/").status_code == 200, page
        assert superuser_client.get(f"/admin/alerts/{page}/add/").status_code == 403, page

    response = superuser_client.post(
        "/admin/alerts/destination/add/",
        {"tenant": world.tenant_a.pk, "name": "ops", "kind": "webhook", "url": "https://hooks.example.com/x",
         "emails": "", "is_active": "on"},
    )  # fmt: skip
    assert response.status_code == 302, response.content.decode()[:3000]
    destination = Destination.objects.get(name="ops")
    assert destination.signing_secret.startswith("whsec_")
    audit = AuditLog.objects.get(action="alert_destination.create")
    assert audit.source == "admin" and "signing_secret" not in audit.details["after"]
