"""Serving services: change deployments (each change audited and followed by a reconcile), and reconcile them
with what runs.

The deployment writes are the only place a deployment or its pools are created, changed or deleted: the REST API,
the portal and the demo bootstrap call them, each naming itself as the audit row's `source` ("api", "portal",
"system").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.utils import timezone

from tenants.audit import audit_record, audited, snapshot

from .model_length import LENGTH_FIELDS, max_model_len_check
from .models import (
    AutoscalingPolicy,
    Endpoint,
    ModelDeployment,
    ObservedStatus,
    OrchestratorKind,
    Pool,
    PoolRole,
    ScalingEvent,
)
from .orchestrators import ORCHESTRATORS, LocalOrchestrator, ReconcileResult, orchestrator_for

log = logging.getLogger(__name__)


def deployment_snapshot(deployment: ModelDeployment) -> dict:
    """A deployment and its pools as the audit log records them, wherever it is changed from."""
    data = snapshot(deployment)
    data["pools"] = {pool.name: snapshot(pool) for pool in deployment.pools.order_by("name")}
    return data


def _audited(actor, source: str, deployment: ModelDeployment | None = None, *, delete: bool = False):
    return audited(
        "deployment", deployment, actor=actor, source=source, snapshot_of=deployment_snapshot, delete=delete
    )


def pools_check(pools: Sequence[Mapping[str, Any]]) -> None:
    """A deployment's set of pools: unique names, and prefill and decode pools only together."""
    names = [pool["name"] for pool in pools]
    if len(names) != len(set(names)):
        raise ValidationError("Pool names must be unique within a deployment.")
    roles = {pool.get("role", PoolRole.BOTH) for pool in pools}
    if (PoolRole.PREFILL in roles) != (PoolRole.DECODE in roles):
        raise ValidationError("A disaggregated deployment needs both a prefill and a decode pool.")


def _pool_save(pool: Pool, fields: Mapping[str, Any]) -> None:
    for name, value in fields.items():
        setattr(pool, name, value)
    pool.full_clean()
    pool.save()


def deployment_create(
    *,
    actor,
    source: str,
    fields: Mapping[str, Any],
    pools: Sequence[Mapping[str, Any]] = (),
) -> ModelDeployment:
    """A deployment with its pools (each a mapping of Pool fields); its engines start on the reconcile that
    follows the commit. Raises ValidationError for what the models refuse."""
    pools_check(pools)
    with _audited(actor, source) as change:
        deployment = change.instance = ModelDeployment(**fields)
        deployment.full_clean()
        max_model_len_check(deployment, pools)
        deployment.save()
        for pool_fields in pools:
            _pool_save(Pool(deployment=deployment), pool_fields)
        deployment_changed(deployment_id=deployment.pk)
    return deployment


def deployment_update(
    *,
    actor,
    source: str,
    deployment: ModelDeployment,
    fields: Mapping[str, Any],
    pools: Sequence[Mapping[str, Any]] | None = None,
) -> ModelDeployment:
    """Change a deployment's fields; `pools`, when given, is its whole new set of pools, matched by name (those
    not named are deleted). Audited when anything changed; reconciled after the commit either way."""
    if pools is not None:
        pools_check(pools)
    with transaction.atomic():
        deployment = ModelDeployment.objects.select_for_update().get(pk=deployment.pk)
        with _audited(actor, source, deployment):
            for name, value in fields.items():
                setattr(deployment, name, value)
            deployment.full_clean()
            if pools is not None or LENGTH_FIELDS & fields.keys():
                max_model_len_check(deployment, deployment.pools.all() if pools is None else pools)
            deployment.save()
            if pools is not None:
                deployment.pools.exclude(name__in=[pool["name"] for pool in pools]).delete()
                existing = {pool.name: pool for pool in deployment.pools.all()}
                for pool_fields in pools:
                    pool = existing.get(pool_fields["name"]) or Pool(deployment=deployment)
                    replicas_before = pool.replicas if pool.pk else None
                    _pool_save(pool, pool_fields)
                    if replicas_before is not None and replicas_before != pool.replicas:
                        autoscaling_pause(actor=actor, source=source, pool=pool, before=replicas_before)
        deployment_changed(deployment_id=deployment.pk)
    return deployment


