"""The kubernetes orchestrator: a deployment's pools as Deployments or LeaderWorkerSets on a cluster.

Each reconcile renders what the deployment wants (kube_render), lists what the cluster has under our labels,
server-side-applies what differs under one field manager, deletes what is no longer wanted, and reads the pods
back into Endpoint rows. An object is sent only when it differs from what runs: the hash of what we last applied
is kept in an annotation (it catches fields we stopped setting) and every field we set is compared with the live
one (it catches someone else's edits). So a second reconcile in a row sends nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Collection
from datetime import datetime

from django.conf import settings
from django.utils import timezone

from inference_platform.config_version import bump_config_version_on_commit

from .. import drain
from ..autoscaling import unschedulable_note
from ..engine_command import UnsupportedEngineOption
from ..lifetimes import lifetime_close, lifetime_open, lifetime_ready
from ..models import (
    DesiredStatus,
    Endpoint,
    Health,
    KvConnector,
    ModelDeployment,
    ObservedStatus,
    OrchestratorKind,
    Pool,
)
from . import kube_render as render
from .base import Orchestrator, ReconcileResult
from .kube_api import KubeApi, KubernetesError, cluster_configured

log = logging.getLogger(__name__)

HASH_ANNOTATION = "inference-platform/applied-hash"
# The ReplicaSet controller deletes the pods of lowest cost first when a Deployment scales down.
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
DRAIN_DELETION_COST = -1_000_000


def applied_hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def contains(live, desired) -> bool:
    """Whether every field set in `desired` has that value in `live` (which may hold more: defaults, status)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            contains(live.get(key), value) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(contains(a, b) for a, b in zip(live, desired, strict=True))
        )
    return live == desired


