"""The quota kinds are one table (tenants/limits.py): admission's counters and checks, the router's view of a
quota, the ceilings, the admin, the API and the portal are built from it, so a new kind is a field, a row and a
migration."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import redis.asyncio as aioredis
from django.conf import settings

from routing import contracts as contracts_module
from routing.contracts import quota_counters
from routing.info import QuotaInfo
from routing.metering import admission as admission_module
from routing.metering.admission import Admission
from tenants import limits as limits_module
from tenants.admin import QuotaAdmin, TenantAdmin
from tenants.api.serializers import QuotaSerializer, TenantSerializer
from tenants.limits import LIMITS, Limit, ceiling_fields, quota_fields
from tenants.models import Quota, Tenant

# A kind the platform does not have: the prompt tokens a key may have served from cache each minute.
CACHE_READS = Limit(
    "cache_reads_per_minute",
    "max_cache_reads_per_minute",
    "cache_reads",
    "input",
    "minute",
    "crpm",
    "cache reads",
)


def test_every_row_names_a_quota_field_and_a_tenant_ceiling_and_is_read_everywhere():
    quota_model, tenant_model = {f.name for f in Quota._meta.fields}, {f.name for f in Tenant._meta.fields}
    for limit in LIMITS:
        assert limit.field in quota_model and limit.ceiling in tenant_model
        assert limit.field in QuotaSerializer.Meta.fields and limit.field in QuotaAdmin.list_display
        assert limit.ceiling in TenantSerializer.Meta.fields
    assert [f.name for f in dataclasses.fields(QuotaInfo)] == [
        *(limit.field for limit in LIMITS),
        "budget_period",
    ]
    assert set(quota_fields()) >= {limit.field for limit in LIMITS}
    admin_fields = next(
        options["fields"] for name, options in TenantAdmin.fieldsets if name == "Quota ceilings"
    )
    assert admin_fields == ceiling_fields()


def test_a_new_kind_of_quota_is_checked_counted_settled_and_shown_from_its_row_alone(monkeypatch):
    """The scripts take every limit by name: a row added to the table is enforced with no other change."""
    table = (*LIMITS, CACHE_READS)
    monkeypatch.setattr(admission_module, "LIMITS", table)
    monkeypatch.setattr(contracts_module, "LIMITS", table)
    monkeypatch.setattr(limits_module, "LIMITS", table)
    fields = {limit.field: None for limit in table}
    quota = SimpleNamespace(**{**fields, "cache_reads_per_minute": 250, "budget_period": "day"})
    team = 880_001

    async def scenario():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        admission = Admission(client)
        try:
            decisions = []
            for n in range(3):
                decisions.append(
                    await admission.admit(
                        request_id=f"cache-reads-{n}",
                        scopes=[("team", team, quota)],
                        input_reserve=100,
                        output_reserve=10,
                        spend_reserve=0,
                    )
                )
            # The first request used 40 prompt tokens, not the 100 it reserved: settled, it frees 60.
            await client.script_load(admission_module.SETTLE)  # the finisher loads it on NOSCRIPT
            async with client.pipeline(transaction=False) as pipe:
                admission.settle_in(pipe, decisions[0].reservation, -60, 0, 0)
                await pipe.execute()
            again = await admission.admit(
                request_id="cache-reads-3",
                scopes=[("team", team, quota)],
                input_reserve=100,
                output_reserve=10,
                spend_reserve=0,
            )
            return decisions, again
        finally:
            await client.delete(*await client.keys(f"q:team:{team}:*"))
            await client.aclose()

    decisions, again = asyncio.run(scenario())
    assert [d.admitted for d in decisions] == [True, True, False]
    refused = decisions[2]
    assert refused.limit == "cache_reads" and refused.scope == "team"
    assert refused.message == "Rate limit reached for this team: cache reads."
    assert again.admitted  # 40 + 100 + 100 of 250


def test_the_portal_reads_each_kinds_counter_by_its_field():
    import redis

    quota = QuotaInfo(**dict.fromkeys((limit.field for limit in LIMITS), None), budget_period="month")
    client = redis.Redis.from_url(settings.REDIS_URL)
    counted = quota_counters(client, kind="team", ident=880_002, quota=quota)
    assert counted == dict.fromkeys((limit.field for limit in LIMITS), 0)
