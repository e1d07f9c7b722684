"""Sending deliveries: webhooks (signed JSON) and e-mail (Django's e-mail backend), retried with backoff.

A webhook request carries three headers beside the JSON body:

    X-Platform-Delivery:  the delivery's id (the same on every retry: a receiver can drop repeats)
    X-Platform-Timestamp: Unix seconds when this attempt was signed
    X-Platform-Signature: v1=<hex HMAC-SHA256 of "<timestamp>.<body>" under the destination's signing secret>

A receiver recomputes the HMAC over the raw body, compares it in constant time and refuses old timestamps.

Each attempt is claimed by compare-and-set on the delivery's row (status pending and due), so a task and the
periodic sweep never send one delivery twice at once. A failure is retried after ALERT_DELIVERY_BACKOFF_S,
doubling each time, up to ALERT_DELIVERY_ATTEMPTS attempts; a receiver's 4xx other than 408 and 429 fails it at once.
Any other error of one attempt (a bug, a URL stored before it was validated) counts against its attempts too.

A webhook is the tenant's server, so nothing it does may hold a worker: an attempt has one deadline for everything
(connect, headers and body: ALERT_WEBHOOK_TIMEOUT_S, at most half the claim, so the claim cannot run out and let a
second attempt start beside it), only the first RESPONSE_READ_BYTES of the answer are read, and deliveries run on
the Celery queue "alerts" (settings.CELERY_TASK_ROUTES), served by workers of their own.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import smtplib
import socket
import time
from datetime import timedelta
from urllib.parse import urlsplit, urlunsplit

import httpx
from django.conf import settings
from django.core.mail import EmailMessage
from django.db.models import F
from django.utils import timezone

from .addresses import is_public_address, webhook_url_problem
from .messages import email_text
from .models import Delivery, DeliveryStatus, Destination, DestinationKind

log = logging.getLogger(__name__)

# How long an attempt holds its claim: a worker that dies mid-attempt leaves the delivery to the sweep after it.
CLAIM_S = 120
RETRYABLE_4XX = (408, 429)
# What is read of a receiver's answer: enough to show in last_error, never a body that fills the worker's memory.
RESPONSE_READ_BYTES = 4096


class DeliveryError(Exception):
    def __init__(self, message: str, *, status: int | None = None, permanent: bool = False):
        super().__init__(message)
        self.status = status
        self.permanent = permanent


def sign(secret: str, timestamp: int, body: bytes) -> str:
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"v1={digest}"


def signature_valid(secret: str, timestamp: str, body: bytes, signature: str) -> bool:
    """What a receiver does (the tests use it): recompute and compare in constant time."""
    return hmac.compare_digest(sign(secret, int(timestamp), body), signature)


def backoff(attempts: int) -> timedelta:
    seconds = settings.ALERT_DELIVERY_BACKOFF_S * 2 ** max(attempts - 1, 0)
    return timedelta(seconds=min(seconds, 3600))


def attempt_deadline_s() -> float:
    """The most one webhook attempt may take, all included: well inside its claim, so that no other worker can
    claim the delivery again while this attempt still runs."""
    return min(settings.ALERT_WEBHOOK_TIMEOUT_S, CLAIM_S / 2)


def delivery_attempt(*, delivery_id: int) -> Delivery | None:
    """Make one attempt at a due delivery; None when it is not due or another worker holds it."""
    now = timezone.now()
    claimed = Delivery.objects.filter(
        pk=delivery_id, status=DeliveryStatus.PENDING, next_attempt_at__lte=now
    ).update(
        next_attempt_at=now + timedelta(seconds=CLAIM_S), attempts=F("attempts") + 1, last_attempt_at=now
    )
    if claimed != 1:
        return None
    delivery = Delivery.objects.select_related("destination").get(pk=delivery_id)
    try:
        delivery.response_status = _send(delivery)
    except DeliveryError as exc:
        _failed(delivery, exc)
    except Exception as exc:  # noqa: BLE001 - a bug, or a row stored before validation: it counts all the same
        log.exception("alert delivery %s: unexpected error", delivery.pk)
        _failed(delivery, DeliveryError(f"{type(exc).__name__}: {exc}"))
    else:
        delivery.status, delivery.sent_at, delivery.last_error = DeliveryStatus.SENT, timezone.now(), ""
    delivery.save(update_fields=["status", "sent_at", "last_error", "response_status", "next_attempt_at"])
    return delivery


def _failed(delivery: Delivery, exc: DeliveryError) -> None:
    """Record a failed attempt: retried after the backoff, or failed for good."""
    delivery.last_error = str(exc)[:2000]
    delivery.response_status = exc.status
    if exc.permanent or delivery.attempts >= settings.ALERT_DELIVERY_ATTEMPTS:
        delivery.status = DeliveryStatus.FAILED
        log.warning("alert delivery %s failed for good: %s", delivery.pk, exc)
    else:
        delivery.next_attempt_at = timezone.now() + backoff(delivery.attempts)
        log.info("alert delivery %s failed (attempt %s), retrying: %s", delivery.pk, delivery.attempts, exc)


def due_deliveries(limit: int = 100) -> list[int]:
    return list(
        Delivery.objects.filter(status=DeliveryStatus.PENDING, next_attempt_at__lte=timezone.now())
        .order_by("next_attempt_at")
        .values_list("pk", flat=True)[:limit]
    )


def _send(delivery: Delivery) -> int | None:
    destination = delivery.destination
    if not destination.is_active:
        raise DeliveryError("The destination is switched off.", permanent=True)
    if destination.kind == DestinationKind.EMAIL:
        return _send_email(destination, delivery.payload)
    return _send_webhook(destination, delivery)


def _send_email(destination: Destination, payload: dict) -> None:
    message = EmailMessage(
        subject=payload["subject"],
        body=email_text(payload),
        from_email=settings.ALERT_EMAIL_FROM,
        to=list(destination.emails),
    )
    try:
        message.send()
    except (smtplib.SMTPException, OSError) as exc:
        raise DeliveryError(f"E-mail not accepted: {exc}") from exc
    return None


def webhook_body(payload: dict) -> bytes:
    body = {name: value for name, value in payload.items() if name != "subject"}
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def _send_webhook(destination: Destination, delivery: Delivery) -> int:
    problem = webhook_url_problem(destination.url)
    if problem:
        raise DeliveryError(problem, permanent=True)
    body = webhook_body(delivery.payload)
    timestamp = int(time.time())
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "inference-platform-alerts/1",
        # Only the first bytes of the answer are read: as sent, not a compressed body that inflates on reading.
        "Accept-Encoding": "identity",
        "X-Platform-Delivery": str(delivery.pk),
        "X-Platform-Timestamp": str(timestamp),
        "X-Platform-Signature": sign(destination.signing_secret, timestamp, body),
    }
    url, extensions = destination.url, {}
    if destination.tenant_id is not None and not settings.ALERT_WEBHOOK_ALLOW_PRIVATE:
        url, host = _public_address(destination.url)
        headers["Host"] = host
        extensions = {"sni_hostname": urlsplit(destination.url).hostname}
    deadline = attempt_deadline_s()
    try:
        status, head = asyncio.run(_post(url, body, headers, extensions, deadline))
    except TimeoutError as exc:
        raise DeliveryError(f"No complete answer within {deadline:g} s.") from exc
    except httpx.HTTPError as exc:
        raise DeliveryError(f"{type(exc).__name__}: {exc}") from exc
    if 200 <= status < 300:
        return status
    permanent = 400 <= status < 500 and status not in RETRYABLE_4XX
    raise DeliveryError(f"The receiver answered {status}: {head[:300]}", status=status, permanent=permanent)


async def _post(url: str, body: bytes, headers: dict, extensions: dict, deadline: float) -> tuple[int, str]:
    """POST and read at most RESPONSE_READ_BYTES of the answer, all within `deadline` seconds (httpx's own
    timeout is per read: a receiver sending a byte now and then would hold the attempt for ever)."""
    async with asyncio.timeout(deadline):
        async with httpx.AsyncClient(timeout=deadline, follow_redirects=False) as client:
            request = client.build_request("POST", url, content=body, headers=headers, extensions=extensions)
            response = await client.send(request, stream=True)
            try:
                head = bytearray()
                if not response.is_success:
                    async for chunk in response.aiter_raw():
                        head += chunk
                        if len(head) >= RESPONSE_READ_BYTES:
                            break
                return response.status_code, head[:RESPONSE_READ_BYTES].decode("utf-8", "replace")
            finally:
                await response.aclose()


def _public_address(url: str) -> tuple[str, str]:
    """The URL with its host resolved to a public address (and the Host header to send), so that a tenant's
    webhook cannot reach the platform's own network: the check and the connection use the same address, which
    DNS cannot change in between."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise DeliveryError(f"Cannot resolve {host}: {exc}") from exc
    for *_, sockaddr in infos:
        # The address itself is not said: a tenant would learn what the platform's internal names resolve to.
        if not is_public_address(ipaddress.ip_address(sockaddr[0])):
            raise DeliveryError(
                f"{host} does not resolve to a public address: a tenant's webhook must be public "
                "(operators can allow private ones with ALERT_WEBHOOK_ALLOW_PRIVATE).",
                permanent=True,
            )
    address = ipaddress.ip_address(infos[0][4][0])
    netloc = f"[{address}]" if address.version == 6 else str(address)
    if parts.port:
        netloc += f":{parts.port}"
    host_header = host if not parts.port else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, "")), host_header
