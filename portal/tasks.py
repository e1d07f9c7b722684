"""Celery beat: the billing roll-up (tenants/billing.py) every minute.

It lives here because Celery discovers `tasks` modules per app; the work itself is tenants' billing code.
"""

from __future__ import annotations

from celery import shared_task

from inference_platform.celery import app
from tenants.billing import usage_rollup

ROLLUP_EVERY_S = 60.0


@shared_task(acks_late=True, ignore_result=True)
def rollup_usage() -> int:
    """Add the ledger's new records to the daily roll-ups; a second run at once finds nothing to do."""
    return usage_rollup()


def _schedule_rollup(sender, **kwargs) -> None:
    sender.add_periodic_task(ROLLUP_EVERY_S, rollup_usage.s(), name="rollup-usage", expires=ROLLUP_EVERY_S)


# Imported after the app is finalised (autodiscovery), the signal has already fired.
if app.finalized:
    _schedule_rollup(app)
else:
    app.on_after_finalize.connect(_schedule_rollup, weak=False)
