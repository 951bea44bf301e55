"""Latents no other site reads are integrated out of the fit (barren nodes of the model's
graph): ∫ p(x | θ) dx = 1, so the posterior of the other latents is that of the model
without them, and ``sample`` draws them from the model given the others.

The constructs users write: ``obs_mask=`` (its ``<site>_unobserved`` imputation latent),
a posterior-predictive latent sampled inside the model, group effects of groups without
data, a discrete latent nothing reads. Each reference is the same model without the
barren latents (or its closed form), in float64.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import blr_fit

numpyro.enable_x64()

RNG = np.random.default_rng(0)
Y = RNG.normal(1.0, 2.0, 60)
MISSING = np.zeros(60, bool)
MISSING[RNG.choice(60, 12, replace=False)] = True
Y_NAN = np.where(MISSING, np.nan, Y)


def fit(model, *args, **kw):
    return blr_fit(model, args, rng_key=random.PRNGKey(0), progress_bar=False, **kw)


def normal_scale(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(5.0))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Normal(mu, sigma), obs=y)


def normal_scale_obs_mask(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(5.0))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Normal(mu, sigma), obs=y, obs_mask=~np.isnan(y))


def normal_scale_with_prediction(y):
    """A posterior-predictive latent in the model, and an unread hierarchy (z, then w
    reading only z): all three read by nothing that is observed."""
    normal_scale(y)
    mu = numpyro.sample("mu_copy", dist.Normal(0.0, 1.0))
    numpyro.sample("w", dist.Normal(mu, 1.0))


@pytest.fixture(scope="module")
def reference():
    return fit(normal_scale, Y[~MISSING])


def _moments(result):
    return np.array([[result.posterior[s].mean, result.posterior[s].variance] for s in ("mu", "sigma")], dtype=float)


@pytest.mark.parametrize("data", [Y_NAN, Y[~MISSING]], ids=["12 of 60 missing", "every value observed"])
def test_obs_mask_gives_the_posterior_of_the_observed_values(reference, data):
    """Imputed values and the padding at observed positions no longer act as data on the
    scale (they made its sd 0.66x NUTS's): the fit is the fit of the observed values."""
    result = fit(normal_scale_obs_mask, data)
    assert result.plan.barren == ("y_unobserved",)
    assert "integrated out" in result.plan.describe() and "y_unobserved" not in result.posterior
    np.testing.assert_allclose(_moments(result), _moments(reference), rtol=1e-8)
    draws = result.sample(random.PRNGKey(1), 4000)
    assert draws["y_unobserved"].shape == (4000, len(data))
    seen = ~np.isnan(data)
    np.testing.assert_array_equal(np.asarray(draws["y"])[:, seen], np.broadcast_to(data[seen], (4000, int(seen.sum()))))
    # the imputations are the posterior predictive: mean E[mu], variance E[sigma^2] + Var[mu]
    # (tolerances: 5 standard errors of 4000 draws pooled over the positions)
    imputed = np.asarray(draws["y_unobserved"]).ravel()
    s2 = reference.sample(random.PRNGKey(2), 4000)["sigma"] ** 2
    sd = np.sqrt(s2.mean() + reference.posterior["mu"].variance)
    assert abs(imputed.mean() - reference.posterior["mu"].mean) < 5 * sd / np.sqrt(4000)
    assert abs(imputed.std() / sd - 1) < 0.05


def test_unread_latents_are_left_out_recursively(reference):
    """A posterior-predictive latent, and a latent read only by an unread latent: the
    data's posterior is unchanged and the draws follow the model."""
    result = fit(normal_scale_with_prediction, Y[~MISSING])
    assert result.plan.barren == ("mu_copy", "w")
    np.testing.assert_allclose(_moments(result), _moments(reference), rtol=1e-8)
    draws = result.sample(random.PRNGKey(1), 20_000)
    # w ~ N(0, 2) marginally: 5 standard errors of 20,000 draws
    assert abs(float(np.mean(draws["w"]))) < 5 * np.sqrt(2 / 20_000)
    assert abs(float(np.var(draws["w"])) / 2 - 1) < 5 * np.sqrt(2 / 20_000)
    summary = result.summary(print_table=False)
    assert {"mu", "sigma", "mu_copy", "w"} <= set(summary)


def dirichlet_with_unread_label(counts):
    p = numpyro.sample("p", dist.Dirichlet(np.ones(3)))
    numpyro.sample("k", dist.Categorical(p))  # a label nothing reads
    with numpyro.plate("n", len(counts)):
        numpyro.sample("g", dist.Categorical(p), obs=counts)


def test_unread_discrete_latent_adds_no_phantom_count():
    """Conjugate and exact: Dirichlet(1 + counts), with no extra count from the label."""
    g = RNG.integers(0, 3, 30)
    result = fit(dirichlet_with_unread_label, g)
    assert result.plan.barren == ("k",)
    alpha = 1.0 + np.bincount(g, minlength=3)
    np.testing.assert_allclose(result.posterior["p"].concentration, alpha, rtol=1e-10)
    draws = result.sample(random.PRNGKey(3), 100)
    assert set(np.unique(draws["k"])) <= {0, 1, 2}


def prior_only():
    mu = numpyro.sample("mu", dist.Normal(1.0, 2.0))
    numpyro.sample("x", dist.Normal(mu, 1.0))


def test_a_model_without_data_or_with_named_families_keeps_its_latents():
    """Nothing is left out when nothing else would remain (the fit is the prior), nor a
    latent the user gave a family."""
    result = blr_fit(prior_only, (), progress_bar=False)
    assert result.plan.barren == ()
    np.testing.assert_allclose([result.posterior["x"].mean, result.posterior["x"].variance], [1.0, 5.0], rtol=1e-6)
    kept = fit(normal_scale_obs_mask, Y_NAN, families={"y_unobserved": "gaussian-diag"})
    assert kept.plan.barren == () and "y_unobserved" in kept.posterior


def poisson_obs_mask(y):
    rate = numpyro.sample("rate", dist.Gamma(2.0, 1.0))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Poisson(rate), obs=y, obs_mask=~np.isnan(y))


