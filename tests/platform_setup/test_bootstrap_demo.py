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
