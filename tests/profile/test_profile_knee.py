"""Knee detection on synthetic latency curves, and the budget recommended from it."""

from __future__ import annotations

import numpy as np
import pytest

from tokq.profiling.profile.knee import fit_knee, recommend_budget, throughput_saturation

GRID = 16 * 2.0 ** np.arange(11)  # 16 ... 16384, one point per doubling


def hinge_ms(tokens, flat_ms, knee_tokens, ms_per_token):
    return flat_ms + ms_per_token * np.maximum(0.0, tokens - knee_tokens)


def noisy(latency_ms, noise_fraction, seed):
    return latency_ms * np.exp(np.random.default_rng(seed).normal(0.0, noise_fraction, latency_ms.size))


def within_one_grid_step(found, true):
    return abs(np.log2(found / true)) <= 1.0


@pytest.mark.parametrize("seed", range(5))
def test_knee_of_noisy_flat_then_linear_curve_is_found_within_one_grid_step(seed):
    latency = noisy(hinge_ms(GRID, 10.0, 600, 10.0 / 600), 0.05, seed)
    fit = fit_knee(GRID, latency)
    assert fit.kind == "knee"
    assert within_one_grid_step(fit.knee_tokens, 600)
    assert fit.flat_ms == pytest.approx(10.0, rel=0.1)
    assert fit.slope_ms_per_token == pytest.approx(10.0 / 600, rel=0.25)


def test_noise_free_knee_is_exact():
    fit = fit_knee(GRID, hinge_ms(GRID, 4.0, 1500, 0.002))
    assert fit.kind == "knee"
    assert fit.knee_tokens == pytest.approx(1500, rel=0.02)
    assert fit.predict_ms(np.array([100.0, 8000.0])) == pytest.approx([4.0, 4.0 + 0.002 * 6500], rel=1e-3)


@pytest.mark.parametrize("seed", range(3))
def test_pure_linear_curve_has_no_knee(seed):
    fit = fit_knee(GRID, noisy(0.02 * GRID, 0.03, seed))
    assert fit.kind == "linear" and fit.knee_tokens is None
    assert "no flat stretch" in fit.reason


@pytest.mark.parametrize("seed", range(3))
def test_pure_flat_curve_has_no_knee(seed):
    fit = fit_knee(GRID, noisy(np.full(GRID.size, 5.0), 0.05, seed))
    assert fit.kind == "flat" and fit.knee_tokens is None
    assert "beyond the largest batch" in fit.reason
    assert fit.flat_ms == pytest.approx(5.0, rel=0.1)


@pytest.mark.parametrize("seed", range(3))
def test_knee_at_the_top_edge_of_the_grid(seed):
    # Only the last point is past the knee: still found, never placed beyond the grid.
    latency = noisy(hinge_ms(GRID, 10.0, 8192, 10.0 / 8192), 0.03, seed)
    fit = fit_knee(GRID, latency)
    assert fit.kind == "knee"
    assert within_one_grid_step(fit.knee_tokens, 8192) and fit.knee_tokens < GRID[-1]


@pytest.mark.parametrize("seed", range(3))
def test_knee_at_the_bottom_edge_is_found_or_said_to_be_below_the_grid(seed):
    latency = noisy(hinge_ms(GRID, 1.0, 24, 1.0 / 24), 0.03, seed)
    fit = fit_knee(GRID, latency)
    if fit.kind == "knee":
        assert within_one_grid_step(fit.knee_tokens, 24)
    else:
        assert fit.kind == "linear" and "below" in fit.reason


# -- the budget: a latency goal and where throughput stops growing ------------------------------

def grid(points_per_doubling: int, lo: float = 16, hi: float = 16384) -> np.ndarray:
    n = int(round(np.log2(hi / lo) * points_per_doubling))
    return np.round(lo * 2.0 ** (np.arange(n + 1) / points_per_doubling))


def cpu_line_ms(tokens):
    """all-MiniLM-L6-v2 on this CPU (profiling/results/model.md): 2.7 ms per forward + 0.25 ms per token."""
    return 2.7 + 0.25 * tokens


