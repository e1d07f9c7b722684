"""The autoscaling rule and its policy's validation (serving/autoscaling.py, serving/models.py)."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from routing.contracts import AUTOSCALE_HISTORY_KEY
from serving import services
from serving.autoscaling import (
    Signals,
    Trend,
    _trend,
    autoscale_all,
    growth,
    recommend,
    role_signals,
    stabilise,
)
from serving.models import (
    AutoscalingPolicy,
    Endpoint,
    Health,
    KvConnector,
    ModelDeployment,
    Pool,
    PoolRole,
    ScalingEvent,
)
from serving.services import AUTOSCALER
from tenants.models import AuditLog


def policy(**fields) -> AutoscalingPolicy:
    defaults = {"enabled": True, "min_replicas": 1, "max_replicas": 10}
    return AutoscalingPolicy(**{**defaults, **fields})


def test_queued_prompt_tokens_ask_for_replicas_in_proportion():
    p = policy(queued_prompt_tokens_per_replica=8000)
    rec = recommend(p, 2, Signals(ready=2, queued_prompt_tokens=30_000), Trend(), startup_s=0)
    assert rec.replicas == 4 and rec.asks == {"queued_prompt_tokens_per_replica": 4}
    assert "queued_prompt_tokens_per_replica asks for 4" in rec.reason


def test_the_projection_looks_one_start_up_time_ahead():
    p = policy(running_requests_per_replica=16)
    now = Signals(ready=2, running_requests=30)
    assert recommend(p, 2, now, Trend(), startup_s=60).replicas == 2
    # Growing by one sequence a second: in the 60 s an engine takes to start, 90 will run.
    growing = recommend(p, 2, now, Trend(running_requests=1.0), startup_s=60)
    assert growing.replicas == 6
    # A shrinking load is not projected down: today's figure counts.
    assert recommend(p, 2, now, Trend(running_requests=-1.0), startup_s=60).replicas == 2


# A closed loop of two sessions, one pass a second for 30 s: one or two requests running, or none.
NIGHT = [1, 2, 1, 0, 2, 1, 1, 2, 0, 1, 2, 1, 0, 1, 2, 1, 1, 0, 2, 1, 0, 1, 2, 1, 1, 0, 2, 1, 1, 0, 2]


def test_the_noise_of_a_few_sessions_is_not_projected():
    samples = [(float(t), float(v)) for t, v in enumerate(NIGHT)]
    # Two passes 10 s apart read 0 then 2: a "rise" of 0.2 a second, 6 more sequences over a 30 s start-up.
    assert (samples[-11][1], samples[-1][1]) == (0.0, 2.0)
    assert growth(samples) == 0.0
    p = policy(running_requests_per_replica=6)
    now = Signals(ready=1, running_requests=2)
    assert recommend(p, 1, now, Trend(running_requests=growth(samples)), startup_s=30).replicas == 1


def test_a_sustained_ramp_is_projected_ahead_of_the_load():
    # Half a sequence more a second, with the same noise around the line.
    samples = [(float(t), 2 + 0.5 * t + (v - 1)) for t, v in enumerate(NIGHT[:21])]
    rate = growth(samples)
    assert 0.3 < rate <= 0.5  # the slope less its confidence margin
    p = policy(running_requests_per_replica=6)
    now = Signals(ready=2, running_requests=samples[-1][1])  # 11 running: two replicas' worth today
    assert recommend(p, 2, now, Trend(), startup_s=20).replicas == 2
    ahead = recommend(p, 2, now, Trend(running_requests=rate), startup_s=20)
    assert ahead.replicas == 4 and ahead.asks["running_requests_per_replica"] == 4
    # Too few passes to tell growth from noise: none.
    assert growth(samples[-3:]) == 0.0


def test_the_trend_is_fitted_over_the_recorded_passes_of_its_window(settings):
    import json

    import redis

    client = redis.Redis.from_url(settings.REDIS_URL)
    key = AUTOSCALE_HISTORY_KEY.format(987_654)
    now = 10_000.0
    try:
        # Passes a second apart, newest first at the head: the last 30 s ramp; an older one, much lower, is out.
        passes = [{"t": now - age, "running_requests": 20 - 0.5 * age} for age in range(1, 31)]
        passes.append({"t": now - 40, "running_requests": -100, "kv_cache_utilization": None})
        client.rpush(key, *[json.dumps(p) for p in passes])
        trend = _trend(client, 987_654, Signals(ready=2, running_requests=20), now)
        assert abs(trend.running_requests - 0.5) < 1e-6
        assert trend.queued_prompt_tokens == 0.0 and trend.kv_cache_utilization == 0.0
    finally:
        client.delete(key)


def test_a_missed_latency_objective_raises_and_a_close_one_holds():
    p = policy(itl_p90_s=0.05, running_requests_per_replica=64)
    quiet = Signals(ready=4, running_requests=10)
    assert recommend(p, 4, quiet, Trend(), 0).replicas == 3  # capacity alone: one down at a time
    close = Signals(ready=4, running_requests=10, itl_p90_s=0.045)
    assert recommend(p, 4, close, Trend(), 0).replicas == 4  # within 80 % of the objective: held
    missed = Signals(ready=4, running_requests=10, itl_p90_s=0.075)
    assert recommend(p, 4, missed, Trend(), 0).replicas == 6  # 4 x 1.5


@pytest.mark.parametrize(
    "role, kept",
    [
        ("prefill", {"queued_prompt_tokens", "ttft_p90_s"}),
        ("decode", {"running_requests", "kv_cache_utilization", "itl_p90_s"}),
        (
            "both",
            {"queued_prompt_tokens", "ttft_p90_s", "running_requests", "kv_cache_utilization", "itl_p90_s"},
        ),
    ],
)
def test_a_pool_reads_the_signals_of_its_role(role, kept):
    """What the worker's pass and the fleet planner's autoscaler both read a pool by: a prefill pool its prompt
    backlog and TTFT, a decode pool its sequences, KV use and inter-token latency, an aggregated pool all."""
    signals = role_signals(role, 2, 9000.0, 7.0, [0.5, 0.7], (1.5, 0.04, 30))
    measured = {
        "queued_prompt_tokens": 9000.0,
        "ttft_p90_s": 1.5,
        "running_requests": 7.0,
        "kv_cache_utilization": pytest.approx(0.6),
        "itl_p90_s": 0.04,
    }
    empty = {"queued_prompt_tokens": 0.0, "running_requests": 0.0}
    for name, value in measured.items():
        assert getattr(signals, name) == (value if name in kept else empty.get(name))
    assert (signals.ready, signals.requests) == (2, 30)
    assert role_signals(role, 0, 0.0, 0.0, [], (None, None, 0)).kv_cache_utilization is None


def test_bounds_and_steps():
    p = policy(queued_prompt_tokens_per_replica=1000, max_replicas=6, max_scale_up_step=2)
    rec = recommend(p, 2, Signals(ready=2, queued_prompt_tokens=50_000), Trend(), 0)
    assert rec.replicas == 4 and "at most 2 up at once" in rec.reason
    rec = recommend(p, 5, Signals(ready=5, queued_prompt_tokens=50_000), Trend(), 0)
    assert rec.replicas == 6 and "bounded to [1, 6]" in rec.reason
    idle = recommend(policy(queued_prompt_tokens_per_replica=1000, min_replicas=2), 3, Signals(), Trend(), 0)
    assert idle.replicas == 2 and idle.reason.startswith("no demand")


def test_kv_cache_utilisation_scales_the_replicas_it_is_measured_over():
    p = policy(kv_cache_utilization=0.7)
    assert recommend(p, 3, Signals(ready=3, kv_cache_utilization=0.93), Trend(), 0).replicas == 4
    assert recommend(p, 3, Signals(ready=3, kv_cache_utilization=0.7), Trend(), 0).replicas == 3


def test_stabilisation_moves_up_on_lasting_demand_and_down_on_lasting_quiet():
    now = 1000.0
    spike = [(now - 20, 2), (now - 10, 2), (now, 6)]
    assert stabilise(spike, now, 2, up_window_s=15, down_window_s=300) == 2  # one high ask is not enough
    lasting = [(now - 20, 2), (now - 10, 5), (now, 6)]
    assert stabilise(lasting, now, 2, up_window_s=15, down_window_s=300) == 5
    assert stabilise(lasting, now, 2, up_window_s=0, down_window_s=300) == 6
    quiet = [(now - 400, 6), (now - 200, 3), (now, 2)]
    assert stabilise(quiet, now, 4, up_window_s=15, down_window_s=300) == 3
    assert stabilise(quiet, now, 4, up_window_s=15, down_window_s=100) == 2


@pytest.fixture
def pools(db):
    deployment = ModelDeployment.objects.create(name="m", served_model_name="m", model_source="m")
    split = {"kv_connector": KvConnector.NIXL}
    return {
        "both": Pool.objects.create(deployment=deployment, name="main"),
        "prefill": Pool.objects.create(deployment=deployment, name="p", role=PoolRole.PREFILL, **split),
        "decode": Pool.objects.create(deployment=deployment, name="d", role=PoolRole.DECODE, **split),
    }


def test_validation_says_what_to_fix(pools):
    with pytest.raises(ValidationError) as bounds:
        AutoscalingPolicy(pool=pools["both"], min_replicas=5, max_replicas=2).full_clean()
    assert "above the maximum" in str(bounds.value.message_dict["min_replicas"])
    with pytest.raises(ValidationError) as decode_ttft:
        AutoscalingPolicy(pool=pools["decode"], ttft_p90_s=1.0).full_clean()
    assert "decode pool has no ttft p90 s signal" in decode_ttft.value.message_dict["ttft_p90_s"][0]
    with pytest.raises(ValidationError) as prefill_kv:
        AutoscalingPolicy(pool=pools["prefill"], kv_cache_utilization=0.8).full_clean()
    assert "kv_cache_utilization" in prefill_kv.value.message_dict
    with pytest.raises(ValidationError) as no_target:
        AutoscalingPolicy(pool=pools["both"], enabled=True).full_clean()
    assert "at least one target" in no_target.value.message_dict["enabled"][0]
    AutoscalingPolicy(pool=pools["both"], enabled=True, ttft_p90_s=2.0, itl_p90_s=0.05).full_clean()
    AutoscalingPolicy(pool=pools["prefill"], queued_prompt_tokens_per_replica=8192).full_clean()


# --- the policy through the API, and a person's edit pausing it ------------------------------------------


def test_operators_set_a_policy_through_the_api_and_bad_ones_are_explained(world, client_for, pools):
    operator = client_for(world.operator)
    wrong = operator.post(
        "/api/autoscaling-policies/", {"pool": pools["decode"].pk, "ttft_p90_s": 2.0}, format="json"
    )
    assert wrong.status_code == 400 and "decode pool has no ttft" in wrong.json()["ttft_p90_s"][0]
    inverted = operator.post(
        "/api/autoscaling-policies/",
        {"pool": pools["both"].pk, "min_replicas": 4, "max_replicas": 2, "ttft_p90_s": 2.0},
        format="json",
    )
    assert inverted.status_code == 400
    made = operator.post(
        "/api/autoscaling-policies/",
        {"pool": pools["decode"].pk, "enabled": True, "itl_p90_s": 0.05, "max_replicas": 8},
        format="json",
    )
    assert made.status_code == 201, made.json()
    assert AuditLog.objects.filter(action="autoscaling_policy.create", source="api").count() == 1
    member = client_for(world.member_a1)
    assert member.get("/api/autoscaling-policies/").json()["results"][0]["itl_p90_s"] == 0.05
    refused = member.patch(
        f"/api/autoscaling-policies/{made.json()['id']}/", {"enabled": False}, format="json"
    )
    assert refused.status_code == 403


def test_a_persons_edit_pauses_autoscaling_until_it_is_turned_back_on(world, client_for, pools):
    pool = pools["both"]
    policy = AutoscalingPolicy.objects.create(pool=pool, enabled=True, running_requests_per_replica=8)
    assert services.pool_scale(actor=world.operator, source="portal", pool=pool, replicas=3)
    policy.refresh_from_db()
    assert not policy.enabled and world.operator.username in policy.paused_reason
    event = ScalingEvent.objects.get(pool=pool)
    assert (event.from_replicas, event.to_replicas, event.actor) == (1, 3, world.operator.username)
    # The autoscaler's own changes pause nothing.
    policy.enabled = True
    policy.save()
    assert services.pool_scale(actor=AUTOSCALER, source=AUTOSCALER, pool=pool, replicas=4)
    policy.refresh_from_db()
    assert policy.enabled and policy.paused_reason == ""
    assert AuditLog.objects.filter(action="deployment.scale", actor_label="autoscaler").count() == 1
    # An edit of the deployment's pools through the API pauses it too.
    response = client_for(world.operator).patch(
        f"/api/deployments/{pool.deployment_id}/",
        {
            "pools": [
                {"name": "main", "replicas": 2},
                {"name": "p", "role": "prefill", "kv_connector": "NixlConnector"},
                {"name": "d", "role": "decode", "kv_connector": "NixlConnector"},
            ]
        },
        format="json",
    )
    assert response.status_code == 200, response.json()
    policy.refresh_from_db()
    assert not policy.enabled and "(api)" in policy.paused_reason
    turned_on = client_for(world.operator).patch(
        f"/api/autoscaling-policies/{policy.pk}/", {"enabled": True}, format="json"
    )
    assert turned_on.status_code == 200 and turned_on.json()["paused_reason"] == ""


# --- the autoscaler's pass, on real Redis and Postgres -----------------------------------------------------


def test_the_autoscaler_follows_the_engines_load_up_and_down(pools, settings):
    import redis

    from routing.contracts import LOAD_KEY

    client = redis.Redis.from_url(settings.REDIS_URL)
    pool = pools["both"]
    AutoscalingPolicy.objects.create(
        pool=pool,
        enabled=True,
        max_replicas=6,
        running_requests_per_replica=4,
        scale_up_window_s=0,
        scale_down_window_s=0,
        max_scale_up_step=3,
    )
    endpoints = [
        Endpoint.objects.create(
            pool=pool, name=f"m-main-{i}", url=f"http://10.9.0.{i}:8000", role="both", health=Health.HEALTHY
        )
        for i in range(2)
    ]
    for endpoint in endpoints:
        client.hset(LOAD_KEY.format(endpoint.pk), mapping={"running": 9, "waiting": 1, "kv_usage": 0.5})
    try:
        [event] = autoscale_all(client)
        pool.refresh_from_db()
        # 20 sequences at 4 per replica ask for 5; at most 3 up at once from 1.
        assert pool.replicas == 4 and (event.from_replicas, event.to_replicas) == (1, 4)
        assert event.actor == AUTOSCALER and event.signals["running_requests"] == 20
        assert "running_requests_per_replica asks for 5" in event.reason
        assert AutoscalingPolicy.objects.get(pool=pool).enabled
        for endpoint in endpoints:
            client.hset(LOAD_KEY.format(endpoint.pk), mapping={"running": 0, "waiting": 0})
        [down] = autoscale_all(client)
        pool.refresh_from_db()
        assert (down.from_replicas, down.to_replicas) == (4, 3) and down.reason.startswith("no demand")
    finally:
        client.delete(*[LOAD_KEY.format(e.pk) for e in endpoints])
        client.delete(f"autoscale:recs:{pool.pk}", f"autoscale:last:{pool.pk}")


def test_no_more_replicas_are_asked_for_while_some_wait_for_room_on_the_cluster(pools, settings):
    """Pods the scheduler cannot place (no GPU free) would only wait too: the autoscaler holds the pool, and asks
    again once the orchestrator no longer reports any waiting."""
    import redis

    from routing.contracts import LOAD_KEY
    from serving.autoscaling import unschedulable_note

    client = redis.Redis.from_url(settings.REDIS_URL)
    pool = pools["both"]
    AutoscalingPolicy.objects.create(
        pool=pool, enabled=True, max_replicas=6, running_requests_per_replica=4, scale_up_window_s=0
    )
    endpoint = Endpoint.objects.create(
        pool=pool, name="m-main-0", url="http://10.9.1.1:8000", role="both", health=Health.HEALTHY
    )
    client.hset(LOAD_KEY.format(endpoint.pk), mapping={"running": 12, "waiting": 0})
    try:
        unschedulable_note(client, pool.pk, 1)
        assert autoscale_all(client) == []
        pool.refresh_from_db()
        assert pool.replicas == 1
        unschedulable_note(client, pool.pk, 0)
        [event] = autoscale_all(client)
        assert (event.from_replicas, event.to_replicas) == (1, 3)  # 12 sequences at 4 a replica
    finally:
        client.delete(LOAD_KEY.format(endpoint.pk), f"autoscale:recs:{pool.pk}", f"autoscale:last:{pool.pk}")
        unschedulable_note(client, pool.pk, 0)
