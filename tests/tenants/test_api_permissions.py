"""Who may do what through the REST API under /api/.

The design, in three rules:
  * another tenant's object does not exist for you: 404, never 403;
  * inside your scope, a write you may not make is 403;
  * operators may do everything.

The permission matrix below is that design written out per route, action and actor. Further tests cover
mass assignment (fields a caller must not be able to set), the API key secret, anonymous callers and
API keys used as credentials.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient

from serving.models import ModelDeployment
from tenants.keys import api_key_create, api_key_revoke
from tenants.models import (
    ApiKey,
    AuditLog,
    Membership,
    ModelAlias,
    PriceSheet,
    PriorityClass,
    Quota,
    Role,
    Scope,
    Team,
)

from ..conftest import make_usage

ACTORS = ("operator", "admin_a", "team_admin_a1", "member_a1", "admin_b")


# --- what each route's actions act on -----------------------------------------------------------------
# target: the object (of tenant A / team A1, or the world's platform-wide one) that retrieve, update,
# delete and custom actions act on. patch: a harmless valid change. create: a valid new object's body,
# built in the world (it may add what it needs, such as a user to give a role to).


def _new_user(world, username="nina"):
    return get_user_model().objects.create_user(username=username, password="pw-nina-long-enough")


def _new_membership(world):
    _new_user(world)
    return {"user": "nina", "role": Role.MEMBER, "team": world.team_a1.pk}


def _new_price_sheet(world):
    return {
        "served_model_name": "tiny-qwen",
        "tenant": world.tenant_a.pk,
        "effective_from": timezone.now().isoformat(),
        "input_per_mtok": "0.3",
        "cached_input_per_mtok": "0.03",
        "output_per_mtok": "0.9",
    }


def _new_routing_policy(world):
    deployment = ModelDeployment.objects.create(
        name="small", served_model_name="small-model", model_source="models/small", engine_kind="sim"
    )
    return {"deployment": deployment.pk, "mode": world.policy.mode}


def _alias_of(tenant, name: str = "coder"):
    """A model alias of the tenant's, made on first use (the world has none of its own)."""
    deployment = ModelDeployment.objects.get(served_model_name="tiny-qwen")
    return ModelAlias.objects.get_or_create(tenant=tenant, name=name, defaults={"deployment": deployment})[0]


def _audit_row_of_tenant_a(world):
    return AuditLog.objects.filter(tenant=world.tenant_a).first()


ROUTES = {
    "tenants": dict(
        target=lambda w: w.tenant_a,
        patch={"name": "Acme Corp"},
        create=lambda w: {"name": "Cargo", "slug": "cargo"},
    ),
    "teams": dict(
        target=lambda w: w.team_a1,
        patch={"name": "Agents II"},
        create=lambda w: {"tenant": w.tenant_a.pk, "name": "Ops", "slug": "ops"},
    ),
    "memberships": dict(
        target=lambda w: w.membership_member_a1,
        patch={"role": Role.MEMBER},
        create=_new_membership,
    ),
    # A team's admins may change its priority class and nothing else of it; its weight and the models it may
    # call are its tenant admins'.
    "teams: priority class": dict(
        url="teams",
        target=lambda w: w.team_a1,
        patch={"priority_class": PriorityClass.BATCH},
    ),
    "teams: share and models": dict(
        url="teams",
        target=lambda w: w.team_a1,
        patch={"fair_share_weight": 3, "restrict_models": True},
    ),
    "keys": dict(
        target=lambda w: w.key_a1.api_key,
        patch={"name": "a1 agent (renamed)"},
        create=lambda w: {"team": w.team_a1.pk, "name": "new agent", "scopes": [Scope.INFERENCE]},
    ),
    "keys: priority class": dict(
        url="keys",
        target=lambda w: w.key_a1.api_key,
        patch={"priority_class": PriorityClass.BATCH},
    ),
    "tenants: share and ceiling": dict(
        url="tenants",
        target=lambda w: w.tenant_a,
        patch={"fair_share_weight": 3, "max_priority_class": PriorityClass.INTERACTIVE},
    ),
    "model-aliases": dict(
        target=lambda w: _alias_of(w.tenant_a),
        patch={"name": "coder-next"},
        create=lambda w: {"tenant": w.tenant_a.pk, "name": "reviewer", "deployment": w.deployment.pk},
    ),
    "model-aliases of tenant B": dict(
        url="model-aliases",
        target=lambda w: _alias_of(w.tenant_b),
        patch={"name": "coder-next"},
    ),
    "quotas": dict(
        target=lambda w: w.quota_a1,
        patch={"requests_per_minute": 120},
        # Team A1 already has its team-wide quota; A2 has none.
        create=lambda w: {"team": w.team_a2.pk, "requests_per_minute": 10},
    ),
    "price-sheets": dict(
        target=lambda w: w.price_list,  # the list price (no tenant)
        patch={"output_per_mtok": "1.6"},
        create=_new_price_sheet,
    ),
    "price-sheets of tenant B": dict(
        url="price-sheets",
        target=lambda w: w.price_b,
        patch={"output_per_mtok": "1.3"},
    ),
    "deployments": dict(
        target=lambda w: w.deployment,
        patch={"max_model_len": 8192},
        create=lambda w: {
            "name": "small",
            "served_model_name": "small-model",
            "model_source": "models/small",
            "engine_kind": "sim",
        },
    ),
    "routing-policies": dict(
        target=lambda w: w.policy,
        patch={"prefix_weight": 2.5},
        create=_new_routing_policy,
    ),
    "usage": dict(
        target=lambda w: w.usage_a1,
        lookup="request_id",
        patch={"status": "failed"},
        create=lambda w: {"request_id": "req-new", "model": "tiny-qwen"},
    ),
    "audit-log": dict(
        target=_audit_row_of_tenant_a,
        patch={"action": "nothing.happened"},
        create=lambda w: {"action": "nothing.happened"},
    ),
}