@pytest.mark.parametrize("points_per_doubling", [1, 2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_gpu_shaped_curve_lands_at_or_just_past_the_knee(points_per_doubling, seed):
    # Voyage's A100 shape: flat to ~600 tokens, then compute-bound (cost per token constant).
    # Noise 2% (medians of many CUDA-event timings are steadier); at 5%, ~1 run in 6 lands two
    # grid steps past, from the fit's error.
    x = grid(points_per_doubling)
    latency = noisy(hinge_ms(x, 12.0, 600, 12.0 / 600), 0.02, seed)
    rec = recommend_budget(x, latency, fit_knee(x, latency), slo_p99_ms=500.0)
    step = 2.0 ** (1 / points_per_doubling)
    assert 600 / step < rec.token_budget <= 600 * step * 1.001, rec  # at the knee or one grid step past
    assert rec.limited_by == "throughput" and rec.latency_cap_tokens > rec.token_budget
    assert rec.latency_ms <= 12.0 * step * 1.1  # the flat latency, or one grid step past it


def test_gpu_shaped_curve_under_a_tight_goal_is_limited_by_the_goal():
    x = grid(2)
    latency = hinge_ms(x, 12.0, 600, 12.0 / 600)
    rec = recommend_budget(x, latency, fit_knee(x, latency), slo_p99_ms=20.0)  # a forward may take 10 ms: below the flat part
    assert rec.token_budget is None and rec.limited_by is None and "--slo-p99-ms" in rec.reason
    rec = recommend_budget(x, latency, fit_knee(x, latency), slo_p99_ms=26.0)  # 13 ms: just past the knee
    assert rec.limited_by == "latency goal" and rec.max_batch_ms == 13.0
    assert rec.token_budget == x[latency <= 13.0].max() == 512 and rec.throughput_cap_tokens == 724


@pytest.mark.parametrize("seed", range(3))
def test_cpu_shaped_curve_is_capped_where_throughput_stops_growing(seed):
    # No flat part: the fixed cost per forward matters less as batches grow, until it stops mattering.
    x = grid(2, 16, 8192)
    latency = noisy(cpu_line_ms(x), 0.02, seed)
    rec = recommend_budget(x, latency, fit_knee(x, latency), slo_p99_ms=500.0)
    true_tokens, _ = throughput_saturation(x, cpu_line_ms(x), 0.95)  # 256 on this grid (205 exactly)
    assert rec.limited_by == "throughput"
    assert true_tokens / 2 ** 0.5 <= rec.token_budget <= true_tokens
    # The old rule (the best throughput within 2x the smallest batch's latency) gave 45 tokens here;
    # the goal would allow ~1,000 (250 ms), but past ~200 a bigger batch buys little throughput.
    assert rec.latency_cap_tokens in (724, 1024)


def test_cpu_shaped_curve_under_a_tight_goal_is_limited_by_the_goal():
    x = grid(1, 16, 8192)
    rec = recommend_budget(x, cpu_line_ms(x), fit_knee(x, cpu_line_ms(x)), slo_p99_ms=40.0)  # 20 ms per forward: up to 69 tokens
    assert (rec.token_budget, rec.limited_by, rec.latency_cap_tokens) == (64, "latency goal", 64)
    assert rec.throughput_cap_tokens > 64 and "40 ms" in rec.reason


def test_a_slow_point_caps_every_larger_batch():
    x = grid(1, 16, 8192)
    latency = cpu_line_ms(x)
    latency[x == 512] = 400.0  # over the 250 ms a 500 ms goal allows (e.g. a cache cliff)
    rec = recommend_budget(x, latency, fit_knee(x, latency), slo_p99_ms=500.0)
    assert rec.latency_cap_tokens == 256 and rec.token_budget <= 256


def test_flat_curve_takes_the_largest_batch_and_says_the_grid_may_be_too_small():
    rec = recommend_budget(GRID, np.full(GRID.size, 5.0), fit_knee(GRID, np.full(GRID.size, 5.0)))
    assert rec.token_budget == 16384 and rec.limited_by == "grid" and "--max-tokens" in rec.reason


@pytest.mark.parametrize("stopped, says", [
    ("a 181-token batch took 11 ms, over the 8 ms bound", "a larger --stop-ms may find a bigger budget"),
    ("out of memory at 32768 tokens (OutOfMemoryError)", "larger batches ran out of memory"),
])
def test_a_sweep_cut_short_names_what_cut_it_not_max_tokens(stopped, says):
    rec = recommend_budget(GRID, np.full(GRID.size, 5.0), fit_knee(GRID, np.full(GRID.size, 5.0)),
                           stopped_reason=stopped)
    assert rec.limited_by == "grid" and says in rec.reason and "--max-tokens" not in rec.reason


def test_goal_must_be_positive():
    with pytest.raises(ValueError, match="goal"):
        recommend_budget(GRID, hinge_ms(GRID, 10.0, 600, 0.01), slo_p99_ms=0.0)


@pytest.mark.parametrize("tokens, latency", [([16, 32], [1.0, 2.0]), ([16, 32, 64], [1.0, 0.0, 2.0]),
                                             ([16, 32, 64], [1.0, 2.0])])
def test_bad_input_is_refused(tokens, latency):
    with pytest.raises(ValueError):
        fit_knee(np.array(tokens, float), np.array(latency, float))


def test_throughput_saturation_is_the_first_batch_near_the_peak():
    latency = hinge_ms(GRID, 10.0, 600, 10.0 / 600)  # 512 tokens: 85% of the peak, 1024: all of it
    tokens, peak = throughput_saturation(GRID, latency, fraction=0.9)
    tokens_per_s = GRID / latency * 1000
    assert peak == pytest.approx(tokens_per_s.max())
    assert tokens_per_s[GRID == tokens][0] >= 0.9 * peak
    assert tokens_per_s[GRID < tokens].max() < 0.9 * peak and tokens == 1024


# :g writes 10000 as '1e+04': a 10 s goal or a 1.5 s forward must print plainly, small values as before.
@pytest.mark.parametrize("value, digits, text", [(0.93, 4, "0.93"), (22.0, 4, "22"), (0.04475, 4, "0.04475"),
                                                 (5000.0, 4, "5,000"), (10_000.0, 4, "10,000"),
                                                 (12_345.6, 4, "12,346"), (1e9, 4, "1,000,000,000"),
                                                 (1500.0, 3, "1,500"), (1.26, 3, "1.26"), (1e-6, 4, "1e-06")])
def test_numbers_print_plainly(value, digits, text):
    from tokq.profiling.profile.knee import plain

    assert plain(value, digits) == text


def test_a_10_second_goal_and_a_1500_ms_forward_are_not_in_e_notation():
    latency = np.full(GRID.size, 1500.0)
    fit = fit_knee(GRID, latency)
    rec = recommend_budget(GRID, latency, fit, slo_p99_ms=10_000.0)
    assert "of 1,500 ms up to" in fit.reason
    assert "p99 <= 10,000 ms allows 5,000 ms per forward" in rec.reason and "e+" not in rec.reason
