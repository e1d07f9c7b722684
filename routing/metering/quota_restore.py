"""Budget counters brought back to the ledger after Redis lost them.

A token or spend budget is counted in Redis (routing/metering/admission.py): every admitted request's reservation, settled
to what it used before its usage event is appended to the stream. So a budget's counter never holds less than the
ledger's total for its period: the ledger has only requests that were settled into the counter first. A counter
below the ledger means Redis lost it (restarted empty, failed over to a replica behind it, evicted), and every
team would otherwise get its budget afresh. Each run raises such a counter by the difference (INCRBY: what
requests add meanwhile stays), so it holds at least what the ledger says was used. Level-triggered and idempotent,
run by beat every RESTORE_EVERY_S seconds.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from django.db.models import F, Q, Sum

from routing.contracts import quota_counters
from routing.info import QuotaInfo
from routing.metering.admission import Admission, money_units
from routing.snapshot import _ceilings, _quota
from tenants.limits import LIMITS
from tenants.models import Quota, Tenant, UsageRecord
from tenants.periods import period_bounds

log = logging.getLogger(__name__)

RESTORE_EVERY_S = 15.0
BUDGETS = {limit.field: index for index, limit in enumerate(LIMITS) if limit.window == "budget"}


def _budget_scopes() -> list[tuple[str, int, QuotaInfo, Q]]:
    """Every scope with a token or spend budget: (kind, id, its quota, its ledger rows)."""
    scopes = []
    with_budget = Q(token_budget__isnull=False) | Q(spend_budget__isnull=False)
    for quota in Quota.objects.filter(with_budget):
        if quota.api_key_id:
            scopes.append(("key", quota.api_key_id, _quota(quota), Q(api_key_id=quota.api_key_id)))
        else:
            scopes.append(("team", quota.team_id, _quota(quota), Q(team_id=quota.team_id)))
    ceilings = Q(max_token_budget__isnull=False) | Q(max_spend_budget__isnull=False)
    for tenant in Tenant.objects.filter(ceilings):
        scopes.append(("tenant", tenant.id, _ceilings(tenant), Q(tenant_id=tenant.id)))
    return scopes


def quota_counters_restore(redis_client) -> list[str]:
    """Raise every budget counter that holds less than the ledger's total for its period to that total; return
    what was raised, as text."""
    now = time.time()
    at = datetime.fromtimestamp(now, UTC)
    raised = []
    for kind, ident, quota, rows in _budget_scopes():
        start, end = period_bounds(quota.budget_period, at)
        used = UsageRecord.objects.filter(rows, created_at__gte=start, created_at__lt=end).aggregate(
            tokens=Sum(F("prompt_tokens") + F("output_tokens")), spend=Sum("cost")
        )
        ledger = {"token_budget": int(used["tokens"] or 0), "spend_budget": money_units(used["spend"] or 0)}
        counted = quota_counters(redis_client, kind=kind, ident=ident, quota=quota)
        keys = Admission._scope_keys(kind, ident, quota, int(now // 60), int(start.timestamp()))
        for field, index in BUDGETS.items():
            have = counted[field]
            have = money_units(have) if field == "spend_budget" else int(have)
            if have < ledger[field]:
                key = keys[index]
                with redis_client.pipeline(transaction=False) as pipe:
                    pipe.incrby(key, ledger[field] - have)
                    pipe.expire(key, max(1, int(end.timestamp() - now)) + 3600)
                    pipe.execute()
                raised.append(f"{kind} {ident} {field}: {have} -> {ledger[field]}")
    if raised:
        log.warning("quota counters below the ledger (Redis lost them), raised: %s", "; ".join(raised))
    return raised
