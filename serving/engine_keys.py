"""The API key that an engine on Kubernetes requires on its OpenAI routes, one per deployment.

The key is derived, not stored: an HMAC of the deployment id under the platform's secret. The kubernetes
orchestrator puts it in a Secret that the engine pods read as VLLM_API_KEY; the router computes the same key
for every engine call without a database read or a Redis round trip. Changing the secret changes every key
(the orchestrator's next reconcile rewrites the Secrets and rolls the engine pods).
"""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings

# Keeps these HMACs apart from any other use of the same secret.
_PURPOSE = b"inference-platform engine api key v1:"


def _secret() -> bytes:
    # A dedicated ENGINE_KEY_SECRET when the settings define one, else SECRET_KEY.
    return (getattr(settings, "ENGINE_KEY_SECRET", "") or settings.SECRET_KEY).encode()


def engine_api_key(deployment_id: int) -> str:
    """The bearer token the engines of deployment `deployment_id` accept (64 hex digits)."""
    message = _PURPOSE + str(int(deployment_id)).encode()
    return hmac.new(_secret(), message, hashlib.sha256).hexdigest()
