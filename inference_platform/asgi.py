"""The ASGI entry point (Channels). The /v1 data plane mounts here; everything else is Django."""

import os

from channels.routing import ProtocolTypeRouter
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

django_asgi_app = get_asgi_application()

application = ProtocolTypeRouter({"http": django_asgi_app})
