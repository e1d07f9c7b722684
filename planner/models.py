"""What-if runs: a recorded period of one deployment's traffic replayed on the deployment as it is and on a fleet
with an operator's changes (planner/whatif.py says what can change; planner/tasks.py runs it)."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class RunStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"


class WhatIfRun(models.Model):
    """One what-if: the period replayed, the changes, and, once simulated, both fleets' figures beside the
    period's actual ones (`result`, written once by the task)."""

    deployment = models.ForeignKey(
        "serving.ModelDeployment", on_delete=models.CASCADE, related_name="what_if_runs"
    )
    since = models.DateTimeField(help_text="Start of the recorded period, inclusive.")
    until = models.DateTimeField(help_text="End of the recorded period, exclusive.")
    baseline_profile = models.CharField(
        max_length=100, help_text="The performance profile the deployment's engines are simulated with."
    )
    changes = models.JSONField(default=dict, blank=True, help_text="What the changed fleet does differently.")
    status = models.CharField(max_length=10, choices=RunStatus.choices, default=RunStatus.PENDING)
    progress = models.PositiveSmallIntegerField(default=0, help_text="Percent done.")
    stage = models.CharField(max_length=100, blank=True, help_text="What the run is doing now.")
    message = models.TextField(blank=True, help_text="Why the run failed.")
    result = models.JSONField(null=True, blank=True)
    # The period's recorded requests when the run was created, which the limits were checked against: the run
    # replays no more, whatever reaches the trace for the period later (entries are drained after their request).
    trace_requests = models.PositiveIntegerField(
        null=True, blank=True, help_text="Recorded requests in the period when the run was created."
    )
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name = "what-if run"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(until__gt=models.F("since")),
                name="whatif_period_not_empty",
                violation_error_message="The period must end after it starts.",
            ),
            models.CheckConstraint(condition=models.Q(progress__lte=100), name="whatif_progress_percent"),
        ]

    def __str__(self) -> str:
        return f"what-if {self.pk} on {self.deployment_id} ({self.status})"

    @property
    def done(self) -> bool:
        return self.status in (RunStatus.SUCCEEDED, RunStatus.FAILED)
