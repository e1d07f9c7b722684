"""The kubernetes orchestrator: a deployment's pools as Deployments or LeaderWorkerSets on a cluster.

Each reconcile renders what the deployment wants (kube_render), lists what the cluster has under our labels,
server-side-applies what differs under one field manager, deletes what is no longer wanted, and reads the pods
back into Endpoint rows. An object is sent only when it differs from what runs: the hash of what we last applied
is kept in an annotation (it catches fields we stopped setting) and every field we set is compared with the live
one (it catches someone else's edits). So a second reconcile in a row sends nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Collection

from django.conf import settings
from django.utils import timezone

from inference_platform.config_version import bump_config_version_on_commit

from ..engine_command import UnsupportedEngineOption
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
            # Rendered once up front (with a stand-in owner) so a bad pool changes nothing on the cluster.
            render.render_children(deployment, owner=None) if running else []
        except UnsupportedEngineOption as exc:
            return ReconcileResult(ObservedStatus.FAILED, f"Cannot render: {exc}.")

        live = self._live(namespace, deployment.pk)
        applied: list[str] = []
        root = self._apply(render.render_root(deployment), live, applied)
        owner = render.owner_reference(deployment, root["metadata"]["uid"])
        desired = [render.render_root(deployment)]
        if running:
            desired += render.render_children(deployment, owner)
            for obj in desired[1:]:
                self._apply(obj, live, applied)
        pruned = self._prune(live, {render.object_key(obj) for obj in desired})
        endpoints_changed = self._read_endpoints(deployment, namespace)
        if applied or pruned or endpoints_changed:
            bump_config_version_on_commit()
        return self._summary(deployment, namespace, applied, pruned)

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
        """One Endpoint per serving pod that has an IP; returns whether any row changed."""
        pods = self.api.list("v1", "Pod", namespace, _selector(deployment.pk))
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
            Endpoint.objects.filter(url=wanted["url"]).exclude(pool=pool, name=name).delete()
            if wanted["health"] == Health.HEALTHY:
                wanted["last_seen_at"] = now
            Endpoint.objects.update_or_create(pool=pool, name=name, defaults=wanted)
            changed = True
        deleted, _ = Endpoint.objects.filter(pool=pool).exclude(name__in=names).delete()
        return changed or bool(deleted)

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
        for pool in pools:
            status = (workloads.get(pool.name) or {}).get("status") or {}
            ready = int(status.get("readyReplicas") or 0)
            any_ready |= ready > 0
            ready_pools += ready >= pool.replicas
            lines.append(f"{pool.name}: {ready} of {pool.replicas} replicas ready")
        message = "; ".join([*lines, *notes]) + "."
        if ready_pools == len(pools):
            return ReconcileResult(ObservedStatus.READY, message, endpoints)
        status = ObservedStatus.DEGRADED if any_ready else ObservedStatus.PROGRESSING
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
