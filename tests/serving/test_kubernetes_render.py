"""What the kubernetes orchestrator renders for representative deployments: valid against the official schemas
(Kubernetes, LeaderWorkerSet, InferencePool) and identical to the golden files kept for review.

Regenerate the golden files after a deliberate change with UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from django.test import override_settings

from serving.engine_command import UnsupportedEngineOption
from serving.engine_keys import engine_api_key
from serving.models import KvConnector, ModelDeployment, OrchestratorKind, Pool, PoolRole
from serving.orchestrators import kube_render as render
from tests.deploy.validation import KUBERNETES_VERSION, validate_object, validate_objects

GOLDEN = Path(__file__).resolve().parents[2] / "deploy" / "golden" / "engines"
OWNER_UID = "00000000-0000-4000-8000-000000000001"
GiB = 1024**3

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fixed_engine_key_secret(settings):
    """The engine keys in the golden files come from this, not from the machine's own SECRET_KEY."""
    settings.ENGINE_KEY_SECRET = "golden-files-only-not-a-secret"


def _deployment(pk: int, name: str, **fields) -> ModelDeployment:
    return ModelDeployment.objects.create(
        pk=pk,
        name=name,
        served_model_name=fields.pop("served_model_name", name),
        model_source=fields.pop("model_source", "Qwen/Qwen3-8B"),
        orchestrator=OrchestratorKind.KUBERNETES,
        engine_image="vllm/vllm-openai:v0.11.0",
        **fields,
    )


def aggregated() -> ModelDeployment:
    deployment = _deployment(71001, "qwen3-8b", max_model_len=32768)
    Pool.objects.create(
        deployment=deployment,
        name="main",
        replicas=2,
        tensor_parallel_size=2,
        gpus_per_replica=2,
        accelerator="NVIDIA-H100-80GB-HBM3",
        cpu_request="8",
        memory_request="64Gi",
    )
    return deployment


def prefill_decode() -> ModelDeployment:
    deployment = _deployment(71002, "llama-70b-pd", model_source="meta-llama/Llama-3.3-70B-Instruct")
    for name, role, replicas, tp in (("prefill", PoolRole.PREFILL, 1, 4), ("decode", PoolRole.DECODE, 2, 2)):
        Pool.objects.create(
            deployment=deployment,
            name=name,
            role=role,
            replicas=replicas,
            tensor_parallel_size=tp,
            gpus_per_replica=tp,
            kv_connector=KvConnector.NIXL,
            memory_request="128Gi",
        )
    return deployment


def wide_ep() -> ModelDeployment:
    """DeepSeek-style wide expert parallelism: data-parallel attention over 2 nodes of 8 GPUs per replica."""
    deployment = _deployment(
        71003, "deepseek-r1", model_source="deepseek-ai/DeepSeek-R1-0528", revision="main"
    )
    for name, role, nodes in (("prefill", PoolRole.PREFILL, 2), ("decode", PoolRole.DECODE, 2)):
        Pool.objects.create(
            deployment=deployment,
            name=name,
            role=role,
            replicas=1,
            data_parallel_size=8 * nodes,
            enable_expert_parallel=True,
            nodes_per_replica=nodes,
            gpus_per_replica=8 * nodes,
            kv_connector=KvConnector.NIXL,
            accelerator="NVIDIA-H200",
            memory_request="1Ti",
            extra_engine_args=["--trust-remote-code"],
        )
    return deployment


def cpu_offload() -> ModelDeployment:
    deployment = _deployment(71004, "qwen3-32b-offload", model_source="Qwen/Qwen3-32B")
    Pool.objects.create(
        deployment=deployment,
        name="main",
        tensor_parallel_size=2,
        gpus_per_replica=2,
        kv_connector=KvConnector.OFFLOADING,
        cpu_offload_bytes=200 * GiB,
        memory_request="320Gi",
    )
    return deployment


def speculative() -> ModelDeployment:
    deployment = _deployment(71005, "qwen3-coder-spec", model_source="Qwen/Qwen3-Coder-30B-A3B-Instruct")
    Pool.objects.create(
        deployment=deployment,
        name="ngram",
        gpus_per_replica=1,
        speculative_method="ngram",
        num_speculative_tokens=4,
        enable_kv_events=False,
    )
    return deployment


