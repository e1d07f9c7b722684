"""The routing plugin registry: a scorer, a mode and the policy's weight for it come from one registration, and
the routing policy's model, snapshot, admin and API follow the registered table."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from routing.admin import RoutingPolicyAdmin
from routing.api.serializers import RoutingPolicySerializer
from routing.info import NO_POLICY, DeploymentInfo, EndpointInfo, PolicyInfo
from routing.models import SCORER_WEIGHT_FIELDS, RoutingMode, RoutingPolicy, policy_fields
from routing.scheduling.load import EndpointLoad
from routing.scheduling.pipeline import REGISTRY, Pipeline, Registry, RequestContext
from routing.snapshot import load_snapshot
from serving.models import DesiredStatus, ModelDeployment


class PinnedScorer:
    """Prefers one engine (as a scorer of, say, a LoRA adapter loaded there would)."""

    def __init__(self, endpoint_id: int):
        self.endpoint_id = endpoint_id

    def score(self, ctx, candidates, policy):
        return [1.0 if c.endpoint.id == self.endpoint_id else 0.0 for c in candidates]


# The weight field a new scorer brings: a model field on RoutingPolicy and the same field, with the same default, on
# routing.info.PolicyInfo (test_policy_info_is_the_models_fields_and_defaults holds the two equal); here a
# PolicyInfo with that one field more stands for it.
PinnedPolicy = dataclasses.make_dataclass(
    "PinnedPolicy",
    [("pinned_weight", float, dataclasses.field(default=4.0))],
    bases=(PolicyInfo,),
    frozen=True,
    slots=True,
)


def with_pinned(affinity: bool = False) -> Registry:
    """The router's registry, plus the pinned scorer and a mode that uses it: nothing else is edited."""
    registry = REGISTRY.copy()
    registry.scorer("pinned", PinnedScorer(3), weight="pinned_weight", affinity=affinity)
    registry.mode("pinned", (*REGISTRY.modes["least_loaded"], "pinned"))
    return registry


def picks(registry: Registry, policy, loads=None, count: int = 8) -> Counter:
    endpoints = tuple(EndpointInfo(i, f"e{i}", f"http://e{i}", "both", 1) for i in range(4))
    deployment = DeploymentInfo(1, "tiny", "tiny", 4096, 128, policy, endpoints, 0)
    loads = loads or {i: EndpointLoad() for i in range(4)}
    pipeline = Pipeline(registry)
    chosen = Counter()
    for _ in range(count):
        pick, candidates = pipeline.choose(deployment, RequestContext(model="tiny"), loads)
        chosen[pick.endpoint.id] += 1
    return chosen


def test_a_scorer_added_through_the_registry_alone_changes_the_pick():
    registry = with_pinned()
    # Four idle engines: without the new scorer, equals take turns.
    assert picks(registry, PinnedPolicy(mode="least_loaded")) == {0: 2, 1: 2, 2: 2, 3: 2}
    # The mode that lists it sends everything to the engine it prefers, by the weight its field holds.
    assert picks(registry, PinnedPolicy(mode="pinned")) == {3: 8}
    assert picks(registry, PinnedPolicy(mode="pinned", pinned_weight=0.0)) == {0: 2, 1: 2, 2: 2, 3: 2}
    # The router's own registry is untouched.
    assert "pinned" not in REGISTRY.scorers and "pinned" not in REGISTRY.modes


def test_the_load_guard_takes_away_the_scores_registered_as_affinity():
    def busy_pinned_engine() -> dict[int, EndpointLoad]:
        loads = {i: EndpointLoad() for i in range(4)}
        for _ in range(6):
            loads[3].begin()
        return loads

    # The pinned engine is busy, but 4 x 1.0 of its score outweighs its queue score.
    assert picks(with_pinned(), PinnedPolicy(mode="pinned"), busy_pinned_engine()) == {3: 8}
    # Registered as an affinity, the load guard drops it there: the others share the requests.
    spread = picks(with_pinned(affinity=True), PinnedPolicy(mode="pinned"), busy_pinned_engine(), count=9)
    assert spread == {0: 3, 1: 3, 2: 3}


def test_the_registry_refuses_what_it_could_not_run():
    registry = REGISTRY.copy()
    with pytest.raises(ValueError, match="registered already"):
        registry.step("queue", lambda choice: None)
    with pytest.raises(KeyError, match="no_such_scorer"):
        registry.mode("broken", ("not_excluded", "no_such_scorer"))
    with pytest.raises(ValueError, match="one weight field"):
        registry.scorer("other_prefix", PinnedScorer(0), weight="queue_weight", key="prefix", affinity=True)


def test_every_mode_the_database_allows_is_registered_and_every_weight_is_a_policy_field():
    assert {mode.value for mode in RoutingMode} <= set(REGISTRY.modes)
    names = [f.name for f in policy_fields()]
    assert set(REGISTRY.weight_fields) <= set(names)
    # The database's check covers every weight.
    assert set(REGISTRY.weight_fields) == set(SCORER_WEIGHT_FIELDS)
    # The admin lists the registered weights; the API carries every field the router reads.
    assert set(REGISTRY.weight_fields) <= set(RoutingPolicyAdmin.list_display)
    assert RoutingPolicySerializer.Meta.fields == ["id", "deployment", *names, "updated_at"]


def test_policy_info_is_the_models_fields_and_defaults():
    fields = policy_fields()
    assert [f.name for f in dataclasses.fields(PolicyInfo)] == [f.name for f in fields]
    unsaved = RoutingPolicy()
    assert PolicyInfo() == PolicyInfo(**{f.name: getattr(unsaved, f.name) for f in fields})
    assert PolicyInfo().mode == RoutingMode.PRECISE
    assert NO_POLICY.mode == RoutingMode.ROUND_ROBIN  # a deployment without a policy row


@pytest.mark.django_db
def test_the_snapshot_reads_every_policy_field():
    def deployment(name: str) -> ModelDeployment:
        return ModelDeployment.objects.create(
            name=name,
            served_model_name=name,
            model_source="models/tiny-qwen",
            engine_kind="sim",
            desired_status=DesiredStatus.RUNNING,
        )

    tuned = deployment("tuned")
    values = {
        "mode": RoutingMode.APPROXIMATE.value,
        "prefix_weight": 5.0,
        "queue_weight": 0.5,
        "prefill_backlog_weight": 2.5,
        "kv_utilization_weight": 0.25,
        "session_affinity_weight": 1.5,
        "gpu_tier_weight": 0.9,
        "cpu_tier_weight": 0.4,
        "load_guard_ratio": 2.0,
        "pd_split_threshold_tokens": 4096,
        "flow_control": False,
        "saturation_waiting_per_engine": 1.5,
        "saturation_spare_slots_per_engine": 0.0,
        "saturation_kv_utilization": 0.8,
        "saturation_prefill_tokens_per_engine": 8192,
        "max_wait_interactive_s": 5.0,
        "max_wait_standard_s": 20.0,
        "max_wait_batch_s": 120.0,
    }
    assert set(values) == {f.name for f in policy_fields()}
    RoutingPolicy.objects.create(deployment=tuned, **values)
    deployment("plain")
    snapshot = load_snapshot()
    assert snapshot.deployments["tuned"].policy == PolicyInfo(**values)
    assert snapshot.deployments["plain"].policy == NO_POLICY
