"""Single sign-on sessions are checked with the identity provider again every OIDC_SESSION_REFRESH_S (settings:
OIDC_RENEW_ID_TOKEN_EXPIRY_SECONDS), so that someone the provider drops, or moves out of a group, loses what it gave
within that interval rather than when the session ends (two weeks).

The check is mozilla-django-oidc's: a page load sends the browser to the provider with prompt=none, and the
provider answers the callback at once, with a sign-in (whose claims the group rules are applied to again: grants
taken back, the session ended when none is left) or with an error such as login_required (the session is ended).
Only a page load can make that round trip; any other request of a session whose check is due (a form's POST, the
API, a script's fetch) is refused with a 403 until a page load has renewed it. Sessions signed in with a password
are never checked.
"""

from __future__ import annotations

import functools
import time

from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils.module_loading import import_string
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.middleware import SessionRefresh as ProviderCheck

# Where the library's callback keeps when the next check is due (seconds since the epoch).
CHECK_DUE_KEY = "oidc_id_token_expiration"
# Reached while a check is due: the sign-in's own steps, and signing out.
EXEMPT = [
    "sso:authenticate",
    "sso:callback",
    "sso:refused",
    "portal:logout",
    "admin:logout",
    "rest_framework:logout",
]


def signed_in_by_sso(session) -> bool:
    backend = session.get(BACKEND_SESSION_KEY)
    if not backend:
        return False
    try:
        return issubclass(import_string(backend), OIDCAuthenticationBackend)
    except ImportError:
        return False


def check_due(session) -> bool:
    """Whether this session signed in through the provider and is due for its check (a session from before checks
    existed has no time: it is due)."""
    return signed_in_by_sso(session) and session.get(CHECK_DUE_KEY, 0) <= time.time()


@functools.cache
def _exempt_paths() -> frozenset[str]:
    return frozenset(reverse(name) for name in EXEMPT)


class _PageCheck(ProviderCheck):
    """The library's redirect to the provider (state, nonce and PKCE kept in the session as for a sign-in), built
    with the settings as they are now; whether to check was decided by SessionRefresh."""

    def is_refreshable_url(self, request: HttpRequest) -> bool:
        return True


class SessionRefresh:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self._check(request) or self.get_response(request)

    def _check(self, request: HttpRequest) -> HttpResponse | None:
        if not settings.OIDC_RP_CLIENT_ID or not check_due(request.session):
            return None
        if request.path in _exempt_paths() or not request.user.is_authenticated:
            return None
        if request.method in ("GET", "HEAD") and _page_load(request):
            return _PageCheck(self.get_response).process_request(request)
        return _refused(request)


def _page_load(request: HttpRequest) -> bool:
    """A browser loading a page (it can follow the provider's redirects), not a script or an API client."""
    return _wants_html(request) and request.headers.get("x-requested-with") != "XMLHttpRequest"


def _wants_html(request: HttpRequest) -> bool:
    return "text/html" in request.headers.get("accept", "")


def _refused(request: HttpRequest) -> HttpResponse:
    message = (
        f"Your single sign-on session is due for its check with {settings.OIDC_PROVIDER_NAME}: load any page of the "
        "portal to renew it, then try again. Nothing was changed."
    )
    if not _wants_html(request):
        return JsonResponse({"detail": message}, status=403)
    context = {"message": message, "provider": settings.OIDC_PROVIDER_NAME, "sso_enabled": True}
    return render(request, "sso/refused.html", context, status=403)
