"""Pareto-smoothed importance weights and weighted summaries (blrppl.posterior.importance):
hand-worked inputs and outputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from jax import random

from blrppl.posterior.diagnostics import psis_khat
from blrppl.posterior.importance import psis_smooth, resample, weighted_stats


def test_equal_weights_are_returned_as_they_are():
    log_w, k = psis_smooth(np.full(100, 3.7))
    assert k == -math.inf
    np.testing.assert_allclose(np.exp(log_w), np.full(100, 0.01))


def test_a_weight_that_is_not_finite_gives_infinite_khat():
    lw = np.zeros(100)
    lw[3] = np.nan
    assert psis_smooth(lw)[1] == math.inf


@pytest.mark.parametrize("shape", [0.2, 0.5, 0.9])
def test_smoothing_keeps_the_bulk_and_caps_the_tail(shape):
    """Pareto weights of shape k: the smoothed weights sum to one, the draws below the tail
    keep their ratios, the tail is sorted as the raw one, no weight exceeds the largest raw
    one, and k̂ is the diagnostic's (the same generalised Pareto fit)."""
    rng = np.random.default_rng(0)
    raw = np.log(rng.pareto(1.0 / shape, size=4000) + 1.0)
    log_w, k = psis_smooth(raw)
    assert k == pytest.approx(psis_khat(raw))
    tail = int(math.ceil(min(0.2 * raw.size, 3 * math.sqrt(raw.size))))
    # (the shape's estimate from M exceedances has sd ≈ (1 + k)/√M: three of them)
    assert abs(k - shape) < 3 * (1 + shape) / math.sqrt(tail)
    w = np.exp(log_w)
    assert w.sum() == pytest.approx(1.0)
    order = np.argsort(raw)
    bulk, top = order[:-tail], order[-tail:]
    np.testing.assert_allclose(log_w[bulk] - log_w[bulk[0]], raw[bulk] - raw[bulk[0]], atol=1e-12)
    assert np.all(np.diff(log_w[top]) >= -1e-12)
    assert np.max(log_w - log_w[bulk[0]]) <= np.max(raw - raw[bulk[0]]) + 1e-12


def test_smoothing_lowers_the_variance_of_a_heavy_tailed_estimate():
    """The mean of x under weights w ∝ Pareto(k = 0.6) draws over 200 repetitions: the
    smoothed estimate's spread is below the raw one's (what smoothing is for)."""
    rng = np.random.default_rng(1)
    raw_est, smooth_est = [], []
    for _ in range(200):
        lw = np.log(rng.pareto(1 / 0.6, size=1000) + 1.0)
        x = rng.normal(size=1000) + lw  # (x correlates with the weight)
        w = np.exp(lw - lw.max())
        raw_est.append(np.sum(w * x) / w.sum())
        smooth_est.append(np.sum(np.exp(psis_smooth(lw)[0]) * x))
    assert np.std(smooth_est) < np.std(raw_est)


def test_weighted_stats_of_equal_weights_are_the_draws_own():
    x = np.arange(1.0, 11.0)[:, None] * np.array([1.0, -2.0])
    s = weighted_stats(x, np.full(10, -math.log(10)), 0.8)
    np.testing.assert_allclose(s["mean"], [5.5, -11.0])
    np.testing.assert_allclose(s["sd"], x.std(0))
    # (the weighted quantile is the first draw whose cumulative weight reaches q)
    np.testing.assert_allclose(s["median"], [5.0, -12.0])
    np.testing.assert_allclose(s["10.0%"], [1.0, -20.0])
    np.testing.assert_allclose(s["90.0%"], [9.0, -4.0])


def test_a_weight_of_two_counts_as_a_repeated_draw():
    """Weights (2, 1, 1) over (0, 1, 3) are the draws (0, 0, 1, 3) equally weighted."""
    s = weighted_stats(np.array([0.0, 1.0, 3.0]), np.log(np.array([0.5, 0.25, 0.25])), 0.5)
    assert float(s["mean"]) == pytest.approx(1.0)
    assert float(s["sd"]) == pytest.approx(np.std([0.0, 0.0, 1.0, 3.0]))
    assert float(s["median"]) == 0.0


def test_resampling_draws_by_weight():
    draws = {"a": np.array([10.0, 20.0, 30.0])}
    out = resample(random.PRNGKey(0), draws, np.log(np.array([0.0, 0.25, 0.75]) + 1e-300), 20000)
    counts = np.array([(out["a"] == v).mean() for v in (10.0, 20.0, 30.0)])
    assert counts[0] == 0.0
    # (binomial sd of a share at 20,000 draws: 0.003)
    np.testing.assert_allclose(counts[1:], [0.25, 0.75], atol=0.015)
