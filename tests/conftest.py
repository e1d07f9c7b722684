"""Shared fixtures. Tests run against the real PostgreSQL and Redis that `make test` provides.

Each test declares its tier, what it needs beyond that, by a marker on the test or on its module
(`pytestmark`), or, for the vLLM half of a test run on each engine, on its parameter (`pytest.param("vllm",
marks=pytest.mark.vllm)`, as `serving.engines.BOTH_ENGINES` does): `vllm` (a real vLLM engine), `browser`
(headless Chromium), `kubectl`, `kube` (the control-plane tier) and `agents` (the coding agents' CLIs), which
`make test-fast` leaves out; `unit` (pure functions, which `make test-unit` runs alone with no database or
Redis; `heavy` ones only in `make test`). A test with none of these is in the fast tier. Nothing infers a
tier: collection fails, naming the test and the marker, when a test or a fixture it depends on starts vLLM or
drives Chromium without declaring it.
"""

from __future__ import annotations

import functools
import inspect
import re
import shutil
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient

from routing.models import RoutingPolicy
from serving.models import ModelDeployment, Pool
from tenants.keys import IssuedKey, api_key_create
from tenants.models import Membership, PriceSheet, Quota, Role, Scope, Team, Tenant, UsageRecord

from .serving.engines import ENGINE_PYTHON, RunningEngine, start_engine
from .template_db import create_test_database


@dataclass
class World:
    """Two tenants with people in every role, so each route can be tried by someone who must be refused."""

    tenant_a: Tenant
    tenant_b: Tenant
    team_a1: Team
    team_a2: Team
    team_b1: Team
    operator: object
    admin_a: object  # tenant admin of A
    team_admin_a1: object
    member_a1: object
    admin_b: object  # tenant admin of B
    key_a1: IssuedKey
    key_a2: IssuedKey
    key_b1: IssuedKey
    quota_a1: Quota
    quota_b1: Quota
    price_list: PriceSheet
    price_b: PriceSheet
    deployment: ModelDeployment
    policy: RoutingPolicy
    usage_a1: UsageRecord
    usage_b1: UsageRecord
    membership_member_a1: Membership
    membership_admin_b: Membership


def make_user(username: str, role: str | None = None, *, tenant=None, team=None):
    user = get_user_model().objects.create_user(username=username, password="pw-" + username + "-long-enough")
    if role:
        Membership.objects.create(
            user=user, role=role, tenant=tenant or (team.tenant if team else None), team=team
        )
    return user


def make_usage(key: IssuedKey, request_id: str, **fields) -> UsageRecord:
    team = key.api_key.team
    defaults = dict(
        model="tiny-qwen",
        prompt_tokens=1000,
        cached_prompt_tokens=600,
        output_tokens=50,
        cost=Decimal("0.00012"),
        status="completed",
    )
    return UsageRecord.objects.create(
        request_id=request_id,
        tenant_id=team.tenant_id,
        team=team,
        api_key=key.api_key,
        **{**defaults, **fields},
    )


# --- tiers: what a test needs beyond PostgreSQL, Redis and the simulator --------------------------------------
# Nothing here adds a marker; this only checks the declarations. A test that starts a real vLLM engine or
# drives Chromium without declaring so would run in `make test-fast`, which has neither, so collection fails
# and names it.

# Source that starts a real vLLM engine: `start_engine("vllm")`, `start_engines("vllm", ...)`, or the engine
# environment's interpreter itself (not `settings.ENGINE_PYTHON`, which only names it in a command line).
STARTS_VLLM = re.compile(r'start_engines?\(\s*"vllm"|(?<![.\w])ENGINE_PYTHON\b')
STARTS_BROWSER = re.compile(r"\bplaywright\b")
# Parameters that pick a sim/vLLM pair's half: an engine fixture's own params, or an engine fixture's name.
SIM_HALVES = {"sim", "sim_engine", "demo_sim"}
VLLM_HALVES = {"vllm_engine", "demo_vllm"}


@functools.cache
def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _fixtures(item) -> list:
    """The fixtures the test depends on, directly or not."""
    names = item._fixtureinfo.name2fixturedefs
    return [definition for name in item.fixturenames for definition in names.get(name, ())]


def _halves(item) -> set[str]:
    """The engine a sim/vLLM pair's half runs on: {"sim"}, {"vllm"} or neither. "vllm" as a plain test
    parameter (a field's value, say) names no engine; as an engine fixture's param, it does."""
    params = getattr(item, "callspec", None)
    halves = set()
    for name, value in params.params.items() if params else ():
        if not isinstance(value, str):
            continue
        definitions = item._fixtureinfo.name2fixturedefs.get(name, ())
        parametrizes_fixture = any(definition.params for definition in definitions)
        if value in SIM_HALVES:
            halves.add("sim")
        elif value in VLLM_HALVES or (value == "vllm" and parametrizes_fixture):
            halves.add("vllm")
    return halves


def _undeclared(item) -> list[str]:
    """Why the test needs a tier marker it does not carry, if it does."""
    halves = _halves(item)
    # A pair's simulator half needs no vLLM, though the body it shares with the other half names it.
    functions = [definition.func for definition in _fixtures(item)]
    body = [] if "sim" in halves else [item.function]
    reasons = []
    if not item.get_closest_marker("vllm"):
        if "vllm" in halves:
            reasons.append(
                "vllm: its parameter picks the vLLM engine (pytest.param(..., marks=pytest.mark.vllm))"
            )
        elif starts := [f.__name__ for f in body + functions if STARTS_VLLM.search(_source(f))]:
            reasons.append(f"vllm: {', '.join(starts)} starts a real vLLM engine")
    if not item.get_closest_marker("browser"):
        if drives := [f.__name__ for f in [item.function, *functions] if STARTS_BROWSER.search(_source(f))]:
            reasons.append(f"browser: {', '.join(drives)} drives Chromium")
    return reasons


