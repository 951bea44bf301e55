"""Latents on constrained supports fitted as Gaussians on their unconstrained space:
interval, ordered vector, correlation Cholesky factor (positive and simplex are covered by
the non-conjugate tests). References are grid integrals of the exact posterior."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from blrppl import blr_fit

RNG = np.random.default_rng(0)
Y = RNG.normal(0.5, 1.0, 20)
Y2 = RNG.multivariate_normal([0.0, 0.0], [[1.0, 0.6], [0.6, 1.0]], 50)
NUM_DRAWS = 20_000


def interval(y):
    p = numpyro.sample("p", dist.Uniform(-1.0, 3.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(p, 1.0), obs=y)


def ordered(y):
    c = numpyro.sample("c", dist.ImproperUniform(dist.constraints.ordered_vector, (), (2,)))
    numpyro.factor("prior", -0.5 * jnp.sum(c**2) / 9.0)
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(c[0], 1.0), obs=y)
        numpyro.sample("y_shifted", dist.Normal(c[1], 1.0), obs=y + 2.0)


def correlation(y):
    chol = numpyro.sample("L", dist.LKJCholesky(2, 2.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.MultivariateNormal(jnp.zeros(2), scale_tril=chol), obs=y)


def grid_moments(grid, logp):
    w = np.exp(logp - logp.max())
    w /= w.sum()
    mean = np.sum(w * grid)
    return mean, np.sqrt(np.sum(w * (grid - mean) ** 2))


def reference(name):
    """Mean and sd of one scalar of the exact posterior, by a 1-D grid."""
    if name == "interval":
        grid = np.linspace(-1 + 1e-9, 3 - 1e-9, 400_001)
        logp = -0.5 * np.sum((Y[:, None] - grid) ** 2, 0)
        return grid_moments(grid, logp)
    if name == "ordered":
        # c0 < c1 with c1 − c0 ≈ 2 ± 0.3: the order constraint is inactive to many sd, so c0's
        # posterior is the Gaussian N(Σy / (n + 1/9), 1 / (n + 1/9))
        prec = Y.size + 1 / 9.0
        return Y.sum() / prec, np.sqrt(1 / prec)
    # correlation r of a 2×2 LKJ(2) Cholesky factor: density ∝ (1 − r²)^(η−1), unit variances
    grid = np.linspace(-1 + 1e-6, 1 - 1e-6, 200_001)
    s11, s22, s12 = np.sum(Y2[:, 0] ** 2), np.sum(Y2[:, 1] ** 2), np.sum(Y2[:, 0] * Y2[:, 1])
    n = Y2.shape[0]
    det = 1 - grid**2
    logp = np.log(det) * (2.0 - 1.0) - 0.5 * n * np.log(det) - 0.5 * (s11 + s22 - 2 * grid * s12) / det
    return grid_moments(grid, logp)


CASES = {
    "interval": (interval, (Y,), lambda d: d["p"]),
    "ordered": (ordered, (Y,), lambda d: d["c"][:, 0]),
    "correlation": (correlation, (Y2,), lambda d: d["L"][:, 1, 0]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_constrained_latent_matches_exact_posterior(name):
    model, data, scalar = CASES[name]
    res = blr_fit(model, data, progress_bar=False)
    assert res.converged, res.message
    draws = res.sample(jax.random.key(0), NUM_DRAWS)
    site = next(iter(draws))
    assert res.plan.block(site).transform is not None  # fitted on the unconstrained space
    x = np.asarray(scalar(draws))
    mean, sd = reference(name)
    # Monte Carlo messages and a Gaussian on the unconstrained space: 0.25 sd, sd within 25 %
    assert abs(x.mean() - mean) / sd < 0.25, (x.mean(), mean, sd)
    assert abs(x.std() / sd - 1) < 0.25, (x.std(), sd)
    support = res.posterior[site].support
    assert bool(jnp.all(support(jnp.asarray(draws[site]))))


def per_step_interval(y):
    """A probability drawn at each step of a ``scan`` (its Uniform's bounds stacked per step,
    one pair per element) read through ``clamp_probs``: no closed form."""
    from numpyro.contrib.control_flow import scan

    def step(carry, y_t):
        p = numpyro.sample("p", dist.Uniform(0.0, 1.0))
        with numpyro.plate("n", y_t.shape[0]):
            numpyro.sample("y", dist.Bernoulli(dist.util.clamp_probs(0.9 * p)), obs=y_t)
        return carry, None

    scan(step, 0.0, y)


def test_interval_bounds_stacked_by_scan_match_exact_posteriors():
    y = (RNG.random((6, 20)) < 0.5).astype(np.int32)
    res = blr_fit(per_step_interval, {"y": y}, rng_key=jax.random.PRNGKey(0), progress_bar=False)
    assert res.plan.block("p").transform is not None
    draws = np.asarray(res.sample(jax.random.PRNGKey(1), NUM_DRAWS)["p"])
    grid = np.linspace(1e-6, 1 - 1e-6, 20_001)
    for t, (hits, n) in enumerate(zip(y.sum(1), [y.shape[1]] * y.shape[0])):
        mean, sd = grid_moments(grid, hits * np.log(0.9 * grid) + (n - hits) * np.log1p(-0.9 * grid))
        # (each step's posterior is a smooth unimodal density: a tenth of its sd, 10 %)
        assert abs(draws[:, t].mean() - mean) / sd < 0.1, (t, draws[:, t].mean(), mean, sd)
        assert abs(draws[:, t].std() / sd - 1) < 0.1, (t, draws[:, t].std(), sd)
