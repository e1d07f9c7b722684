"""The Kubernetes objects of one model deployment, as plain dicts ready for server-side apply.

Per deployment: a root ConfigMap that owns everything else (delete it and the cluster's garbage collector
removes the rest), a Secret with the engines' API key, a NetworkPolicy that lets only the platform's own pods
in, another that lets the engines out only to DNS and to each other, and optionally one InferencePool for a
Gateway API inference gateway. Per pool: a Deployment (one node per replica) or a LeaderWorkerSet (several
nodes per replica: wide expert parallelism with data-parallel attention), and a headless Service for discovery.

The engine's arguments come from engine_command.render_engine_command, the same renderer the local orchestrator
uses; only what differs in a pod is changed: it listens on all addresses, the model path is taken as given, and
addresses that name the engine (KV-events topic, NIXL side channel) use the pod's IP from the downward API,
and its OpenAI routes require the deployment's API key (VLLM_API_KEY from the Secret).

Over 400 lines: every object of a deployment is rendered from the same pool settings and names, and the golden
manifests test them together.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import shlex

from django.conf import settings
from kubernetes.utils import parse_quantity

from ..engine_command import EnginePorts, UnsupportedEngineOption, render_engine_command
from ..engine_keys import engine_api_key
from ..models import EngineKind, KvConnector, ModelDeployment, Pool

MANAGER = "inference-platform"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_DEPLOYMENT = "inference-platform/deployment"
LABEL_DEPLOYMENT_ID = "inference-platform/deployment-id"
LABEL_POOL = "inference-platform/pool"
LABEL_ROLE = "inference-platform/role"
# LeaderWorkerSet's own labels on its pods (sigs.k8s.io/lws api/leaderworkerset/v1).
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"

HTTP_PORT = 8000
KV_EVENTS_PORT = 5557
SIDE_CHANNEL_PORT = 5600  # vLLM's default VLLM_NIXL_SIDE_CHANNEL_PORT
DP_RPC_PORT = 13345
PORTS = EnginePorts(http=HTTP_PORT, kv_events=KV_EVENTS_PORT, side_channel=SIDE_CHANNEL_PORT)

ROOT_API = ("v1", "ConfigMap")
SECRET_API = ("v1", "Secret")
NETWORK_POLICY_API = ("networking.k8s.io/v1", "NetworkPolicy")
DEPLOYMENT_API = ("apps/v1", "Deployment")
LWS_API = ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
SERVICE_API = ("v1", "Service")
INFERENCE_POOL_API = ("inference.networking.k8s.io/v1", "InferencePool")
# Every kind the orchestrator creates, in the order it applies them (the root first: the rest refer to it;
# the key and the policy before the pods that need them).
MANAGED_KINDS = [
    ROOT_API,
    SECRET_API,
    NETWORK_POLICY_API,
    SERVICE_API,
    DEPLOYMENT_API,
    LWS_API,
    INFERENCE_POOL_API,
]

# With this variable set, vLLM (0.32: serve/middleware/authenticate.py) requires the bearer token under /v1,
# /v2, /inference and /cohere. Everything else stays open: /health and /metrics (so probes and the load
# scraper need no key), but also /invocations and /tokenize; the NetworkPolicy is what keeps those in.
ENGINE_KEY_ENV = "VLLM_API_KEY"
# On the pod template: a new key changes it, so the pods restart and read the new Secret.
ENGINE_KEY_ANNOTATION = "inference-platform/engine-key-sha256"

# The platform's own pods, as deploy/base labels them, and the namespace they run in.
PLATFORM_NAME_LABEL = "app.kubernetes.io/name"
ROUTER_PODS = "router"
WORKER_PODS = "worker"  # scrapes the engines' /metrics (routing/scheduling/load_scraper.py)
KV_INGESTER_PODS = "kv-ingester"
DEFAULT_PLATFORM_NAMESPACE = "inference-platform"
# The cluster DNS, as kubeadm, EKS, GKE and AKS label CoreDNS (or kube-dns).
DNS_NAMESPACE = "kube-system"
DNS_POD_LABELS = {"k8s-app": "kube-dns"}
DNS_PORT = 53
# Never a destination of an engine, whatever the operator opens: the link-local ranges, where cloud metadata
# services answer (169.254.169.254), and EC2's IPv6 metadata address.
NEVER_REACHED = tuple(
    ipaddress.ip_network(cidr) for cidr in ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128")
)


def namespace_of(deployment: ModelDeployment) -> str:
    return deployment.namespace or settings.KUBERNETES_NAMESPACE


def root_name(deployment: ModelDeployment) -> str:
    return deployment.name


def pool_object_name(deployment: ModelDeployment, pool: Pool) -> str:
    """Deployment, LWS and Service name; short enough that pod names and LWS group labels stay legal."""
    name = f"{deployment.name}-{pool.name}"
    if len(name) > 45:
        name = f"{name[:36].rstrip('-')}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    # A Service name must start with a letter (DNS-1035).
    return name if name[0].isalpha() else f"d{name}"[:45]


def deployment_labels(deployment: ModelDeployment) -> dict[str, str]:
    return {
        LABEL_MANAGED_BY: MANAGER,
        LABEL_DEPLOYMENT: deployment.name,
        LABEL_DEPLOYMENT_ID: str(deployment.pk),
    }


def platform_namespace() -> str:
    """Where the router, worker and KV-event ingester run (deploy/base puts them in inference-platform)."""
    return getattr(settings, "KUBERNETES_PLATFORM_NAMESPACE", "") or DEFAULT_PLATFORM_NAMESPACE


def engine_key_secret_name(deployment: ModelDeployment) -> str:
    return f"{deployment.name}-engine-key"


def network_policy_name(deployment: ModelDeployment) -> str:
    return f"{deployment.name}-engines"


def egress_policy_name(deployment: ModelDeployment) -> str:
    return f"{deployment.name}-engines-egress"


def engine_pods(deployment: ModelDeployment) -> dict:
    """Every engine pod of the deployment, whatever its pool or role, and no other pod."""
    return {"matchLabels": {LABEL_DEPLOYMENT: deployment.name}}


def pool_selector(deployment: ModelDeployment, pool: Pool) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: deployment.name, LABEL_POOL: pool.name}


def pool_labels(deployment: ModelDeployment, pool: Pool) -> dict[str, str]:
    return {**deployment_labels(deployment), LABEL_POOL: pool.name, LABEL_ROLE: pool.role}


def _meta(name: str, namespace: str, labels: dict[str, str], owner: dict | None) -> dict:
    meta = {"name": name, "namespace": namespace, "labels": labels}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


def owner_reference(deployment: ModelDeployment, uid: str) -> dict:
    api_version, kind = ROOT_API
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": root_name(deployment),
        "uid": uid,
        "blockOwnerDeletion": True,
    }


def render_root(deployment: ModelDeployment) -> dict:
    api_version, kind = ROOT_API
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _meta(
            root_name(deployment), namespace_of(deployment), deployment_labels(deployment), None
        ),
        "data": {
            "served-model-name": deployment.served_model_name,
            "model": deployment.model_source,
            "pools": ",".join(pool.name for pool in deployment.pools.all()),
        },
    }


def render_engine_key(deployment: ModelDeployment, owner: dict | None) -> dict:
    """The Secret holding the engines' API key (as `data`, which is what the API server keeps and lists)."""
    key = engine_api_key(deployment.pk)
    api_version, kind = SECRET_API
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _meta(
            engine_key_secret_name(deployment), namespace_of(deployment), deployment_labels(deployment), owner
        ),
        "type": "Opaque",
        "data": {ENGINE_KEY_ENV: base64.b64encode(key.encode()).decode()},
    }


