"""API keys: only an HMAC of the secret is stored, the secret is shown once, and revocation is final."""

from django.db import connection

from tenants.keys import api_key_create, api_key_revoke, api_key_verify, key_hmac
from tenants.models import ApiKey, Scope


def dump_database() -> str:
    """Every row of every table in the database, as text."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        tables = [row[0] for row in cursor.fetchall()]
        chunks = []
        for table in tables:
            cursor.execute(f'SELECT row_to_json(t)::text FROM "{table}" t')
            chunks.extend(row[0] for row in cursor.fetchall())
    assert len(tables) > 10
    return "\n".join(chunks)


def test_it_stores_no_secret_anywhere_in_the_database(world, client_for):
    response = client_for(world.team_admin_a1).post(
        "/api/keys/", {"team": world.team_a1.pk, "name": "ci bot"}, format="json"
    )
    assert response.status_code == 201
    secret = response.json()["key"]
    dump = dump_database()
    assert secret.split("_")[1] in dump  # the visible prefix is stored, so the dump is real
    for issued in (world.key_a1, world.key_a2, world.key_b1):
        assert issued.secret not in dump
        assert issued.secret.split("_", 2)[2] not in dump
    assert secret not in dump and secret.split("_", 2)[2] not in dump


def test_it_stores_the_hmac_of_the_key_with_the_pepper(world, settings):
    key = world.key_a1.api_key
    assert key.secret_hmac == key_hmac(world.key_a1.secret)
    settings.API_KEY_PEPPER = "another pepper"
    assert key.secret_hmac != key_hmac(world.key_a1.secret)
    assert api_key_verify(world.key_a1.secret) is None  # a key does not survive a change of pepper


def test_it_verifies_a_key_and_refuses_a_tampered_one(world):
    assert api_key_verify(world.key_a1.secret) == world.key_a1.api_key
    tampered = world.key_a1.secret[:-1] + ("A" if world.key_a1.secret[-1] != "A" else "B")
    assert api_key_verify(tampered) is None
    assert api_key_verify("not-a-key") is None
    assert api_key_verify(world.key_a1.secret.replace("ipk_", "sk_")) is None


def test_it_refuses_a_revoked_or_expired_key(world):
    assert api_key_revoke(api_key=world.key_a1.api_key) is True
    assert api_key_revoke(api_key=world.key_a1.api_key) is False  # already revoked: nothing changes
    assert api_key_verify(world.key_a1.secret) is None
    from datetime import timedelta

    from django.utils import timezone

    ApiKey.objects.filter(pk=world.key_a2.api_key.pk).update(
        expires_at=timezone.now() + timedelta(milliseconds=1)
    )
    import time

    time.sleep(0.01)
    assert api_key_verify(world.key_a2.secret) is None


def test_it_shows_the_secret_on_create_and_never_again(world, client_for):
    client = client_for(world.admin_a)
    created = client.post(
        "/api/keys/", {"team": world.team_a2.pk, "name": "k", "scopes": ["inference"]}, format="json"
    )
    assert created.status_code == 201
    body = created.json()
    assert body["key"].startswith(body["prefix"] + "_")
    assert created["Cache-Control"] == "no-store"
    detail = client.get(f"/api/keys/{body['id']}/")
    listing = client.get("/api/keys/")
    for response in (detail, listing):
        assert response.status_code == 200
        assert body["key"] not in response.content.decode()
        assert '"key"' not in response.content.decode()


def test_it_makes_distinct_keys(world):
    keys = {
        api_key_create(team=world.team_a1, name=f"k{i}", scopes=[Scope.INFERENCE]).secret for i in range(20)
    }
    assert len(keys) == 20
