"""Engines cannot be made to fetch what a request names: an egress NetworkPolicy per deployment lets engine pods
reach only the cluster DNS and their own deployment's pods (plus ranges an operator opens, never cloud
metadata), and vLLM engines of a model that takes media get an allow-list of media hosts, empty by default.
The reconcile of that policy, read back from a real API server, is in tests/kube/test_egress_policy.py."""

from __future__ import annotations

import ipaddress
import json
import subprocess

import pytest
from django.conf import settings

from serving.engine_command import EnginePorts, render_engine_command
from serving.models import KvConnector, ModelDeployment, OrchestratorKind, Pool
from serving.orchestrators import kube_render as render
from tests.deploy.validation import validate_objects
from tests.serving.test_kubernetes_render import CASES, by_kind, pod_templates, render_all

from .engines import ENGINE_PYTHON

pytestmark = pytest.mark.django_db

PLATFORM = "inference-platform"
ENGINES = "inference"
METADATA = "169.254.169.254"


def egress_policy(objects: list[dict]) -> dict:
    (policy,) = [obj for obj in by_kind(objects, "NetworkPolicy") if "Egress" in obj["spec"]["policyTypes"]]
    return policy


def _port_matches(rule: dict, port: int, protocol: str) -> bool:
    if "ports" not in rule:
        return True
    return any(
        spec.get("protocol", "TCP") == protocol and spec["port"] <= port <= spec.get("endPort", spec["port"])
        for spec in rule["ports"]
    )


def _peer_matches(peer: dict, policy_namespace: str, destination: dict) -> bool:
    if "ipBlock" in peer:
        if "ip" not in destination:
            return False
        address = ipaddress.ip_address(destination["ip"])
        block = peer["ipBlock"]
        inside = address in ipaddress.ip_network(block["cidr"])
        return inside and not any(address in ipaddress.ip_network(cidr) for cidr in block.get("except", []))
    if "pod" not in destination:
        return False
    namespace, labels = destination["namespace"], destination["pod"]
    if "namespaceSelector" in peer:
        wanted = peer["namespaceSelector"].get("matchLabels", {})
        if not wanted.items() <= {"kubernetes.io/metadata.name": namespace}.items():
            return False
    elif namespace != policy_namespace:
        return False
    return peer.get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()


def reaches(policy: dict, destination: dict, port: int, protocol: str = "TCP") -> bool:
    """Whether the policy lets its pods send to `destination` ({"ip": ...} or {"namespace", "pod": labels})."""
    assert policy["spec"]["policyTypes"] == ["Egress"]
    for rule in policy["spec"].get("egress", []):
        if not _port_matches(rule, port, protocol):
            continue
        if not rule.get("to") or any(
            _peer_matches(peer, policy["metadata"]["namespace"], destination) for peer in rule["to"]
        ):
            return True
    return False


def platform_pod(name: str) -> dict:
    return {"namespace": PLATFORM, "pod": {render.PLATFORM_NAME_LABEL: name}}


DNS = {"namespace": "kube-system", "pod": {"k8s-app": "kube-dns", "pod-template-hash": "5d78c9869d"}}
# Where a request could point an engine: none of it may be reachable.
FORBIDDEN = [
    ({"ip": METADATA}, 80),
    ({"ip": "fd00:ec2::254"}, 80),
    ({"ip": "10.96.0.1"}, 443),  # the Kubernetes API's service address
    ({"ip": "1.1.1.1"}, 443),  # the internet
    (platform_pod("postgres"), 5432),
    (platform_pod("redis"), 6379),
    (platform_pod("router"), 8000),
    (platform_pod("kv-ingester"), 5557),
    ({"namespace": ENGINES, "pod": {render.LABEL_DEPLOYMENT: "someone-elses-model"}}, 5600),
    ({"namespace": ENGINES, "pod": {render.LABEL_DEPLOYMENT: "someone-elses-model"}}, 8000),
    (DNS, 80),
]
PEERS = {
    "aggregated": False,
    "prefill-decode": True,
    "wide-ep": True,
    "cpu-offload": False,
    "speculative": False,
}


