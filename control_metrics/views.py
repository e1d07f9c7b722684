"""/metrics/platform and /metrics/engines on the web process, for the operator's Prometheus only: they name
deployments, engines, tenants and teams. Both answer `Authorization: Bearer <PLATFORM_METRICS_TOKEN>` and
nothing else; with no token set they are not served."""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .collector import registry
from .targets import engine_targets


def _authorised(request: HttpRequest) -> bool:
    token = settings.PLATFORM_METRICS_TOKEN
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(given.strip(), token)


def _refused() -> HttpResponse:
    response = JsonResponse({"detail": "Send `Authorization: Bearer <PLATFORM_METRICS_TOKEN>`."}, status=401)
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


@require_GET
def platform_metrics(request: HttpRequest) -> HttpResponse:
    if not _authorised(request):
        return _refused()
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


@require_GET
def engine_scrape_targets(request: HttpRequest) -> HttpResponse:
    if not _authorised(request):
        return _refused()
    return JsonResponse(engine_targets(), safe=False)
