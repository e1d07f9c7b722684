"""The routing pipeline's modules import Django (the policy's fields come from its model). The planner reads no
database: where no settings are configured, it configures the few apps those modules need and nothing else."""

from __future__ import annotations

import os

APPS = ["django.contrib.contenttypes", "django.contrib.auth", "tenants", "serving", "routing"]


def ensure_django() -> None:
    """Make the routing modules importable: the project's settings when DJANGO_SETTINGS_MODULE names them (as
    under the test suite), else a bare configuration with no reachable database."""
    import django
    from django.apps import apps
    from django.conf import settings

    if apps.ready:
        return
    if not settings.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        settings.configure(
            INSTALLED_APPS=APPS,
            # Never connected to: the planner makes no query.
            DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "planner-unused"}},
            USE_TZ=True,
        )
    django.setup()
