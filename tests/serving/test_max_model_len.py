"""A deployment's max_model_len is refused where its engines would refuse it: above the length vLLM derives from
the model's config (and its tokenizer's), through the API, the admin and the portal, and by the orchestrator for a
deployment saved before the model's config could be read. The engines' own start-up refusal is in
test_engine_conformance.py and test_simulator.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from django.test import Client

from serving import services
from serving.models import ModelDeployment, ObservedStatus, Pool
from serving.orchestrators import processes

TINY_POSITIONS = 262_144  # models/tiny-qwen: max_position_embeddings (and its tokenizer's model_max_length)
YARN_X4 = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262_144}}


@pytest.fixture
def operator_api(world, client_for):
    return client_for(world.operator)


def create(api, **fields):
    body = {
        "name": "long",
        "served_model_name": "long-qwen",
        "model_source": "models/tiny-qwen",
        "engine_kind": "vllm",
        **fields,
    }
    return api.post("/api/deployments/", body, format="json")


@pytest.mark.parametrize("engine_kind", ["vllm", "sim"])
def test_it_refuses_a_max_model_len_beyond_the_models_positions(operator_api, engine_kind):
    response = create(operator_api, engine_kind=engine_kind, max_model_len=1_048_576)
    assert response.status_code == 400, response.content
    (message,) = response.json()["max_model_len"]
    assert message.startswith("max_model_len 1048576 is longer than models/tiny-qwen allows: 262144 tokens")
    assert "max_position_embeddings 262144 in its config.json" in message
    assert "set max_model_len to 262144 or less" in message
    assert not ModelDeployment.objects.filter(name="long").exists()


def test_it_takes_the_models_own_length(operator_api):
    response = create(operator_api, max_model_len=TINY_POSITIONS)
    assert response.status_code == 201, response.content


def test_a_change_beyond_the_model_is_refused_and_changes_nothing(world, operator_api):
    url = f"/api/deployments/{world.deployment.pk}/"
    response = operator_api.patch(url, {"max_model_len": TINY_POSITIONS + 1}, format="json")
    assert response.status_code == 400
    assert "262144 tokens" in response.json()["max_model_len"][0]
    world.deployment.refresh_from_db()
    assert world.deployment.max_model_len == 4096


def test_a_deployment_saved_before_the_check_can_still_be_stopped(world, operator_api):
    ModelDeployment.objects.filter(pk=world.deployment.pk).update(max_model_len=1_048_576)
    url = f"/api/deployments/{world.deployment.pk}/"
    response = operator_api.patch(url, {"desired_status": "stopped"}, format="json")
    assert response.status_code == 200, response.content
    response = operator_api.patch(url, {"max_model_len": 1_048_575}, format="json")
    assert response.status_code == 400


def test_a_pools_rope_scaling_override_lengthens_the_model(world, operator_api):
    """vLLM's --hf-overrides with YaRN (as Qwen's model cards say to run long contexts): the length it derives
    is original_max_position_embeddings times the factor, for the engines of that pool."""
    url = f"/api/deployments/{world.deployment.pk}/"
    yarn = ["--hf-overrides", json.dumps(YARN_X4)]
    response = operator_api.patch(
        url,
        {"max_model_len": 1_048_576, "pools": [{"name": "main", "extra_engine_args": yarn}]},
        format="json",
    )
    assert response.status_code == 200, response.content

    # Without it again the model is back to its own length: refused, whatever the request leaves out.
    response = operator_api.patch(url, {"pools": [{"name": "main", "extra_engine_args": []}]}, format="json")
    assert response.status_code == 400
    assert "262144 tokens" in response.json()["max_model_len"][0]
    response = operator_api.patch(
        url,
        {"max_model_len": 1_048_577, "pools": [{"name": "main", "extra_engine_args": yarn}]},
        format="json",
    )
    assert response.status_code == 400
    message = response.json()["max_model_len"][0]
    assert "with pool main's engine arguments: 1048576 tokens" in message
    assert (
        "original_max_position_embeddings 262144 in its config.json, times the RoPE scaling factor 4.0"
        in message
    )


def write_model(folder: Path, config: dict, tokenizer_config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


@pytest.mark.parametrize(
    "config, tokenizer_config, limit, how",
    [
        ({"seq_length": 2048, "max_position_embeddings": 32768}, None, 2048, "seq_length 2048"),
        ({"max_sequence_length": 8192}, None, 8192, "max_sequence_length 8192"),
        ({"max_position_embeddings": 32768}, {"model_max_length": 16384}, 16384, "tokenizer_config.json"),
        (
            {"max_position_embeddings": 8192, "rope_scaling": {"type": "linear", "factor": 2.0}},
            None,
            16384,
            "times the RoPE scaling factor 2.0",
        ),
        (  # llama3 scaling: max_position_embeddings already counts it
            {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            None,
            131072,
            "max_position_embeddings 131072",
        ),
    ],
)
def test_the_limit_follows_vllms_rule(operator_api, tmp_path, config, tokenizer_config, limit, how):
    folder = write_model(tmp_path / "model", config, tokenizer_config)
    assert create(operator_api, model_source=str(folder), max_model_len=limit).status_code == 201
    ModelDeployment.objects.filter(name="long").delete()
    response = create(operator_api, model_source=str(folder), max_model_len=limit + 1)
    assert response.status_code == 400
    message = response.json()["max_model_len"][0]
    assert f"{limit} tokens" in message and how in message


def test_a_sliding_window_caps_it_only_when_disabled(world, operator_api, tmp_path):
    folder = write_model(tmp_path / "model", {"max_position_embeddings": 32768, "sliding_window": 4096})
    response = create(operator_api, model_source=str(folder), max_model_len=32768)
    assert response.status_code == 201, response.content
    url = f"/api/deployments/{response.json()['id']}/"
    pools = [{"name": "main", "extra_engine_args": ["--disable-sliding-window"]}]
    response = operator_api.patch(url, {"pools": pools}, format="json")
    assert response.status_code == 400
    assert (
        "4096 tokens (sliding_window 4096 (--disable-sliding-window))" in response.json()["max_model_len"][0]
    )


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """This machine's Hugging Face cache, empty."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def cache_config(cache: Path, repo_id: str, config: dict) -> None:
    """Put a model's config.json in the cache as the hub client (or an engine that fetched it) leaves it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    write_model(repo / "snapshots" / "abc123", config)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")


def test_a_hub_model_is_checked_from_this_machines_cache(operator_api, hub_cache):
    cache_config(hub_cache, "example-org/coder-32k", {"max_position_embeddings": 32768})
    response = create(operator_api, model_source="example-org/coder-32k", max_model_len=65536)
    assert response.status_code == 400
    assert "example-org/coder-32k allows: 32768 tokens" in response.json()["max_model_len"][0]


def test_a_hub_model_not_here_is_taken_as_given(operator_api, hub_cache):
    """No config to read and no call to the hub from an API request: the engines are the judges."""
    response = create(operator_api, model_source="example-org/not-fetched", max_model_len=1_048_576)
    assert response.status_code == 201, response.content


# --- the admin and the portal ---------------------------------------------------------------------------------


@pytest.fixture
def operator_browser(world) -> Client:
    world.operator.is_staff = True
    world.operator.is_superuser = True
    world.operator.save()
    client = Client()
    client.force_login(world.operator)
    return client


def admin_form(deployment: ModelDeployment, pool: Pool, **fields) -> dict:
    data = {
        "name": deployment.name,
        "served_model_name": deployment.served_model_name,
        "model_source": deployment.model_source,
        "engine_kind": deployment.engine_kind,
        "orchestrator": deployment.orchestrator,
        "max_model_len": deployment.max_model_len,
        "block_size": deployment.block_size,
        "desired_status": deployment.desired_status,
        "tool_call_parser": "",
        "reasoning_parser": "",
        "chat_template": "",
        "pools-TOTAL_FORMS": "1",
        "pools-INITIAL_FORMS": "1",
        "pools-MIN_NUM_FORMS": "0",
        "pools-MAX_NUM_FORMS": "1000",
        "pools-0-id": pool.pk,
        "pools-0-deployment": deployment.pk,
        "pools-0-name": pool.name,
        "pools-0-role": pool.role,
        "pools-0-replicas": pool.replicas,
        "pools-0-tensor_parallel_size": 1,
        "pools-0-data_parallel_size": 1,
        "pools-0-nodes_per_replica": 1,
        "pools-0-enable_prefix_caching": "on",
        "pools-0-enable_kv_events": "on",
        "pools-0-kv_connector": "",
        "pools-0-cpu_offload_bytes": 0,
        "pools-0-speculative_method": "",
        "pools-0-max_num_seqs": pool.max_num_seqs,
        "pools-0-gpus_per_replica": 1,
        "pools-0-extra_engine_args": "[]",
    }
    return {**data, **fields}


def test_the_admin_refuses_it_and_takes_a_pools_rope_scaling(world, operator_browser):
    deployment, pool = world.deployment, world.deployment.pools.get()
    url = f"/admin/serving/modeldeployment/{deployment.pk}/change/"
    response = operator_browser.post(url, admin_form(deployment, pool, max_model_len=1_048_576))
    assert response.status_code == 200  # the form again, with the error
    (formset,) = response.context["inline_admin_formsets"]
    (message,) = formset.formset.non_form_errors()
    assert message.startswith("max_model_len 1048576 is longer than models/tiny-qwen allows: 262144 tokens")
    deployment.refresh_from_db()
    assert deployment.max_model_len == 4096

    yarn = json.dumps(["--hf-overrides", json.dumps(YARN_X4)])
    form = admin_form(deployment, pool, max_model_len=1_048_576, **{"pools-0-extra_engine_args": yarn})
    response = operator_browser.post(url, form)
    assert response.status_code == 302, response.content[:3000]
    deployment.refresh_from_db()
    assert deployment.max_model_len == 1_048_576


def test_the_portal_refuses_a_model_shorter_than_the_default(world, operator_browser, tmp_path):
    """The portal's form sets no max_model_len: the default (4096) is refused for a model of 2048 positions."""
    folder = write_model(tmp_path / "short", {"max_position_embeddings": 2048})
    data = {
        "name": "short",
        "served_model_name": "short-model",
        "model_source": str(folder),
        "engine_kind": "sim",
        "replicas": 1,
    }
    response = operator_browser.post("/portal/deployments/new/", data)
    assert response.status_code == 200
    (message,) = response.context["form"].non_field_errors()
    assert message.startswith(f"max_model_len 4096 is longer than {folder} allows: 2048 tokens")
    assert not ModelDeployment.objects.filter(name="short").exists()


