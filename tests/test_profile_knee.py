"""Knee detection on synthetic latency curves, and the budget recommended from it."""

from __future__ import annotations

import numpy as np
import pytest

from tokq.profiling.knee import fit_knee, recommend_budget, throughput_saturation

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


def test_recommendation_is_the_fastest_measured_batch_within_twice_the_flat_latency():
    latency = hinge_ms(GRID, 10.0, 600, 10.0 / 600)
    fit = fit_knee(GRID, latency)
    rec = recommend_budget(GRID, latency, fit)
    assert rec.max_batch_ms == pytest.approx(2 * fit.flat_ms)
    # 1024 tokens take ~17 ms, 2048 ~34 ms: 1024 is the largest within 20 ms
    assert rec.budget_tokens == 1024
    assert rec.latency_ms <= rec.max_batch_ms
    assert rec.tokens_per_s == pytest.approx(1024 / (latency[GRID == 1024][0] / 1000))


def test_explicit_ceiling_and_throughput_peak_are_respected():
    latency = hinge_ms(GRID, 10.0, 600, 10.0 / 600)
    latency[GRID == 4096] *= 3  # a slow point (e.g. a cache cliff): not the best throughput
    fit = fit_knee(GRID, latency)
    rec = recommend_budget(GRID, latency, fit, max_batch_ms=300.0)
    assert rec.budget_tokens == 16384 or latency[GRID == rec.budget_tokens][0] <= 300.0
    assert rec.budget_tokens != 4096
    tokens_per_s = GRID / latency * 1000
    assert rec.tokens_per_s == pytest.approx(tokens_per_s[latency <= 300.0].max())


def test_no_budget_when_the_ceiling_is_below_every_batch():
    latency = hinge_ms(GRID, 10.0, 600, 10.0 / 600)
    rec = recommend_budget(GRID, latency, fit_knee(GRID, latency), max_batch_ms=1.0)
    assert rec.budget_tokens is None and "--max-batch-ms" in rec.reason


def test_flat_curve_recommends_the_largest_batch_and_says_the_grid_may_be_too_small():
    latency = np.full(GRID.size, 5.0)
    rec = recommend_budget(GRID, latency, fit_knee(GRID, latency))
    assert rec.budget_tokens == 16384 and "larger grid" in rec.reason


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
