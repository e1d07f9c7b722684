"""Celery beat: the billing roll-up (tenants/billing.py), which also adds the ledger's new records to the
per-minute and per-hour series; sampling the engines' scraped load into the history (portal/history.py); and
pruning the history's old rows.

They live here because Celery discovers `tasks` modules per app; the roll-up itself is tenants' billing code.
The sampler and the pruner are scheduled in settings (CELERY_BEAT_SCHEDULE).
"""

from __future__ import annotations

from celery import shared_task

from inference_platform.celery import app
from tenants.billing import usage_rollup

from .history import history_prune, history_sample

# Often enough that the live page's last hour trails the ledger by seconds; each run holds the ledger's SHARE
# lock only while it adds the records that came since the last one.
ROLLUP_EVERY_S = 15.0


@shared_task(acks_late=True, ignore_result=True)
def rollup_usage() -> int:
    """Add the ledger's new records to the daily roll-ups and the series; a second run at once finds nothing."""
    return usage_rollup()


@shared_task(acks_late=True, ignore_result=True)
def sample_history() -> int:
    return history_sample()


@shared_task(acks_late=True, ignore_result=True)
def prune_history() -> int:
    return history_prune()


def _schedule_rollup(sender, **kwargs) -> None:
    sender.add_periodic_task(ROLLUP_EVERY_S, rollup_usage.s(), name="rollup-usage", expires=ROLLUP_EVERY_S)


# Imported after the app is finalised (autodiscovery), the signal has already fired.
if app.finalized:
    _schedule_rollup(app)
else:
    app.on_after_finalize.connect(_schedule_rollup, weak=False)