CASES = {
    "aggregated": aggregated,
    "prefill-decode": prefill_decode,
    "wide-ep": wide_ep,
    "cpu-offload": cpu_offload,
    "speculative": speculative,
}
# The aggregated case also gets an InferencePool in front.
INFERENCE_POOL = {"KUBERNETES_INFERENCE_POOL": True, "KUBERNETES_ENDPOINT_PICKER": "qwen3-8b-epp:9002"}


def render_all(case: str) -> list[dict]:
    overrides = INFERENCE_POOL if case == "aggregated" else {}
    with override_settings(**overrides):
        deployment = CASES[case]()
        owner = render.owner_reference(deployment, OWNER_UID)
        return [
            render.render_root(deployment),
            *render.render_engine_access(deployment, owner),
            *render.render_children(deployment, owner),
        ]


def dump(objects: list[dict]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False, width=120)


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == kind]


def container(workload: dict, template: str = "template") -> dict:
    spec = workload["spec"]
    pod = spec[template] if template == "template" else spec["leaderWorkerTemplate"][template]
    return pod["spec"]["containers"][0]


@pytest.mark.parametrize("case", list(CASES))
def test_it_renders_valid_objects_matching_the_golden_file(case):
    objects = render_all(case)
    validate_objects(objects)
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump(objects))
    assert path.read_text() == dump(objects), (
        f"{path} is stale: rerun with UPDATE_GOLDEN=1 and review the diff"
    )


