"""The seed's scale on a simulated cluster: a P/D deployment on 68 nodes x 8 GPUs (544 GPUs), through the
kubernetes orchestrator against a real control plane, scaled by the autoscaler.

    .venv/bin/python -m bench.kube_scale            # about 2 minutes, the control plane's start included
    .venv/bin/python -m bench.kube_scale --no-docs  # print the table only, leave docs/benchmarks.md alone
    .venv/bin/python -m bench.kube_scale --profile  # and cProfile every pass over 0.2 CPU s (stderr)

The control plane is the test tier's (tests/kube/harness.py): etcd, kube-apiserver, kube-controller-manager and
kube-scheduler, with 68 fake GPU nodes kept Ready by their Leases (renewed every 10 s here) and the kubelet
stand-in reporting each bound pod Running and Ready at once, without starting its engine: the engines' own
start-up is left out, what is measured is the platform and Kubernetes. The worker reconciles with the
orchestrator ServiceAccount's token (deploy/base/rbac.yaml), as in the tier's tests, one pass right after the
desired state changes and then every FOLLOW_UP_S (2 s), as the Celery task's follow-ups do.

The autoscaler (serving/autoscaling.py) decides every change: the load it reads is written into Redis as the
engines' scraped loads (sequences running, for the decode pool) and the routers' published prefill backlogs (for
the prefill pool) would be, so that its policies (1 to 34 replicas a pool, windows of 0 s) ask for 34 + 34
engines (all 544 GPUs), then 9 + 8, then 34 + 34 again. Before that, a one-pool deployment of one engine gives
the reconcile's cost at the smallest size (it is deleted before the P/D deployment, which needs every node).

Measured, in this process: from the autoscaler pass that changed the replicas to every pod bound (the pods
watched by the admin, every 0.25 s) and to every engine routed (after a reconcile pass: one healthy Endpoint row
per pod, none draining, the deployment Ready and the routers' config version bumped since the change); per
reconcile pass, the worker's API requests (by method; LISTs; bytes of the answers), its SQL queries and the
reconciling thread's CPU time (time.thread_time: the kubelet and node stand-ins run in other threads).
It uses the database `bench_kube_scale` (dropped and re-created) and Redis database 10 (flushed).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench import harness as h
from bench.docs_section import write_section

ROOT = h.ROOT
log = h.log
BENCH_DB = "bench_kube_scale"
BENCH_REDIS_DB = 10
NAMESPACE = "inference"
NODES = 68
GPUS_PER_NODE = 8
ENGINE_GPUS = 8
POOL_MAX = NODES * GPUS_PER_NODE // ENGINE_GPUS // 2  # 34 prefill + 34 decode engines fill the GPUs
LEASE_EVERY_S = 10.0
# The autoscaler's targets, and the load that asks for a given number of replicas under them.
PREFILL_TOKENS_PER_REPLICA = 4000
DECODE_RUNNING_PER_REPLICA = 16
TARGET_S = 60.0
STEADY_CPU_TARGET_S = 1.0
WRITES = ("PATCH", "POST", "PUT", "DELETE")
# (name, prefill replicas, decode replicas) the autoscaler is driven to, in order.
PHASES = [("up", POOL_MAX, POOL_MAX), ("down", 9, 8), ("up again", POOL_MAX, POOL_MAX)]


# --- what one reconcile costs -----------------------------------------------------------------------------


@dataclass
class Pass:
    """One reconcile pass: the worker's API requests, SQL queries, CPU and wall time."""

    requests: Counter = field(default_factory=Counter)  # method -> count
    lists: int = 0
    bytes_read: int = 0
    queries: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    message: str = ""

    @property
    def calls(self) -> int:
        return sum(self.requests.values())

    @property
    def writes(self) -> int:
        return sum(self.requests[m] for m in WRITES)

    def add(self, other: Pass) -> None:
        self.requests.update(other.requests)
        self.lists += other.lists
        self.bytes_read += other.bytes_read
        self.queries += other.queries
        self.cpu_s += other.cpu_s
        self.wall_s += other.wall_s


def is_list(method: str, path: str) -> bool:
    """A LIST: a GET of a namespaced collection (`.../namespaces/<namespace>/<plural>`), not of one object."""
    parts = path.split("?")[0].rstrip("/").split("/")
    return method == "GET" and len(parts) >= 3 and parts[-3] == "namespaces"


