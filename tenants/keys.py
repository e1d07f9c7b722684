"""API keys: issue, verify, revoke. Only an HMAC of a key with the server pepper is ever stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from django.conf import settings
from django.utils import timezone

from inference_platform.config_version import bump_config_version_on_commit

from .audit import audited
from .entitlements import entitlement_snapshot
from .models import ApiKey, Team

if TYPE_CHECKING:
    from serving.models import ModelDeployment

_PUBLIC_ID_ALPHABET = "abcdefghijkmnpqrstuvwxyz23456789"
PUBLIC_ID_LENGTH = 12


def key_hmac(raw_key: str) -> str:
    return hmac.new(settings.API_KEY_PEPPER.encode(), raw_key.encode(), hashlib.sha256).hexdigest()


def parse_key(raw_key: str) -> str | None:
    """The public id inside a key of the form `ipk_<public_id>_<secret>`, or None if it is not one."""
    parts = raw_key.split("_", 2)
    if (
        len(parts) != 3
        or parts[0] != settings.API_KEY_PREFIX
        or len(parts[1]) != PUBLIC_ID_LENGTH
        or not parts[2]
    ):
        return None
    return parts[1]


@dataclass(frozen=True)
class IssuedKey:
    api_key: ApiKey
    secret: str  # the full key; shown to its owner once and never stored


def api_key_create(
    *,
    team: Team,
    name: str,
    scopes: list[str],
    expires_at: datetime | None = None,
    priority_class: str = "",
    deployments: Iterable[ModelDeployment] = (),
    actor=None,
    source: str = "api",
) -> IssuedKey:
    """Issue a key. `priority_class` blank: the team's; `deployments` empty: all its team may call."""
    public_id = "".join(secrets.choice(_PUBLIC_ID_ALPHABET) for _ in range(PUBLIC_ID_LENGTH))
    raw_key = f"{settings.API_KEY_PREFIX}_{public_id}_{secrets.token_urlsafe(32)}"
    with audited("api_key", actor=actor, source=source, snapshot_of=entitlement_snapshot) as change:
        api_key = change.instance = ApiKey.objects.create(
            team=team,
            name=name,
            public_id=public_id,
            secret_hmac=key_hmac(raw_key),
            scopes=sorted(set(scopes)),
            expires_at=expires_at,
            priority_class=priority_class,
            created_by=actor if getattr(actor, "pk", None) else None,
        )
        if deployments:
            api_key.deployments.set(deployments)
    return IssuedKey(api_key=api_key, secret=raw_key)


def api_key_revoke(*, api_key: ApiKey, actor=None, source: str = "api") -> bool:
    """Revoke a key. Returns False when it was already revoked (and then changes nothing)."""
    with audited("api_key", api_key, actor=actor, source=source, verb="revoke"):
        now = timezone.now()
        updated = ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=now)
        if not updated:
            return False
        api_key.revoked_at = now
        bump_config_version_on_commit()  # routers drop the key within their poll interval
    return True


def api_key_verify(raw_key: str) -> ApiKey | None:
    """The active key matching `raw_key`, or None. Compares HMACs in constant time."""
    public_id = parse_key(raw_key)
    if public_id is None:
        return None
    api_key = ApiKey.objects.select_related("team__tenant").filter(public_id=public_id).first()
    if api_key is None or not hmac.compare_digest(api_key.secret_hmac, key_hmac(raw_key)):
        return None
    return api_key if api_key.is_active else None
