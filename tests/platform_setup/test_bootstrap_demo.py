"""`manage.py bootstrap_demo` (serving/management/commands/) makes its superuser (with a printed password) only
under DEBUG, and the demo deployment through the same service as the API and the portal."""

from __future__ import annotations

import io

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from routing.models import RoutingPolicy
from serving.models import ModelDeployment
from tenants.models import ApiKey, AuditLog, Tenant


def _bootstrap() -> str:
    out = io.StringIO()
    call_command("bootstrap_demo", stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_it_makes_no_superuser_when_debug_is_off(settings):
    settings.DEBUG = False
    output = _bootstrap()
    assert not get_user_model().objects.filter(is_superuser=True).exists()
    assert "not created (DEBUG is off)" in output
    # The rest of the demo is still there.
    assert Tenant.objects.filter(slug="demo").exists() and ApiKey.objects.filter(name="demo agent").exists()


@pytest.mark.django_db
def test_it_makes_the_operator_under_debug(settings):
    settings.DEBUG = True
    output = _bootstrap()
    operator = get_user_model().objects.get(username="operator")
    assert operator.is_superuser and "Operator:  operator / " in output
    assert "Operator:  operator (exists)" in _bootstrap()


@pytest.mark.django_db
def test_it_makes_the_demo_deployment_once_through_the_deployment_service(
    settings, django_capture_on_commit_callbacks
):
    settings.DEBUG = False
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        _bootstrap()
    deployment = ModelDeployment.objects.get(name="tiny-demo")
    assert list(deployment.pools.values_list("name", "replicas")) == [("main", 2)]
    assert RoutingPolicy.objects.filter(deployment=deployment).exists()
    record = AuditLog.objects.get(action="deployment.create")
    assert (record.source, record.actor) == ("system", None)
    assert record.details["after"]["pools"]["main"]["replicas"] == 2
    assert any("deployment_changed" in c.__qualname__ for c in callbacks)  # its engines start once committed
    _bootstrap()
    assert AuditLog.objects.filter(action="deployment.create").count() == 1


@pytest.mark.django_db
def test_it_gives_the_demo_a_context_that_fits_a_coding_agents_session(settings):
    settings.DEBUG = False
    output = _bootstrap()
    deployment = ModelDeployment.objects.get(name="tiny-demo")
    assert deployment.max_model_len == 131072
    assert "context 131072 tokens" in output


@pytest.mark.django_db
def test_it_prints_the_key_only_when_it_makes_it(settings):
    settings.DEBUG = False
    first = _bootstrap()
    key = first.split("API key:", 1)[1].split()[0]
    assert key.startswith("ipk_") and first.count(key) == 1
    again = _bootstrap()
    assert "ipk_" not in again and "demo key exists" in again
