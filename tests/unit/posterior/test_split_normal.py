"""The split normal (:class:`blrppl.posterior.split_normal.SplitNormal`), a scale's marginal on a
central composite design: its density, moments, quantiles and draws against each other."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import random

from blrppl.posterior.split_normal import SplitNormal


def test_density_moments_and_quantiles_agree():
    """The density integrates to 1 and gives the closed-form mean and variance (trapezoid
    rule over ±12 sds, 200,001 points); the cdf is the density's integral, the icdf its
    inverse, and the left of the mode holds σ_L / (σ_L + σ_R)."""
    d = SplitNormal(0.3, 0.5, 1.7)
    x = np.linspace(0.3 - 6.0, 0.3 + 21.0, 200_001)
    p = np.exp(np.asarray(d.log_prob(jnp.asarray(x))))
    assert abs(np.trapezoid(p, x) - 1.0) < 1e-9
    mean = np.trapezoid(x * p, x)
    np.testing.assert_allclose(float(d.mean), mean, rtol=1e-8)
    np.testing.assert_allclose(float(d.variance), np.trapezoid((x - mean) ** 2 * p, x), rtol=1e-8)
    np.testing.assert_allclose(float(d.cdf(0.3)), 0.5 / 2.2, rtol=1e-12)
    for q in (0.01, 0.1, 0.5 / 2.2, 0.6, 0.99):
        v = float(d.icdf(q))
        np.testing.assert_allclose(float(d.cdf(v)), q, rtol=1e-10)
        np.testing.assert_allclose(np.trapezoid(p[x <= v], x[x <= v]), q, atol=1e-4)


def test_draws_have_its_moments():
    """400,000 draws: mean within 4 standard errors (sd/√n), variance within 1 %
    (its standard error, √((κ − 1)/n) relative with a kurtosis κ < 5 here, is 0.3 %)."""
    d = SplitNormal(jnp.asarray(-1.0), jnp.asarray(2.0), jnp.asarray(0.5))
    x = np.asarray(d.sample(random.PRNGKey(0), (400_000,)))
    sd = float(jnp.sqrt(d.variance))
    assert abs(x.mean() - float(d.mean)) < 4 * sd / np.sqrt(x.size)
    assert abs(x.var() / float(d.variance) - 1.0) < 0.01
    assert np.all(np.isfinite(x))
