"""The web side's ASGI application: the admin, the portal, the REST API and the portal's live-traffic WebSocket
(`/ws/portal/live/`), on one port, behind one session cookie.

Served by gunicorn with uvicorn workers:
`gunicorn inference_platform.web_asgi:application --worker-class uvicorn_worker.UvicornWorker`.
The router (inference_platform/asgi.py) is another process on another port, for API keys only.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

django_asgi_app = get_asgi_application()  # sets Django up before the portal's consumers import models

from channels.routing import ProtocolTypeRouter  # noqa: E402

from portal.websockets import websocket_application  # noqa: E402


def web_application(http=django_asgi_app) -> ProtocolTypeRouter:
    """Django's pages (or `http`, such as a test's handler that also serves static files) and the WebSocket."""
    return ProtocolTypeRouter({"http": http, "websocket": websocket_application()})


application = web_application()
