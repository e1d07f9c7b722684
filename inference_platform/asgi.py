"""The router's ASGI application (Channels): the /v1 data plane agents call.

Run it with an ASGI server, e.g. `uvicorn inference_platform.asgi:application --loop uvloop --http httptools`.
The admin, the portal and the REST API are served by the WSGI app (gunicorn) instead.
"""

import os

from channels.routing import ProtocolTypeRouter
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

django_asgi_app = get_asgi_application()  # sets Django up before the router imports models

from portal.routing import websocket_application  # noqa: E402
from routing.app import Router  # noqa: E402

router = Router()

application = ProtocolTypeRouter(
    {"http": router, "lifespan": router, "websocket": websocket_application()}  # portal's live traffic
)