# --- the permission matrix -----------------------------------------------------------------------------
# 405: the route does not offer the method. 409: allowed, but the object is protected by what it still has
# (tenant A still has teams; team A1 still has keys and usage), which shows the permission check passed.
# Creating is not about an existing object, so another tenant's admin naming tenant A's team or tenant in
# a create body gets 400 (the choice does not exist for them), not 404.
#
# fmt: off
MATRIX = [
    # route                       action      operator admin_a team_admin_a1 member_a1 admin_b
    ("tenants",                   "retrieve", 200,     200,    200,          200,      404),
    ("tenants",                   "update",   200,     403,    403,          403,      404),
    ("tenants",                   "delete",   409,     403,    403,          403,      404),
    ("tenants",                   "create",   201,     403,    403,          403,      403),
    ("tenants: share and ceiling", "update",  200,     403,    403,          403,      404),

    ("teams",                     "retrieve", 200,     200,    200,          200,      404),
    ("teams",                     "update",   200,     200,    403,          403,      404),
    ("teams",                     "delete",   409,     409,    403,          403,      404),
    ("teams",                     "create",   201,     201,    403,          403,      400),
    ("teams: priority class",     "update",   200,     200,    200,          403,      404),
    ("teams: share and models",   "update",   200,     200,    403,          403,      404),

    ("memberships",               "retrieve", 200,     200,    200,          200,      404),
    ("memberships",               "update",   200,     200,    200,          403,      404),
    ("memberships",               "delete",   204,     204,    204,          403,      404),
    ("memberships",               "create",   201,     201,    201,          403,      400),

    ("keys",                      "retrieve", 200,     200,    200,          200,      404),
    ("keys",                      "update",   200,     200,    200,          403,      404),
    ("keys",                      "revoke",   200,     200,    200,          403,      404),
    ("keys",                      "delete",   405,     405,    405,          405,      405),
    ("keys",                      "create",   201,     201,    201,          403,      400),
    ("keys: priority class",      "update",   200,     200,    200,          403,      404),

    # A tenant's aliases are read by everyone in it and changed by its admins.
    ("model-aliases",             "retrieve", 200,     200,    200,          200,      404),
    ("model-aliases",             "update",   200,     200,    403,          403,      404),
    ("model-aliases",             "delete",   204,     204,    403,          403,      404),
    ("model-aliases",             "create",   201,     201,    403,          403,      400),
    ("model-aliases of tenant B", "retrieve", 200,     404,    404,          404,      200),
    ("model-aliases of tenant B", "update",   200,     404,    404,          404,      200),
    ("model-aliases of tenant B", "delete",   204,     404,    404,          404,      204),

    ("quotas",                    "retrieve", 200,     200,    200,          200,      404),
    ("quotas",                    "update",   200,     200,    403,          403,      404),
    ("quotas",                    "delete",   204,     204,    403,          403,      404),
    ("quotas",                    "create",   201,     201,    403,          403,      400),

    ("price-sheets",              "retrieve", 200,     200,    200,          200,      200),
    ("price-sheets",              "update",   200,     403,    403,          403,      403),
    ("price-sheets",              "delete",   204,     403,    403,          403,      403),
    ("price-sheets",              "create",   201,     403,    403,          403,      403),

    ("price-sheets of tenant B",  "retrieve", 200,     404,    404,          404,      200),
    ("price-sheets of tenant B",  "update",   200,     404,    404,          404,      403),
    ("price-sheets of tenant B",  "delete",   204,     404,    404,          404,      403),

    ("deployments",               "retrieve", 200,     200,    200,          200,      200),
    ("deployments",               "update",   200,     403,    403,          403,      403),
    ("deployments",               "delete",   204,     403,    403,          403,      403),
    ("deployments",               "create",   201,     403,    403,          403,      403),

    ("routing-policies",          "retrieve", 200,     403,    403,          403,      403),
    ("routing-policies",          "update",   200,     403,    403,          403,      403),
    ("routing-policies",          "delete",   204,     403,    403,          403,      403),
    ("routing-policies",          "create",   201,     403,    403,          403,      403),

    ("usage",                     "retrieve", 200,     200,    200,          200,      404),
    ("usage",                     "update",   405,     405,    405,          405,      405),
    ("usage",                     "delete",   405,     405,    405,          405,      405),
    ("usage",                     "create",   405,     405,    405,          405,      405),

    # Team admins and members have no audit trail: the rows of their tenant do not exist for them.
    ("audit-log",                 "retrieve", 200,     200,    404,          404,      404),
    ("audit-log",                 "update",   405,     405,    405,          405,      405),
    ("audit-log",                 "delete",   405,     405,    405,          405,      405),
    ("audit-log",                 "create",   405,     405,    405,          405,      405),
]
# fmt: on


