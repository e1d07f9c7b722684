"""/metrics/platform and /metrics/engines on the web process: only for the bearer of PLATFORM_METRICS_TOKEN,
and what they say is what Postgres holds."""

from __future__ import annotations

import shutil
import subprocess
from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from serving.models import Endpoint, Health, ObservedStatus
from tenants.billing import usage_rollup

from ..conftest import make_usage

TOKEN = "scraper-token"


@pytest.fixture
def scraper(client, settings):
    settings.PLATFORM_METRICS_TOKEN = TOKEN

    def get(path: str, token: str | None = TOKEN):
        headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
        return client.get(path, **headers)

    return get


def samples(response) -> dict[tuple[str, frozenset], float]:
    text = response.content.decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(found: dict, name: str, **labels) -> float:
    return found[(name, frozenset(labels.items()))]


@pytest.mark.parametrize("path", ["/metrics/platform", "/metrics/engines"])
def test_it_refuses_a_scraper_without_the_token(scraper, path, world):
    assert scraper(path, token=None).status_code == 401
    assert scraper(path, token="not-it").status_code == 401
    assert scraper(path).status_code == 200


def test_it_serves_nothing_when_no_token_is_set(client, settings, world):
    settings.PLATFORM_METRICS_TOKEN = ""
    assert client.get("/metrics/platform", HTTP_AUTHORIZATION="Bearer ").status_code == 401


def test_it_reports_deployment_status_pools_and_engines(scraper, world):
    deployment = world.deployment
    deployment.observed_status = ObservedStatus.DEGRADED
    deployment.save()
    pool = deployment.pools.get()
    now = timezone.now()
    Endpoint.objects.create(
        pool=pool, name="tiny-main-0", url="http://127.0.0.1:9101", role=pool.role, health=Health.HEALTHY
    )
    Endpoint.objects.create(
        pool=pool,
        name="tiny-main-1",
        url="http://127.0.0.1:9102",
        role=pool.role,
        health=Health.UNHEALTHY,
        restart_count=4,
        next_restart_at=now + timedelta(seconds=30),
        draining_since=now,
    )

    found = samples(scraper("/metrics/platform"))

    ids = {"deployment": "tiny", "model": "tiny-qwen"}
    assert value(found, "platform_deployment_status", **ids, status="degraded") == 1
    assert value(found, "platform_deployment_status", **ids, status="ready") == 0
    assert value(found, "platform_deployment_desired_running", **ids) == 1
    pool_ids = {**ids, "pool": "main", "role": pool.role}
    assert value(found, "platform_pool_desired_replicas", **pool_ids) == 2
    assert value(found, "platform_endpoints", **pool_ids, health="healthy") == 1
    assert value(found, "platform_endpoints", **pool_ids, health="unhealthy") == 1
    assert value(found, "platform_endpoints", **pool_ids, health="starting") == 0
    assert value(found, "platform_endpoints_draining", **pool_ids) == 1
    assert value(found, "platform_endpoint_restarts_total", **pool_ids, endpoint="tiny-main-1") == 4
    assert value(found, "platform_endpoint_restart_backoff", **pool_ids, endpoint="tiny-main-1") == 1
    assert value(found, "platform_endpoint_restart_backoff", **pool_ids, endpoint="tiny-main-0") == 0


def test_it_reports_usage_by_tenant_and_team_from_the_roll_up(scraper, world):
    make_usage(world.key_a1, "req-a1-2", prompt_tokens=1000, cached_prompt_tokens=600, output_tokens=50)
    make_usage(
        world.key_a1, "req-a1-3", prompt_tokens=10, cached_prompt_tokens=0, output_tokens=5, status="failed"
    )
    usage_rollup()

    found = samples(scraper("/metrics/platform"))

    ids = {"tenant": str(world.tenant_a.pk), "team": "agents", "model": world.usage_a1.model}
    assert value(found, "platform_usage_requests_total", **ids) == 3
    assert value(found, "platform_usage_errors_total", **ids) == 1
    prompt = world.usage_a1.prompt_tokens + 1010
    assert value(found, "platform_usage_tokens_total", **ids, kind="prompt") == prompt
    assert value(found, "platform_usage_tokens_total", **ids, kind="cached_prompt") == (
        world.usage_a1.cached_prompt_tokens + 600
    )
    assert (
        value(found, "platform_tenant_info", tenant=str(world.tenant_a.pk), slug="acme", active="true") == 1
    )
    # Another tenant's usage is its own series.
    other = {"tenant": str(world.tenant_b.pk), "team": "bots", "model": world.usage_b1.model}
    assert value(found, "platform_usage_requests_total", **other) == 1


def test_it_lists_the_engines_as_scrape_targets(scraper, world):
    pool = world.deployment.pools.get()
    Endpoint.objects.create(pool=pool, name="tiny-main-0", url="http://127.0.0.1:9101", role=pool.role)

    targets = scraper("/metrics/engines").json()

    assert targets == [
        {
            "targets": ["127.0.0.1:9101"],
            "labels": {
                "__scheme__": "http",
                "deployment": "tiny",
                "pool": "main",
                "role": pool.role,
                "endpoint": "tiny-main-0",
            },
        }
    ]


def test_the_exposition_passes_promtools_lint(scraper, world):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package: `make promtool`)")
    usage_rollup()
    body = scraper("/metrics/platform").content
    run = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
