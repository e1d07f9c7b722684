"""What the budget rules watch: each team's and tenant's token and spend budget against the ledger.

Usage is read from the ledger (tenants/billing.py: the daily roll-ups plus the records not rolled up yet), the
source of truth billing reports use; it trails the router's own counters by the ingestion lag only. A pass over
every rule reads through one BudgetReader: the budgets once, and each tenant's usage once per period, however
many rules watch them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from tenants.access import Access
from tenants.billing import Period, usage_report
from tenants.models import Quota, Tenant
from tenants.periods import period_bounds

from .models import AlertKind, AlertRule, BudgetScope
from .observations import Observation

# Whole-platform read access for the checks: a rule's own scope is applied by the queries below.
SYSTEM = Access(True, frozenset(), frozenset(), frozenset(), frozenset())
# A forecast is made only once this share of the period has passed: before, one burst would forecast anything.
FORECAST_AFTER = 0.05
# A forecast clears when the projection falls under this share of the budget (so it does not flap around 100 %).
FORECAST_CLEARS_BELOW = Decimal("0.9")


@dataclass(frozen=True)
class Budget:
    """One budget of one team or tenant in the current period, and what the ledger says of it."""

    scope: str  # "team" or "tenant"
    ident: int
    tenant_id: int
    label: str  # "team acme/agents", "tenant acme"
    kind: str  # "token" or "spend"
    limit: Decimal
    used: Decimal
    currency: str  # spend only
    period: str
    start: datetime
    end: datetime

    def amount(self, value: Decimal) -> str:
        if self.kind == "token":
            return f"{int(value):,} tokens"
        return f"{value.quantize(Decimal('0.01'))} {self.currency}"


class BudgetReader:
    """The budgets and the ledger's usage, each read once and shared by every rule of a pass: a tenant with many
    rules costs the ledger no more than a tenant with one."""

    def __init__(self) -> None:
        self._quotas: list[Quota] | None = None
        self._tenants: list[Tenant] | None = None
        self._usage: dict[tuple, dict[int, dict]] = {}

    def team_quotas(self) -> list[Quota]:
        """Every team-wide quota with a budget, of every active tenant."""
        if self._quotas is None:
            quotas = Quota.objects.filter(api_key__isnull=True, team__tenant__is_active=True)
            quotas = quotas.exclude(token_budget__isnull=True, spend_budget__isnull=True)
            self._quotas = list(quotas.select_related("team__tenant"))
        return self._quotas

    def tenants(self) -> list[Tenant]:
        """Every active tenant with a budget ceiling."""
        if self._tenants is None:
            self._tenants = list(
                Tenant.objects.filter(is_active=True).exclude(
                    max_token_budget__isnull=True, max_spend_budget__isnull=True
                )
            )
        return self._tenants

    def usage(self, *, group_by: str, tenant_id: int, start: datetime, end: datetime) -> dict[int, dict]:
        key = (group_by, tenant_id, start, end)
        if key not in self._usage:
            self._usage[key] = _usage_by(group_by=group_by, tenant_id=tenant_id, start=start, end=end)
        return self._usage[key]


def budgets_of(rule: AlertRule, now: datetime, reader: BudgetReader | None = None) -> Iterator[Budget]:
    reader = reader or BudgetReader()
    if rule.budget_scope == BudgetScope.TENANT:
        yield from _tenant_budgets(rule, now, reader)
    else:
        yield from _team_budgets(rule, now, reader)


def _team_budgets(rule: AlertRule, now: datetime, reader: BudgetReader) -> Iterator[Budget]:
    for quota in reader.team_quotas():
        team = quota.team
        if rule.tenant_id not in (None, team.tenant_id) or rule.team_id not in (None, team.pk):
            continue
        start, end = period_bounds(quota.budget_period, now)
        used = reader.usage(group_by="team", tenant_id=team.tenant_id, start=start, end=end).get(team.pk, {})
        label = f"team {team}"
        yield from _budgets(
            "team", team.pk, team.tenant_id, label, quota.token_budget, quota.spend_budget, quota.currency,
            used, quota.budget_period, start, end,
        )  # fmt: skip


def _tenant_budgets(rule: AlertRule, now: datetime, reader: BudgetReader) -> Iterator[Budget]:
    for tenant in reader.tenants():
        if rule.tenant_id not in (None, tenant.pk):
            continue
        start, end = period_bounds(tenant.max_budget_period, now)
        used = reader.usage(group_by="tenant", tenant_id=tenant.pk, start=start, end=end).get(tenant.pk, {})
        yield from _budgets(
            "tenant", tenant.pk, tenant.pk, f"tenant {tenant.slug}", tenant.max_token_budget,
            tenant.max_spend_budget, tenant.max_spend_currency, used, tenant.max_budget_period, start, end,
        )  # fmt: skip


def _budgets(scope, ident, tenant_id, label, tokens, spend, currency, used, period, start, end):
    tokens_used, spend_by_currency = used.get("tokens", 0), used.get("spend", {})
    if tokens is not None:
        yield Budget(
            scope,
            ident,
            tenant_id,
            label,
            "token",
            Decimal(tokens),
            Decimal(tokens_used),
            "",
            period,
            start,
            end,
        )
    if spend is not None:
        used_spend = spend_by_currency.get(currency, Decimal(0))
        yield Budget(scope, ident, tenant_id, label, "spend", spend, used_spend, currency, period, start, end)


def _usage_by(*, group_by: str, tenant_id: int, start: datetime, end: datetime) -> dict[int, dict]:
    """Tokens (input, cached included, plus output, as the budgets count them) and spend per currency, per team
    or tenant id, in [start, end)."""
    report = usage_report(access=SYSTEM, period=Period(start, end), group_by=group_by, tenant_id=tenant_id)
    out: dict[int, dict] = {}
    for row in report.rows:
        entry = out.setdefault(row.key, {"tokens": 0, "spend": {}})
        entry["tokens"] += row.input_tokens + row.output_tokens
        entry["spend"][row.currency] = entry["spend"].get(row.currency, Decimal(0)) + row.cost
    return out


def _key(budget: Budget, what: str) -> str:
    return f"{budget.scope}:{budget.ident}:{budget.kind}:{what}:{budget.start:%Y-%m-%d}"


def _share(budget: Budget) -> Decimal:
    return budget.used / budget.limit if budget.limit > 0 else Decimal("Infinity")


def budget_observations(
    rule: AlertRule, now: datetime, reader: BudgetReader | None = None
) -> Iterator[Observation]:
    for budget in budgets_of(rule, now, reader):
        if rule.kind == AlertKind.BUDGET:
            yield from _crossings(rule, budget)
        else:
            yield _forecast(budget, now)


def _details(budget: Budget, **extra) -> dict:
    return {
        "scope": budget.scope,
        "id": budget.ident,
        "budget": budget.kind,
        "limit": str(budget.limit),
        "used": str(budget.used),
        "currency": budget.currency,
        "period": budget.period,
        "period_start": budget.start.isoformat(),
        "period_end": budget.end.isoformat(),
        **extra,
    }


def _crossings(rule: AlertRule, budget: Budget) -> Iterator[Observation]:
    """One observation per percentage. Only the highest one crossed is told: usage that jumps past 50 and 80 %
    between two checks sends the 80 % alert alone."""
    share = _share(budget)
    percentages = sorted(set(rule.percentages))
    crossed = [p for p in percentages if share * 100 >= p]
    for percentage in percentages:
        holding = percentage in crossed
        summary = (
            f"{budget.label.capitalize()} has used {min(share * 100, Decimal(9999)):.0f} % of its {budget.kind} "
            f"budget this {budget.period} ({budget.amount(budget.used)} of {budget.amount(budget.limit)}), "
            f"past {percentage} %; it resets {budget.end:%Y-%m-%d %H:%M} UTC."
        )
        yield Observation(
            key=_key(budget, str(percentage)),
            tenant_id=budget.tenant_id,
            holding=holding,
            quiet=holding and percentage != crossed[-1],
            summary=summary,
            details=_details(budget, percentage=percentage),
        )


def _forecast(budget: Budget, now: datetime) -> Observation:
    """At the period's rate so far, will the budget run out before the period ends?"""
    elapsed = now - budget.start
    length = budget.end - budget.start
    key = _key(budget, "forecast")
    if elapsed < length * FORECAST_AFTER or budget.used <= 0:
        return Observation(key=key, tenant_id=budget.tenant_id, holding=None)
    ratio = Decimal(length / elapsed)
    projected = budget.used * ratio
    runs_out = budget.start + elapsed * float(min(budget.limit / budget.used, Decimal(10**6)))
    holding = projected > budget.limit
    if not holding and projected >= budget.limit * FORECAST_CLEARS_BELOW:
        return Observation(key=key, tenant_id=budget.tenant_id, holding=None)
    summary = (
        f"At this {budget.period}'s rate, {budget.label}'s {budget.kind} budget "
        f"({budget.amount(budget.limit)}) runs out around {min(runs_out, budget.end):%Y-%m-%d %H:%M} UTC, before "
        f"the {budget.period} ends on {budget.end:%Y-%m-%d %H:%M} UTC: {budget.amount(budget.used)} used so far, "
        f"{budget.amount(projected)} forecast."
    )
    return Observation(
        key=key,
        tenant_id=budget.tenant_id,
        holding=holding,
        summary=summary,
        details=_details(
            budget, forecast=str(projected.quantize(Decimal("0.0001"))), runs_out=runs_out.isoformat()
        ),
    )