@pytest.mark.parametrize("case", list(CASES))
def test_it_renders_a_valid_egress_policy_selecting_exactly_the_deployments_engine_pods(case):
    objects = render_all(case)
    policy = egress_policy(objects)
    validate_objects([policy])
    name = objects[0]["metadata"]["name"]
    assert policy["metadata"]["name"] == f"{name}-engines-egress"
    assert (
        policy["metadata"]["labels"][render.LABEL_DEPLOYMENT_ID]
        == objects[0]["metadata"]["labels"][render.LABEL_DEPLOYMENT_ID]
    )
    assert policy["metadata"]["ownerReferences"][0]["name"] == name
    selector = policy["spec"]["podSelector"]["matchLabels"]
    templates = [
        template
        for workload in by_kind(objects, "Deployment") + by_kind(objects, "LeaderWorkerSet")
        for template in pod_templates(workload)
    ]
    roles = {template["metadata"]["labels"][render.LABEL_ROLE] for template in templates}
    assert roles and all(selector.items() <= t["metadata"]["labels"].items() for t in templates)
    assert selector == {render.LABEL_DEPLOYMENT: name}  # and no pod of another deployment
    # The ingress policy is as it was: ingress only.
    (ingress,) = [obj for obj in by_kind(objects, "NetworkPolicy") if obj is not policy]
    assert ingress["spec"]["policyTypes"] == ["Ingress"]


@pytest.mark.parametrize("case", list(CASES))
def test_engines_reach_only_the_dns_and_their_own_deployments_pods(case):
    objects = render_all(case)
    policy = egress_policy(objects)
    assert all(rule.get("to") for rule in policy["spec"]["egress"])  # an empty `to` would mean anywhere
    assert reaches(policy, DNS, 53, "UDP") and reaches(policy, DNS, 53, "TCP")
    for destination, port in FORBIDDEN:
        assert not reaches(policy, destination, port), destination
    name = objects[0]["metadata"]["name"]
    for workload in by_kind(objects, "Deployment") + by_kind(objects, "LeaderWorkerSet"):
        for template in pod_templates(workload):
            peer = {"namespace": ENGINES, "pod": template["metadata"]["labels"]}
            # NIXL side channels of every data-parallel rank, the data-parallel RPC port: only between peers.
            for port in (5600, 5615, render.DP_RPC_PORT):
                assert reaches(policy, peer, port) == PEERS[case], (name, port)
            assert not reaches(policy, peer, render.HTTP_PORT)


def test_operator_ranges_are_opened_but_never_cloud_metadata(settings):
    settings.KUBERNETES_ENGINE_EGRESS_CIDRS = ["10.20.0.0/16", "0.0.0.0/0", "::/0"]
    policy = egress_policy(render_all("aggregated"))
    validate_objects([policy])
    assert reaches(policy, {"ip": "10.20.3.4"}, 443) and reaches(policy, {"ip": "1.1.1.1"}, 443)
    for address in (METADATA, "169.254.0.1", "fe80::1", "fd00:ec2::254"):
        assert not reaches(policy, {"ip": address}, 80), address


# --- media URLs ----------------------------------------------------------------------------------------------

PORTS = EnginePorts(http=8100, kv_events=5557, side_channel=5600)
TEXT_CONFIG = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
VISION_CONFIG = {
    "model_type": "qwen2_5_vl",
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "vision_config": {"depth": 32},
}


def model_dir(tmp_path, name: str, config: dict, *, preprocessor: bool = False) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if preprocessor:
        (folder / "preprocessor_config.json").write_text("{}")
    return str(folder)


def local_argv(model_source: str, engine_kind: str = "vllm") -> tuple[list[str], dict]:
    deployment = ModelDeployment(
        name="m",
        served_model_name="m",
        model_source=model_source,
        engine_kind=engine_kind,
        max_model_len=4096,
    )
    command = render_engine_command(deployment=deployment, pool=Pool(name="main"), ports=PORTS)
    return command.argv, command.env


def media_domains(argv: list[str]) -> list[str] | None:
    if "--allowed-media-domains" not in argv:
        return None
    assert argv.count("--allowed-media-domains") == 1
    values = argv[argv.index("--allowed-media-domains") + 1 :]
    return values[: next((i for i, value in enumerate(values) if value.startswith("--")), len(values))]


def test_the_local_engine_gets_the_media_allow_list_exactly_when_its_model_takes_media(tmp_path):
    cases = [
        ("models/tiny-qwen", False),  # a text-only model here
        (model_dir(tmp_path, "text", TEXT_CONFIG), False),
        (model_dir(tmp_path, "vision", VISION_CONFIG), True),  # a vision encoder in config.json
        (
            model_dir(tmp_path, "processor", TEXT_CONFIG, preprocessor=True),
            True,
        ),  # a media processor beside it
        ("Qwen/Qwen2.5-VL-7B-Instruct", True),  # a hub id: its config is not here to rule media out
    ]
    seen = []
    for source, _ in cases:
        argv, env = local_argv(source)
        seen.append((media_domains(argv), env.get("VLLM_MEDIA_URL_ALLOW_REDIRECTS")))
    # Empty by default: a host that never resolves, since vLLM reads an empty list as "any host".
    assert seen == [((["none.invalid"], "0") if media else (None, None)) for _, media in cases]


