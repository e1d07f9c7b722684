"""Deployments changed through the REST API: one audit row each (source `api`), a reconcile after the commit,
and the same rules on the set of pools as every other caller of serving.services."""

from __future__ import annotations

import pytest

from serving.models import ModelDeployment, Pool
from tenants.models import AuditLog

DISAGGREGATED = [
    {"name": "prefill", "role": "prefill", "kv_connector": "NixlConnector", "replicas": 1},
    {"name": "decode", "role": "decode", "kv_connector": "NixlConnector", "replicas": 2},
]


def _queued(callbacks, name: str) -> int:
    return sum(name in callback.__qualname__ for callback in callbacks)


@pytest.fixture
def operator_api(world, client_for):
    return client_for(world.operator)


def test_it_creates_a_deployment_with_its_pools(world, operator_api, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = operator_api.post(
            "/api/deployments/",
            {
                "name": "split",
                "served_model_name": "split-qwen",
                "model_source": "models/tiny-qwen",
                "engine_kind": "sim",
                "pools": DISAGGREGATED,
            },
            format="json",
        )
    assert response.status_code == 201, response.content
    body = response.json()
    assert sorted((p["name"], p["role"], p["replicas"]) for p in body["pools"]) == [
        ("decode", "decode", 2),
        ("prefill", "prefill", 1),
    ]
    deployment = ModelDeployment.objects.get(pk=body["id"])
    assert deployment.pools.count() == 2
    record = AuditLog.objects.get(action="deployment.create")
    assert (record.source, record.actor, record.target_id) == ("api", world.operator, str(deployment.pk))
    assert set(record.details["after"]["pools"]) == {"prefill", "decode"}
    assert _queued(callbacks, "deployment_changed") == 1


def test_a_patch_of_pools_scales_one_and_removes_those_not_named(
    world, operator_api, django_capture_on_commit_callbacks
):
    Pool.objects.create(deployment=world.deployment, name="spare", replicas=1)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = operator_api.patch(
            f"/api/deployments/{world.deployment.pk}/",
            {"pools": [{"name": "main", "replicas": 5}]},
            format="json",
        )
    assert response.status_code == 200, response.content
    assert [(p["name"], p["replicas"]) for p in response.json()["pools"]] == [("main", 5)]
    assert list(world.deployment.pools.values_list("name", "replicas")) == [("main", 5)]
    record = AuditLog.objects.get(action="deployment.update")
    assert record.source == "api" and record.actor == world.operator
    before, after = record.details["changes"]["pools"]
    assert (before["main"]["replicas"], after["main"]["replicas"]) == (2, 5)
    assert "spare" in before and "spare" not in after
    assert _queued(callbacks, "deployment_changed") == 1


def test_it_deletes_a_deployment_and_sweeps_its_engines(
    world, operator_api, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = operator_api.delete(f"/api/deployments/{world.deployment.pk}/")
    assert response.status_code == 204
    assert not ModelDeployment.objects.filter(pk=world.deployment.pk).exists()
    record = AuditLog.objects.get(action="deployment.delete")
    assert record.source == "api" and record.details["before"]["pools"]["main"]["replicas"] == 2
    assert _queued(callbacks, "deployment_deleted") == 1


@pytest.mark.parametrize(
    "pools, message",
    [
        ([{"name": "main"}, {"name": "main"}], "Pool names must be unique within a deployment."),
        (DISAGGREGATED[:1], "A disaggregated deployment needs both a prefill and a decode pool."),
    ],
)
def test_it_refuses_a_set_of_pools_that_cannot_serve(world, operator_api, pools, message):
    before = AuditLog.objects.count()
    response = operator_api.patch(f"/api/deployments/{world.deployment.pk}/", {"pools": pools}, format="json")
    assert response.status_code == 400
    assert response.json()["pools"] == [message]
    assert AuditLog.objects.count() == before
    assert list(world.deployment.pools.values_list("name", "replicas")) == [("main", 2)]


def test_it_refuses_changes_from_anyone_but_an_operator(world, client_for):
    before = AuditLog.objects.count()
    response = client_for(world.admin_a).patch(
        f"/api/deployments/{world.deployment.pk}/",
        {"pools": [{"name": "main", "replicas": 9}]},
        format="json",
    )
    assert response.status_code == 403
    assert world.deployment.pools.get().replicas == 2 and AuditLog.objects.count() == before
