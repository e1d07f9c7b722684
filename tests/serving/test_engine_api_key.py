"""An engine started with an API key (`--api-key`, or VLLM_API_KEY as the Kubernetes orchestrator gives its pods)
guards what vLLM guards, /v1 and its other API prefixes, and nothing else: /health, /metrics and /tokenize answer
without it. The simulator behaves as vLLM does, proven against both."""

from __future__ import annotations

import httpx
import pytest

from .engines import BOTH_ENGINES, start_engine

KEY = "engine-key-for-this-test"


@pytest.fixture(params=BOTH_ENGINES)
def keyed_engine(request):
    engine = start_engine(request.param, "--api-key", KEY, events=False)
    yield engine
    engine.stop()


def test_the_key_guards_the_api_and_only_the_api(keyed_engine):
    url = keyed_engine.url
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer not-it"}, timeout=30)
    assert (wrong.status_code, wrong.json()) == (401, {"error": "Unauthorized"})
    basic = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Basic {KEY}"}, timeout=30)
    assert basic.status_code == 401
    ok = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert ok.status_code == 200
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": ok.json()["data"][0]["id"],
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        },
        timeout=60,
    )
    assert chat.status_code == 401
    # Outside the guarded prefixes vLLM asks for no key (why the engines' NetworkPolicies matter).
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200
    assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, timeout=30).status_code == 200
