"""manage.py profile_engine against a running simulator deployment: the fitted profile recovers the timing the
simulator was configured with, and the planner loads the stored profile and simulates with it."""

from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command

from planner.measure import Plan
from planner.profile import Profile, profile_names
from planner.sim import simulate
from planner.trace import TraceRequest
from serving.models import Endpoint, EngineKind, Health, ModelDeployment, Pool
from tests.serving.engines import MODEL_NAME, start_engine

pytestmark = pytest.mark.django_db

# The simulator's configured truth: a prompt token costs PREFILL_S (no per-prefill overhead); a token of one
# running sequence DECODE_S, and every other running sequence adds PER_SEQ_S to it.
PREFILL_S = 0.0001
DECODE_S = 0.02
PER_SEQ_S = 0.002
KV_BLOCKS = 1024
# Measured over HTTP on a shared 2-core machine: each gap carries a millisecond or so of event-loop and transport.
TOLERANCE = 0.15


@pytest.fixture
def sim_deployment():
    engine = start_engine(
        "sim",
        "--prefill-time-per-token",
        str(PREFILL_S),
        "--decode-time",
        str(DECODE_S),
        "--decode-time-per-seq",
        str(PER_SEQ_S),
        "--kv-cache-blocks",
        str(KV_BLOCKS),
        "--max-num-seqs",
        "16",
        events=False,
    )
    deployment = ModelDeployment.objects.create(
        name="profiled",
        served_model_name=MODEL_NAME,
        model_source="models/tiny-qwen",
        engine_kind=EngineKind.SIM,
        max_model_len=4096,
        block_size=128,
    )
    pool = Pool.objects.create(deployment=deployment, name="main", max_num_seqs=16, gpus_per_replica=1)
    Endpoint.objects.create(
        pool=pool, name="profiled-main-0", url=engine.url, role="both", health=Health.HEALTHY
    )
    yield deployment
    engine.stop()


def test_it_fits_the_simulators_configured_timing_and_the_planner_uses_it(sim_deployment, tmp_path):
    path = tmp_path / "profiled.json"
    call_command("profile_engine", "profiled", "--quick", "--output", str(path))

    stored = json.loads(path.read_text())
    assert stored["source"].startswith("measured here")
    assert stored["measurements"]["prefill"] and stored["measurements"]["decode"]
    # Prefills beside decoding streams, the second behind a cached prefix, checked against the fitted model.
    mixed = stored["measurements"]["mixed"]
    assert [(x["seqs"], x["prompt_tokens"], x["cached_tokens"]) for x in mixed] == [
        (4, 2048, 0),
        (8, 2048, 1024),
    ]
    assert all(x["ttft_s"] > 0 and x["timed_by"] == "engine" for x in mixed)
    assert stored["fit"]["mixed_median_abs_error"] >= 0
    profile = Profile.load(path)
    assert profile.name == "profiled"
    assert profile.prefill_per_token_s == pytest.approx(PREFILL_S, rel=TOLERANCE)
    # One sequence's step, and what each further sequence adds.
    assert profile.step_fixed_s + profile.decode_per_seq_s == pytest.approx(DECODE_S, rel=TOLERANCE)
    assert profile.decode_per_seq_s == pytest.approx(PER_SEQ_S, rel=0.25)
    # The simulator's decode does not depend on the context, nor its prefill on what is cached before it (beyond
    # the cost of receiving and hashing a longer prompt).
    assert profile.decode_per_ktoken_s * 2 < 0.1 * DECODE_S  # 2K tokens of context: under a tenth of a step
    fixed = profile.iteration_s([(0, 0)], 0, 0)  # the fixed cost of an iteration holding a prefill
    fresh = profile.iteration_s([(2048, 0)], 0, 0) - fixed
    assert fresh == pytest.approx(2048 * PREFILL_S, rel=TOLERANCE)
    behind_cached = profile.iteration_s([(512, 1024)], 0, 0) - fixed
    assert behind_cached == pytest.approx(512 * PREFILL_S, rel=TOLERANCE)
    assert profile.kv_capacity_tokens == KV_BLOCKS * 128  # read back from kv_cache_usage_perc
    assert profile.max_num_seqs == 16

    # The planner, on that profile: one long prompt, then four sequences decoding together.
    prompt = 3968
    alone = simulate([TraceRequest(0, 0.0, prompt, 20, tuple(range(8)))], 1, profile, "round_robin").seqs[0]
    lone_prefill = profile.iteration_s([(prompt, 0)], 0, 0) + profile.request_overhead_s
    assert alone.first_token_s == pytest.approx(lone_prefill)
    assert alone.first_token_s == pytest.approx(prompt * PREFILL_S, rel=TOLERANCE)
    itl = (alone.finished_s - alone.first_token_s) / 19
    assert itl == pytest.approx(DECODE_S, rel=TOLERANCE)
    together = [TraceRequest(i, 0.0, 300, 40, (100 + i,)) for i in range(4)]
    seqs = simulate(together, 1, profile, "round_robin").seqs
    last_first_token = max(s.first_token_s for s in seqs)
    steps = [s for s in seqs if s.finished_s > last_first_token]
    gap = min((s.finished_s - last_first_token) / (40 - 1) for s in steps)
    assert gap == pytest.approx(DECODE_S + 3 * PER_SEQ_S, rel=TOLERANCE)


