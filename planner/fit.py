"""Fit a profile's parameters to an engine's measurements (planner.measure), by least squares (plain Python: a
few columns and a few dozen points).

The profile's iteration model (planner/profile.py) is linear in its parameters, so each measurement is one row of a
linear system:

- a decode gap with `n` sequences reading `c` context tokens in all: step_fixed + n * decode_per_seq + decode_per_ktoken * c / 1000;
- a prefill of `t` new tokens after `k` cached ones, in chunks of at most max_num_batched_tokens: per chunk
  step_fixed, plus t * prefill_per_token + prefill_attention * (sum over its tokens of the context before) / 1000,
  plus the request's overhead (HTTP, parsing: the answer's latency holds it, the engine's iterations do not); or,
  for an engine whose prefills cost less fixed time than a decode step, prefill_fixed in place of step_fixed.
  Points the engine's own TTFT timed add to that overhead what lies outside its clock: the client's time less
  the engine's (the HTTP round trip, the server's parsing and serialisation), their median.

Mixed points (a prefill sent while streams decode) are not fitted: they check the model, that an iteration holding
both costs what the two parts cost (`mixed_*_abs_error` in the summary).

Decode first (its gaps hold no request overhead), then prefill with step_fixed known. Every parameter is at least 0:
of the subsets of columns whose unconstrained fit is non-negative, the one with the least squared error wins (a
handful of columns, so trying every subset is cheap and exact).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from itertools import combinations

from .measure import Measurements
from .profile import Profile

Matrix = list[list[float]]


def lstsq(a: Matrix, y: list[float]) -> list[float] | None:
    """Least squares by the normal equations, columns scaled to unit length first; None when they are not
    independent. Enough for the handful of columns and points here."""
    cols = len(a[0])
    scale = [math.sqrt(sum(row[c] ** 2 for row in a)) or 1.0 for c in range(cols)]
    scaled = [[row[c] / scale[c] for c in range(cols)] for row in a]
    # [A'A | A'y], solved by Gaussian elimination with partial pivoting.
    m = [
        [sum(r[i] * r[j] for r in scaled) for j in range(cols)]
        + [sum(r[i] * v for r, v in zip(scaled, y, strict=True))]
        for i in range(cols)
    ]
    for c in range(cols):
        pivot = max(range(c, cols), key=lambda r: abs(m[r][c]))
        if abs(m[pivot][c]) < 1e-12:
            return None
        m[c], m[pivot] = m[pivot], m[c]
        for r in range(cols):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * z for x, z in zip(m[r], m[c], strict=True)]
    return [m[c][cols] / m[c][c] / scale[c] for c in range(cols)]


def nonnegative_lstsq(a: Matrix, y: list[float], free: tuple[int, ...] = ()) -> list[float]:
    """min |a x - y| subject to x >= 0 except for the `free` columns, for a few columns: the best fit over the
    subsets of the other columns whose unconstrained fit is non-negative."""
    cols = len(a[0])
    bounded = [c for c in range(cols) if c not in free]
    best, best_err = [0.0] * cols, math.inf
    for size in range(len(bounded) + 1):
        for chosen in combinations(bounded, size):
            subset = sorted((*free, *chosen))
            if not subset:
                continue
            x = lstsq([[row[c] for c in subset] for row in a], y)
            if x is None or any(v < 0 for c, v in zip(subset, x, strict=True) if c not in free):
                continue
            full = [0.0] * cols
            for c, v in zip(subset, x, strict=True):
                full[c] = v
            err = sum((predict(row, full) - v) ** 2 for row, v in zip(a, y, strict=True))
            if err < best_err:
                best, best_err = full, err
    return best


def predict(row: list[float], x: list[float]) -> float:
    return sum(r * v for r, v in zip(row, x, strict=True))


def prefill_features(computed: int, cached: int, chunk: int) -> tuple[int, float]:
    """(iterations, attention in token-ktokens) of a prefill of `computed` tokens after `cached` ones."""
    iterations, attention, before, left = 0, 0.0, cached, computed
    while left > 0:
        take = min(left, chunk)
        iterations += 1
        attention += take * (before + take / 2) / 1000
        before += take
        left -= take
    return iterations, attention


@dataclass
class Fit:
    profile: Profile
    prefill_errors: list[float]  # per point: (predicted - measured) / measured
    decode_errors: list[float]
    mixed_errors: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        def worst(errors: list[float]) -> float:
            return round(max((abs(e) for e in errors), default=0.0), 4)

        def median(errors: list[float]) -> float:
            return round(statistics.median(abs(e) for e in errors), 4) if errors else 0.0

        return {
            "prefill_median_abs_error": median(self.prefill_errors),
            "prefill_max_abs_error": worst(self.prefill_errors),
            "decode_median_abs_error": median(self.decode_errors),
            "decode_max_abs_error": worst(self.decode_errors),
        } | (
            {
                "mixed_median_abs_error": median(self.mixed_errors),
                "mixed_max_abs_error": worst(self.mixed_errors),
            }
            if self.mixed_errors
            else {}
        )


def fit_profile(m: Measurements, base: Profile) -> Fit:
    """`base` with its timing and KV capacity replaced by what `m` shows (its other fields kept)."""
    if not m.decode or not m.prefill:
        raise ValueError("a fit needs decode and prefill measurements")
    # Decode: gap = step_fixed + n * per_seq + per_ktoken * context / 1000, context at the stream's middle.
    a = [[1.0, d.seqs, d.seqs * (d.prompt_tokens + d.output_tokens / 2) / 1000] for d in m.decode]
    y = [d.itl_s for d in m.decode]
    x = nonnegative_lstsq(a, y)
    step_fixed, per_seq, per_ktoken = x
    decode_errors = [(predict(row, x) - v) / v for row, v in zip(a, y, strict=True)]

    chunk = base.max_num_batched_tokens
    rows, y2 = [], []
    for p in m.prefill:
        iterations, attention = prefill_features(p.prompt_tokens - p.cached_tokens, p.cached_tokens, chunk)
        rows.append([1.0, p.prompt_tokens - p.cached_tokens, attention])
        y2.append(p.ttft_s - iterations * step_fixed)
    # The intercept is left free, so that the per-token terms are not bent to make up for it. Above nothing, it
    # is the request's overhead; below, the engine charges a prefill less than a decode step's fixed cost (the
    # simulator runs prefills beside the decode steps, with a fixed cost of their own): prefill_fixed_s.
    intercept, per_token, attention_s = nonnegative_lstsq(rows, y2, free=(0,))
    # Outside the engine's clock: the HTTP round trip and the server's parsing and serialisation, the median of
    # the client's time less the engine's over the points both timed.
    outside = [p.client_s - p.ttft_s for p in m.prefill if p.timed_by == "engine" and p.client_s is not None]
    http_s = max(0.0, statistics.median(outside)) if outside else 0.0
    changes = {
        "step_fixed_s": _round(step_fixed),
        "decode_per_seq_s": _round(per_seq),
        "decode_per_ktoken_s": _round(per_ktoken),
        "request_overhead_s": _round(max(0.0, intercept) + http_s),
        "prefill_fixed_s": None if intercept >= 0 else _round(max(0.0, step_fixed + intercept)),
        "prefill_per_token_s": _round(per_token),
        "prefill_attention_s": _round(attention_s),
    }
    if m.kv_blocks:
        changes["kv_capacity_tokens"] = m.kv_blocks * m.block_size
    profile = base.with_(**changes)
    prefill_errors = [
        (lone_prefill_s(profile, p.prompt_tokens - p.cached_tokens, p.cached_tokens) - measured) / measured
        for p in m.prefill
        for measured in [client_time(p)]
    ]
    mixed_errors = [
        (
            mixed_prefill_s(profile, x.seqs, x.context, x.prompt_tokens - x.cached_tokens, x.cached_tokens)
            - measured
        )
        / measured
        for x in m.mixed
        for measured in [client_time(x)]
    ]
    return Fit(profile, prefill_errors, decode_errors, mixed_errors)


def client_time(point) -> float:
    """A prefill point's time as its client saw it (what the profile's request overhead covers): the client's clock
    where the engine's timed the point and the client's was kept, else the one it was timed by."""
    return point.client_s if point.timed_by == "engine" and point.client_s is not None else point.ttft_s


def lone_prefill_s(profile: Profile, computed: int, cached: int) -> float:
    """The profile's time to the first token of a request alone on its engine: its overhead, then its chunks."""
    return profile.request_overhead_s + chunks_s(profile, computed, cached, 0, 0)


def mixed_prefill_s(profile: Profile, seqs: int, context: int, computed: int, cached: int) -> float:
    """The profile's time to the first token of a request sent while `seqs` sequences of `context` tokens each
    decode: its overhead, half a decode step (it arrives during one), then its chunks beside their decode tokens."""
    half_step = profile.iteration_s([], seqs, seqs * context) / 2
    return profile.request_overhead_s + half_step + chunks_s(profile, computed, cached, seqs, seqs * context)


def chunks_s(profile: Profile, computed: int, cached: int, seqs: int, context: int) -> float:
    """The iterations that compute `computed` prompt tokens after `cached` ones, each beside `seqs` decoding
    sequences reading `context` tokens in all, whose decode tokens take as many of the iteration's budget."""
    t, before, left = 0.0, cached, computed
    while left > 0:
        take = min(left, profile.max_num_batched_tokens - seqs)
        t += profile.iteration_s([(take, before)], seqs, context)
        before += take
        left -= take
    return t


def _round(value: float) -> float:
    """Four significant figures: more than the measurements hold."""
    return float(f"{float(value):.4g}")
