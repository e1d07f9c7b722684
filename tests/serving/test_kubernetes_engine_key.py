"""The engine API key on a real vLLM engine, handed to it as a pod hands it: VLLM_API_KEY in its environment
(kube_render takes it from the deployment's Secret). vLLM then refuses its OpenAI routes without the key,
while /health (the kubelet's probes) and /metrics (the worker's load scraper) stay open.
"""

from __future__ import annotations

import httpx
import pytest
import redis
from django.conf import settings

from routing.contracts import LOAD_KEY
from routing.scheduling.load_scraper import endpoint_loads_scrape
from serving.engine_keys import engine_api_key
from serving.models import Endpoint, Health, ModelDeployment, OrchestratorKind, Pool
from serving.orchestrators import kube_render

from .engines import MODEL_NAME, RunningEngine, start_engine

pytestmark = pytest.mark.vllm

DEPLOYMENT_ID = 72001
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def keyed_vllm_engine() -> RunningEngine:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(kube_render.ENGINE_KEY_ENV, engine_api_key(DEPLOYMENT_ID))
        engine = start_engine("vllm", events=False, tool_parser=False)
    yield engine
    engine.stop()


def test_vllm_refuses_its_openai_routes_without_the_deployments_key(keyed_vllm_engine):
    url = keyed_vllm_engine.url
    key = engine_api_key(DEPLOYMENT_ID)
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60).status_code == 401
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
    for authorization in (
        f"Bearer {engine_api_key(DEPLOYMENT_ID + 1)}",
        f"Bearer {key.upper()}",
        f"Basic {key}",
    ):
        headers = {"Authorization": authorization}
        assert (
            httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers, timeout=60).status_code
            == 401
        )
    headers = {"Authorization": f"Bearer {key}"}
    answer = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 1


@pytest.mark.django_db
def test_probes_and_the_load_scraper_need_no_key(keyed_vllm_engine):
    assert httpx.get(f"{keyed_vllm_engine.url}/health", timeout=10).status_code == 200
    deployment = ModelDeployment.objects.create(
        name="keyed",
        served_model_name=MODEL_NAME,
        model_source=MODEL_NAME,
        orchestrator=OrchestratorKind.KUBERNETES,
    )
    pool = Pool.objects.create(deployment=deployment, name="main")
    endpoint = Endpoint.objects.create(
        pool=pool, name="keyed-main-a", url=keyed_vllm_engine.url, role=pool.role, health=Health.HEALTHY
    )
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(LOAD_KEY.format(endpoint.pk))
    assert endpoint_loads_scrape(timeout=10) == 1
    load = client.hgetall(LOAD_KEY.format(endpoint.pk))
    assert b"running" in load and b"kv_usage" in load