# --- the orchestrator ------------------------------------------------------------------------------------------


def test_an_engine_that_would_refuse_it_is_reported_not_restarted(live_engines, settings):
    """A deployment saved before its model's config could be read here (a hub model that its first engine then
    fetched, or one saved before this check): the reconcile fails it with the reason, and starts no engine that
    would exit and be restarted again and again."""
    settings.ENGINE_RESTART_BACKOFF_S = 1
    deployment = ModelDeployment.objects.create(
        name="too-long", served_model_name="too-long", model_source="models/tiny-qwen", engine_kind="sim"
    )
    Pool.objects.create(deployment=deployment, name="main", replicas=1, max_num_seqs=8)
    ModelDeployment.objects.filter(pk=deployment.pk).update(max_model_len=1_048_576)

    for _ in range(3):
        services.deployment_reconcile(deployment_id=deployment.pk)
        time.sleep(0.5)
    deployment.refresh_from_db()
    assert deployment.observed_status == ObservedStatus.FAILED, deployment.status_message
    assert (
        "max_model_len 1048576 is longer than models/tiny-qwen allows: 262144 tokens"
        in deployment.status_message
    )
    assert all(slot.deployment_id != deployment.pk for slot in processes.find_engines())
    assert not deployment.pools.get().endpoints.exists()
