"""REST API credentials: a browser session, a personal token (`Authorization: Bearer ipt_...`), or an
API key with the `read-usage` scope, which may read its own team's usage and nothing else.

Personal tokens are django-rest-knox tokens: only a SHA-512 digest is stored, and each expires
(`PERSONAL_TOKEN_TTL_HOURS`). Whatever the credential, someone whose tenant is deactivated is refused (403).
"""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.authentication import SessionScheme
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from knox.auth import TokenAuthentication as KnoxTokenAuthentication
from rest_framework import exceptions
from rest_framework.authentication import (
    BaseAuthentication,
    SessionAuthentication,
    get_authorization_header,
)

from ..access import TENANT_DEACTIVATED, Access
from ..keys import api_key_verify
from ..models import ApiKey, Scope


def refuse_locked_out(user) -> None:
    """Refuse a person whose every membership is in a deactivated tenant."""
    if Access.for_user(user).locked_out:
        raise exceptions.PermissionDenied(TENANT_DEACTIVATED)


class PersonalTokenAuthentication(KnoxTokenAuthentication):
    """A person's API token, made at `POST /api/auth/token/` or on the portal's token page."""

    def authenticate(self, request):
        if _bearer(request).startswith(f"{settings.API_KEY_PREFIX}_"):
            return None  # an API key: ApiKeyAuthentication's to judge
        return super().authenticate(request)

    def authenticate_credentials(self, token: bytes):
        try:
            token.decode()
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("Invalid token.") from None
        return super().authenticate_credentials(token)

    def validate_user(self, auth_token):
        user, auth_token = super().validate_user(auth_token)
        refuse_locked_out(user)
        return user, auth_token


class ActiveTenantSessionAuthentication(SessionAuthentication):
    """A signed-in browser session, refused when the person's tenant is deactivated."""

    def authenticate(self, request):
        result = super().authenticate(request)
        if result is not None:
            refuse_locked_out(result[0])
        return result


class KeyPrincipal:
    """The caller when a request is authenticated by an API key rather than by a person."""

    is_authenticated = True
    is_anonymous = False
    is_superuser = False
    is_staff = False
    pk = None

    def __init__(self, api_key: ApiKey):
        self.api_key = api_key

    def get_username(self) -> str:
        return f"key:{self.api_key.prefix}"

    @property
    def access(self) -> Access:
        team = self.api_key.team
        return Access(False, frozenset(), frozenset(), frozenset({team.id}), frozenset({team.tenant_id}))


class ApiKeyAuthentication(BaseAuthentication):
    def authenticate_header(self, request) -> str:
        return "Bearer"

    def authenticate(self, request):
        raw = _bearer(request)
        if not raw.startswith(f"{settings.API_KEY_PREFIX}_"):
            return None
        api_key = api_key_verify(raw)
        if api_key is None:
            raise exceptions.AuthenticationFailed("Invalid, expired or revoked API key.")
        if not api_key.team.tenant.is_active:
            raise exceptions.PermissionDenied(TENANT_DEACTIVATED)
        if Scope.READ_USAGE not in api_key.scopes:
            raise exceptions.PermissionDenied("This API key lacks the read-usage scope.")
        return KeyPrincipal(api_key), api_key


def _bearer(request) -> str:
    parts = get_authorization_header(request).split()
    if len(parts) == 2 and parts[0].lower() == b"bearer":
        return parts[1].decode(errors="replace")
    return ""


class PersonalTokenScheme(OpenApiAuthenticationExtension):
    target_class = PersonalTokenAuthentication
    name = "personalToken"
    priority = 1  # before drf-spectacular's own description of knox tokens

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A person's API token (`ipt_...`), from `POST /api/auth/token/`; it expires.",
        }


class ActiveTenantSessionScheme(SessionScheme):
    target_class = ActiveTenantSessionAuthentication


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = ApiKeyAuthentication
    name = "apiKey"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key with the read-usage scope (usage only).",
        }