def _matrix_cases():
    for route, action, *codes in MATRIX:
        for actor, code in zip(ACTORS, codes, strict=True):
            yield pytest.param(route, action, actor, code, id=f"{route}-{action}-{actor}-{code}")


def _url(route: str, obj=None, suffix: str = "") -> str:
    spec = ROUTES[route]
    base = f"/api/{spec.get('url', route)}/"
    if obj is None:
        return base
    return f"{base}{getattr(obj, spec.get('lookup', 'pk'))}/{suffix}"


def _call(world, client, route: str, action: str):
    spec = ROUTES[route]
    if action == "create":
        return client.post(_url(route), spec["create"](world), format="json")
    target = spec["target"](world)
    assert target is not None, f"the world has no {route} object to try"
    if action == "retrieve":
        return client.get(_url(route, target))
    if action == "update":
        return client.patch(_url(route, target), spec["patch"], format="json")
    if action == "delete":
        return client.delete(_url(route, target))
    return client.post(_url(route, target, f"{action}/"))  # a custom action such as keys' revoke


@pytest.mark.parametrize(("route", "action", "actor", "expected"), list(_matrix_cases()))
def test_it_applies_the_permission_matrix(world, client_for, route, action, actor, expected):
    response = _call(world, client_for(getattr(world, actor)), route, action)
    assert response.status_code == expected, response.content[:500]


@pytest.mark.parametrize(
    ("route", "action"),
    [
        (route, action)
        for route, action, *codes in MATRIX
        if action in ("update", "delete") and codes[0] < 300
    ],
)
def test_it_really_makes_the_change_the_operator_asked_for(world, client_for, route, action):
    spec = ROUTES[route]
    target = spec["target"](world)
    _call(world, client_for(world.operator), route, action)
    model = type(target)
    if action == "delete":
        assert not model.objects.filter(pk=target.pk).exists()
    elif action == "update":
        target.refresh_from_db()
        for field, value in spec["patch"].items():
            assert _same(getattr(target, field), value), field