def _platform_pods(name: str) -> dict:
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": platform_namespace()}},
        "podSelector": {"matchLabels": {PLATFORM_NAME_LABEL: name}},
    }


def _tcp(port: int, end_port: int | None = None) -> dict:
    port_spec = {"protocol": "TCP", "port": port}
    if end_port is not None:
        port_spec["endPort"] = end_port
    return port_spec


def render_network_policy(deployment: ModelDeployment, owner: dict | None) -> dict:
    """Ingress to the deployment's pods from the platform only; everything else is refused.

    - engine HTTP: the router (requests) and the Celery worker (the load scraper reads /metrics);
    - KV events: the KV-event ingester;
    - between the deployment's own pods, when they talk to each other (NIXL, or a LeaderWorkerSet), every
      port but HTTP: the NIXL side channel (5600 and up, one port per data-parallel rank) and UCX's
      transfers, the data-parallel RPC port and torch.distributed/NCCL, whose ports are chosen at run time.
    The kubelet's probes come from the node, which a NetworkPolicy always lets through.
    """
    pools = list(deployment.pools.all())
    ingress = [
        {"from": [_platform_pods(ROUTER_PODS), _platform_pods(WORKER_PODS)], "ports": [_tcp(HTTP_PORT)]}
    ]
    if any(pool.enable_kv_events for pool in pools):
        ingress.append({"from": [_platform_pods(KV_INGESTER_PODS)], "ports": [_tcp(KV_EVENTS_PORT)]})
    if _peers_talk(pools):
        ingress.append({"from": [{"podSelector": engine_pods(deployment)}], "ports": _all_but_http()})
    api_version, kind = NETWORK_POLICY_API
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _meta(
            network_policy_name(deployment), namespace_of(deployment), deployment_labels(deployment), owner
        ),
        "spec": {"podSelector": engine_pods(deployment), "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _peers_talk(pools: list[Pool]) -> bool:
    """Whether the deployment's pods talk to each other: NIXL between pools, or the nodes of a LeaderWorkerSet."""
    return any(_nixl(pool) or pool.nodes_per_replica > 1 for pool in pools)


def _all_but_http() -> list[dict]:
    return [_tcp(1, HTTP_PORT - 1), _tcp(HTTP_PORT + 1, 65535)]


def _ip_block(cidr: str) -> dict:
    """An operator-opened range, less the addresses no engine may reach inside it."""
    try:
        network = ipaddress.ip_network(cidr, strict=False)
    except ValueError as exc:
        raise UnsupportedEngineOption(f"KUBERNETES_ENGINE_EGRESS_CIDRS: {cidr!r} is no CIDR") from exc
    same_family = [denied for denied in NEVER_REACHED if denied.version == network.version]
    if any(network.subnet_of(denied) for denied in same_family):
        raise UnsupportedEngineOption(
            f"KUBERNETES_ENGINE_EGRESS_CIDRS: {cidr} is link-local or cloud metadata, which engines never reach"
        )
    block: dict = {"cidr": str(network)}
    inside = [str(denied) for denied in same_family if denied.subnet_of(network)]
    if inside:
        block["except"] = inside
    return block


def render_egress_policy(deployment: ModelDeployment, owner: dict | None) -> dict:
    """Where the deployment's engine pods may send: nowhere a tenant's request could name on its own.

    - the cluster DNS (UDP and TCP 53): a LeaderWorkerSet's workers find their leader by name, and the weights'
      host (below) is named too;
    - the deployment's own pods, when they talk to each other (NIXL side channels and transfers, data-parallel
      RPC, torch.distributed), on every port but HTTP, as the ingress policy lets them in;
    - the ranges in settings.KUBERNETES_ENGINE_EGRESS_CIDRS (a model mirror or proxy), less NEVER_REACHED.
    Nothing of the platform's own namespace: the router, the worker and the KV-event ingester connect to the
    engines (ZMQ events are published on a socket the engine binds), never the other way. So cloud metadata,
    the platform's Postgres and Redis, other deployments' engines and the internet are out of reach, whatever
    URL a request carries.
    """
    dns = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": DNS_NAMESPACE}},
        "podSelector": {"matchLabels": dict(DNS_POD_LABELS)},
    }
    egress = [
        {
            "to": [dns],
            "ports": [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}],
        }
    ]
    if _peers_talk(list(deployment.pools.all())):
        egress.append({"to": [{"podSelector": engine_pods(deployment)}], "ports": _all_but_http()})
    blocks = [_ip_block(cidr) for cidr in settings.KUBERNETES_ENGINE_EGRESS_CIDRS]
    if blocks:
        egress.append({"to": [{"ipBlock": block} for block in blocks]})
    api_version, kind = NETWORK_POLICY_API
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _meta(
            egress_policy_name(deployment), namespace_of(deployment), deployment_labels(deployment), owner
        ),
        "spec": {"podSelector": engine_pods(deployment), "policyTypes": ["Egress"], "egress": egress},
    }


