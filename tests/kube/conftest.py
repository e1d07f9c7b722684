"""The control-plane tier: a real Kubernetes API server, controller-manager and scheduler for the session, GPU
nodes kept Ready, and a kubelet stand-in that runs the pods' engines (tests/kube/harness.py says what is real and
what stands in). Without the binaries its tests are skipped, saying how to get them; with them, a control plane
that does not start fails the tier."""

from __future__ import annotations

import itertools
import subprocess
import time

import pytest
from kubernetes import client, config

from .harness import ROOT, ControlPlane, ControlPlaneMissing, FakeKubelet, FakeNodes, service_account_token

DEPLOY = ROOT / "deploy"
ENGINES_NAMESPACE = "inference"
_node_names = itertools.count(1)


# Package scope: the control plane runs while this folder's tests do, not for the rest of the suite (pytest-django
# runs transactional tests last, so the folder's tests may come in two runs, each starting it in 5-10 s).
@pytest.fixture(scope="package")
def control_plane(tmp_path_factory):
    try:
        plane = ControlPlane(tmp_path_factory.mktemp("control-plane"))
    except ControlPlaneMissing as exc:
        pytest.skip(str(exc))
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="package")
def kube_admin(control_plane) -> client.ApiClient:
    return control_plane.api()


def kubectl(control_plane, *args: str, input: str | None = None, kubeconfig=None) -> str:
    run = subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig or control_plane.kubeconfig), *args],
        capture_output=True,
        text=True,
        input=input,
        timeout=120,
    )
    if run.returncode:
        raise AssertionError(f"kubectl {' '.join(args)} failed:\n{run.stderr}")
    return run.stdout


def crds_established(control_plane, timeout: float = 60) -> None:
    """Wait until every CRD the API server holds serves its kind (a CRD just made has no status yet)."""
    extensions = client.ApiextensionsV1Api(control_plane.api())
    deadline = time.monotonic() + timeout
    while not all(
        any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])
        for crd in extensions.list_custom_resource_definition().items
    ):
        assert time.monotonic() < deadline, f"the CRDs were not established within {timeout} s"
        time.sleep(0.2)


@pytest.fixture(scope="package")
def platform_installed(control_plane):
    """The CRDs the platform needs, then the dev overlay, applied server-side as an operator would."""
    kubectl(control_plane, "apply", "--server-side", "-f", str(DEPLOY / "crds"))
    crds_established(control_plane)
    kubectl(control_plane, "apply", "--server-side", "-k", str(DEPLOY / "overlays" / "dev"))
    return control_plane


@pytest.fixture
def nodes(kube_admin):
    """Fresh GPU nodes for one test (names never reused); removed after it."""
    fake = FakeNodes(kube_admin)
    made: list[str] = []

    def add(count: int = 1, gpus: int = 8) -> list[str]:
        names = [f"gpu-node-{next(_node_names)}" for _ in range(count)]
        for name in names:
            fake.add(name, gpus=gpus)
        made.extend(names)
        return names

    fake.make = add
    yield fake
    fake.stop()
    core = client.CoreV1Api(kube_admin)
    for name in made:
        core.delete_node(name)


@pytest.fixture
def kubelet(kube_admin, nodes, tmp_path):
    fake = FakeKubelet(kube_admin, tmp_path / "pods", nodes=nodes)
    yield fake
    fake.stop()


@pytest.fixture
def worker_cluster(platform_installed, kube_admin, tmp_path, settings):
    """The orchestrator's settings pointed at the real API server with the worker pod's token."""
    token = service_account_token(kube_admin, "inference-platform", "orchestrator")
    path = platform_installed.kubeconfig_for(tmp_path / "worker.kubeconfig", "orchestrator", token)
    settings.KUBERNETES_KUBECONFIG = str(path)
    settings.KUBERNETES_CONTEXT = None
    settings.KUBERNETES_NAMESPACE = ENGINES_NAMESPACE
    settings.KUBERNETES_NAMESPACES = [ENGINES_NAMESPACE]
    settings.KUBERNETES_PRESTOP_SLEEP_S = 0
    return config.new_client_from_config(config_file=str(path))