def _same(stored, sent) -> bool:
    return (
        Decimal(str(stored)) == Decimal(str(sent)) if isinstance(stored, Decimal | float) else stored == sent
    )


@pytest.mark.parametrize(
    ("route", "action", "actor"),
    [
        (route, action, actor)
        for route, action, *codes in MATRIX
        for actor, code in zip(ACTORS, codes, strict=True)
        if action in ("update", "delete", "revoke") and code in (403, 404, 405)
    ],
)
def test_it_leaves_the_object_unchanged_when_refused(world, client_for, route, action, actor):
    target = ROUTES[route]["target"](world)
    before = type(target).objects.filter(pk=target.pk).values().get()
    _call(world, client_for(getattr(world, actor)), route, action)
    assert type(target).objects.filter(pk=target.pk).values().get() == before


# --- list endpoints are scoped too ---------------------------------------------------------------------
# Which of the world's objects each actor sees in a list (World attribute names; for memberships, whose
# membership it is).
#
# fmt: off
LISTS = [
    # route          operator / admin_a / team_admin_a1 / member_a1 / admin_b
    ("tenants",      ["tenant_a", "tenant_b"],
                     ["tenant_a"],
                     ["tenant_a"],
                     ["tenant_a"],
                     ["tenant_b"]),
    ("teams",        ["team_a1", "team_a2", "team_b1"],
                     ["team_a1", "team_a2"],
                     ["team_a1"],
                     ["team_a1"],
                     ["team_b1"]),
    ("memberships",  list(ACTORS),
                     ["admin_a", "team_admin_a1", "member_a1"],
                     ["team_admin_a1", "member_a1"],
                     ["team_admin_a1", "member_a1"],
                     ["admin_b"]),
    ("keys",         ["key_a1", "key_a2", "key_b1"],
                     ["key_a1", "key_a2"],
                     ["key_a1"],
                     ["key_a1"],
                     ["key_b1"]),
    ("quotas",       ["quota_a1", "quota_b1"],
                     ["quota_a1"],
                     ["quota_a1"],
                     ["quota_a1"],
                     ["quota_b1"]),
    ("price-sheets", ["price_list", "price_b"],
                     ["price_list"],
                     ["price_list"],
                     ["price_list"],
                     ["price_list", "price_b"]),
    ("usage",        ["usage_a1", "usage_b1"],
                     ["usage_a1"],
                     ["usage_a1"],
                     ["usage_a1"],
                     ["usage_b1"]),
]
# fmt: on


def _ident(obj):
    """How an object shows in a list: keys by their row, usage by request id, memberships by user."""
    if hasattr(obj, "api_key") and hasattr(obj, "secret"):  # an IssuedKey
        return obj.api_key.pk
    if hasattr(obj, "request_id"):
        return obj.request_id
    if hasattr(obj, "username"):
        return obj.username
    return obj.pk


def _list_ident(route: str, item: dict):
    return {"usage": item.get("request_id"), "memberships": item.get("user")}.get(route, item.get("id"))


def _list_cases():
    for route, *seen in LISTS:
        for actor, names in zip(ACTORS, seen, strict=True):
            yield pytest.param(route, actor, names, id=f"{route}-{actor}")


@pytest.mark.parametrize(("route", "actor", "names"), list(_list_cases()))
def test_it_scopes_every_list(world, client_for, route, actor, names):
    response = client_for(getattr(world, actor)).get(_url(route))
    assert response.status_code == 200
    seen = {_list_ident(route, item) for item in response.json()["results"]}
    assert seen == {_ident(getattr(world, name)) for name in names}


@pytest.mark.parametrize(
    ("actor", "tenants"),
    [
        ("operator", ["tenant_a", "tenant_b"]),
        ("admin_a", ["tenant_a"]),
        ("team_admin_a1", ["tenant_a"]),
        ("member_a1", ["tenant_a"]),
        ("admin_b", ["tenant_b"]),
    ],
)
def test_it_lists_the_model_aliases_of_ones_tenants_only(world, client_for, actor, tenants):
    aliases = {_alias_of(world.tenant_a).pk: "tenant_a", _alias_of(world.tenant_b).pk: "tenant_b"}
    response = client_for(getattr(world, actor)).get("/api/model-aliases/")
    assert response.status_code == 200
    assert sorted(aliases[row["id"]] for row in response.json()["results"]) == tenants