# --- the engine container ------------------------------------------------------------------------------


def _replace_flag(argv: list[str], flag: str, value: str | None) -> None:
    """Set the value of `flag` in place (or drop the flag and its value when value is None)."""
    index = argv.index(flag)
    if value is None:
        del argv[index : index + 2]
    else:
        argv[index + 1] = value


def engine_args(deployment: ModelDeployment, pool: Pool) -> tuple[list[str], dict[str, str]]:
    """The engine's arguments (after the program) and its fixed environment, for a pod."""
    command = render_engine_command(deployment=deployment, pool=pool, ports=PORTS)
    extra = [str(arg) for arg in pool.extra_engine_args or []]
    # The program (`python -m module`) is the container's command; the pool's own extra args stay as given.
    argv = command.argv[3 : len(command.argv) - len(extra)]
    _replace_flag(argv, "--host", "0.0.0.0")
    _replace_flag(argv, "--model", deployment.model_source)
    if deployment.tokenizer:
        _replace_flag(argv, "--tokenizer", deployment.tokenizer)
    if settings.LOCAL_ENGINE_LOAD_FORMAT and "--load-format" in argv:
        _replace_flag(argv, "--load-format", None)  # a local-only setting: a cluster loads real weights
    if "--logits-processors" in argv:
        # Real weights end their answers and call tools by themselves: the dummy model's processors go, all of them.
        index = argv.index("--logits-processors")
        end = index + 1
        while end < len(argv) and not argv[end].startswith("--"):
            end += 1
        del argv[index:end]
    if pool.enable_kv_events:
        index = argv.index("--kv-events-config") + 1
        events = json.loads(argv[index])
        # Kubernetes expands $(POD_IP) from the container's environment (the downward API).
        events["topic"] = f"kv@$(POD_IP):{HTTP_PORT}@{deployment.served_model_name}"
        argv[index] = json.dumps(events, separators=(",", ":"))
    if "--chat-template" in argv:
        # Kubernetes expands $(NAME) and $$ in container args: a template's own `$` must reach vLLM as written.
        index = argv.index("--chat-template") + 1
        argv[index] = argv[index].replace("$", "$$")
    # Only what an engine in a pod needs; the rest of the local environment is about CPU engines on loopback.
    env = {"PYTHONHASHSEED": command.env["PYTHONHASHSEED"]}
    for name in ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_MEDIA_URL_ALLOW_REDIRECTS"):
        if name in command.env:
            env[name] = command.env[name]
    return argv + extra, env


