"""A real OpenID Connect provider for the single sign-on tests: Django OAuth Toolkit with OIDC on, in its own
process over its own SQLite file, signing ID tokens with an RSA key the test generates (PROVIDER_RSA_KEY)."""

import os
from pathlib import Path

SECRET_KEY = os.environ["PROVIDER_SECRET_KEY"]
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "oauth2_provider",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
ROOT_URLCONF = "tests.sso.provider.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [Path(__file__).parent / "templates"],
        "OPTIONS": {"context_processors": ["django.template.context_processors.request"]},
    }
]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["PROVIDER_DB"]}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
# The platform under test runs on the same host: its cookies must not collide with the provider's.
SESSION_COOKIE_NAME = "provider_sessionid"
CSRF_COOKIE_NAME = "provider_csrftoken"
LOGIN_URL = "/accounts/login/"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast; test accounts only
OAUTH2_PROVIDER = {
    "OIDC_ENABLED": True,
    "OIDC_RSA_PRIVATE_KEY": os.environ["PROVIDER_RSA_KEY"],
    "PKCE_REQUIRED": True,
    "SCOPES": {
        "openid": "OpenID Connect",
        "email": "E-mail address",
        "profile": "Profile",
        "groups": "Groups",
    },
    "OAUTH2_VALIDATOR_CLASS": "tests.sso.provider.validator.GroupsValidator",
}
# A failure inside the provider shows its traceback in provider.log (the test's temporary folder).
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django.request": {"handlers": ["console"], "level": "ERROR"}},
}