def test_it_shows_team_admins_and_members_only_their_own_teams_usage(world, client_for):
    make_usage(world.key_a2, "req-a2")
    for actor, expected in [
        (world.admin_a, {"req-a1", "req-a2"}),
        (world.team_admin_a1, {"req-a1"}),
        (world.member_a1, {"req-a1"}),
        (world.admin_b, {"req-b1"}),
    ]:
        results = client_for(actor).get("/api/usage/").json()["results"]
        assert {row["request_id"] for row in results} == expected, actor.username
    assert client_for(world.member_a1).get("/api/usage/req-a2/").status_code == 404


def test_it_scopes_the_audit_log(world, client_for):
    # Changes in both tenants, so each tenant has rows beyond those the world made.
    client_for(world.admin_a).patch(f"/api/teams/{world.team_a1.pk}/", {"name": "A"}, format="json")
    client_for(world.admin_b).patch(f"/api/teams/{world.team_b1.pk}/", {"name": "B"}, format="json")

    def tenants_seen(user):
        response = client_for(user).get("/api/audit-log/")
        assert response.status_code == 200
        return [row["tenant"] for row in response.json()["results"]]

    assert {world.tenant_a.pk, world.tenant_b.pk} <= set(tenants_seen(world.operator))
    seen_by_a = tenants_seen(world.admin_a)
    assert seen_by_a and set(seen_by_a) == {world.tenant_a.pk}
    seen_by_b = tenants_seen(world.admin_b)
    assert seen_by_b and set(seen_by_b) == {world.tenant_b.pk}
    # Team admins and members get an empty trail, not an error.
    assert tenants_seen(world.team_admin_a1) == []
    assert tenants_seen(world.member_a1) == []
    # Filtering by another tenant finds nothing either.
    response = client_for(world.admin_b).get("/api/audit-log/", {"tenant": world.tenant_a.pk})
    assert response.status_code == 200 and response.json()["results"] == []
    row = _audit_row_of_tenant_a(world)
    assert client_for(world.admin_b).get(f"/api/audit-log/{row.pk}/").status_code == 404


def test_it_does_not_let_a_filter_widen_the_scope(world, client_for):
    client = client_for(world.admin_b)
    for url, params in [
        ("/api/keys/", {"team": world.team_a1.pk}),
        ("/api/keys/", {"team__tenant": world.tenant_a.pk}),
        ("/api/teams/", {"tenant": world.tenant_a.pk}),
        ("/api/quotas/", {"team": world.team_a1.pk}),
        ("/api/memberships/", {"tenant": world.tenant_a.pk}),
        ("/api/usage/", {"tenant": world.tenant_a.pk}),
        ("/api/price-sheets/", {"tenant": world.tenant_a.pk}),
        ("/api/model-aliases/", {"tenant": world.tenant_a.pk}),
    ]:
        response = client.get(url, params)
        assert response.status_code == 200, url
        assert response.json()["results"] == [], (url, params)


# --- no mass assignment --------------------------------------------------------------------------------


def test_it_refuses_a_tenant_admin_a_team_in_another_tenant(world, client_for):
    response = client_for(world.admin_a).post(
        "/api/teams/", {"tenant": world.tenant_b.pk, "name": "Sneaky", "slug": "sneaky"}, format="json"
    )
    assert response.status_code == 400
    assert "tenant" in response.json()
    assert not Team.objects.filter(slug="sneaky").exists()


@pytest.mark.parametrize("actor", ["operator", "admin_a"])
def test_it_never_moves_a_team_to_another_tenant(world, client_for, actor):
    response = client_for(getattr(world, actor)).patch(
        f"/api/teams/{world.team_a1.pk}/", {"tenant": world.tenant_b.pk, "name": "Agents II"}, format="json"
    )
    assert response.status_code == 200
    world.team_a1.refresh_from_db()
    assert world.team_a1.tenant_id == world.tenant_a.pk
    assert world.team_a1.name == "Agents II"
    assert response.json()["tenant"] == world.tenant_a.pk


