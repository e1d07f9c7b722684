"""The built-in routing plugins and modes, registered into the router's registry: one line each.

A new scorer is a class in routing/scheduling/scorers/, one `REGISTRY.scorer` line here naming the policy field that holds its
weight, that field on RoutingPolicy with its migration, and its name in the modes that use it: see
docs/routing.md#adding-a-scorer.
"""

from __future__ import annotations

from routing.scheduling import steps
from routing.scheduling.filters import not_excluded, with_room
from routing.scheduling.picker import fewest_sent_lately, soonest_first_token
from routing.scheduling.pipeline import REGISTRY
from routing.scheduling.scorers.kv_utilization import KvUtilizationScorer
from routing.scheduling.scorers.prefix_match import ApproximatePrefixScorer, PrecisePrefixScorer
from routing.scheduling.scorers.queue import PrefillBacklogScorer, QueueScorer
from routing.scheduling.scorers.session import SessionAffinityScorer

REGISTRY.filter("not_excluded", not_excluded)
REGISTRY.filter("with_room", with_room)

REGISTRY.scorer("precise_prefix", PrecisePrefixScorer(), weight="prefix_weight", key="prefix", affinity=True)
REGISTRY.scorer(
    "approximate_prefix", ApproximatePrefixScorer(), weight="prefix_weight", key="prefix", affinity=True
)
REGISTRY.scorer("queue", QueueScorer(), weight="queue_weight")
REGISTRY.scorer("prefill", PrefillBacklogScorer(), weight="prefill_backlog_weight")
REGISTRY.scorer("kv_utilization", KvUtilizationScorer(), weight="kv_utilization_weight")
REGISTRY.scorer("session", SessionAffinityScorer(), weight="session_affinity_weight", affinity=True)

REGISTRY.step("session_spare", steps.session_spare)
REGISTRY.step("new_session_spread", steps.new_session_spread)
REGISTRY.step("load_guard", steps.guard)

REGISTRY.tie_break("soonest_first_token", soonest_first_token)
REGISTRY.tie_break("fewest_sent_lately", fewest_sent_lately)

# Modes: the plugins each runs, in order. Scores sum in the order listed.
LOAD = ("queue", "prefill", "kv_utilization")
GUARDS = ("session_spare", "new_session_spread", "load_guard")
TIES = ("soonest_first_token", "fewest_sent_lately")
REGISTRY.mode("round_robin", ("not_excluded", "with_room", "fewest_sent_lately"))
REGISTRY.mode("least_loaded", ("not_excluded", "with_room", *LOAD, "session", *GUARDS, *TIES))
REGISTRY.mode(
    "approximate", ("not_excluded", "with_room", "approximate_prefix", *LOAD, "session", *GUARDS, *TIES)
)
REGISTRY.mode("precise", ("not_excluded", "with_room", "precise_prefix", *LOAD, "session", *GUARDS, *TIES))