class Meter:
    """Counts the Kubernetes requests made by one thread (the reconciling one), at the client's REST layer, where
    each request and the bytes of its answer are seen once."""

    def __init__(self, profile: bool = False):
        from kubernetes.client import rest

        self.profile = profile
        self.local = threading.local()
        original = rest.RESTClientObject.request
        meter = self

        def request(client, method, url, *args, **kwargs):
            response = original(client, method, url, *args, **kwargs)
            current: Pass | None = getattr(meter.local, "current", None)
            if current is not None:
                current.requests[method] += 1
                path = url.split("://", 1)[-1].partition("/")[2]
                current.lists += is_list(method, "/" + path)
                current.bytes_read += len(getattr(response, "data", b"") or b"")
            return response

        rest.RESTClientObject.request = request

    def reconcile(self, deployment_id: int) -> tuple[object, Pass]:
        from django.db import connection

        from serving import services

        record = Pass()

        def count(execute, sql, params, many, context):
            record.queries += 1
            return execute(sql, params, many, context)

        profiler = cProfile.Profile() if self.profile else None
        self.local.current = record
        started, cpu = time.monotonic(), time.thread_time()
        try:
            with connection.execute_wrapper(count):
                if profiler:
                    profiler.enable()
                result = services.deployment_reconcile(deployment_id=deployment_id)
        finally:
            if profiler:
                profiler.disable()
            record.cpu_s = time.thread_time() - cpu
            record.wall_s = time.monotonic() - started
            self.local.current = None
        record.message = result.message if result else "skipped"
        if profiler and record.cpu_s > 0.2:  # what a costly pass spends its CPU on, for the reading
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(12)
            log(f"profile of a pass of {record.cpu_s:.2f} CPU s ({record.message[:80]}):\n{out.getvalue()}")
        return result, record


# --- the cluster ------------------------------------------------------------------------------------------


