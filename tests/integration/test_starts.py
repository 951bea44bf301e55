"""A regression whose noise sd has Stan's half-t prior, written as posteriordb's ports write it,
``dist.FoldedDistribution(dist.StudentT(3, 0, 10))`` (the diamonds model): it was refused with
"invalid scale parameter ... at the model's starting point", the folded distribution's base
mean, 0, being its start. It fits, and matches the exact posterior.

The reference is exact up to a 1-D grid: given σ the coefficients are conjugate, so
p(σ | y) ∝ p(σ) N(y | 0, σ² I + 10² X̃ X̃ᵀ) and E[β | y] = ∫ p(σ | y) E[β | σ, y] dσ.
"""

from __future__ import annotations

import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from scipy import stats

from blrppl import blr_fit

RNG = np.random.default_rng(0)
X = RNG.normal(size=(50, 3))
Y = 1.0 + X @ np.array([0.5, -1.0, 2.0]) + 0.7 * RNG.normal(size=50)


def regression(X, y=None):
    a = numpyro.sample("a", dist.Normal(0.0, 10.0))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.FoldedDistribution(dist.StudentT(3.0, 0.0, 10.0)))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Normal(a + X @ b, sigma), obs=y)


def exact_posterior():
    """Means and sds of (a, b) and σ, by a grid over σ (the posterior's mass lies in (0.4, 1.2))."""
    design = np.column_stack([np.ones(len(Y)), X])
    grid = np.linspace(0.3, 1.5, 2001)
    log_post, means, seconds = [], [], []
    for s in grid:
        cov = s**2 * np.eye(len(Y)) + 100.0 * design @ design.T
        log_post.append(stats.multivariate_normal(np.zeros(len(Y)), cov).logpdf(Y) + stats.t(3, 0, 10).logpdf(s))
        precision = design.T @ design / s**2 + np.eye(4) / 100.0
        cond_cov = np.linalg.inv(precision)
        m = cond_cov @ design.T @ Y / s**2
        means.append(m)
        seconds.append(cond_cov + np.outer(m, m))
    w = np.exp(np.array(log_post) - max(log_post))
    w /= w.sum()
    mean = w @ np.array(means)
    sd = np.sqrt(np.einsum("g,gii->i", w, np.array(seconds)) - mean**2)
    s_mean = w @ grid
    return mean, sd, s_mean, np.sqrt(w @ grid**2 - s_mean**2)


def test_half_t_noise_prior_fits_the_exact_posterior():
    """Means within 0.1 posterior sd and sds within 10 %: q is one Gaussian on (a, b, log σ),
    whose sd of σ is some 7 % below the exact one here; 20,000 draws put a Monte Carlo error of
    0.007 sd on each mean."""
    result = blr_fit(regression, (X, Y), rng_key=random.PRNGKey(0), progress_bar=False)
    assert result.converged, result.message
    draws = result.sample(random.PRNGKey(1), 20_000)
    fitted = np.concatenate([np.asarray(draws["a"])[:, None], np.asarray(draws["b"])], axis=1)
    mean, sd, s_mean, s_sd = exact_posterior()
    np.testing.assert_allclose(fitted.mean(0), mean, atol=0.1 * sd.min())
    np.testing.assert_allclose(fitted.std(0), sd, rtol=0.1)
    sigma = np.asarray(draws["sigma"])
    assert abs(sigma.mean() - s_mean) < 0.1 * s_sd
    np.testing.assert_allclose(sigma.std(), s_sd, rtol=0.1)
