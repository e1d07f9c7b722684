"""Celery tasks for tenants: writing the usage stream into the ledger."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from inference_platform.celery import app

from .usage_stream import consumer_name, usage_ingest_until_empty, usage_stream_trim

INGEST_EVERY_S = 2.0


@shared_task(acks_late=True, ignore_result=True)
def ingest_usage() -> int:
    """Drain the usage stream for at most a few seconds, then trim what the group has acknowledged (never an
    entry not yet written); beat starts another run every two seconds."""
    written = usage_ingest_until_empty(
        consumer=consumer_name(), max_seconds=settings.USAGE_INGEST_MAX_SECONDS
    )
    usage_stream_trim()
    return written


def _schedule_ingest(sender, **kwargs) -> None:
    # A run older than the interval is dropped: the next one does the same work.
    sender.add_periodic_task(INGEST_EVERY_S, ingest_usage.s(), name="ingest-usage", expires=INGEST_EVERY_S)


# This module may be imported after the app is finalised (autodiscovery), when the signal has already fired.
if app.finalized:
    _schedule_ingest(app)
else:
    app.on_after_finalize.connect(_schedule_ingest, weak=False)
