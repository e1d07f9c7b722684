"""The router's ASGI application: the /v1 data plane agents call, with their API keys.

Run it with an ASGI server, e.g. `uvicorn inference_platform.asgi:application --loop uvloop --http routing.server.http_server:LimitedHttpToolsProtocol`.
HTTP and lifespan only: the admin, the portal (its live-traffic WebSocket included) and the REST API are the web
side's (inference_platform/web_asgi.py), so operators' session cookies never reach the router's port.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

get_asgi_application()  # sets Django up before the router imports models

from routing.server.app import Router  # noqa: E402

application = Router()