@pytest.mark.parametrize("team", ["team_a2", "team_b1"])
def test_it_refuses_a_team_admin_a_key_in_another_team(world, client_for, team):
    before = ApiKey.objects.count()
    response = client_for(world.team_admin_a1).post(
        "/api/keys/",
        {"team": getattr(world, team).pk, "name": "sneaky", "scopes": ["inference"]},
        format="json",
    )
    assert response.status_code == 400
    assert "team" in response.json()
    assert ApiKey.objects.count() == before


def test_it_never_moves_a_key_to_another_team(world, client_for):
    api_key = world.key_a1.api_key
    for team in (world.team_a2, world.team_b1):
        response = client_for(world.team_admin_a1).patch(
            f"/api/keys/{api_key.pk}/", {"team": team.pk}, format="json"
        )
        assert response.status_code == 200
        api_key.refresh_from_db()
        assert api_key.team_id == world.team_a1.pk


def test_it_ignores_read_only_fields_when_a_key_is_created(world, client_for):
    response = client_for(world.team_admin_a1).post(
        "/api/keys/",
        {
            "team": world.team_a1.pk,
            "name": "new agent",
            "scopes": ["inference"],
            "prefix": "ipk_chosenbyme",
            "public_id": "chosenbyme12",
            "secret_hmac": "0" * 64,
            "revoked_at": timezone.now().isoformat(),
            "last_used_at": timezone.now().isoformat(),
            "created_by": world.operator.username,
            "is_active": False,
            "key": "ipk_chosenbyme12_secret",
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    body = response.json()
    api_key = ApiKey.objects.get(pk=body["id"])
    assert api_key.public_id != "chosenbyme12"
    assert api_key.secret_hmac != "0" * 64
    assert body["prefix"] == api_key.prefix != "ipk_chosenbyme"
    assert api_key.revoked_at is None and body["revoked_at"] is None
    assert api_key.last_used_at is None
    assert api_key.created_by == world.team_admin_a1 and body["created_by"] == "tom"
    assert body["is_active"] is True
    assert body["key"] != "ipk_chosenbyme12_secret"


def test_it_ignores_read_only_fields_when_a_key_is_changed(world, client_for):
    api_key = world.key_a1.api_key
    before = ApiKey.objects.filter(pk=api_key.pk).values().get()
    response = client_for(world.team_admin_a1).patch(
        f"/api/keys/{api_key.pk}/",
        {
            "prefix": "ipk_chosenbyme",
            "revoked_at": timezone.now().isoformat(),
            "created_by": world.team_admin_a1.username,
            "last_used_at": timezone.now().isoformat(),
            "created_at": (timezone.now() - timedelta(days=30)).isoformat(),
        },
        format="json",
    )
    assert response.status_code == 200
    assert ApiKey.objects.filter(pk=api_key.pk).values().get() == before


@pytest.mark.parametrize(
    ("actor", "role", "scope"),
    [
        ("team_admin_a1", Role.TENANT_ADMIN, "tenant_a"),
        ("team_admin_a1", Role.OPERATOR, None),
        ("team_admin_a1", Role.MEMBER, "team_a2"),  # not their team
        ("team_admin_a1", Role.MEMBER, "team_b1"),
        ("admin_a", Role.OPERATOR, None),
        ("admin_a", Role.TENANT_ADMIN, "tenant_b"),
        ("admin_a", Role.MEMBER, "team_b1"),
    ],
)
def test_it_refuses_to_grant_a_role_beyond_ones_own(world, client_for, actor, role, scope):
    _new_user(world)
    body = {"user": "nina", "role": role}
    if scope:
        body["team" if scope.startswith("team") else "tenant"] = getattr(world, scope).pk
    response = client_for(getattr(world, actor)).post("/api/memberships/", body, format="json")
    assert response.status_code == 400, response.content
    assert not Membership.objects.filter(user__username="nina").exists()


@pytest.mark.parametrize("role", [Role.TENANT_ADMIN, Role.OPERATOR])
def test_it_refuses_a_team_admin_raising_a_members_role(world, client_for, role):
    membership = world.membership_member_a1
    response = client_for(world.team_admin_a1).patch(
        f"/api/memberships/{membership.pk}/", {"role": role, "team": None}, format="json"
    )
    assert response.status_code == 400, response.content
    membership.refresh_from_db()
    assert (membership.role, membership.team_id) == (Role.MEMBER, world.team_a1.pk)


def test_it_refuses_a_tenant_admin_making_anyone_an_operator(world, client_for):
    membership = world.membership_member_a1
    response = client_for(world.admin_a).patch(
        f"/api/memberships/{membership.pk}/", {"role": Role.OPERATOR}, format="json"
    )
    assert response.status_code == 400
    membership.refresh_from_db()
    assert membership.role == Role.MEMBER


def test_it_never_moves_a_membership_to_another_user_or_scope(world, client_for):
    membership = world.membership_member_a1
    response = client_for(world.team_admin_a1).patch(
        f"/api/memberships/{membership.pk}/",
        {"user": world.admin_b.username, "team": world.team_b1.pk, "tenant": world.tenant_b.pk},
        format="json",
    )
    assert response.status_code == 200
    membership.refresh_from_db()
    assert (membership.user_id, membership.team_id, membership.tenant_id) == (
        world.member_a1.pk,
        world.team_a1.pk,
        world.tenant_a.pk,
    )


@pytest.mark.parametrize("actor", ["admin_a", "team_admin_a1", "member_a1", "admin_b"])
def test_it_lets_only_operators_create_or_change_price_sheets(world, client_for, actor):
    client = client_for(getattr(world, actor))
    own_tenant = (world.tenant_b if actor == "admin_b" else world.tenant_a).pk
    body = {**_new_price_sheet(world), "tenant": own_tenant}
    assert client.post("/api/price-sheets/", body, format="json").status_code == 403
    assert client.post("/api/price-sheets/", {**body, "tenant": None}, format="json").status_code == 403
    response = client.patch(
        f"/api/price-sheets/{world.price_list.pk}/", {"tenant": own_tenant}, format="json"
    )
    assert response.status_code == 403
    assert PriceSheet.objects.count() == 2
    world.price_list.refresh_from_db()
    assert world.price_list.tenant_id is None


def test_it_never_moves_a_quota_to_another_team_or_key(world, client_for):
    quota = world.quota_a1
    response = client_for(world.admin_a).patch(
        f"/api/quotas/{quota.pk}/",
        {"team": world.team_a2.pk, "api_key": world.key_a2.api_key.pk, "requests_per_minute": 30},
        format="json",
    )
    assert response.status_code == 200
    quota.refresh_from_db()
    assert (quota.team_id, quota.api_key_id, quota.requests_per_minute) == (world.team_a1.pk, None, 30)


@pytest.mark.parametrize(("team", "api_key"), [("team_b1", None), ("team_a2", "key_b1")])
def test_it_refuses_a_tenant_admin_a_quota_outside_the_tenant(world, client_for, team, api_key):
    body = {"team": getattr(world, team).pk, "requests_per_minute": 10}
    if api_key:
        body["api_key"] = getattr(world, api_key).api_key.pk
    response = client_for(world.admin_a).post("/api/quotas/", body, format="json")
    assert response.status_code == 400
    assert Quota.objects.count() == 2


# --- the key's secret ----------------------------------------------------------------------------------


@pytest.mark.parametrize("actor", ACTORS)
def test_it_never_shows_a_keys_secret_in_lists_or_details(world, client_for, actor):
    client = client_for(getattr(world, actor))
    listed = client.get("/api/keys/")
    assert listed.status_code == 200
    rows = listed.json()["results"]
    assert rows
    for row in rows:
        assert "key" not in row
        assert "secret_hmac" not in row
        detail = client.get(f"/api/keys/{row['id']}/")
        assert detail.status_code == 200 and "key" not in detail.json()
    for issued in (world.key_a1, world.key_a2, world.key_b1):
        assert issued.secret not in listed.content.decode()


def test_it_shows_the_secret_exactly_once_when_a_key_is_created(world, client_for):
    client = client_for(world.team_admin_a1)
    response = client.post(
        "/api/keys/", {"team": world.team_a1.pk, "name": "new agent", "scopes": ["read-usage"]}, format="json"
    )
    assert response.status_code == 201
    assert response["Cache-Control"] == "no-store"
    secret = response.json()["key"]
    assert secret.startswith(response.json()["prefix"] + "_")
    assert response.content.decode().count(secret) == 1
    key_id = response.json()["id"]
    for later in (
        client.get(f"/api/keys/{key_id}/"),
        client.get("/api/keys/"),
        client.patch(f"/api/keys/{key_id}/", {"name": "renamed"}, format="json"),
        client.post(f"/api/keys/{key_id}/revoke/"),
        client_for(world.admin_a).get("/api/audit-log/"),
    ):
        assert later.status_code == 200
        assert secret not in later.content.decode()
        assert '"key"' not in later.content.decode()


# --- anonymous callers ---------------------------------------------------------------------------------
# DRF answers an anonymous caller 401 when the first authenticator names a WWW-Authenticate scheme (Bearer,
# as configured now) and 403 when it does not (session authentication). Either is acceptable, 200 never is;
# the code's choice is 401.
ANONYMOUS_STATUS = 401


@pytest.mark.parametrize("route", [route for route in ROUTES if "url" not in ROUTES[route]])
@pytest.mark.parametrize("action", ["list", "retrieve", "update", "delete", "create"])
def test_it_refuses_anonymous_callers(world, route, action):
    client = APIClient()
    response = client.get(_url(route)) if action == "list" else _call(world, client, route, action)
    assert response.status_code in (401, 403)
    assert response.status_code == ANONYMOUS_STATUS
    if response.status_code == 401:
        assert response["WWW-Authenticate"].startswith("Bearer")


def test_it_refuses_an_unknown_bearer_token(world):
    client = APIClient()
    for credentials in ("Bearer not-a-token", "Bearer ipk_aaaaaaaaaaaa_wrong"):
        client.credentials(HTTP_AUTHORIZATION=credentials)
        response = client.get("/api/usage/")
        assert response.status_code in (401, 403), credentials


# --- API keys as credentials ---------------------------------------------------------------------------


def _key_client(secret: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def test_it_lets_a_read_usage_key_read_its_teams_usage_only(world):
    make_usage(world.key_a2, "req-a2")
    make_usage(world.key_a1, "req-a1-second")
    client = _key_client(world.key_a1.secret)
    response = client.get("/api/usage/")
    assert response.status_code == 200
    assert {row["request_id"] for row in response.json()["results"]} == {"req-a1", "req-a1-second"}
    assert client.get("/api/usage/req-a1/").status_code == 200
    assert client.get("/api/usage/req-a2/").status_code == 404
    assert client.get("/api/usage/req-b1/").status_code == 404
    # Filters cannot widen it.
    response = client.get("/api/usage/", {"tenant": world.tenant_b.pk})
    assert response.status_code == 200 and response.json()["results"] == []


@pytest.mark.parametrize(
    "route", [route for route in ROUTES if route not in ("usage",) and "url" not in ROUTES[route]]
)
def test_it_refuses_a_key_everywhere_but_usage(world, route):
    client = _key_client(world.key_a1.secret)
    assert client.get(_url(route)).status_code == 403
    assert _call(world, client, route, "retrieve").status_code == 403


def test_it_refuses_a_key_writing_usage_or_revoking_itself(world):
    client = _key_client(world.key_a1.secret)
    assert client.post("/api/usage/", {"request_id": "x"}, format="json").status_code in (403, 405)
    assert client.delete("/api/usage/req-a1/").status_code in (403, 405)
    assert client.post(f"/api/keys/{world.key_a1.api_key.pk}/revoke/").status_code == 403
    world.key_a1.api_key.refresh_from_db()
    assert world.key_a1.api_key.revoked_at is None


def test_it_refuses_a_key_without_the_read_usage_scope(world):
    issued = api_key_create(
        team=world.team_a1, name="inference only", scopes=[Scope.INFERENCE], source="system"
    )
    assert _key_client(issued.secret).get("/api/usage/").status_code == 403


@pytest.mark.parametrize("how", ["revoked", "expired"])
def test_it_answers_401_to_a_revoked_or_expired_key(world, how):
    api_key = world.key_a1.api_key
    if how == "revoked":
        api_key_revoke(api_key=api_key, source="system")
    else:
        ApiKey.objects.filter(pk=api_key.pk).update(
            created_at=timezone.now() - timedelta(days=2), expires_at=timezone.now() - timedelta(days=1)
        )
    response = _key_client(world.key_a1.secret).get("/api/usage/")
    assert response.status_code == 401
    assert "req-a1" not in response.content.decode()