def test_obs_mask_on_counts_is_exact():
    """Missing counts are latents of unbounded discrete support, which cannot be fitted
    (refused before, naming the site); read by nothing, they are integrated out: the
    posterior is Gamma(2 + Σ observed, 1 + number observed), and the draws are counts."""
    counts = RNG.poisson(4.0, 40).astype(float)
    counts[:7] = np.nan
    result = fit(poisson_obs_mask, counts)
    assert result.plan.barren == ("y_unobserved",)
    seen = counts[~np.isnan(counts)]
    q = result.posterior["rate"]
    np.testing.assert_allclose([q.concentration, q.rate], [2.0 + seen.sum(), 1.0 + seen.size], rtol=1e-10)
    draws = np.asarray(result.sample(random.PRNGKey(4), 200)["y_unobserved"])[:, :7]
    assert np.all(draws >= 0) and np.all(draws == np.round(draws))


def subsampled_obs_mask(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", len(y), subsample_size=50) as idx:
        batch = y[idx]
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=batch, obs_mask=~jnp.isnan(batch))


def test_subsampled_model_draws_the_integrated_latents():
    """A NumPy data array indexed by the plate's subsample (traced under Predictive's vmap):
    the draws of the integrated-out latent come from the model run on JAX arrays (with the
    NumPy array it raised, and ``sample`` warned and gave ``mu`` alone)."""
    y = np.where(np.arange(200) % 10 == 0, np.nan, RNG.normal(2.0, 1.0, 200))
    result = fit(subsampled_obs_mask, y, num_steps=20)
    assert result.plan.barren == ("y_unobserved",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        draws = result.sample(random.PRNGKey(5), 10)
    assert draws["y_unobserved"].shape == (10, 50) and np.all(np.isfinite(draws["y_unobserved"]))
