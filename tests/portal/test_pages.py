"""Portal pages: who sees what, keys shown once, deployments changed with an audit trail, cost to serve."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.test import Client
from django.utils import timezone

from portal.models import AcceleratorPrice
from serving.models import EndpointLifetime, ModelDeployment, Pool
from tenants.keys import api_key_verify
from tenants.models import ApiKey, AuditLog

from ..conftest import make_usage


@pytest.fixture
def browser():
    def make(user) -> Client:
        client = Client()
        client.force_login(user)
        return client

    return make


def test_it_asks_strangers_to_sign_in(world):
    response = Client().get("/portal/teams/")
    assert response.status_code == 302 and response["Location"].startswith("/portal/login/")


def test_it_signs_in_with_a_password(world):
    client = Client()
    response = client.post("/portal/login/", {"username": "olive", "password": "pw-olive-long-enough"})
    assert response.status_code == 302
    assert client.get("/portal/", follow=True).request["PATH_INFO"] == "/portal/fleet/"


def test_fleet_is_for_operators(world, browser):
    page = browser(world.operator).get("/portal/fleet/")
    assert page.status_code == 200 and b"tiny-qwen" in page.content
    assert browser(world.admin_a).get("/portal/fleet/").status_code == 403
    assert browser(world.admin_a).get("/portal/", follow=True).request["PATH_INFO"] == "/portal/teams/"


@pytest.mark.parametrize(
    ("viewer", "visible", "hidden"),
    [
        ("team_admin_a1", ["team_a1"], ["team_a2", "team_b1"]),
        ("member_a1", ["team_a1"], ["team_a2", "team_b1"]),
        ("admin_a", ["team_a1", "team_a2"], ["team_b1"]),
        ("admin_b", ["team_b1"], ["team_a1", "team_a2"]),
    ],
)
def test_team_pages_show_only_the_viewers_teams(world, browser, viewer, visible, hidden):
    client = browser(getattr(world, viewer))
    listing = client.get("/portal/teams/").content.decode()
    for name in visible:
        team = getattr(world, name)
        assert str(team) in listing
        assert client.get(f"/portal/teams/{team.pk}/").status_code == 200
    for name in hidden:
        team = getattr(world, name)
        assert str(team) not in listing
        assert client.get(f"/portal/teams/{team.pk}/").status_code == 404


@pytest.mark.parametrize(
    ("viewer", "labels", "absent"),
    [
        ("team_admin_a1", ["acme/agents"], ["acme/research", "bolt/bots"]),
        ("admin_a", ["acme/agents", "acme/research"], ["bolt/bots"]),
        ("admin_b", ["bolt/bots"], ["acme/agents", "acme/research"]),
    ],
)
def test_report_page_and_csv_show_only_the_viewers_scope(world, browser, viewer, labels, absent):
    make_usage(world.key_a2, "page-a2")
    client = browser(getattr(world, viewer))
    page = client.get("/portal/reports/", {"period": "month", "group_by": "team"}).content.decode()
    exported = client.get("/portal/reports/export.csv", {"period": "month", "group_by": "team"})
    assert exported["Content-Type"].startswith("text/csv")
    rows = list(csv.reader(io.StringIO(exported.content.decode())))
    assert sorted(r[3] for r in rows[1:-1]) == sorted(labels)
    for label in labels:
        assert label in page
    for label in absent:
        assert label not in page


def test_a_team_admin_creates_a_key_and_sees_the_secret_once(world, browser):
    client = browser(world.team_admin_a1)
    response = client.post(
        f"/portal/teams/{world.team_a1.pk}/keys/", {"name": "ci agent", "scopes": ["inference"]}
    )
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    secret = response.context["issued"].secret
    assert secret in response.content.decode()
    assert api_key_verify(secret).name == "ci agent"
    again = client.get(f"/portal/teams/{world.team_a1.pk}/").content.decode()
    assert "ci agent" in again and secret not in again
    assert AuditLog.objects.filter(action="api_key.create", source="portal").count() == 1


def test_only_admins_of_a_team_manage_its_keys(world, browser):
    data = {"name": "x", "scopes": ["inference"]}
    assert browser(world.member_a1).post(f"/portal/teams/{world.team_a1.pk}/keys/", data).status_code == 403
    assert browser(world.admin_b).post(f"/portal/teams/{world.team_a1.pk}/keys/", data).status_code == 404
    key = world.key_a1.api_key
    assert browser(world.admin_b).post(f"/portal/keys/{key.pk}/revoke/").status_code == 404
    assert browser(world.member_a1).post(f"/portal/keys/{key.pk}/revoke/").status_code == 403
    assert browser(world.admin_a).post(f"/portal/keys/{key.pk}/revoke/").status_code == 302
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None
    assert api_key_verify(world.key_a1.secret) is None


def test_team_page_shows_quota_use_now(world, browser):
    world.quota_a1.token_budget = 100_000
    world.quota_a1.save()
    page = browser(world.team_admin_a1).get(f"/portal/teams/{world.team_a1.pk}/")
    quota = page.context["quotas"][0]
    limits = {name: (limit, used) for name, limit, used, _ in quota["limits"]}
    # The router's admission counters: nothing went through admission here (the fixture's record is ledger only).
    assert limits["Tokens this month"] == (100_000, 0)
    assert limits["Requests per minute"][0] == 60


def test_operator_creates_scales_and_deletes_a_deployment(world, browser, django_capture_on_commit_callbacks):
    client = browser(world.operator)
    data = {
        "name": "coder",
        "served_model_name": "coder-7b",
        "model_source": "models/tiny-qwen",
        "engine_kind": "sim",
        "replicas": 1,
    }
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = client.post("/portal/deployments/new/", data)
    assert any("deployment_changed" in c.__qualname__ for c in callbacks)  # reconcile once committed
    deployment = ModelDeployment.objects.get(name="coder")
    assert response["Location"] == f"/portal/deployments/{deployment.pk}/"
    status = client.get(f"/portal/deployments/{deployment.pk}/status/").json()
    assert (status["desired"], status["healthy"], status["percent"]) == (1, 0, 0)
    pool = deployment.pools.get()
    with django_capture_on_commit_callbacks(execute=False):
        client.post(f"/portal/deployments/{deployment.pk}/scale/{pool.pk}/", {"replicas": 3})
    assert Pool.objects.get(pk=pool.pk).replicas == 3
    with django_capture_on_commit_callbacks(execute=False):
        client.post(f"/portal/deployments/{deployment.pk}/delete/")
    assert not ModelDeployment.objects.filter(name="coder").exists()
    records = list(AuditLog.objects.filter(source="portal").order_by("id"))
    assert [r.action for r in records] == ["deployment.create", "deployment.scale", "deployment.delete"]
    # The audit records a deployment with its pools, as the REST API's records do.
    assert records[0].details["after"]["pools"]["main"]["replicas"] == 1
    assert records[2].details["before"]["pools"]["main"]["replicas"] == 3
    assert browser(world.admin_a).post("/portal/deployments/new/", data).status_code == 403


def test_cost_to_serve_shows_every_input(world, browser):
    pool = world.deployment.pools.get()
    pool.accelerator, pool.gpus_per_replica = "nvidia-h100-80gb", 1
    pool.save()
    AcceleratorPrice.objects.update_or_create(
        accelerator="nvidia-h100-80gb", defaults={"price_per_gpu_hour": Decimal("2.5")}
    )
    day = (timezone.now() - timedelta(days=2)).date()
    midnight = datetime(day.year, day.month, day.day, tzinfo=UTC)
    # What ran: one engine all day (and on), one for the day's first six hours, one before the day only.
    for name, start, stop in (
        ("e0", midnight - timedelta(days=1), None),
        ("e1", midnight, midnight + timedelta(hours=6)),
        ("e2", midnight - timedelta(hours=5), midnight),
    ):
        EndpointLifetime.objects.create(
            pool=pool,
            deployment_name=world.deployment.name,
            pool_name=pool.name,
            endpoint_name=name,
            accelerator="nvidia-h100-80gb",
            gpus=1,
            started_at=start,
            stopped_at=stop,
        )
    for n in range(4):
        make_usage(
            world.key_a1,
            f"cts-{n}",
            deployment=world.deployment,
            created_at=datetime(day.year, day.month, day.day, 12, tzinfo=UTC),
        )
    page = browser(world.operator).get(
        f"/portal/deployments/{world.deployment.pk}/cost/",
        {"period": "day", "at": day.isoformat(), "group_by": "deployment"},
    )
    cost = page.context["cost"]
    assert cost.gpu_cost == Decimal("2.5") * (24 + 6)  # the GPU-hours that ran in the day, not replicas x 24
    [row] = cost.pools
    assert (row.engines, row.gpu_hours) == (2, Decimal(30))
    assert (cost.fresh_input_tokens, cost.cached_input_tokens, cost.output_tokens) == (1600, 2400, 200)
    # The weights are the list sheet's prices: 0.5, 0.05, 1.5 per Mtok.
    weighted = (
        Decimal(1600) * Decimal("0.5") + Decimal(2400) * Decimal("0.05") + Decimal(200) * Decimal("1.5")
    )
    assert cost.per_mtok[2] == cost.gpu_cost * Decimal("1.5") / weighted * 1_000_000
    html = page.content.decode()
    for text in ("nvidia-h100-80gb", "$2.50", "OpenAI GPT-4.1", "Anthropic Claude Sonnet 4"):
        assert text in html
    assert '<td id="gpu-cost" class="num">$75.00</td>' in html


def test_the_deployment_page_flags_blind_prefix_routing(world, browser):
    """The routers' counters say what prefix routing saw: predicted against reported cached tokens, requests it
    could not render, and endpoints the ingester cannot index, read from Redis as the routers wrote them."""
    import redis
    from django.conf import settings

    from routing.contracts import PREFIX_BLIND_KEY, PREFIX_HEALTH_KEY

    deployment = ModelDeployment.objects.get(served_model_name="tiny-qwen")
    client = redis.Redis.from_url(settings.REDIS_URL)
    minute = int(timezone.now().timestamp() // 60)
    for key in client.scan_iter(match=f"prefix:health:{deployment.pk}:*"):
        client.delete(key)
    page = browser(world.operator).get(f"/portal/deployments/{deployment.pk}/").content.decode()
    assert "Routing is partly blind" not in page and 'id="render-failures">none' in page
    client.hset(
        PREFIX_HEALTH_KEY.format(deployment.pk, minute),
        mapping={"predicted": 7040, "reported": 18560, "render:image": 3},
    )
    client.hset(PREFIX_BLIND_KEY.format(deployment.pk), "12", "the engine stores blocks of 16 tokens")
    try:
        page = browser(world.operator).get(f"/portal/deployments/{deployment.pk}/").content.decode()
    finally:
        client.delete(PREFIX_HEALTH_KEY.format(deployment.pk, minute), PREFIX_BLIND_KEY.format(deployment.pk))
    assert (
        '7,040 / <span title="18,560">18.6K</span> (37.9%)' in page
        and "predicted 37.9% of the cached tokens" in page
    )
    assert (
        "image: 3" in page and "Endpoint 12 cannot be indexed: the engine stores blocks of 16 tokens" in page
    )


def test_the_deployment_page_charts_autoscaling_and_lists_scaling_events(world, browser):
    """The page holds the history's charts (replicas beside the signals that drove them, latency p90s against
    their objectives: tests/portal/test_history.py), each pool's policy, and the recent scaling events with their
    reasons."""
    from serving.models import AutoscalingPolicy, ScalingEvent

    pool = world.deployment.pools.get()
    AutoscalingPolicy.objects.create(
        pool=pool, enabled=True, max_replicas=6, ttft_p90_s=1.5, running_requests_per_replica=8
    )
    ScalingEvent.objects.create(
        pool=pool,
        from_replicas=1,
        to_replicas=3,
        signals={"running_requests": 20},
        reason="running_requests_per_replica asks for 3",
    )
    html = browser(world.operator).get(f"/portal/deployments/{world.deployment.pk}/").content.decode()
    assert f"{pool.name}: on, 1 to 6 replicas" in html
    assert f'data-url="/portal/history/?scope=deployment&amp;id={world.deployment.pk}"' in html
    charts = (
        browser(world.operator)
        .get("/portal/history/", {"scope": "deployment", "id": world.deployment.pk, "period": "hour"})
        .json()["charts"]
    )
    by_id = {c["id"]: [s["key"] for s in c["series"]] for c in charts}
    assert by_id["ttft"] == ["ttft_p50", "ttft_p90", "ttft_objective"]
    assert by_id["itl"] == ["itl_p50", "itl_p90"]  # no ITL objective set
    assert by_id["pool_main"][:2] == ["replicas", "ready"]
    assert "1 → 3" in html and "running_requests_per_replica asks for 3" in html
