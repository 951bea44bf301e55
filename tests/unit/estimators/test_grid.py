"""Factors of a few scalars without a closed form: a tensor Gauss–Hermite rule over their
neighbours' scalars (``quadrature`` with no projections), deterministic where Monte Carlo
was noisy.

A factor with no closed form and no linked affine projections whose continuous neighbours
are Gaussian blocks of at most four scalars in all has E_q[log f] = Σ_k w_k log f(m + L z_k)
over a tensor grid of nodes z_k: its fixed point is the optimum of that ELBO, computed here
in numpy with a finer rule and scipy's optimiser.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from numpyro.contrib.control_flow import scan

from blrppl import blr_fit
from blrppl.estimators.quadrature import GRID_NODES

Y, NOISE = 0.8, 0.3


def tanh_model(y):
    """y ~ Normal(tanh(a) + b, s): the location is opaque ('tanh' of a latent), a and b one
    joint Gaussian (a dense 2 × 2 covariance)."""
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    numpyro.sample("y", dist.Normal(jnp.tanh(a) + b, NOISE), obs=y)


def _tanh_elbo_optimum(nodes=40):
    """argmax over q = N(m, L Lᵀ) of E_q[log p(a) + log p(b) + log p(y | a, b)] + ½ log|L Lᵀ|."""
    from scipy.optimize import minimize

    t, w = np.polynomial.hermite_e.hermegauss(nodes)
    w = w / w.sum()
    z = np.stack(np.meshgrid(t, t, indexing="ij"), -1).reshape(-1, 2)
    wz = np.outer(w, w).reshape(-1)

    def negative(p):
        m, chol = p[:2], np.array([[np.exp(p[2]), 0.0], [p[3], np.exp(p[4])]])
        x = m + z @ chol.T
        cov = chol @ chol.T
        prior = -0.5 * (m @ m + np.trace(cov))
        lik = -0.5 * wz @ (Y - np.tanh(x[:, 0]) - x[:, 1]) ** 2 / NOISE**2
        return -(prior + lik + p[2] + p[4])

    best = minimize(negative, np.array([0.3, 0.3, -1.0, 0.0, -1.0]), method="BFGS", options={"gtol": 1e-12})
    m, chol = best.x[:2], np.array([[np.exp(best.x[2]), 0.0], [best.x[3], np.exp(best.x[4])]])
    return m, chol @ chol.T


def test_opaque_factor_of_two_scalars_is_the_optimum_of_its_quadrature_elbo():
    fit = blr_fit(tanh_model, {"y": Y}, rng_key=random.PRNGKey(0), tol=1e-30, num_steps=500, progress_bar=False)
    plan = fit.plan.describe()
    (factor,) = [f for f in fit.plan.factors if f.name == "y"]
    assert factor.estimator == "quadrature" and not factor.spec.links, plan
    assert len(fit.plan.blocks) == 1 and fit.plan.blocks[0].size == 2, plan  # (a, b) joint
    got_mean = [float(fit.posterior[s].mean) for s in ("a", "b")]
    got_var = [float(fit.posterior[s].variance) for s in ("a", "b")]
    # the optimum of the ELBO under the estimator's own rule ...
    mean, cov = _tanh_elbo_optimum(GRID_NODES[2])
    np.testing.assert_allclose(got_mean, mean, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(got_var, np.diag(cov), rtol=1e-7)
    # ... which is the exact ELBO's (a 60-node rule) to the rule's accuracy
    mean, cov = _tanh_elbo_optimum(60)
    np.testing.assert_allclose(got_mean, mean, rtol=1e-3)
    np.testing.assert_allclose(got_var, np.diag(cov), rtol=1e-3)
    # (the ELBO is deterministic: the run's last steps agree to rounding)
    assert np.ptp(np.asarray(fit.elbo[-5:])) < 1e-9


def stationary_ar1(y):
    """An AR(1) state started from its stationary distribution, as time-series models write
    it: the start's scale sigma / sqrt(1 - phi²) is opaque, its factor reads three scalars."""
    phi = numpyro.sample("phi", dist.Uniform(-1.0, 1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    x0 = numpyro.sample("x0", dist.Normal(0.0, sigma / jnp.sqrt(1.0 - phi**2)))

    def step(prev, y_t):
        x = numpyro.sample("x", dist.Normal(phi * prev, sigma))
        numpyro.sample("y", dist.Normal(x, 0.3), obs=y_t)
        return x, None

    scan(step, x0, y)


def stationary_ar1_data() -> np.ndarray:
    """60 noisy observations of an AR(1) state with persistence 0.8."""
    rng = np.random.default_rng(3)
    x = np.zeros(60)
    for t in range(60):
        x[t] = 0.8 * (x[t - 1] if t else 0.0) + 0.5 * rng.normal()
    return x + 0.3 * rng.normal(size=60)


def test_stationary_start_is_integrated_on_a_grid_and_the_fit_is_deterministic():
    fit = blr_fit(stationary_ar1, {"y": stationary_ar1_data()}, rng_key=random.PRNGKey(0), progress_bar=False)
    plan = fit.plan.describe()
    estimators = {f.name: f.estimator for f in fit.plan.factors}
    assert estimators["x0"] == "quadrature" and "monte_carlo" not in estimators.values(), plan
    assert fit.converged and "relative ELBO change" in fit.message, fit.message
    phi = fit.sample(random.PRNGKey(1), 2000)["phi"]
    assert 0.5 < float(np.mean(phi)) < 0.95


def two_rates(seen, caught):
    """Two probabilities of one joint Gaussian block (its latents are small and non-conjugate),
    each read by its own factor through ``clamp_probs`` (no closed form, no projection: the
    grid rule), as NumPyro's capture–recapture models read survival and recapture."""
    phi = numpyro.sample("phi", dist.Uniform(0.0, 1.0))
    rho = numpyro.sample("rho", dist.Uniform(0.0, 1.0))
    with numpyro.plate("n", len(seen)):
        numpyro.sample("seen", dist.Bernoulli(dist.util.clamp_probs(phi)), obs=seen)
        numpyro.sample("caught", dist.Bernoulli(dist.util.clamp_probs(rho)), obs=caught)


def test_a_factor_reading_some_members_of_a_joint_block_integrates_over_them_only(monkeypatch):
    """φ and ρ are one joint Gaussian block; one factor reads φ only, the other ρ only. Each is
    integrated over the marginal of the scalars it reads (32 nodes, not 20² over the block;
    NumPyro's capture–recapture model 4, three members: 23 → 12 s a fit), and the fit equals
    the one integrating over the whole block (the same integrals, each rule accurate far below
    the tolerance; measured: parameters within 3e-14)."""
    import collections

    import blrppl.engine.cache as cache_module
    import blrppl.estimators.quadrature as quadrature_module

    rng = np.random.default_rng(0)
    seen, caught = (rng.random(50) < 0.3).astype(float), (rng.random(50) < 0.8).astype(float)
    marginal = blr_fit(two_rates, (seen, caught), rng_key=random.PRNGKey(0), progress_bar=False)
    reads = {f.name: f.spec.grid_positions for f in marginal.plan.factors if f.estimator == "quadrature"}
    assert reads["seen"] == (("(phi, rho)", (0,)),) and reads["caught"] == (("(phi, rho)", (1,)),), reads
    monkeypatch.setattr(quadrature_module, "grid_positions", lambda *_: {})
    monkeypatch.setattr(cache_module, "_CACHE", collections.OrderedDict())  # (compiled again)
    whole = blr_fit(two_rates, (seen, caught), rng_key=random.PRNGKey(0), progress_bar=False)
    assert all(not getattr(f.spec, "grid_positions", ()) for f in whole.plan.factors)
    assert marginal.num_steps == whole.num_steps
    for name in whole.params:
        np.testing.assert_allclose(marginal.params[name], whole.params[name], rtol=1e-8, atol=1e-10)
