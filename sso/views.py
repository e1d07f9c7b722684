"""The sign-in's two ends (off, 404, unless the provider is configured) and the page that says why a sign-in was
refused."""

from __future__ import annotations

from django.conf import settings
from django.contrib import auth
from django.http import Http404, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils.http import urlencode
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from .services import REFUSALS


def sso_enabled() -> bool:
    return bool(settings.OIDC_RP_CLIENT_ID)


def sign_in_start(request):
    if not sso_enabled():
        raise Http404("Single sign-on is not configured.")
    return OIDCAuthenticationRequestView.as_view()(request)


# The provider's answers to a prompt=none check (sso/refresh.py) that mean it no longer vouches for the person.
SESSION_ENDED = {"login_required", "interaction_required", "consent_required", "account_selection_required"}


class CallbackView(OIDCAuthenticationCallbackView):
    def get(self, request):
        # Only the answer to a sign-in or check this browser started (its state is in the session) may change who
        # is signed in here: otherwise any page could sign the person out by linking to this address.
        if request.GET.get("state") not in request.session.get("oidc_states", {}):
            return _refused_page(request, "stale", status=400)
        return super().get(request)

    def login_failure(self):
        # A refused sign-in ends any session this browser had: who is signed in must not depend on it.
        if self.request.user.is_authenticated:
            auth.logout(self.request)
        code = getattr(self.request, "sso_refusal", None)
        if code is None:
            code = "ended" if self.request.GET.get("error") in SESSION_ENDED else "failed"
        return HttpResponseRedirect(f"{reverse('sso:refused')}?{urlencode({'reason': code})}")


def sign_in_callback(request):
    if not sso_enabled():
        raise Http404("Single sign-on is not configured.")
    return CallbackView.as_view()(request)


def refused(request):
    return _refused_page(request, request.GET.get("reason"), status=403)


def _refused_page(request, reason: str | None, *, status: int):
    message = REFUSALS.get(reason, REFUSALS["failed"])
    return render(
        request,
        "sso/refused.html",
        {"message": message, "provider": settings.OIDC_PROVIDER_NAME, "sso_enabled": sso_enabled()},
        status=status,
    )
