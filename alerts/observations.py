"""What a check reports about one condition of a rule, each time it runs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Observation:
    key: str  # which condition of the rule; stable across checks (and periods, for budgets: it names the period)
    tenant_id: int | None = None  # whose the condition is (a tenant's budget), for scoping who sees the alert
    # True: the condition holds; False: it does not; None: this check cannot tell (too little traffic, a source
    # that did not answer), so the state stays as it was.
    holding: bool | None = None
    # Holds, but is not worth a message of its own: a lower percentage crossed along with a higher one.
    quiet: bool = False
    summary: str = ""
    details: dict = field(default_factory=dict)
