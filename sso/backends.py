"""Authentication backends: the identity provider's (OpenID Connect authorization-code flow, through
mozilla-django-oidc), and the switch that turns password sign-in off."""

from __future__ import annotations

import logging

from django.conf import settings
from django.core.exceptions import PermissionDenied, SuspiciousOperation
from mozilla_django_oidc.auth import OIDCAuthenticationBackend

from .services import SignInRefused, sso_sign_in

log = logging.getLogger(__name__)


class LocalSignInSwitch:
    """Refuses every username-and-password sign-in (the portal's, the admin's, the browsable API's forms and
    POST /api/auth/token/) when LOCAL_SIGN_IN is off. Placed before ModelBackend, which still answers for
    permissions. It signs no one in, so it has no get_user (Django's test client picks the first backend with one).
    """

    def authenticate(self, request, username=None, password=None, **kwargs):
        if password is not None and not settings.LOCAL_SIGN_IN:
            raise PermissionDenied("Password sign-in is switched off; sign in with single sign-on.")
        return None


class OidcBackend(OIDCAuthenticationBackend):
    """Signs in the person the provider vouches for: matched by issuer and subject, created on first sign-in,
    their roles from the group rules (sso/services.py). A refusal's reason is left on the request for the
    callback view's page."""

    def get_or_create_user(self, access_token, id_token, payload):
        userinfo = self.get_userinfo(access_token, id_token, payload)
        if str(userinfo.get("sub")) != str(payload.get("sub")):
            raise SuspiciousOperation("The userinfo answer is about another subject than the ID token.")
        try:
            return sso_sign_in(claims={**userinfo, "iss": payload["iss"], "sub": payload["sub"]})
        except SignInRefused as refusal:
            log.info("single sign-on refused %s at %s: %s", payload["sub"], payload["iss"], refusal.code)
            self.request.sso_refusal = refusal.code
            return None


def outside_sign_in_limits(request, credentials: dict | None) -> bool:
    """django-axes' whitelist: a sign-in without a password (the provider's callback) is neither counted nor
    locked out. The provider checked the person; a refusal there is about groups, not a guessed password, and
    counting it would lock everyone behind the same address out of single sign-on."""
    return credentials is not None and "password" not in credentials and "nonce" in credentials
