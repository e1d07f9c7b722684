"""REST API credentials: a browser session, a personal token (`Authorization: Bearer <token>`), or an
API key with the `read-usage` scope, which may read its own team's usage and nothing else."""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication, get_authorization_header

from ..access import Access
from ..keys import api_key_verify
from ..models import ApiKey, Scope


class BearerTokenAuthentication(TokenAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        if _bearer(request).startswith(f"{settings.API_KEY_PREFIX}_"):
            return None  # an API key: ApiKeyAuthentication's to judge
        return super().authenticate(request)


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


class ApiKeyAuthentication(TokenAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        raw = _bearer(request)
        if not raw.startswith(f"{settings.API_KEY_PREFIX}_"):
            return None
        api_key = api_key_verify(raw)
        if api_key is None:
            raise exceptions.AuthenticationFailed("Invalid, expired or revoked API key.")
        if Scope.READ_USAGE not in api_key.scopes:
            raise exceptions.PermissionDenied("This API key lacks the read-usage scope.")
        return KeyPrincipal(api_key), api_key


def _bearer(request) -> str:
    parts = get_authorization_header(request).split()
    if len(parts) == 2 and parts[0].lower() == b"bearer":
        return parts[1].decode(errors="replace")
    return ""


class PersonalTokenScheme(OpenApiAuthenticationExtension):
    target_class = BearerTokenAuthentication
    name = "personalToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "A person's API token."}


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = ApiKeyAuthentication
    name = "apiKey"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key with the read-usage scope (usage only).",
        }
