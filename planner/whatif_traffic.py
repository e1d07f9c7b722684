"""The traffic of a what-if: a recorded period of a deployment as the planner's requests, and that traffic made
larger or smaller per tenant or per team.

The period is read as `manage.py export_trace` writes it (`routing.metering.traffic_trace.export_rows`, then the planner's
own trace parser), so a what-if replays exactly what an export of the same period would.

A multiplier scales a tenant's (or a team's) traffic by whole agents, never by splitting one:

- the unit is the session (an agent's conversation; a request without a session is a unit of its own), so a
  conversation's requests stay together and keep reusing each other's prefixes;
- x k (a whole number) replays the unit k times; x f with a fraction replays it floor(f) times and once more with
  probability f - floor(f), drawn per unit from a fixed seed (the same run draws the same units). x0 removes it;
- the first copy is the recorded traffic itself. Each further copy is a new, independent group of agents: copy
  j gets block ids and sessions of its own, so it shares no prefix with the recorded traffic nor with copy j' (no
  cache hit across copies, not even on a shared system prompt), while inside copy j the prefixes the recorded
  units shared with each other stay shared. Copies arrive when the recorded requests did.

A team's multiplier takes precedence over its tenant's, and a tenant's over the one for all traffic.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from itertools import islice

from .trace import TraceRequest, parse

SEED = "what-if"


@dataclass(frozen=True)
class Traffic:
    """Multipliers by tenant id and by team id (as strings, as the trace holds them), and for everything else."""

    tenants: dict[str, float] = field(default_factory=dict)
    teams: dict[str, float] = field(default_factory=dict)
    everyone: float = 1.0

    @classmethod
    def from_changes(cls, changes: dict) -> Traffic:
        traffic = changes.get("traffic") or {}
        return cls(
            tenants={str(k): float(v) for k, v in (traffic.get("tenants") or {}).items()},
            teams={str(k): float(v) for k, v in (traffic.get("teams") or {}).items()},
            everyone=float(traffic.get("all", 1.0)),
        )

    def factor(self, tenant: str, team: str | None) -> float:
        if team is not None and team in self.teams:
            return self.teams[team]
        return self.tenants.get(tenant, self.everyone)

    @property
    def unchanged(self) -> bool:
        return self.everyone == 1.0 and all(f == 1.0 for f in (*self.tenants.values(), *self.teams.values()))


@dataclass
class RecordedTrace:
    requests: list[TraceRequest]
    teams: dict[int, str]  # request index -> team id


def trace_from_rows(rows: Iterable[dict]) -> RecordedTrace:
    """Export rows (routing.metering.traffic_trace.export_rows) read by the planner's trace parser, with each request's
    team beside it (the parser keeps the tenant, not the team)."""
    rows = list(rows)
    requests = parse(json.dumps(row, separators=(",", ":")) for row in rows)
    teams = {i: str(row["team"]) for i, row in enumerate(rows) if row.get("team") is not None}
    return RecordedTrace(requests, teams)


def recorded_trace(
    *, deployment_id: int, since: datetime, until: datetime, limit: int | None = None
) -> RecordedTrace:
    """The period's recorded requests of a deployment, as `manage.py export_trace` exports them: the first
    `limit` of them in order of arrival where a limit is given (the rows beyond it are never read)."""
    from routing.metering.traffic_trace import export_rows

    return trace_from_rows(islice(export_rows(deployment_id=deployment_id, since=since, until=until), limit))


def _unit(r: TraceRequest) -> str:
    return f"{r.tenant}/s{r.session}" if r.session is not None else f"{r.tenant}/r{r.index}"


def copies_of(unit: str, factor: float, seed: str = SEED) -> int:
    """How many times a unit is replayed under a multiplier: floor(factor), plus one with probability of the
    fraction, drawn from the unit's name and the seed."""
    whole = int(factor)
    fraction = factor - whole
    if fraction > 0 and random.Random(f"{seed}:{unit}").random() < fraction:
        whole += 1
    return whole


def unit_copies(trace: RecordedTrace, traffic: Traffic, seed: str = SEED) -> dict[str, int]:
    """How many times each unit of the trace is replayed."""
    copies: dict[str, int] = {}
    for r in trace.requests:
        unit = _unit(r)
        if unit not in copies:
            copies[unit] = copies_of(unit, traffic.factor(r.tenant, trace.teams.get(r.index)), seed)
    return copies


def held_blocks(trace: RecordedTrace, traffic: Traffic, seed: str = SEED) -> int:
    """The block ids a what-if holds for the trace under the multipliers, counted before any copy is made: the
    recording's once (the baseline replays it, and the changed fleet's first copy shares its ids) and each
    further copy's own."""
    copies = unit_copies(trace, traffic, seed)
    return sum(len(r.hash_ids) * max(1, copies[_unit(r)]) for r in trace.requests)


def multiply(trace: RecordedTrace, traffic: Traffic, seed: str = SEED) -> list[TraceRequest]:
    """The trace with each tenant's or team's traffic multiplied (see the module's docstring), in order of
    arrival, renumbered from 0."""
    if traffic.unchanged:
        return list(trace.requests)
    next_id = 1 + max((h for r in trace.requests for h in r.hash_ids), default=-1)
    renamed: dict[tuple[int, int], int] = {}
    copies = unit_copies(trace, traffic, seed)
    out: list[tuple[float, int, int, TraceRequest]] = []
    for r in trace.requests:
        for j in range(copies[_unit(r)]):
            if j == 0:
                out.append((r.arrival_s, r.index, 0, r))
                continue
            ids = []
            for h in r.hash_ids:
                key = (j, h)
                if key not in renamed:
                    renamed[key] = next_id
                    next_id += 1
                ids.append(renamed[key])
            session = None if r.session is None else f"{r.session}~{j}"
            out.append(
                (
                    r.arrival_s,
                    r.index,
                    j,
                    TraceRequest(
                        0, r.arrival_s, r.input_tokens, r.output_tokens, tuple(ids), r.tenant, session
                    ),
                )
            )
    out.sort(key=lambda x: x[:3])
    return [
        TraceRequest(i, r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids, r.tenant, r.session)
        for i, (*_, r) in enumerate(out)
    ]