def test_the_operators_media_hosts_are_the_allow_list_and_the_simulator_gets_none(tmp_path, settings):
    settings.ENGINE_ALLOWED_MEDIA_DOMAINS = ["images.example.com", "CDN.example.org"]
    vision = model_dir(tmp_path, "vision", VISION_CONFIG)
    argv, _ = local_argv(vision)
    assert media_domains(argv) == ["images.example.com", "cdn.example.org"]
    argv, env = local_argv(vision, engine_kind="sim")  # it fetches no URL and takes no such flag
    assert media_domains(argv) is None and "VLLM_MEDIA_URL_ALLOW_REDIRECTS" not in env


def pod_engines(model_source: str) -> list[dict]:
    """The engine containers of a P/D deployment whose prefill pool spans two nodes (leader and worker)."""
    name = f"d{ModelDeployment.objects.count()}"
    deployment = ModelDeployment.objects.create(
        name=name,
        served_model_name=name,
        model_source=model_source,
        orchestrator=OrchestratorKind.KUBERNETES,
    )
    for name, role, nodes in (("prefill", "prefill", 2), ("decode", "decode", 1)):
        Pool.objects.create(
            deployment=deployment,
            name=name,
            role=role,
            nodes_per_replica=nodes,
            data_parallel_size=nodes,
            gpus_per_replica=nodes,
            kv_connector=KvConnector.NIXL,
        )
    objects = render.render_children(deployment, owner=None)
    return [
        template["spec"]["containers"][0]
        for workload in by_kind(objects, "Deployment") + by_kind(objects, "LeaderWorkerSet")
        for template in pod_templates(workload)
    ]


def test_every_engine_pod_gets_the_media_allow_list_exactly_when_its_model_takes_media():
    for model_source, media in (("models/tiny-qwen", False), ("Qwen/Qwen2.5-VL-7B-Instruct", True)):
        engines = pod_engines(model_source)
        assert len(engines) == 3  # decode; prefill's leader and worker
        for engine in engines:
            argv = engine["args"] if engine["command"][0] != "/bin/sh" else engine["args"][0].split()
            env = {item["name"]: item.get("value") for item in engine["env"]}
            assert media_domains(argv) == (["none.invalid"] if media else None), model_source
            assert env.get("VLLM_MEDIA_URL_ALLOW_REDIRECTS") == ("0" if media else None)


VLLM_MEDIA_CHECK = """
import base64, io, json, sys
from PIL import Image
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.multimodal.media.connector import MediaConnector
from vllm.multimodal.media.image import ImageMediaIO
from vllm.utils.argparse_utils import FlexibleArgumentParser

args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
connector = MediaConnector(allowed_media_domains=args.allowed_media_domains)
seen = {"domains": args.allowed_media_domains}
try:
    connector.load_from_url("http://169.254.169.254/latest/meta-data/", ImageMediaIO(), fetch_timeout=2)
    seen["metadata"] = "fetched"
except Exception as exc:
    seen["metadata"] = str(exc)
png = io.BytesIO()
Image.new("RGB", (2, 2)).save(png, format="PNG")
inline = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
seen["inline"] = list(connector.load_from_url(inline, ImageMediaIO()).size)
print(json.dumps(seen))
"""


@pytest.mark.vllm
@pytest.mark.skipif(not ENGINE_PYTHON.exists(), reason="no engine environment (make test builds it)")
def test_vllm_takes_the_flag_refuses_a_metadata_url_and_still_takes_inline_media():
    """The command as rendered, parsed by vLLM's own server parser and given to its media loader."""
    argv, _ = local_argv("Qwen/Qwen2.5-VL-7B-Instruct")
    run = subprocess.run(
        [str(ENGINE_PYTHON), "-c", VLLM_MEDIA_CHECK, *argv[3:]],
        cwd=settings.BASE_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["domains"] == ["none.invalid"]
    assert "allowed domains" in seen["metadata"] and METADATA in seen["metadata"]
    assert seen["inline"] == [2, 2]
