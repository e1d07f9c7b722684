"""The test databases are copies of one migrated template.

Migrating a fresh test database takes 15-40 s here, and the suite makes one per xdist worker; PostgreSQL copies a
database (`CREATE DATABASE ... TEMPLATE`) in about a second. So the first worker to arrive migrates a template,
named after the test database and marked with a fingerprint of the migrations and Django's version, and each
worker copies it; a template whose mark differs (a migration changed) is made again. Workers take turns under a
PostgreSQL advisory lock. tests/conftest.py's `django_db_setup` uses this in place of pytest-django's own.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import django
from django.conf import settings

ROOT = Path(__file__).resolve().parents[1]
LOCK = 0x7E57DB  # the advisory lock the workers take turns under


def fingerprint() -> str:
    digest = hashlib.sha256(django.get_version().encode())
    for path in sorted(ROOT.glob("*/migrations/*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def _switch(connection, name: str) -> None:
    connection.close()
    settings.DATABASES[connection.alias]["NAME"] = name
    connection.settings_dict["NAME"] = name


def _migrate_template(connection, template: str, mark: str) -> None:
    """Make `template` anew with Django's own create_test_db (migrate and the cache table), then mark it."""
    original, test_settings = connection.settings_dict["NAME"], connection.settings_dict["TEST"]
    old_test_name = test_settings.get("NAME")
    test_settings["NAME"] = template
    try:
        connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    finally:
        test_settings["NAME"] = old_test_name
        _switch(connection, original)
    quote = connection.ops.quote_name
    with connection.creation._nodb_cursor() as cursor:
        cursor.execute(f"COMMENT ON DATABASE {quote(template)} IS %s", [mark])


def create_test_database(connection) -> str:
    """Create this worker's test database as a copy of the template (made first if missing or stale), switch
    the connection to it and return the name the connection had before."""
    creation, quote = connection.creation, connection.ops.quote_name
    original = connection.settings_dict["NAME"]
    name = creation._get_test_db_name()  # test_<name>, with pytest-django's _gwN for an xdist worker
    template = f"test_{original}_template"
    mark = fingerprint()
    with creation._nodb_cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", [LOCK])
        try:
            cursor.execute(
                "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s", [template]
            )
            row = cursor.fetchone()
            if row is None or row[0] != mark:
                _migrate_template(connection, template, mark)
            cursor.execute(f"DROP DATABASE IF EXISTS {quote(name)}")
            cursor.execute(f"CREATE DATABASE {quote(name)} TEMPLATE {quote(template)}")
        finally:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [LOCK])
    _switch(connection, name)
    connection.ensure_connection()
    return original