class Cluster:
    """The control plane, the fake nodes and the kubelet stand-in, and the worker's kubeconfig."""

    def __init__(self, state: Path):
        from tests.kube import harness as kube

        kube.LEASE_EVERY_S = LEASE_EVERY_S  # 68 nodes' heartbeats; the node-monitor grace period is 50 s
        self.kube = kube
        self.plane = kube.ControlPlane(state / "control-plane")
        self.admin = self.plane.api()
        self.nodes = kube.FakeNodes(self.admin)
        self.kubelet = None

    def install(self, state: Path) -> Path:
        """The CRDs, then the dev overlay, applied server-side; the worker's kubeconfig."""
        from kubernetes import client

        self.kubectl("apply", "--server-side", "-f", str(ROOT / "deploy" / "crds"))
        extensions = client.ApiextensionsV1Api(self.admin)
        deadline = time.monotonic() + 60
        while not all(
            any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])
            for crd in extensions.list_custom_resource_definition().items
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the CRDs were not established within 60 s")
            time.sleep(0.2)
        self.kubectl("apply", "--server-side", "-k", str(ROOT / "deploy" / "overlays" / "dev"))
        for index in range(1, NODES + 1):
            self.nodes.add(f"gpu-node-{index}", gpus=GPUS_PER_NODE)
        self.kubelet = self.kube.FakeKubelet(self.admin, state / "pods", run_engines=False, nodes=self.nodes)
        token = self.kube.service_account_token(self.admin, "inference-platform", "orchestrator")
        return self.plane.kubeconfig_for(state / "worker.kubeconfig", "orchestrator", token)

    def kubectl(self, *args: str) -> None:
        subprocess.run(
            ["kubectl", "--kubeconfig", str(self.plane.kubeconfig), *args],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def pods(self, deployment_id: int) -> list:
        from kubernetes import client

        from serving.orchestrators import kube_render as render

        selector = f"{render.LABEL_DEPLOYMENT_ID}={deployment_id}"
        return client.CoreV1Api(self.admin).list_namespaced_pod(NAMESPACE, label_selector=selector).items

    def stop(self) -> None:
        if self.kubelet:
            self.kubelet.stop()
        self.nodes.stop()
        self.plane.stop()


class BoundWatch(threading.Thread):
    """When every pod of the deployment is bound (the count wanted, none terminating), seen every 0.25 s."""

    def __init__(self, cluster: Cluster, deployment_id: int, wanted: int, since: float):
        super().__init__(daemon=True)
        self.cluster, self.deployment_id, self.wanted, self.since = cluster, deployment_id, wanted, since
        self.bound_s: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while self.bound_s is None and not self.stop.wait(0.25):
            try:
                pods = self.cluster.pods(self.deployment_id)
            except Exception:  # noqa: BLE001 - a failed look is retried
                continue
            live = [p for p in pods if not p.metadata.deletion_timestamp]
            if len(pods) == self.wanted and all(p.spec.node_name for p in live) and len(live) == self.wanted:
                self.bound_s = time.monotonic() - self.since


# --- the platform -------------------------------------------------------------------------------------------


def setup_django(env: dict) -> None:
    os.environ.update(env)
    import django

    django.setup()


def make_deployment(name: str, pools: list[dict], policies: dict[str, dict]) -> int:
    from serving.models import AutoscalingPolicy, ModelDeployment, Pool

    deployment = ModelDeployment.objects.create(
        name=name,
        served_model_name=name,
        model_source="models/tiny-qwen",
        engine_kind="sim",
        orchestrator="kubernetes",
    )
    for fields in pools:
        pool = Pool.objects.create(
            deployment=deployment, gpus_per_replica=ENGINE_GPUS, tensor_parallel_size=ENGINE_GPUS, **fields
        )
        if pool.name in policies:
            AutoscalingPolicy.objects.create(pool=pool, enabled=True, **policies[pool.name])
    return deployment.pk


def publish_demand(deployment_id: int, prefill: int, decode: int) -> None:
    """The load that asks for `prefill` and `decode` replicas, spread over each pool's serving engines, written
    where the engines' load scraper (decode: sequences running) and the routers (prefill: their backlog of
    uncached prompt tokens) write it. A draining engine's load is cleared: the routers send it nothing new and
    what it ran has finished (the simulated requests are instant)."""
    import redis
    from django.conf import settings

    from routing.contracts import LOAD_KEY, REPLICA_LOAD_KEY
    from serving.models import Endpoint, Health

    client = redis.Redis.from_url(settings.REDIS_URL)
    now = time.time()
    rows = Endpoint.objects.filter(pool__deployment_id=deployment_id)
    with client.pipeline(transaction=False) as pipe:
        for endpoint_id in rows.filter(draining_since__isnull=False).values_list("id", flat=True):
            pipe.delete(LOAD_KEY.format(endpoint_id), REPLICA_LOAD_KEY.format(endpoint_id))
        for role, replicas in (("prefill", prefill), ("decode", decode)):
            ids = list(
                rows.filter(pool__role=role, health=Health.HEALTHY, draining_since__isnull=True).values_list(
                    "id", flat=True
                )
            )
            for endpoint_id in ids:
                if role == "decode":
                    running = replicas * DECODE_RUNNING_PER_REPLICA / len(ids)
                    load = {"running": running, "waiting": 0, "ts": now}
                    pipe.hset(LOAD_KEY.format(endpoint_id), mapping=load)
                else:
                    backlog = replicas * PREFILL_TOKENS_PER_REPLICA / len(ids)
                    pipe.hset(REPLICA_LOAD_KEY.format(endpoint_id), "bench-router", f"0 0 {now} {backlog}")
        pipe.execute()


def config_version() -> int:
    import redis
    from django.conf import settings

    from routing.contracts import CONFIG_VERSION_KEY

    return int(redis.Redis.from_url(settings.REDIS_URL).get(CONFIG_VERSION_KEY) or 0)


def routed(deployment_id: int, wanted: int, pods: set[str]) -> bool:
    """One healthy, serving Endpoint row per live pod, and nothing else."""
    from serving.models import Endpoint, Health

    rows = list(
        Endpoint.objects.filter(pool__deployment_id=deployment_id).values_list(
            "name", "health", "draining_since"
        )
    )
    return (
        len(rows) == wanted
        and {name for name, _, _ in rows} == pods
        and all(health == Health.HEALTHY and draining is None for _, health, draining in rows)
    )


@dataclass
class Change:
    name: str
    engines_from: int
    engines_to: int
    bound_s: float | None = None
    routed_s: float | None = None
    passes: list[Pass] = field(default_factory=list)
    steady: list[Pass] = field(default_factory=list)
    reason: str = ""
    asks_more_after: bool = False


def converge(
    meter: Meter,
    cluster: Cluster,
    deployment_id: int,
    change: Change,
    since: float,
    timeout: float,
    demand: tuple[int, int] | None = None,
) -> None:
    """Reconcile right away, then every FOLLOW_UP_S, until every engine is bound and routed; the load (`demand`)
    is republished before each pass, as the scraper and the routers keep it fresh."""
    from serving.models import ObservedStatus
    from serving.tasks import FOLLOW_UP_S

    before = config_version()
    watch = BoundWatch(cluster, deployment_id, change.engines_to, since)
    watch.start()
    try:
        while True:
            if demand:
                publish_demand(deployment_id, *demand)
            result, record = meter.reconcile(deployment_id)
            change.passes.append(record)
            live = {p.metadata.name for p in cluster.pods(deployment_id) if not p.metadata.deletion_timestamp}
            if (
                result is not None
                and result.status == ObservedStatus.READY
                and not result.settling
                and len(live) == change.engines_to
                and routed(deployment_id, change.engines_to, live)
                and config_version() > before
            ):
                change.routed_s = time.monotonic() - since
                break
            if time.monotonic() - since > timeout:
                log(f"{change.name}: not converged within {timeout:.0f} s: {record.message}")
                break
            time.sleep(FOLLOW_UP_S)
        deadline = time.monotonic() + 10
        while watch.bound_s is None and time.monotonic() < deadline:
            time.sleep(0.1)
        change.bound_s = watch.bound_s
    finally:
        watch.stop.set()
    for _ in range(3):  # nothing changed since: what a periodic reconcile costs at this size
        change.steady.append(meter.reconcile(deployment_id)[1])


def drive(meter: Meter, cluster: Cluster, deployment_id: int, name: str, prefill: int, decode: int) -> Change:
    """Publish the load that asks for these replicas, run the autoscaler until it changes them, converge."""
    from serving.autoscaling import autoscale_all
    from serving.models import Pool

    before = sum(Pool.objects.filter(deployment_id=deployment_id).values_list("replicas", flat=True))
    change = Change(name, before, prefill + decode)
    deadline = time.monotonic() + 30
    while True:
        publish_demand(deployment_id, prefill, decode)
        since = time.monotonic()
        events = autoscale_all()
        if events:
            change.reason = "; ".join(
                f"{e.pool.name} {e.from_replicas}->{e.to_replicas}: {e.reason}" for e in events
            )
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the autoscaler made no change towards {prefill} + {decode}")
        time.sleep(1)
    now = sum(Pool.objects.filter(deployment_id=deployment_id).values_list("replicas", flat=True))
    if now != change.engines_to:
        raise RuntimeError(
            f"the autoscaler asked for {now} engines, not {change.engines_to}: {change.reason}"
        )
    log(f"{name}: {change.reason}")
    converge(meter, cluster, deployment_id, change, since, timeout=180, demand=(prefill, decode))
    publish_demand(deployment_id, prefill, decode)
    change.asks_more_after = bool(autoscale_all())
    log(
        f"{name}: bound {change.bound_s}, routed {change.routed_s} s, {len(change.passes)} passes, "
        f"steady CPU {change.steady[-1].cpu_s:.3f} s"
    )
    return change


def one_engine(meter: Meter, cluster: Cluster) -> Change:
    """A one-pool deployment of one 8-GPU engine: created, converged, measured steady, deleted."""
    from serving import services
    from serving.models import ModelDeployment

    deployment_id = make_deployment("kube-one", [{"name": "main", "replicas": 1}], {})
    change = Change("create", 0, 1, reason="a new deployment of one engine")
    converge(meter, cluster, deployment_id, change, time.monotonic(), timeout=120)
    ModelDeployment.objects.filter(pk=deployment_id).delete()
    services.engines_sweep()
    deadline = time.monotonic() + 60
    while cluster.pods(deployment_id):
        if time.monotonic() > deadline:
            raise RuntimeError("the one-engine deployment's pods were not deleted")
        time.sleep(0.5)
    return change


# --- the report -----------------------------------------------------------------------------------------------


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def requests_text(record: Pass) -> str:
    return ", ".join(f"{method} {count}" for method, count in sorted(record.requests.items())) or "none"


def pass_row(label: str, engines: int, record: Pass, passes: int = 1) -> str:
    return (
        f"| {label} | {engines} | {passes} | {record.calls} ({requests_text(record)}) | {record.writes} | "
        f"{record.lists} | {record.bytes_read / 1024:,.0f} | {record.queries} | {record.cpu_s:.3f} | "
        f"{record.wall_s:.2f} |"
    )


def median_pass(records: list[Pass]) -> Pass:
    return sorted(records, key=lambda r: r.cpu_s)[len(records) // 2]


def report(argv: list[str], one: Change, changes: list[Change]) -> str:
    lines = [
        h.header("kube_scale", argv),
        f"- Cluster: {NODES} fake nodes x {GPUS_PER_NODE} `nvidia.com/gpu` ({NODES * GPUS_PER_NODE} GPUs), "
        "Kubernetes v1.36.2 (etcd 3.5.1, kube-apiserver, kube-controller-manager, kube-scheduler on 127.0.0.1), "
        f"node Leases renewed every {LEASE_EVERY_S:.0f} s, pods made Running and Ready by the kubelet stand-in "
        "with no engine started. Deployment: a prefill and a decode pool of 8-GPU simulator engines, autoscaled "
        f"(1 to {POOL_MAX} replicas a pool); the worker reconciles with the orchestrator ServiceAccount's token.",
        "",
        f"From the autoscaler's change to every pod bound and every engine routed (target: {TARGET_S:.0f} s):",
        "",
        "| change | engines | pods bound, at the new count (s) | routed (s) | reconcile passes | API requests | writes | LISTs | "
        "KiB read | worker CPU (s) | autoscaler asks more after |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for change in [one, *changes]:
        total = Pass()
        for record in change.passes:
            total.add(record)
        lines.append(
            f"| {change.name} | {change.engines_from} -> {change.engines_to} | {seconds(change.bound_s)} | "
            f"{seconds(change.routed_s)} | {len(change.passes)} | {total.calls} | {total.writes} | {total.lists} | "
            f"{total.bytes_read / 1024:,.0f} | {total.cpu_s:.2f} | {'yes' if change.asks_more_after else 'no'} |"
        )
    lines += [
        "",
        f"Per reconcile pass (target: a steady pass at 68 engines under {STEADY_CPU_TARGET_S:.0f} s of worker CPU "
        "and no write); the steady row is the median of three passes with nothing changed:",
        "",
        "| pass | engines | passes | API requests | writes | LISTs | KiB read | SQL queries | worker CPU (s) | "
        "wall (s) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for change in [one, *changes]:
        lines.append(
            pass_row(f"{change.name}: first pass after the change", change.engines_to, change.passes[0])
        )
        lines.append(pass_row(f"{change.name}: steady", change.engines_to, median_pass(change.steady)))
    lines += ["", "Scaling events:", ""]
    lines += [f"- {change.name}: {change.reason}" for change in [one, *changes]]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.kube_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="store_true", help="cProfile the passes that take over 0.2 CPU s")
    parser.add_argument(
        "--no-docs", action="store_true", help="print the table, leave docs/benchmarks.md alone"
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    h.under_devstack("kube_scale", argv, ("DATABASE_URL", "REDIS_URL"))
    state = h.STATE / "kube_scale"
    state.mkdir(parents=True, exist_ok=True)
    redis_url = h.with_path(os.environ["REDIS_URL"], f"/{BENCH_REDIS_DB}")
    h.flush_redis(redis_url)
    env = h.platform_env(h.fresh_database(os.environ["DATABASE_URL"], BENCH_DB), redis_url)
    h.migrate(env)
    log(f"starting the control plane and {NODES} nodes")
    run_dir = state / f"run-{os.getpid()}"
    cluster = Cluster(run_dir)
    try:
        kubeconfig = cluster.install(run_dir)
        env.update(
            {
                "KUBERNETES_KUBECONFIG": str(kubeconfig),
                "KUBERNETES_NAMESPACE": NAMESPACE,
                "KUBERNETES_NAMESPACES": NAMESPACE,
                "KUBERNETES_PRESTOP_SLEEP_S": "0",
            }
        )
        setup_django(env)
        meter = Meter(profile=args.profile)
        one = one_engine(meter, cluster)
        log(f"one engine: routed in {seconds(one.routed_s)} s")
        policy = {
            "min_replicas": 1,
            "max_replicas": POOL_MAX,
            "scale_up_window_s": 0,
            "scale_down_window_s": 0,
        }
        policy |= {"max_scale_up_step": POOL_MAX, "max_scale_down_step": POOL_MAX}
        deployment_id = make_deployment(
            "kube-pd",
            [
                {"name": "prefill", "role": "prefill", "replicas": 1, "kv_connector": "NixlConnector"},
                {"name": "decode", "role": "decode", "replicas": 1, "kv_connector": "NixlConnector"},
            ],
            {
                "prefill": {**policy, "queued_prompt_tokens_per_replica": PREFILL_TOKENS_PER_REPLICA},
                "decode": {**policy, "running_requests_per_replica": DECODE_RUNNING_PER_REPLICA},
            },
        )
        start = Change("start", 0, 2)
        converge(meter, cluster, deployment_id, start, time.monotonic(), timeout=120)
        changes = [drive(meter, cluster, deployment_id, *phase) for phase in PHASES]
    finally:
        cluster.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    text = report(argv, one, changes)
    print(text)
    if not args.no_docs:
        path = ROOT / "docs" / "benchmarks.md"
        write_section(path, "kube-scale", text, "Kubernetes at the seed's scale", "bench/kube_scale.py")
        log(f"wrote the kube-scale section of {path}")
    return 0


if __name__ == "__main__":
    h.run(main)