def _program(deployment: ModelDeployment) -> list[str]:
    module = "simulator" if deployment.engine_kind == EngineKind.SIM else "vllm.entrypoints.openai.api_server"
    return ["python3", "-m", module]


def _image(deployment: ModelDeployment) -> str:
    if deployment.engine_image:
        return deployment.engine_image
    if deployment.engine_kind == EngineKind.SIM:
        return settings.KUBERNETES_PLATFORM_IMAGE
    return settings.KUBERNETES_ENGINE_IMAGE


def _nixl(pool: Pool) -> bool:
    return pool.kv_connector in (KvConnector.NIXL, KvConnector.MULTI)


def _env(deployment: ModelDeployment, pool: Pool, fixed: dict[str, str], serving: bool) -> list[dict]:
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    if _nixl(pool):
        env.append(
            {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        )
    env += [{"name": key, "value": value} for key, value in sorted(fixed.items())]
    if settings.KUBERNETES_HF_TOKEN_SECRET:
        secret = {"name": settings.KUBERNETES_HF_TOKEN_SECRET, "key": "HF_TOKEN", "optional": True}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": secret}})
    if serving:
        # Not optional: an engine that serves HTTP never starts without its key.
        key = {"name": engine_key_secret_name(deployment), "key": ENGINE_KEY_ENV}
        env.append({"name": ENGINE_KEY_ENV, "valueFrom": {"secretKeyRef": key}})
    return env


def gpus_per_pod(pool: Pool) -> int:
    return pool.gpus_per_replica // pool.nodes_per_replica


def _check(pool: Pool) -> None:
    nodes = pool.nodes_per_replica
    if nodes > 1:
        if pool.data_parallel_size % nodes:
            raise UnsupportedEngineOption(
                f"pool {pool.name}: data_parallel_size {pool.data_parallel_size} must be a multiple of "
                f"nodes_per_replica {nodes} (each node runs the same number of data-parallel ranks)"
            )
        if pool.gpus_per_replica % nodes:
            raise UnsupportedEngineOption(
                f"pool {pool.name}: gpus_per_replica {pool.gpus_per_replica} must divide evenly over {nodes} nodes"
            )
    needed = pool.tensor_parallel_size * pool.data_parallel_size
    if pool.gpus_per_replica and pool.gpus_per_replica != needed:
        raise UnsupportedEngineOption(
            f"pool {pool.name}: tensor x data parallel size is {needed} GPUs per replica, "
            f"but gpus_per_replica is {pool.gpus_per_replica}"
        )
    if pool.cpu_offload_bytes and pool.memory_request:
        if parse_quantity(pool.memory_request) <= pool.cpu_offload_bytes:
            raise UnsupportedEngineOption(
                f"pool {pool.name}: memory_request {pool.memory_request} leaves no room beside "
                f"{pool.cpu_offload_bytes} bytes of CPU KV offload"
            )
    for quantity in (pool.cpu_request, pool.memory_request):
        if quantity:
            try:
                parse_quantity(quantity)
            except ValueError as exc:
                raise UnsupportedEngineOption(
                    f"pool {pool.name}: {quantity!r} is no Kubernetes quantity"
                ) from exc


def _resources(pool: Pool) -> dict:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if pool.cpu_request:
        requests["cpu"] = pool.cpu_request
    if pool.memory_request:
        # Memory is not compressible: the limit is the request, so an engine is never OOM-killed by a neighbour.
        requests["memory"] = limits["memory"] = pool.memory_request
    gpus = gpus_per_pod(pool)
    if gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(gpus)
    resources = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _probes(serving: bool) -> dict:
    if not serving:
        return {}

    def health() -> dict:
        return {"path": "/health", "port": "http"}

    return {
        # Loading weights takes minutes: liveness waits until the engine has started once.
        "startupProbe": {"httpGet": health(), "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {"httpGet": health(), "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {
            "httpGet": health(),
            "periodSeconds": 15,
            "failureThreshold": 4,
            "timeoutSeconds": 5,
        },
    }


def _container_ports(pool: Pool, serving: bool) -> list[dict]:
    ports = []
    if serving:
        ports.append({"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"})
    if pool.enable_kv_events:
        ports.append({"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"})
    if _nixl(pool):
        ports.append({"name": "nixl", "containerPort": SIDE_CHANNEL_PORT, "protocol": "TCP"})
    return ports


def _container(
    deployment: ModelDeployment, pool: Pool, *, command: list[str], args: list[str], env: dict, serving: bool
) -> dict:
    container = {
        "name": "engine",
        "image": _image(deployment),
        "command": command,
        "args": args,
        "env": _env(deployment, pool, env, serving),
        "ports": _container_ports(pool, serving),
        "resources": _resources(pool),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        **_probes(serving),
        **_lifecycle(serving),
    }
    return {key: value for key, value in container.items() if value != {} and value != []}


def _lifecycle(serving: bool) -> dict:
    """Before a serving pod gets SIGTERM it waits until the orchestrator has marked it unhealthy and every
    router has reloaded (a reconcile interval and a config poll), so no new request reaches it while it stops;
    vLLM then finishes what it has within the grace period. A scale-down the orchestrator makes drains first
    (serving/drain.py) and removes a pod only once nothing is in flight there."""
    if not serving:
        return {}
    return {"lifecycle": {"preStop": {"sleep": {"seconds": settings.KUBERNETES_PRESTOP_SLEEP_S}}}}


def _pod_spec(pool: Pool, container: dict) -> dict:
    spec: dict = {
        "containers": [container],
        # NCCL and vLLM's workers exchange tensors through shared memory; the default 64 MiB is far too small.
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.KUBERNETES_SHM_SIZE}}
        ],
        # A pod deleted by anyone (a rollout, a node drain) finishes the requests it has: see _lifecycle.
        "terminationGracePeriodSeconds": settings.ENGINE_DRAIN_TIMEOUT_S
        + settings.KUBERNETES_PRESTOP_SLEEP_S,
        # An engine never calls the Kubernetes API: no token in the pod to steal.
        "automountServiceAccountToken": False,
    }
    if pool.accelerator:
        spec["nodeSelector"] = {settings.KUBERNETES_ACCELERATOR_LABEL: pool.accelerator}
    # A node that stops answering (lost, partitioned, its kubelet dead) holds its engines' GPUs for nothing: their
    # pods are evicted after KUBERNETES_NODE_LOSS_EVICT_S, not Kubernetes' default 300 s, and made again on a live
    # node. The router stops sending to them before that, once the pods are marked not ready.
    spec["tolerations"] = [
        {
            "key": taint,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": settings.KUBERNETES_NODE_LOSS_EVICT_S,
        }
        for taint in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
    ]
    if gpus_per_pod(pool):
        spec["tolerations"].append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    return spec


