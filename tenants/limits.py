"""The quota kinds, one row each. Everything else about a kind is built from its row: the quota's counters and
checks in Redis (routing/metering/admission.py), the router's view of a quota (routing.snapshot.QuotaInfo), the tenant's
ceiling for it, the admin's and the API's fields, the portal's rows and the refusal's message. A new kind is a
`Quota` field (with its `Tenant` ceiling), a row here, and their migration.

No Django here: the request path reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

# What one request adds to a counter, by the name a row gives in `counts`: one request; the prompt's tokens; the
# output's tokens; both; its cost (1e-8 of the currency unit); or a slot while it runs (a lease in a sorted set).
COUNTS = ("request", "input", "output", "tokens", "spend", "slot")
# Over what a counter runs: the current minute; the budget period (the quota's `budget_period`); or the requests
# running now.
WINDOWS = ("minute", "budget", "running")


@dataclass(frozen=True, slots=True)
class Limit:
    field: str  # Quota's field, and QuotaInfo's
    ceiling: str  # Tenant's field: the most the tenant's teams and keys may use together
    code: str  # the error code of a refusal (a 429)
    counts: str  # one of COUNTS
    window: str  # one of WINDOWS
    counter: str  # its counter's name in Redis keys
    label: str  # as people read it, in messages and pages ("requests per minute")
    settled: bool = True  # corrected to what the request used when it ends (a request counts once, as sent)

    @property
    def money(self) -> bool:
        return self.counts == "spend"


LIMITS: tuple[Limit, ...] = (
    Limit(
        "requests_per_minute",
        "max_requests_per_minute",
        "requests",
        "request",
        "minute",
        "rpm",
        "requests per minute",
        settled=False,
    ),
    Limit(
        "input_tokens_per_minute",
        "max_input_tokens_per_minute",
        "input_tokens",
        "input",
        "minute",
        "itpm",
        "input tokens per minute",
    ),
    Limit(
        "output_tokens_per_minute",
        "max_output_tokens_per_minute",
        "output_tokens",
        "output",
        "minute",
        "otpm",
        "output tokens per minute",
    ),
    Limit(
        "max_concurrent_requests",
        "max_concurrent_requests",
        "concurrency",
        "slot",
        "running",
        "conc",
        "concurrent requests",
    ),
    Limit("token_budget", "max_token_budget", "token_budget", "tokens", "budget", "tok", "token budget"),
    Limit("spend_budget", "max_spend_budget", "spend_budget", "spend", "budget", "spend", "spend budget"),
)


def message(code: str) -> str:
    """What a refusal says was reached: "requests per minute", "token budget for this period"."""
    limit = next((limit for limit in LIMITS if limit.code == code), None)
    if limit is None:
        return code
    return f"{limit.label} for this period" if limit.window == "budget" else limit.label


def row_label(limit: Limit, period: str, currency: str) -> str:
    """A portal row's name: "Requests per minute", "Tokens this month", "Spend this month (USD)"."""
    if limit.window != "budget":
        return limit.label.capitalize()
    noun = "Spend" if limit.money else limit.label.removesuffix(" budget").capitalize() + "s"
    return f"{noun} this {period}" + (f" ({currency})" if limit.money else "")


def quota_fields() -> list[str]:
    """A quota's fields as forms, lists and the API show them: the rates and the slots, then the budgets with their
    period and currency."""
    budgets = [limit.field for limit in LIMITS if limit.window == "budget"]
    return [
        *(limit.field for limit in LIMITS if limit.window != "budget"),
        "budget_period",
        *budgets,
        "currency",
    ]


def ceiling_fields() -> list[str]:
    """The tenant's ceilings in the same order: the rates and the slots, then the budgets with their period and
    currency."""
    return [
        *(limit.ceiling for limit in LIMITS if limit.window != "budget"),
        "max_budget_period",
        *(limit.ceiling for limit in LIMITS if limit.window == "budget"),
        "max_spend_currency",
    ]