def _with_hash(obj: dict) -> dict:
    annotated = json.loads(json.dumps(obj))
    annotated["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = applied_hash(obj)
    return annotated


def _selector(deployment_id: int | None = None) -> str:
    selector = f"{render.LABEL_MANAGED_BY}={render.MANAGER}"
    if deployment_id is not None:
        selector += f",{render.LABEL_DEPLOYMENT_ID}={deployment_id}"
    return selector


def _group_index(name: str) -> int:
    """A LeaderWorkerSet leader pod's group index (`<set>-<group>`)."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _started_at(pod: dict) -> datetime | None:
    created = pod["metadata"].get("creationTimestamp")
    return datetime.fromisoformat(created.replace("Z", "+00:00")) if created else None


def _ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _pod_health(pod: dict) -> str:
    status = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp") or status.get("phase") in ("Failed", "Succeeded"):
        return Health.UNHEALTHY
    if _ready(pod):
        return Health.HEALTHY
    restarted = any(c.get("restartCount", 0) > 0 for c in status.get("containerStatuses") or [])
    return Health.UNHEALTHY if restarted else Health.STARTING


def _unschedulable(pod: dict) -> str | None:
    """The scheduler's reason when it found no node for the pod (e.g. "0/68 nodes are available: 68
    Insufficient nvidia.com/gpu."), else None."""
    if pod.get("spec", {}).get("nodeName"):
        return None
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return (condition.get("message") or "no node has room").split(" preemption:")[0].rstrip(". ")
    return None


class KubernetesOrchestrator(Orchestrator):
    kind = OrchestratorKind.KUBERNETES

    def __init__(self, api: KubeApi | None = None):
        self._api = api

    @property
    def api(self) -> KubeApi:
        if self._api is None:
            self._api = KubeApi()
        return self._api

    # --- one deployment ----------------------------------------------------------------------------------

    def reconcile(self, deployment: ModelDeployment) -> ReconcileResult:
        namespace = render.namespace_of(deployment)
        if namespace not in settings.KUBERNETES_NAMESPACES:
            return ReconcileResult(
                ObservedStatus.FAILED,
                f"Namespace {namespace} is not one the orchestrator may use ({', '.join(settings.KUBERNETES_NAMESPACES)}).",
            )
        running = deployment.desired_status == DesiredStatus.RUNNING
        try:
            # Rendered once up front (with a stand-in owner) so a bad pool or setting changes nothing on the cluster.
            render.render_engine_access(deployment, owner=None)
            render.render_children(deployment, owner=None) if running else []
        except UnsupportedEngineOption as exc:
            return ReconcileResult(ObservedStatus.FAILED, f"Cannot render: {exc}.")

        live = self._live(namespace, deployment.pk)
        endpoints_changed = self._read_endpoints(deployment, namespace)
        draining = self._drain(deployment, namespace, live) if running else {}
        applied: list[str] = []
        root = self._apply(render.render_root(deployment), live, applied)
        owner = render.owner_reference(deployment, root["metadata"]["uid"])
        desired = [render.render_root(deployment), *render.render_engine_access(deployment, owner)]
        if running:
            desired += render.render_children(deployment, owner, draining)
        for obj in desired[1:]:
            self._apply(obj, live, applied)
        pruned = self._prune(live, {render.object_key(obj) for obj in desired})
        if applied or pruned or endpoints_changed:
            bump_config_version_on_commit()
        result = self._summary(deployment, namespace, applied, pruned)
        if any(draining.values()):
            result = ReconcileResult(
                result.status,
                result.message + f" Draining {sum(draining.values())} replica(s).",
                result.endpoints,
                settling=True,
            )
        return result

    def _drain(self, deployment: ModelDeployment, namespace: str, live: dict) -> dict[int, int]:
        """Scale-down without dropping a request (serving/drain.py). When a pool's replicas drop below what its
        live workload serves, the pods whose loss costs least are marked draining and made the ones its
        controller deletes first (`controller.kubernetes.io/pod-deletion-cost`); the workload keeps them, counted
        here per pool, until nothing is in flight there. A LeaderWorkerSet removes its highest groups, so those are
        drained. Pods beyond the replicas during a rolling update are not a scale-down: the live workload's own
        replicas, not the pods, decide."""
        kept: dict[int, int] = {}
        for pool in deployment.pools.all():
            api_version, kind = render.LWS_API if pool.nodes_per_replica > 1 else render.DEPLOYMENT_API
            workload = live.get((api_version, kind, render.pool_object_name(deployment, pool)))
            rows = list(Endpoint.objects.filter(pool=pool).order_by("name"))
            serving = [e for e in rows if e.draining_since is None]
            going = [
                e for e in rows if e.draining_since is not None
            ]  # drained ones stay until their pod goes
            leaving = [e for e in going if not drain.drained(self.redis, e)]
            if workload is None:
                continue
            excess = int(workload["spec"].get("replicas") or 0) - len(going) - pool.replicas
            if excess > 0 and serving:
                if pool.nodes_per_replica > 1:
                    victims = sorted(serving, key=lambda e: _group_index(e.name))[-excess:]
                else:
                    victims = drain.choose_victims(self.redis, serving, excess)
                drain.start_draining(victims)
                for victim in victims:
                    self._mark_for_deletion(namespace, victim.name)
                leaving += victims
            elif excess < 0 and leaving and pool.nodes_per_replica == 1:
                back = leaving[:-excess]
                drain.stop_draining(back)
                for endpoint in back:
                    self._mark_for_deletion(namespace, endpoint.name, cost=None)
                leaving = leaving[len(back) :]
            kept[pool.pk] = len(leaving)
        return kept

    def _mark_for_deletion(self, namespace: str, pod: str, cost: int | None = DRAIN_DELETION_COST) -> None:
        """Set (or, with None, clear) the pod's deletion cost, under our field manager."""
        annotations = {} if cost is None else {POD_DELETION_COST: str(cost)}
        self.api.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod, "namespace": namespace, "annotations": annotations},
            }
        )

    @functools.cached_property
    def redis(self):
        import redis

        return redis.Redis.from_url(settings.REDIS_URL)

    def _live(self, namespace: str, deployment_id: int) -> dict[tuple[str, str, str], dict]:
        live = {}
        for api_version, kind in render.MANAGED_KINDS:
            for obj in self.api.list(api_version, kind, namespace, _selector(deployment_id)):
                live[render.object_key(obj)] = obj
        return live

    def _apply(self, obj: dict, live: dict, applied: list[str]) -> dict:
        """Apply `obj` unless the cluster already has it as we would leave it; return the live object."""
        current = live.get(render.object_key(obj))
        annotations = (current or {}).get("metadata", {}).get("annotations") or {}
        if (
            current is not None
            and annotations.get(HASH_ANNOTATION) == applied_hash(obj)
            and contains(current, obj)
        ):
            return current
        result = self.api.apply(_with_hash(obj))
        applied.append(f"{obj['kind']}/{obj['metadata']['name']}")
        return result

    def _prune(self, live: dict, wanted: set) -> list[str]:
        pruned = []
        for key, obj in live.items():
            if key not in wanted:
                api_version, kind, name = key
                self.api.delete(api_version, kind, obj["metadata"]["namespace"], name)
                pruned.append(f"{kind}/{name}")
        return pruned

    # --- what runs ---------------------------------------------------------------------------------------

    def _read_endpoints(self, deployment: ModelDeployment, namespace: str) -> bool:
        """One Endpoint per serving pod that has an IP; returns whether any row changed. Pods the scheduler
        could not place are kept, per pool, for the summary."""
        pods = self.api.list("v1", "Pod", namespace, _selector(deployment.pk))
        self._unschedulable = {}
        for pod in pods:
            reason = _unschedulable(pod)
            if reason is not None:
                pool = pod["metadata"].get("labels", {}).get(render.LABEL_POOL, "")
                count, _ = self._unschedulable.get(pool, (0, ""))
                self._unschedulable[pool] = (count + 1, reason)
        changed = False
        for pool in deployment.pools.all():
            serving = [
                pod
                for pod in pods
                if pod["metadata"].get("labels", {}).get(render.LABEL_POOL) == pool.name
                and (pod.get("status") or {}).get("podIP")
                # In a LeaderWorkerSet only the leader (worker index 0) serves HTTP.
                and pod["metadata"]["labels"].get(render.LWS_WORKER_INDEX_LABEL, "0") == "0"
            ]
            if deployment.desired_status != DesiredStatus.RUNNING:
                serving = []
            changed |= self._sync_pool_endpoints(pool, serving)
            waiting = self._unschedulable.get(pool.name, (0, ""))[0]
            unschedulable_note(self.redis, pool.pk, waiting)
        return changed

    def _sync_pool_endpoints(self, pool: Pool, pods: list[dict]) -> bool:
        now = timezone.now()
        changed = False
        names = set()
        for pod in pods:
            name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
            names.add(name)
            wanted = {
                "url": f"http://{ip}:{render.HTTP_PORT}",
                "role": pool.role,
                "kv_events_endpoint": f"tcp://{ip}:{render.KV_EVENTS_PORT}" if pool.enable_kv_events else "",
                "kv_side_channel": f"{ip}:{render.SIDE_CHANNEL_PORT}"
                if pool.kv_connector in (KvConnector.NIXL, KvConnector.MULTI)
                else "",
                "health": _pod_health(pod),
            }
            endpoint = Endpoint.objects.filter(pool=pool, name=name).first()
            if endpoint and all(getattr(endpoint, key) == value for key, value in wanted.items()):
                if wanted["health"] == Health.HEALTHY:
                    Endpoint.objects.filter(pk=endpoint.pk).update(last_seen_at=now)
                continue
            # A pod IP is unique in the cluster now; an older row may still hold it from a pod that is gone.
            for stale in Endpoint.objects.filter(url=wanted["url"]).exclude(pool=pool, name=name):
                lifetime_close(stale, now)
                stale.delete()
            if wanted["health"] == Health.HEALTHY:
                wanted["last_seen_at"] = now
            if endpoint is None:
                endpoint = Endpoint(pool=pool, name=name)
                lifetime_open(endpoint, pool.deployment, pool, _started_at(pod))
            was_healthy = endpoint.health == Health.HEALTHY and endpoint.pk is not None
            for key, value in wanted.items():
                setattr(endpoint, key, value)
            endpoint.save()
            if wanted["health"] == Health.HEALTHY and not was_healthy:
                lifetime_ready(endpoint, now)
            changed = True
        gone = list(Endpoint.objects.filter(pool=pool).exclude(name__in=names))
        for endpoint in gone:
            lifetime_close(endpoint, now)
            endpoint.delete()
        return changed or bool(gone)

    def _summary(
        self, deployment: ModelDeployment, namespace: str, applied: list[str], pruned: list[str]
    ) -> ReconcileResult:
        notes = []
        if applied:
            notes.append(f"applied {', '.join(applied)}")
        if pruned:
            notes.append(f"deleted {', '.join(pruned)}")
        endpoints = list(Endpoint.objects.filter(pool__deployment=deployment).values_list("name", flat=True))
        if deployment.desired_status != DesiredStatus.RUNNING:
            return ReconcileResult(ObservedStatus.STOPPED, "; ".join(["Stopped", *notes]) + ".", endpoints)
        workloads = {}
        for api_version, kind in (render.DEPLOYMENT_API, render.LWS_API):
            for obj in self.api.list(api_version, kind, namespace, _selector(deployment.pk)):
                workloads[obj["metadata"]["labels"].get(render.LABEL_POOL)] = obj
        lines, ready_pools, any_ready = [], 0, False
        pools = list(deployment.pools.all())
        unschedulable = getattr(self, "_unschedulable", {})
        for pool in pools:
            status = (workloads.get(pool.name) or {}).get("status") or {}
            ready = int(status.get("readyReplicas") or 0)
            any_ready |= ready > 0
            ready_pools += ready >= pool.replicas
            line = f"{pool.name}: {ready} of {pool.replicas} replicas ready"
            if pool.name in unschedulable:
                count, reason = unschedulable[pool.name]
                line += f", {count} cannot be scheduled ({reason})"
            lines.append(line)
        message = "; ".join([*lines, *notes]) + "."
        if ready_pools == len(pools):
            return ReconcileResult(ObservedStatus.READY, message, endpoints)
        # Pods the cluster has no room for wait for capacity, not for a start: degraded, not "progressing".
        stuck = any(pool.name in unschedulable for pool in pools)
        status = ObservedStatus.DEGRADED if any_ready or stuck else ObservedStatus.PROGRESSING
        return ReconcileResult(status, message, endpoints, settling=True)

    # --- deployments that are gone -----------------------------------------------------------------------

    def sweep(self, deployment_ids: Collection[int]) -> list[str]:
        """Delete what we created for deployments that no longer exist (or moved to another orchestrator)."""
        if not cluster_configured():
            return []
        gone = []
        for namespace in settings.KUBERNETES_NAMESPACES:
            for api_version, kind in render.MANAGED_KINDS:
                for obj in self.api.list(api_version, kind, namespace, _selector()):
                    owner = obj["metadata"].get("labels", {}).get(render.LABEL_DEPLOYMENT_ID, "")
                    if owner.isdigit() and int(owner) not in deployment_ids:
                        self.api.delete(api_version, kind, namespace, obj["metadata"]["name"])
                        gone.append(f"{namespace}/{kind}/{obj['metadata']['name']}")
        return gone


__all__ = ["KubernetesError", "KubernetesOrchestrator"]