def _template(deployment: ModelDeployment, pool: Pool, container: dict) -> dict:
    key_digest = hashlib.sha256(engine_api_key(deployment.pk).encode()).hexdigest()[:16]
    return {
        "metadata": {
            "labels": pool_labels(deployment, pool),
            "annotations": {ENGINE_KEY_ANNOTATION: key_digest},
        },
        "spec": _pod_spec(pool, container),
    }


def render_single_node(
    deployment: ModelDeployment, pool: Pool, owner: dict | None, replicas: int | None = None
) -> dict:
    args, env = engine_args(deployment, pool)
    container = _container(deployment, pool, command=_program(deployment), args=args, env=env, serving=True)
    api_version, kind = DEPLOYMENT_API
    name = pool_object_name(deployment, pool)
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _meta(name, namespace_of(deployment), pool_labels(deployment, pool), owner),
        "spec": {
            "replicas": pool.replicas if replicas is None else replicas,
            "selector": {"matchLabels": pool_selector(deployment, pool)},
            # A new engine must be ready before an old one goes: GPUs permitting, capacity never drops.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": _template(deployment, pool, container),
        },
    }


def render_multi_node(
    deployment: ModelDeployment, pool: Pool, owner: dict | None, replicas: int | None = None
) -> dict:
    """One LWS group per replica: the leader (rank 0 of the data-parallel group) serves HTTP, workers are headless.

    vLLM's multi-node data parallelism: every node runs `--data-parallel-size-local` ranks; the leader's address
    and RPC port join them; a worker's first rank is its LWS worker index times the ranks per node.
    """
    args, env = engine_args(deployment, pool)
    local = pool.data_parallel_size // pool.nodes_per_replica
    dp = [
        "--data-parallel-size-local",
        str(local),
        "--data-parallel-address",
        "$(LWS_LEADER_ADDRESS)",
        "--data-parallel-rpc-port",
        str(DP_RPC_PORT),
    ]
    program = _program(deployment)
    leader_args = [*args, *dp, "--data-parallel-start-rank", "0"]
    leader = _container(deployment, pool, command=program, args=leader_args, env=env, serving=True)
    # The start rank needs arithmetic on LWS_WORKER_INDEX, so workers start through a shell. The kubelet
    # expands $(POD_IP) and $(LWS_LEADER_ADDRESS) before the shell runs; `$$` keeps the shell's `$((...))`.
    worker_line = shlex.join([*program, *args, *dp, "--headless"])
    worker_args = [f"exec {worker_line} --data-parallel-start-rank $$((LWS_WORKER_INDEX * {local}))"]
    worker = _container(deployment, pool, command=["/bin/sh", "-c"], args=worker_args, env=env, serving=False)
    api_version, kind = LWS_API
    name = pool_object_name(deployment, pool)
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _meta(name, namespace_of(deployment), pool_labels(deployment, pool), owner),
        "spec": {
            "replicas": pool.replicas if replicas is None else replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": pool.nodes_per_replica,
                # A failed node breaks its whole data-parallel group: restart the group together.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _template(deployment, pool, leader),
                "workerTemplate": _template(deployment, pool, worker),
            },
        },
    }


