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


class CallbackView(OIDCAuthenticationCallbackView):
    def login_failure(self):
        # A refused sign-in ends any session this browser had: who is signed in must not depend on it.
        if self.request.user.is_authenticated:
            auth.logout(self.request)
        code = getattr(self.request, "sso_refusal", "failed")
        return HttpResponseRedirect(f"{reverse('sso:refused')}?{urlencode({'reason': code})}")


def sign_in_callback(request):
    if not sso_enabled():
        raise Http404("Single sign-on is not configured.")
    return CallbackView.as_view()(request)


def refused(request):
    reason = request.GET.get("reason")
    message = REFUSALS.get(reason, REFUSALS["failed"])
    return render(
        request,
        "sso/refused.html",
        {"message": message, "provider": settings.OIDC_PROVIDER_NAME, "sso_enabled": sso_enabled()},
        status=403,
    )
