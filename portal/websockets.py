"""WebSocket routes of the portal, mounted by the web side's ASGI application (inference_platform/web_asgi.py)."""

from channels.auth import AuthMiddlewareStack
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import path

from .consumers import LiveTrafficConsumer

websocket_urlpatterns = [path("ws/portal/live/", LiveTrafficConsumer.as_asgi())]


def websocket_application():
    from channels.routing import URLRouter

    return AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))