def render_service(deployment: ModelDeployment, pool: Pool, owner: dict | None) -> dict:
    """A headless Service: DNS names for every serving pod, no virtual IP (the router picks engines itself)."""
    selector = pool_selector(deployment, pool)
    if pool.nodes_per_replica > 1:
        selector[LWS_WORKER_INDEX_LABEL] = "0"  # only leaders serve HTTP
    ports = [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]
    if pool.enable_kv_events:
        ports.append(
            {"name": "kv-events", "port": KV_EVENTS_PORT, "targetPort": "kv-events", "protocol": "TCP"}
        )
    api_version, kind = SERVICE_API
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _meta(
            pool_object_name(deployment, pool), namespace_of(deployment), pool_labels(deployment, pool), owner
        ),
        "spec": {"clusterIP": "None", "selector": selector, "ports": ports},
    }


def render_inference_pool(deployment: ModelDeployment, owner: dict | None) -> dict:
    """One InferencePool over all of the deployment's serving pods, so a Gateway can route the model to them."""
    spec: dict = {
        "selector": {"matchLabels": {LABEL_DEPLOYMENT: deployment.name}},
        "targetPorts": [{"number": HTTP_PORT}],
    }
    if settings.KUBERNETES_ENDPOINT_PICKER:
        name, _, port = settings.KUBERNETES_ENDPOINT_PICKER.rpartition(":")
        spec["endpointPickerRef"] = {"name": name, "port": {"number": int(port)}}
    api_version, kind = INFERENCE_POOL_API
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _meta(deployment.name, namespace_of(deployment), deployment_labels(deployment), owner),
        "spec": spec,
    }


