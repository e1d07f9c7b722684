"""The few Kubernetes API calls the orchestrator makes, through the official client.

The client's ApiClient does the connection work (kubeconfig or in-cluster credentials, TLS, tokens); the calls
themselves are generic over the kinds we manage, so that built-in kinds and custom resources (LeaderWorkerSet,
InferencePool) go through one code path: server-side apply (PATCH with application/apply-patch+yaml under one
field manager), list by label selector, delete.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import urllib3
from django.conf import settings
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

PLURALS = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "NetworkPolicy": "networkpolicies",
    "Service": "services",
    "Pod": "pods",
    "Deployment": "deployments",
    "LeaderWorkerSet": "leaderworkersets",
    "InferencePool": "inferencepools",
}
# Worth another try: a conflicting write, throttling, or the API server (or the way to it) failing.
RETRYABLE = {409, 429, 500, 502, 503, 504}

T = TypeVar("T")


class KubernetesError(RuntimeError):
    """An API call failed for good (after retries where a retry could help)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ClusterNotConfigured(KubernetesError):
    pass


def cluster_configured() -> bool:
    return settings.KUBERNETES_IN_CLUSTER or bool(settings.KUBERNETES_KUBECONFIG)


def api_client() -> client.ApiClient:
    """A client for the cluster named in settings: the pod's service account, or a kubeconfig and context."""
    if settings.KUBERNETES_IN_CLUSTER:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    if not settings.KUBERNETES_KUBECONFIG:
        raise ClusterNotConfigured(
            "no cluster configured: set KUBERNETES_KUBECONFIG (and KUBERNETES_CONTEXT) or KUBERNETES_IN_CLUSTER"
        )
    configuration = client.Configuration()
    config.load_kube_config(
        config_file=settings.KUBERNETES_KUBECONFIG,
        context=settings.KUBERNETES_CONTEXT,
        client_configuration=configuration,
    )
    return client.ApiClient(configuration)


def _path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    group = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{group}/namespaces/{namespace}/{PLURALS[kind]}"
    return f"{path}/{name}" if name else path


class KubeApi:
    def __init__(self, api: client.ApiClient | None = None):
        self.api = api or api_client()

    def _call(self, method: str, path: str, *, query=None, body=None, content_type="application/json"):
        return self.api.call_api(
            path,
            method,
            query_params=query or [],
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            response_types_map={200: "object", 201: "object", 202: "object"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
            _request_timeout=settings.KUBERNETES_API_TIMEOUT_S,
        )

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """Retry conflicts, throttling and server errors with exponential backoff; raise KubernetesError after."""
        attempts = settings.KUBERNETES_API_RETRIES + 1
        for attempt in range(attempts):
            try:
                return call()
            except ApiException as exc:
                status, reason = exc.status, f"{exc.status} {exc.reason}"
                if status not in RETRYABLE or attempt == attempts - 1:
                    raise KubernetesError(f"{what}: {reason}", status) from exc
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                status, reason = None, str(exc)
                if attempt == attempts - 1:
                    raise KubernetesError(f"{what}: {reason}") from exc
            delay = settings.KUBERNETES_API_BACKOFF_S * 2**attempt
            log.warning("%s: %s; retry in %.1f s", what, reason, delay)
            time.sleep(delay)
        raise AssertionError("unreachable")

    def apply(self, obj: dict) -> dict:
        """Server-side apply under our field manager; fields another manager holds are taken over (force)."""
        meta = obj["metadata"]
        path = _path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        query = [("fieldManager", settings.KUBERNETES_FIELD_MANAGER), ("force", "true")]
        return self._retrying(
            f"apply {obj['kind']} {meta['namespace']}/{meta['name']}",
            lambda: self._call(
                "PATCH", path, query=query, body=obj, content_type="application/apply-patch+yaml"
            ),
        )

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict]:
        """The objects of a kind with these labels; none when the kind is not installed (a CRD missing)."""
        path = _path(api_version, kind, namespace)

        def call():
            try:
                return self._call("GET", path, query=[("labelSelector", selector)])
            except ApiException as exc:
                if exc.status == 404:
                    return {"items": []}
                raise

        items = self._retrying(f"list {kind} in {namespace}", call).get("items") or []
        for item in items:  # a list's items carry no kind of their own
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        path = _path(api_version, kind, namespace, name)

        def call():
            try:
                # Background: the garbage collector removes what the object owns (pods, or a root's children).
                self._call("DELETE", path, query=[("propagationPolicy", "Background")])
            except ApiException as exc:
                if exc.status != 404:
                    raise

        self._retrying(f"delete {kind} {namespace}/{name}", call)