def test_the_committed_profiles_load_by_name_and_say_where_they_come_from():
    names = profile_names()
    assert {"sim-bench", "vllm-cpu-tiny-qwen", "llama-3.3-70b-h100-tp4"} <= set(names)
    for name in names:
        profile = Profile.load(name)
        assert profile.name == name
        assert profile.source
        assert profile.prefill_per_token_s > 0 and profile.step_fixed_s + profile.decode_per_seq_s > 0
    assert Profile.load("vllm-cpu-tiny-qwen").source.startswith("measured here")
    assert "not measured here" in Profile.load("llama-3.3-70b-h100-tp4").source


def test_up_to_measures_to_the_traffics_lengths_and_refuses_past_the_models(sim_deployment):
    plan = Plan.up_to(12288, 32)
    assert plan.prefill_lengths[-1] == 12288 and 8192 in plan.prefill_lengths
    assert plan.decode_contexts[-1] == 12288 and plan.decode_seqs[-1] == 32
    assert plan.prefix_lengths == (1024, 6144)
    # Prefills beside a quarter of max_num_seqs and all but one decoding (the prefill is the last one admitted).
    assert {seqs for seqs, *_ in plan.mixed} == {8, 31}
    assert {(prompt, cached) for _, _, prompt, cached in plan.mixed} == {
        (4096, 0),
        (7168, 6144),
        (12288, 6144),
    }
    with pytest.raises(CommandError, match="not below the deployment's max_model_len"):
        call_command("profile_engine", "profiled", "--up-to", "4096")


def test_a_median_plan_measures_a_real_engine_as_the_least_does(sim_deployment):
    """Each point the median of its runs (as beside busy neighbours), on the simulator with nothing else running:
    the same configured timing comes out."""
    from dataclasses import replace

    from planner.fit import fit_profile
    from planner.measure import measure
    from planner.profile_engine import QUICK

    url = sim_deployment.pools.get().endpoints.get().url
    plan = replace(QUICK, pick="median", decode_repeats=3)  # the points `profile_engine --quick` measures
    got = measure(url, MODEL_NAME, block_size=128, max_model_len=4096, plan=plan)
    assert len(got.prefill) == 6 and len(got.decode) == 6
    profile = fit_profile(got, Profile()).profile
    assert profile.prefill_per_token_s == pytest.approx(PREFILL_S, rel=TOLERANCE)
    assert profile.step_fixed_s + profile.decode_per_seq_s == pytest.approx(DECODE_S, rel=TOLERANCE)