def pytest_collection_modifyitems(config, items):
    undeclared = [f"{item.nodeid}: {reason}" for item in items for reason in _undeclared(item)]
    if undeclared:
        raise pytest.UsageError(
            "tests that need a tier they do not declare (mark the test, its module or its parameter):\n  "
            + "\n  ".join(undeclared)
        )


# What a unit test may not use (`make test-unit` runs them with no database or Redis to be had).
NOT_UNIT = {"db", "transactional_db", "django_db_setup", "live_server", "world", "client_for"}


def pytest_runtest_setup(item):
    if item.get_closest_marker("unit") and NOT_UNIT & set(item.fixturenames):
        pytest.fail(
            f"a unit test uses {sorted(NOT_UNIT & set(item.fixturenames))}: move it out of the unit tier"
        )
    if item.get_closest_marker("kubectl") and not shutil.which("kubectl"):
        pytest.fail("kubectl (with kustomize) is not on PATH: `make kubectl` installs it (`make test` does)")


@pytest.fixture(scope="session")
def django_db_setup(django_test_environment, django_db_blocker, django_db_modify_db_settings):
    """pytest-django's, except that the test database is a copy of a migrated template (tests/template_db.py)."""
    from django.db import connection

    with django_db_blocker.unblock():
        original = create_test_database(connection)
    yield
    with django_db_blocker.unblock():
        connection.creation.destroy_test_db(original, verbosity=0)


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    """Tests sign up several people each; the production hasher would make the suite take minutes."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def world(db) -> World:
    tenant_a = Tenant.objects.create(name="Acme", slug="acme")
    tenant_b = Tenant.objects.create(name="Bolt", slug="bolt")
    team_a1 = Team.objects.create(tenant=tenant_a, name="Agents", slug="agents")
    team_a2 = Team.objects.create(tenant=tenant_a, name="Research", slug="research")
    team_b1 = Team.objects.create(tenant=tenant_b, name="Bots", slug="bots")
    operator = make_user("olive", Role.OPERATOR)
    admin_a = make_user("alice", Role.TENANT_ADMIN, tenant=tenant_a)
    team_admin_a1 = make_user("tom", Role.TEAM_ADMIN, team=team_a1)
    member_a1 = make_user("mia", Role.MEMBER, team=team_a1)
    admin_b = make_user("bob", Role.TENANT_ADMIN, tenant=tenant_b)
    scopes = [Scope.INFERENCE, Scope.READ_USAGE]
    key_a1 = api_key_create(team=team_a1, name="a1 agent", scopes=scopes, source="system")
    key_a2 = api_key_create(team=team_a2, name="a2 agent", scopes=scopes, source="system")
    key_b1 = api_key_create(team=team_b1, name="b1 agent", scopes=scopes, source="system")
    deployment = ModelDeployment.objects.create(
        name="tiny", served_model_name="tiny-qwen", model_source="models/tiny-qwen", engine_kind="sim"
    )
    Pool.objects.create(deployment=deployment, name="main", replicas=2)
    start = timezone.now() - timedelta(days=1)
    return World(
        tenant_a=tenant_a,
        tenant_b=tenant_b,
        team_a1=team_a1,
        team_a2=team_a2,
        team_b1=team_b1,
        operator=operator,
        admin_a=admin_a,
        team_admin_a1=team_admin_a1,
        member_a1=member_a1,
        admin_b=admin_b,
        key_a1=key_a1,
        key_a2=key_a2,
        key_b1=key_b1,
        quota_a1=Quota.objects.create(team=team_a1, requests_per_minute=60),
        quota_b1=Quota.objects.create(team=team_b1, requests_per_minute=60),
        price_list=PriceSheet.objects.create(
            served_model_name="tiny-qwen",
            effective_from=start,
            input_per_mtok=Decimal("0.5"),
            cached_input_per_mtok=Decimal("0.05"),
            output_per_mtok=Decimal("1.5"),
        ),
        price_b=PriceSheet.objects.create(
            served_model_name="tiny-qwen",
            tenant=tenant_b,
            effective_from=start,
            input_per_mtok=Decimal("0.4"),
            cached_input_per_mtok=Decimal("0.04"),
            output_per_mtok=Decimal("1.2"),
        ),
        deployment=deployment,
        policy=RoutingPolicy.objects.create(deployment=deployment),
        usage_a1=make_usage(key_a1, "req-a1"),
        usage_b1=make_usage(key_b1, "req-b1"),
        membership_member_a1=Membership.objects.get(user=member_a1),
        membership_admin_b=Membership.objects.get(user=admin_b),
    )


@pytest.fixture
def client_for():
    """An API client signed in as the given user."""

    def make(user) -> APIClient:
        client = APIClient()
        client.force_authenticate(user=user)
        return client

    return make


# Engines, started once per test session and stopped at its end.
@pytest.fixture(scope="session")
def sim_engine() -> RunningEngine:
    engine = start_engine("sim")
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def vllm_engine() -> RunningEngine:
    if not ENGINE_PYTHON.exists():
        pytest.fail(f"no engine environment at {ENGINE_PYTHON}: run scripts/engine-env.sh (make test does)")
    # --enable-scale-out serves vLLM's own renderer (/v1/chat/completions/render, /v1/messages/render): the
    # oracle of the router's render parity tests.
    engine = start_engine("vllm", "--enable-scale-out")
    yield engine
    engine.stop()