def render_pool(
    deployment: ModelDeployment, pool: Pool, owner: dict | None, replicas: int | None = None
) -> list[dict]:
    """The pool's Service and workload; `replicas` overrides the pool's (its replicas plus those draining)."""
    _check(pool)
    workload = render_multi_node if pool.nodes_per_replica > 1 else render_single_node
    return [render_service(deployment, pool, owner), workload(deployment, pool, owner, replicas)]


def render_engine_access(deployment: ModelDeployment, owner: dict | None) -> list[dict]:
    """The engines' key and network policies: kept for as long as the deployment exists, running or stopped,
    so that pods still shutting down stay guarded and a restart finds them in place."""
    return [
        render_engine_key(deployment, owner),
        render_network_policy(deployment, owner),
        render_egress_policy(deployment, owner),
    ]


def render_children(
    deployment: ModelDeployment, owner: dict | None, draining: dict[int, int] | None = None
) -> list[dict]:
    """The workloads below the root object, for a running deployment. `draining`: pool id -> replicas kept
    beyond the pool's own while they drain."""
    objects = []
    for pool in deployment.pools.all():
        extra = (draining or {}).get(pool.pk, 0)
        objects += render_pool(deployment, pool, owner, pool.replicas + extra if extra else None)
    if settings.KUBERNETES_INFERENCE_POOL:
        objects.append(render_inference_pool(deployment, owner))
    return objects


def object_key(obj: dict) -> tuple[str, str, str]:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]
