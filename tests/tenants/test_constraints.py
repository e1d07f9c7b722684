"""The database itself refuses bad states, whatever code path tries to write them."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from routing.models import RoutingPolicy
from serving.models import Pool
from tenants.models import ApiKey, Membership, PriceSheet, Quota, Role, Team, UsageRecord


def refused(fn) -> bool:
    try:
        with transaction.atomic():
            fn()
            # Deferred constraints (the composite foreign keys) are checked at commit; force them now.
            with connection.cursor() as cursor:
                cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    except IntegrityError:
        return True
    return False


def test_it_refuses_a_membership_whose_scope_does_not_match_its_role(world):
    assert refused(
        lambda: Membership.objects.create(user=world.member_a1, role=Role.OPERATOR, tenant=world.tenant_a)
    )
    assert refused(lambda: Membership.objects.create(user=world.member_a1, role=Role.TENANT_ADMIN))
    assert refused(
        lambda: Membership.objects.create(user=world.member_a1, role=Role.MEMBER, tenant=world.tenant_a)
    )


def test_it_refuses_a_team_role_whose_tenant_is_not_the_teams_tenant(world):
    assert refused(
        lambda: Membership.objects.create(
            user=world.admin_b, role=Role.MEMBER, tenant=world.tenant_b, team=world.team_a2
        )
    )


def test_it_refuses_two_roles_for_one_user_in_one_team(world):
    assert refused(
        lambda: Membership.objects.create(
            user=world.member_a1, role=Role.TEAM_ADMIN, tenant=world.tenant_a, team=world.team_a1
        )
    )


def test_it_refuses_duplicate_team_slugs_within_a_tenant_but_not_across(world):
    assert refused(lambda: Team.objects.create(tenant=world.tenant_a, name="x", slug="agents"))
    assert not refused(lambda: Team.objects.create(tenant=world.tenant_b, name="x", slug="agents"))


def test_it_refuses_keys_without_scopes_with_unknown_scopes_or_a_bad_hmac(world):
    key = world.key_a1.api_key
    assert refused(lambda: ApiKey.objects.filter(pk=key.pk).update(scopes=[]))
    assert refused(lambda: ApiKey.objects.filter(pk=key.pk).update(scopes=["inference", "admin"]))
    assert refused(lambda: ApiKey.objects.filter(pk=key.pk).update(secret_hmac="plain-text-secret"))
    assert refused(
        lambda: ApiKey.objects.filter(pk=key.pk).update(expires_at=key.created_at - timedelta(seconds=1))
    )


def test_it_refuses_a_key_quota_whose_key_is_in_another_team(world):
    assert refused(lambda: Quota.objects.create(team=world.team_a2, api_key=world.key_a1.api_key))
    assert not refused(lambda: Quota.objects.create(team=world.team_a1, api_key=world.key_a1.api_key))


def test_it_refuses_zero_limits_and_a_second_team_wide_quota(world):
    assert refused(lambda: Quota.objects.create(team=world.team_a2, requests_per_minute=0))
    assert refused(lambda: Quota.objects.create(team=world.team_a1))
    assert refused(lambda: Quota.objects.create(team=world.team_a2, spend_budget=Decimal("-1")))


def test_it_refuses_cached_input_dearer_than_input_and_duplicate_starts(world):
    now = timezone.now()
    assert refused(
        lambda: PriceSheet.objects.create(
            served_model_name="m",
            effective_from=now,
            input_per_mtok=1,
            cached_input_per_mtok=2,
            output_per_mtok=1,
        )
    )
    # Two list prices (no tenant) for one model and start: NULL tenants count as equal.
    assert refused(
        lambda: PriceSheet.objects.create(
            served_model_name="tiny-qwen",
            effective_from=world.price_list.effective_from,
            input_per_mtok=1,
            cached_input_per_mtok=0,
            output_per_mtok=1,
        )
    )


def test_it_refuses_usage_whose_team_key_and_tenant_disagree(world):
    base = dict(model="tiny-qwen", prompt_tokens=10, output_tokens=1, status="completed")
    assert refused(
        lambda: UsageRecord.objects.create(
            request_id="x1", tenant=world.tenant_b, team=world.team_a1, api_key=world.key_a1.api_key, **base
        )
    )
    assert refused(
        lambda: UsageRecord.objects.create(
            request_id="x2", tenant=world.tenant_a, team=world.team_a2, api_key=world.key_a1.api_key, **base
        )
    )
    assert refused(
        lambda: UsageRecord.objects.create(
            request_id="req-a1",
            tenant=world.tenant_a,
            team=world.team_a1,
            api_key=world.key_a1.api_key,
            **base,
        )
    )
    assert refused(
        lambda: UsageRecord.objects.create(
            request_id="x3",
            tenant=world.tenant_a,
            team=world.team_a1,
            api_key=world.key_a1.api_key,
            cached_prompt_tokens=11,
            **base,
        )
    )


def test_it_refuses_inconsistent_pool_options(world):
    deployment = world.deployment
    assert refused(lambda: Pool.objects.create(deployment=deployment, name="p", role="prefill"))
    assert refused(lambda: Pool.objects.create(deployment=deployment, name="s", speculative_method="ngram"))
    assert refused(lambda: Pool.objects.create(deployment=deployment, name="c", cpu_offload_bytes=1 << 30))
    assert refused(lambda: Pool.objects.create(deployment=deployment, name="main"))
    assert not refused(
        lambda: Pool.objects.create(
            deployment=deployment, name="p", role="prefill", kv_connector="NixlConnector"
        )
    )


def test_it_refuses_a_cpu_tier_weighing_more_than_the_gpu_tier(world):
    policy = world.policy
    assert refused(
        lambda: RoutingPolicy.objects.filter(pk=policy.pk).update(cpu_tier_weight=1.0, gpu_tier_weight=0.5)
    )
    assert refused(lambda: RoutingPolicy.objects.filter(pk=policy.pk).update(prefix_weight=-1))


@pytest.mark.parametrize(
    "route, payload, field",
    [
        (
            "/api/price-sheets/",
            {
                "served_model_name": "m",
                "effective_from": "2026-01-01T00:00:00Z",
                "input_per_mtok": "1",
                "cached_input_per_mtok": "2",
                "output_per_mtok": "1",
            },
            "non_field_errors",
        ),
        ("/api/teams/", {"tenant": None, "name": "Agents", "slug": "agents"}, "non_field_errors"),
        ("/api/quotas/", {"team": None, "requests_per_minute": 0}, "requests_per_minute"),
    ],
)
def test_it_reports_constraint_violations_as_400_with_a_message(world, client_for, route, payload, field):
    if "team" in payload:
        payload["team"] = world.team_a2.pk
    if "tenant" in payload:
        payload["tenant"] = world.tenant_a.pk
    response = client_for(world.operator).post(route, payload, format="json")
    assert response.status_code == 400, response.content
    body = response.json()
    assert field in body and all(isinstance(m, str) and m for m in body[field])
