"""The what-if run as a Celery task: claim the run, simulate, store the result or the reason it failed."""

from __future__ import annotations

import logging

from celery import shared_task
from django.utils import timezone

from .models import RunStatus, WhatIfRun

log = logging.getLogger(__name__)


@shared_task(name="planner.run_what_if")
def run_what_if(run_id: int) -> str:
    """Run a pending what-if (a run left running by a worker that died starts again from the beginning: the
    simulation is deterministic, so the result is the same). Every error ends the run as failed, with a message."""
    from .whatif import WhatIfError, whatif_execute, whatif_progress

    claimed = WhatIfRun.objects.filter(pk=run_id, status__in=[RunStatus.PENDING, RunStatus.RUNNING]).update(
        status=RunStatus.RUNNING, progress=0, stage="starting", message="", started_at=timezone.now()
    )
    if claimed != 1:
        return "not pending"
    run = WhatIfRun.objects.select_related("deployment").get(pk=run_id)
    try:
        result = whatif_execute(run, lambda percent, stage: whatif_progress(run_id, percent, stage))
    except WhatIfError as exc:
        return _fail(run_id, str(exc))
    except Exception as exc:  # a run ends failed with a message, never as a crashed task
        log.exception("what-if %s failed", run_id)
        return _fail(run_id, f"the simulation failed: {type(exc).__name__}: {exc}")
    # Only while still running: a run failed as lost in the meantime (PLANNER_WHATIF_TIMEOUT_S) stays failed.
    stored = WhatIfRun.objects.filter(pk=run_id, status=RunStatus.RUNNING).update(
        status=RunStatus.SUCCEEDED, progress=100, stage="", result=result, finished_at=timezone.now()
    )
    return "succeeded" if stored else "taken as lost"


def _fail(run_id: int, message: str) -> str:
    WhatIfRun.objects.filter(pk=run_id).update(
        status=RunStatus.FAILED, stage="", message=message[:2000], finished_at=timezone.now()
    )
    return "failed"