def test_it_passes_the_kubernetes_validate_command_in_strict_mode():
    """The golden files through the real CLI: every built-in object passes, none fails."""
    files = sorted(GOLDEN.glob("*.yaml"))
    built_in = sum(
        obj["apiVersion"] in ("v1", "apps/v1", "networking.k8s.io/v1")
        for path in files
        for obj in yaml.safe_load_all(path.read_text())
    )
    cli = Path(sys.executable).parent / "kubernetes-validate"
    run = subprocess.run(
        [str(cli), "--strict", "-k", KUBERNETES_VERSION, *map(str, files)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ERROR" not in run.stdout
    assert run.stdout.count(" passed for resource ") == built_in > 0


def test_it_refuses_objects_the_schemas_refuse():
    """The validation can fail: an unknown field, a wrong type or a missing field, in each kind of schema."""
    aggregated_objects = render_all("aggregated")
    deployment = copy.deepcopy(by_kind(aggregated_objects, "Deployment")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["gpu"] = 1
    service = copy.deepcopy(by_kind(aggregated_objects, "Service")[0])
    service["spec"]["ports"][0]["port"] = "http"
    lws = copy.deepcopy(by_kind(render_all("wide-ep"), "LeaderWorkerSet")[0])
    lws["spec"]["leaderWorkerTemplate"]["groupSize"] = 2
    policy = copy.deepcopy(by_kind(render_all("prefill-decode"), "NetworkPolicy")[0])
    policy["spec"]["ingress"][2]["ports"][0]["endPort"] = "7999"
    for obj in (deployment, service, lws, policy):
        with pytest.raises(Exception, match="(Additional properties|is not of type)"):
            validate_object(obj)
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "x"},
    }
    pool["spec"] = {"selector": {"matchLabels": {"a": "b"}}}
    with pytest.raises(Exception, match="'targetPorts' is a required property"):
        validate_object(pool)


def test_the_aggregated_pool_is_a_deployment_with_gpus_probes_shm_and_the_pod_ip_in_its_kv_topic():
    objects = render_all("aggregated")
    deployment = by_kind(objects, "Deployment")[0]
    engine = container(deployment)
    assert deployment["spec"]["replicas"] == 2
    assert (
        deployment["metadata"]["labels"].items()
        >= {
            render.LABEL_DEPLOYMENT: "qwen3-8b",
            render.LABEL_POOL: "main",
            render.LABEL_ROLE: "both",
        }.items()
    )
    assert engine["image"] == "vllm/vllm-openai:v0.11.0"
    assert engine["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": "2"}
    args = engine["args"]
    assert args[args.index("--model") + 1] == "Qwen/Qwen3-8B"
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert "--load-format" not in args and "--enable-prefix-caching" in args
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events["topic"] == "kv@$(POD_IP):8000@qwen3-8b" and events["endpoint"] == "tcp://*:5557"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in engine["env"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    volume = deployment["spec"]["template"]["spec"]["volumes"][0]
    assert volume["emptyDir"]["medium"] == "Memory" and engine["volumeMounts"][0]["mountPath"] == "/dev/shm"
    for obj in objects[1:]:
        assert (
            obj["metadata"]["ownerReferences"][0].items() >= {"kind": "ConfigMap", "uid": OWNER_UID}.items()
        )
    pool = by_kind(objects, "InferencePool")[0]
    assert pool["spec"]["selector"]["matchLabels"] == {render.LABEL_DEPLOYMENT: "qwen3-8b"}


def test_prefill_and_decode_pools_hand_over_through_nixl_with_the_side_channel_on_the_pod_ip():
    objects = render_all("prefill-decode")
    roles = {}
    for workload in by_kind(objects, "Deployment"):
        engine = container(workload)
        args = engine["args"]
        roles[workload["metadata"]["labels"][render.LABEL_ROLE]] = json.loads(
            args[args.index("--kv-transfer-config") + 1]
        )["kv_role"]
        env = {item["name"]: item for item in engine["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
        assert "UCX_NET_DEVICES" not in env  # loopback is for local engines only
    assert roles == {"prefill": "kv_producer", "decode": "kv_consumer"}


def test_wide_ep_runs_data_parallel_ranks_over_the_nodes_of_a_leader_worker_set():
    objects = render_all("wide-ep")
    assert not by_kind(objects, "Deployment")
    lws = by_kind(objects, "LeaderWorkerSet")[0]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    leader = container(lws, "leaderTemplate")
    args = leader["args"]
    assert args[args.index("--data-parallel-size") + 1] == "16"
    assert args[args.index("--data-parallel-size-local") + 1] == "8"
    assert args[args.index("--data-parallel-address") + 1] == "$(LWS_LEADER_ADDRESS)"
    assert args[args.index("--data-parallel-start-rank") + 1] == "0"
    assert "--enable-expert-parallel" in args and "--trust-remote-code" in args
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == "8"
    worker = container(lws, "workerTemplate")
    assert worker["command"] == ["/bin/sh", "-c"]
    line = worker["args"][0]
    assert "--headless" in line and "--data-parallel-start-rank $$((LWS_WORKER_INDEX * 8))" in line
    assert "readinessProbe" not in worker  # a headless worker serves no HTTP
    service = by_kind(objects, "Service")[0]
    assert service["spec"]["selector"][render.LWS_WORKER_INDEX_LABEL] == "0"


def test_cpu_offload_and_speculative_decoding_reach_the_engine_arguments():
    engine = container(by_kind(render_all("cpu-offload"), "Deployment")[0])
    transfer = json.loads(engine["args"][engine["args"].index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "OffloadingConnector"
    assert transfer["kv_connector_extra_config"]["cpu_bytes_to_use"] == 200 * GiB
    engine = container(by_kind(render_all("speculative"), "Deployment")[0])
    spec = json.loads(engine["args"][engine["args"].index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 4
    assert "--kv-events-config" not in engine["args"]


@pytest.mark.parametrize(
    "case, tool, reasoning",
    [
        ("aggregated", "hermes", "qwen3"),
        ("prefill-decode", "llama3_json", None),
        ("wide-ep", "deepseek_v3", "deepseek_r1"),
        ("speculative", "qwen3_coder", None),
    ],
)
def test_every_pod_gets_its_model_familys_parsers(case, tool, reasoning):
    objects = render_all(case)
    workloads = by_kind(objects, "Deployment") + by_kind(objects, "LeaderWorkerSet")
    for workload in workloads:
        template = "template" if workload["kind"] == "Deployment" else "leaderTemplate"
        args = container(workload, template)["args"]
        assert "--enable-auto-tool-choice" in args and args[args.index("--tool-call-parser") + 1] == tool
        assert reasoning is None or args[args.index("--reasoning-parser") + 1] == reasoning
        assert reasoning is not None or "--reasoning-parser" not in args
    assert workloads


TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}"
)


def test_the_deployments_own_settings_and_chat_template_reach_leader_and_workers():
    """A parser switched off, one set explicitly, and a multi-line template with quotes: one argument in the
    leader's args, and one word again once the worker's shell line is split."""
    deployment = _deployment(
        71006,
        "custom",
        model_source="Qwen/Qwen3-8B",
        tool_call_parser="none",
        reasoning_parser="deepseek_r1",
        chat_template=TEMPLATE,
    )
    Pool.objects.create(
        deployment=deployment,
        name="main",
        data_parallel_size=4,
        nodes_per_replica=2,
        gpus_per_replica=4,
        kv_connector=KvConnector.NIXL,
    )
    objects = [render.render_root(deployment), *render.render_children(deployment, None)]
    validate_objects(objects)
    lws = by_kind(objects, "LeaderWorkerSet")[0]
    leader = container(lws, "leaderTemplate")["args"]
    worker = shlex.split(container(lws, "workerTemplate")["args"][0])
    for args in (leader, worker):
        assert "--tool-call-parser" not in args and "--enable-auto-tool-choice" not in args
        assert args[args.index("--reasoning-parser") + 1] == "deepseek_r1"
        assert args[args.index("--chat-template") + 1] == TEMPLATE


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"tensor_parallel_size": 2, "gpus_per_replica": 1}, "gpus_per_replica is 1"),
        ({"nodes_per_replica": 2, "data_parallel_size": 3, "gpus_per_replica": 3}, "multiple of"),
        (
            {"kv_connector": KvConnector.OFFLOADING, "cpu_offload_bytes": 64 * GiB, "memory_request": "32Gi"},
            "leaves no room",
        ),
    ],
)
def test_it_refuses_pools_it_cannot_run(fields, reason):
    deployment = _deployment(71009, "bad")
    Pool.objects.create(deployment=deployment, name="main", **fields)
    with pytest.raises(UnsupportedEngineOption, match=reason):
        render.render_children(deployment, None)


def test_a_dollar_in_the_chat_template_survives_kubernetes_expansion():
    """Kubernetes turns `$$` into `$` and expands `$(NAME)` in container args: the template's `$` is doubled."""
    template = "{{ '$(HOME) costs $5' }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    deployment = _deployment(71007, "dollar", model_source="Qwen/Qwen3-8B", chat_template=template)
    Pool.objects.create(deployment=deployment, name="main")
    objects = [render.render_root(deployment), *render.render_children(deployment, None)]
    args = container(by_kind(objects, "Deployment")[0])["args"]
    assert args[args.index("--chat-template") + 1] == template.replace("$", "$$")


def pod_templates(workload: dict) -> list[dict]:
    if workload["kind"] == "Deployment":
        return [workload["spec"]["template"]]
    lws = workload["spec"]["leaderWorkerTemplate"]
    return [lws["leaderTemplate"], lws["workerTemplate"]]


@pytest.mark.parametrize("case", list(CASES))
def test_every_serving_engine_requires_the_deployments_key_from_its_secret(case):
    objects = render_all(case)
    (secret,) = by_kind(objects, "Secret")
    deployment = ModelDeployment.objects.get(name=objects[0]["metadata"]["name"])
    key = engine_api_key(deployment.pk)
    assert secret["metadata"]["name"] == f"{deployment.name}-engine-key"
    assert base64.b64decode(secret["data"]["VLLM_API_KEY"]).decode() == key
    assert secret["metadata"]["labels"] == render.deployment_labels(deployment)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == OWNER_UID
    workloads = by_kind(objects, "Deployment") + by_kind(objects, "LeaderWorkerSet")
    for workload in workloads:
        for template in pod_templates(workload):
            engine = template["spec"]["containers"][0]
            env = {item["name"]: item for item in engine["env"]}
            serving = "readinessProbe" in engine
            if serving:
                reference = {"name": secret["metadata"]["name"], "key": "VLLM_API_KEY"}
                assert env["VLLM_API_KEY"] == {
                    "name": "VLLM_API_KEY",
                    "valueFrom": {"secretKeyRef": reference},
                }
            else:
                assert "VLLM_API_KEY" not in env  # a headless worker serves no HTTP
            # The key itself is never in the pod spec, only a digest that rolls the pods when it changes.
            assert key not in json.dumps(template)
            assert template["metadata"]["annotations"][render.ENGINE_KEY_ANNOTATION]
    assert workloads


def test_a_new_key_rolls_the_engine_pods(settings):
    before = by_kind(render_all("aggregated"), "Deployment")[0]["spec"]["template"]
    ModelDeployment.objects.all().delete()
    settings.ENGINE_KEY_SECRET = "rotated"
    after = by_kind(render_all("aggregated"), "Deployment")[0]["spec"]["template"]
    annotation = render.ENGINE_KEY_ANNOTATION
    assert before["metadata"]["annotations"][annotation] != after["metadata"]["annotations"][annotation]


@pytest.mark.parametrize("case", list(CASES))
def test_engine_pods_get_no_service_account_token(case):
    objects = render_all(case)
    for workload in by_kind(objects, "Deployment") + by_kind(objects, "LeaderWorkerSet"):
        for template in pod_templates(workload):
            assert template["spec"]["automountServiceAccountToken"] is False


def _peer_names(rule: dict) -> set[tuple[str, str]]:
    names = set()
    for peer in rule["from"]:
        namespace = (
            peer.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
        )
        labels = peer["podSelector"]["matchLabels"]
        names.add((namespace, labels.get(render.PLATFORM_NAME_LABEL) or labels.get(render.LABEL_DEPLOYMENT)))
    return names


def _ports(rule: dict) -> list[tuple[int, int]]:
    assert {port["protocol"] for port in rule["ports"]} == {"TCP"}
    return [(port["port"], port.get("endPort", port["port"])) for port in rule["ports"]]


@pytest.mark.parametrize(
    "case, kv_events, peers",
    [
        ("aggregated", True, False),
        ("prefill-decode", True, True),  # NIXL between prefill and decode pods
        ("wide-ep", True, True),  # NIXL, and the nodes of each LeaderWorkerSet group
        ("cpu-offload", True, False),
        ("speculative", False, False),
    ],
)
def test_only_the_platform_reaches_the_engines_through_the_network_policy(case, kv_events, peers):
    objects = render_all(case)
    name = objects[0]["metadata"]["name"]
    # The other policy is the engines' egress (tests/serving/test_engine_egress.py).
    (policy,) = [
        obj for obj in by_kind(objects, "NetworkPolicy") if obj["metadata"]["name"] == f"{name}-engines"
    ]
    assert policy["metadata"]["ownerReferences"][0]["uid"] == OWNER_UID
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]  # isolated for ingress: what no rule allows is refused
    # It selects every engine pod of the deployment, and nothing of another deployment.
    for workload in by_kind(objects, "Deployment") + by_kind(objects, "LeaderWorkerSet"):
        for template in pod_templates(workload):
            assert spec["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert spec["podSelector"]["matchLabels"] == {render.LABEL_DEPLOYMENT: name}

    platform = "inference-platform"
    http, *rest = spec["ingress"]
    assert _peer_names(http) == {(platform, "router"), (platform, "worker")}
    assert _ports(http) == [(8000, 8000)]
    if kv_events:
        events, *rest = rest
        assert _peer_names(events) == {(platform, "kv-ingester")} and _ports(events) == [(5557, 5557)]
    if peers:
        own, *rest = rest
        assert _peer_names(own) == {(None, name)}  # no namespaceSelector: this namespace only
        ranges = _ports(own)
        assert ranges == [(1, 7999), (8001, 65535)]  # every port but the engine's HTTP
        # KV events, NIXL side channels of data-parallel ranks, the data-parallel RPC port: all inside.
        assert all(any(lo <= port <= hi for lo, hi in ranges) for port in (5557, 5600, 5615, 13345))
    assert rest == []


def test_the_platform_namespace_comes_from_the_settings(settings):
    settings.KUBERNETES_PLATFORM_NAMESPACE = "llm-platform"
    policy = by_kind(render_all("aggregated"), "NetworkPolicy")[0]
    namespaces = {
        peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
    }
    assert namespaces == {"llm-platform"}