AUTOSCALER = "autoscaler"  # the source (and actor) of the autoscaler's changes


def pool_scale(*, actor, source: str, pool: Pool, replicas: int) -> bool:
    """Set a pool's replicas; returns False when it already had that many. A person's change (any source but
    the autoscaler's) turns the pool's autoscaling off, so the autoscaler never undoes it; it is recorded as a
    scaling event beside the autoscaler's."""
    with transaction.atomic():
        pool = Pool.objects.select_for_update().get(pk=pool.pk)
        if pool.replicas == replicas:
            return False
        before = pool.replicas
        pool.replicas = replicas
        pool.full_clean()
        pool.save(update_fields=["replicas"])
        audit_record(
            actor=actor,
            action="deployment.scale",
            instance=pool.deployment,
            source=source,
            details={"changes": {f"pools.{pool.name}.replicas": [before, replicas]}},
        )
        if source != AUTOSCALER:
            autoscaling_pause(actor=actor, source=source, pool=pool, before=before)
        deployment_changed(deployment_id=pool.deployment_id)
    return True


def autoscaling_pause(*, actor, source: str, pool: Pool, before: int) -> bool:
    """A person set a pool's replicas (from `before` to what it has now): its autoscaling goes off until it is
    turned back on, so the autoscaler never undoes the edit; recorded as a scaling event. True if it was on."""
    who = getattr(actor, "get_username", lambda: "the system")() if actor is not None else "the system"
    paused = AutoscalingPolicy.objects.filter(pool=pool, enabled=True).update(
        enabled=False,
        paused_reason=f"Paused: {who} set the replicas to {pool.replicas} ({source}).",
        updated_at=timezone.now(),
    )
    if paused:
        ScalingEvent.objects.create(
            pool=pool,
            from_replicas=before,
            to_replicas=pool.replicas,
            actor=who[:40],
            reason=f"set by hand ({source}); autoscaling paused until it is turned back on",
        )
    return bool(paused)


def deployment_delete(*, actor, source: str, deployment: ModelDeployment) -> None:
    """Delete a deployment and its pools; its engines are stopped by the sweep that follows the commit."""
    with _audited(actor, source, deployment, delete=True):
        deployment.delete()
        deployment_deleted()


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


@dataclass
class Sweep:
    gone: list[str]
    draining: int  # engines left running until they are idle (drained), to be swept again soon


def engines_sweep() -> Sweep:
    """Stop every engine that belongs to no deployment any more (deleted, or moved to another orchestrator),
    each once it is drained."""
    result = Sweep([], 0)
    for kind, orchestrator_class in ORCHESTRATORS.items():
        ids = set(ModelDeployment.objects.filter(orchestrator=kind).values_list("pk", flat=True))
        try:
            orchestrator = orchestrator_class()
            result.gone += orchestrator.sweep(ids)
            result.draining += getattr(orchestrator, "orphans_draining", 0)
        except Exception:
            # One orchestrator's trouble (a cluster out of reach) must not keep the others from sweeping.
            log.exception("sweeping %s engines failed", kind)
    return result


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
    gone = LocalOrchestrator().sweep(set(), drain_first=False)
    deployments = ModelDeployment.objects.filter(orchestrator=OrchestratorKind.LOCAL)
    deployments.update(
        observed_status=ObservedStatus.STOPPED,
        status_message="The platform stopped its engines.",
        observed_at=timezone.now(),
    )
    Endpoint.objects.filter(pool__deployment__in=deployments).delete()
    return gone
