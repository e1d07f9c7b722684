"""Sign-in throttling (django-axes): which address a sign-in comes from, and what a locked-out one is told."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpResponse, JsonResponse
from django.shortcuts import render


def client_ip(request) -> str | None:
    """The connection's address; behind TRUSTED_PROXY_COUNT proxies (BEHIND_TLS_PROXY), the address the outermost
    trusted proxy appended to X-Forwarded-For. Addresses further left are the client's own say and not trusted.
    DRF's throttles pick the same one (NUM_PROXIES)."""
    proxies = settings.TRUSTED_PROXY_COUNT
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    if proxies and forwarded:
        hops = [hop.strip() for hop in forwarded.split(",") if hop.strip()]
        if hops:
            return hops[-min(proxies, len(hops))]
    return request.META.get("REMOTE_ADDR")


def lockout_response(request, *args, **kwargs) -> HttpResponse:
    """429 for a username refused after too many failed sign-ins from this address: JSON for the API's token
    endpoint, a page for the admin, the portal and the browsable API."""
    minutes = int(settings.AXES_COOLOFF_TIME.total_seconds() // 60)
    detail = (
        f"Too many failed sign-ins for this username from your address: try again in {minutes} minutes, "
        "or ask an operator to unlock it."
    )
    if request.path.startswith("/api/") and not request.path.startswith("/api/auth/login"):
        return JsonResponse({"detail": detail}, status=429, headers={"Retry-After": str(minutes * 60)})
    return render(request, "portal/locked_out.html", {"detail": detail}, status=429)
