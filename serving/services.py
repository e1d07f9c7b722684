"""Serving services: reconcile deployments with what runs, and ask for that after every change."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from django.db import connection, transaction
from django.utils import timezone

from tenants.audit import snapshot

from .models import Endpoint, ModelDeployment, ObservedStatus, OrchestratorKind
from .orchestrators import ORCHESTRATORS, LocalOrchestrator, ReconcileResult, orchestrator_for

log = logging.getLogger(__name__)


def deployment_snapshot(deployment: ModelDeployment) -> dict:
    """A deployment and its pools as the audit log records them, wherever it is changed from."""
    data = snapshot(deployment)
    data["pools"] = {pool.name: snapshot(pool) for pool in deployment.pools.order_by("name")}
    return data


# The first key of the PostgreSQL advisory locks that keep two reconciles of one deployment apart.
RECONCILE_LOCK_CLASS = 0x5E7E


@contextlib.contextmanager
def _deployment_lock(deployment_id: int) -> Iterator[bool]:
    """Hold a session lock on the deployment while reconciling; yield False when another holds it.

    A session-level advisory lock, not a row lock: a reconcile may take seconds (stopping engines) and
    must not hold a transaction open, and PostgreSQL drops the lock by itself if the worker dies.
    """
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", [RECONCILE_LOCK_CLASS, deployment_id])
        acquired = cursor.fetchone()[0]
    try:
        yield acquired
    finally:
        if acquired:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s, %s)", [RECONCILE_LOCK_CLASS, deployment_id])


def deployment_reconcile(*, deployment_id: int) -> ReconcileResult | None:
    """Make what runs match the deployment and record what was observed.

    Returns None when there is nothing to do here: the deployment is gone, its orchestrator kind has no
    implementation in this build, or another reconcile of it is under way.
    """
    with _deployment_lock(deployment_id) as acquired:
        if not acquired:
            log.info("deployment %s is being reconciled elsewhere; skipped", deployment_id)
            return None
        deployment = ModelDeployment.objects.filter(pk=deployment_id).first()
        if deployment is None:
            return None
        orchestrator = orchestrator_for(deployment.orchestrator)
        if orchestrator is None:
            log.debug("no %s orchestrator in this build; %s left alone", deployment.orchestrator, deployment)
            return None
        try:
            result = orchestrator.reconcile(deployment)
        except Exception as exc:
            # Recorded for the operator, then raised: the task retries with backoff (a cluster's API may be
            # briefly unreachable or answer 409/5xx after the orchestrator's own retries).
            ModelDeployment.objects.filter(pk=deployment_id).update(
                observed_status=ObservedStatus.FAILED,
                status_message=f"Reconcile failed: {exc}",
                observed_at=timezone.now(),
            )
            raise
        # update(), not save(): the operator may be editing the deployment at this very moment.
        ModelDeployment.objects.filter(pk=deployment_id).update(
            observed_status=result.status, status_message=result.message, observed_at=timezone.now()
        )
        return result


def engines_sweep() -> list[str]:
    """Stop every engine that belongs to no deployment any more (deleted, or moved to another orchestrator)."""
    gone: list[str] = []
    for kind, orchestrator_class in ORCHESTRATORS.items():
        ids = set(ModelDeployment.objects.filter(orchestrator=kind).values_list("pk", flat=True))
        try:
            gone += orchestrator_class().sweep(ids)
        except Exception:
            # One orchestrator's trouble (a cluster out of reach) must not keep the others from sweeping.
            log.exception("sweeping %s engines failed", kind)
    return gone


def deployments_reconcile_all() -> dict[int, str]:
    """Reconcile every deployment, then sweep; one deployment's failure does not stop the others."""
    outcome: dict[int, str] = {}
    for deployment_id in ModelDeployment.objects.values_list("pk", flat=True):
        try:
            result = deployment_reconcile(deployment_id=deployment_id)
        except Exception as exc:
            log.exception("reconciling deployment %s failed", deployment_id)
            ModelDeployment.objects.filter(pk=deployment_id).update(
                observed_status=ObservedStatus.FAILED,
                status_message=f"Reconcile failed: {exc}",
                observed_at=timezone.now(),
            )
            outcome[deployment_id] = "error"
            continue
        outcome[deployment_id] = result.status if result else "skipped"
    engines_sweep()
    return outcome


def deployment_changed(*, deployment_id: int) -> None:
    """After the current transaction commits, have the workers reconcile this deployment."""
    from .tasks import reconcile_deployment

    transaction.on_commit(lambda: _enqueue(reconcile_deployment, deployment_id))


def deployment_deleted() -> None:
    """After the current transaction commits, have the workers stop the deleted deployment's engines."""
    from .tasks import sweep_engines

    transaction.on_commit(lambda: _enqueue(sweep_engines))


def _enqueue(task, *args) -> None:
    # The beat reconciles everything every few seconds anyway; a broker hiccup must not fail the request.
    try:
        task.apply_async(args=args, retry=True, retry_policy={"max_retries": 2, "interval_start": 0.2})
    except Exception:
        log.exception("could not enqueue %s%s; the periodic reconcile will catch up", task.name, args)


def engines_stop_all() -> list[str]:
    """Stop every local engine this platform instance runs, and record that (when the platform stops).

    Local engines only: they live and die with this machine's platform, unlike a cluster's.
    """
    gone = LocalOrchestrator().sweep(set())
    deployments = ModelDeployment.objects.filter(orchestrator=OrchestratorKind.LOCAL)
    deployments.update(
        observed_status=ObservedStatus.STOPPED,
        status_message="The platform stopped its engines.",
        observed_at=timezone.now(),
    )
    Endpoint.objects.filter(pool__deployment__in=deployments).delete()
    return gone
