"""The profile fit on measurements made up from a known profile: it gives that profile back."""

from __future__ import annotations

import pytest

from planner.fit import fit_profile, lone_prefill_s, mixed_prefill_s, nonnegative_lstsq
from planner.measure import DecodePoint, Measurements, MixedPoint, Plan, PrefillPoint
from planner.profile import Profile

pytestmark = pytest.mark.unit


# vLLM-like: prefill iterations cost a step, requests an overhead; prompts over 2048 tokens in two chunks.
VLLM_LIKE = Profile(
    step_fixed_s=0.002,
    prefill_per_token_s=6e-6,
    prefill_attention_s=1.3e-5,
    decode_per_seq_s=1e-4,
    decode_per_ktoken_s=2e-4,
    request_overhead_s=0.003,
    max_num_batched_tokens=2048,
)


def made_up(truth: Profile) -> Measurements:
    m = Measurements("http://engine", "m", 128, kv_blocks=1000)
    for computed, cached in [(128, 0), (512, 0), (2048, 0), (3072, 0), (128, 1024), (1024, 2048)]:
        m.prefill.append(PrefillPoint(computed + cached, cached, lone_prefill_s(truth, computed, cached)))
    for n in (1, 2, 4, 8, 16):
        for length in (191, 959, 3007):
            context = n * (length + 32)
            m.decode.append(DecodePoint(n, length, 64, truth.iteration_s([], n, context)))
    return m


@pytest.mark.parametrize(
    "truth",
    [
        VLLM_LIKE,
        # Simulator-like: a prefill costs less fixed time than a decode step.
        Profile(
            step_fixed_s=0.0095,
            prefill_fixed_s=0.005,
            prefill_per_token_s=3e-5,
            decode_per_seq_s=5e-4,
            decode_per_ktoken_s=0.0,
            prefill_attention_s=0.0,
        ),
    ],
)
def test_it_gives_back_the_profile_the_measurements_came_from(truth):
    fit = fit_profile(made_up(truth), Profile(max_num_batched_tokens=truth.max_num_batched_tokens))
    got = fit.profile
    for field in (
        "step_fixed_s",
        "prefill_per_token_s",
        "prefill_attention_s",
        "decode_per_seq_s",
        "decode_per_ktoken_s",
        "request_overhead_s",
    ):
        assert getattr(got, field) == pytest.approx(getattr(truth, field), rel=1e-3, abs=1e-9), field
    if truth.prefill_fixed_s is None:
        assert got.prefill_fixed_s is None
    else:
        assert got.prefill_fixed_s == pytest.approx(truth.prefill_fixed_s, rel=1e-3)
    assert got.kv_capacity_tokens == 128_000
    assert fit.summary()["prefill_max_abs_error"] < 1e-3 and fit.summary()["decode_max_abs_error"] < 1e-3


def test_the_least_squares_keep_bounded_parameters_non_negative():
    a = [[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]]
    y = [3.0, 2.0, 1.0]  # a falling line: the slope would be -1
    x = nonnegative_lstsq(a, y)
    assert x[1] == 0 and x[0] == pytest.approx(2.0)
    free = nonnegative_lstsq(a, y, free=(1,))
    assert free == pytest.approx([4.0, -1.0])


def test_the_time_outside_the_engines_clock_joins_the_request_overhead():
    """Points the engine's TTFT timed, with the client's time beside them: the median difference (the HTTP round
    trip and the server's parsing, which the engine's clock does not hold) is added to the fitted overhead."""
    truth = Profile(
        step_fixed_s=0.002, prefill_per_token_s=6e-6, decode_per_seq_s=1e-4, request_overhead_s=0.0
    )
    m = made_up(truth)
    outside = [0.004, 0.005, 0.006, 0.005, 0.030, 0.005]  # one slow outlier: the median ignores it
    for point, extra in zip(m.prefill, outside, strict=True):
        point.client_s = point.ttft_s + extra
    got = fit_profile(m, Profile()).profile
    assert got.request_overhead_s == pytest.approx(0.005, rel=1e-3)
    assert got.prefill_per_token_s == pytest.approx(truth.prefill_per_token_s, rel=1e-3)
    # Timed by the client alone: nothing to add (the intercept already holds it).
    for point in m.prefill:
        point.timed_by, point.client_s = "client", None
    assert fit_profile(m, Profile()).profile.request_overhead_s == pytest.approx(0.0, abs=1e-9)


def test_mixed_points_check_the_model_without_moving_the_fit():
    """Prefills timed while streams decode are set against the profile (their errors in the summary) and change
    none of its parameters: made up from the profile they read zero, and 30 % slower they read 30 %."""
    truth = VLLM_LIKE
    base = Profile(max_num_batched_tokens=2048)
    plain = made_up(truth)
    assert "mixed_median_abs_error" not in fit_profile(plain, base).summary()
    points = [(8, 1024, 4096, 0), (32, 1024, 7168, 6144), (32, 1024, 12288, 6144)]
    for slower, expected in ((1.0, 0.0), (1.3, 0.3 / 1.3)):
        m = made_up(truth)
        for seqs, context, prompt, cached in points:
            took = slower * mixed_prefill_s(truth, seqs, context, prompt - cached, cached)
            m.mixed.append(MixedPoint(seqs, context, prompt, cached, took))
        fit = fit_profile(m, base)
        assert fit.profile == fit_profile(plain, base).profile
        assert fit.summary()["mixed_median_abs_error"] == pytest.approx(expected, abs=2e-3)
    # A chunk shares the iteration's batched tokens with the decode tokens beside it: 2,048 computed tokens
    # beside 8 decoding sequences take two iterations (2,040 tokens, then 8), after half a decode step's wait.
    expected = (
        truth.request_overhead_s
        + truth.iteration_s([], 8, 8192) / 2
        + truth.iteration_s([(2040, 0)], 8, 8192)
        + truth.iteration_s([(8, 2040)], 8, 8192)
    )
    assert mixed_prefill_s(truth, 8, 1024, 2048, 0) == pytest.approx(expected)
    assert lone_prefill_s(truth, 2048, 0) == pytest.approx(
        truth.request_overhead_s + truth.iteration_s([(2048, 0)], 0, 0)
    )


def test_a_points_repeats_make_the_least_on_a_quiet_machine_and_the_median_beside_busy_engines():
    runs = [0.5, 0.1, 0.3]
    assert Plan().typical(runs) == 0.1
    assert Plan(pick="median").typical(runs) == 0.3
    with pytest.raises(ValueError, match="pick must be one of"):
        Plan(pick="mean")
