"""The team page shows quotas beside the router's own admission counters, as the next request will see them."""

from __future__ import annotations

import asyncio
import re

import redis.asyncio as aioredis
from django.conf import settings
from django.test import Client

from routing.info import QuotaInfo
from routing.metering.admission import Admission
from tenants.models import Quota


def test_the_team_page_shows_what_admission_has_counted(world):
    quota = Quota.objects.get(pk=world.quota_a1.pk)
    quota.max_concurrent_requests = 9
    quota.save()
    info = QuotaInfo(quota.requests_per_minute, None, None, 9, None, None, quota.budget_period)

    async def admit_two():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        admission = Admission(client)
        for n in range(2):
            decision = await admission.admit(
                request_id=f"page-{n}",
                scopes=[("team", world.team_a1.pk, info)],
                input_reserve=10,
                output_reserve=5,
                spend_reserve=0,
            )
            assert decision.admitted
        await client.aclose()

    asyncio.run(admit_two())
    page = Client()
    page.force_login(world.team_admin_a1)
    body = page.get(f"/portal/teams/{world.team_a1.pk}/").content.decode()
    rows = [" ".join(re.sub(r"<[^>]+>", " ", row).split()) for row in body.split("<tr>")]
    assert "Requests per minute 2 60 3.3%" in rows
    assert "Concurrent requests 2 9 22.2%" in rows
