"""Models that compute Python values from their data, as textbook ports write them:
``len(set(sex))`` groups, boolean masks of the observations inside ``numpyro.factor``,
``int(x.max()) + 1`` groups, a Python ``if`` on a data value. They are fitted with their data
as compile-time constants; the compiled fit is keyed on the data's values, so the same model
fitted on other data gets those data's posterior (through ``blr_fit`` and ``BLR``)."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import BLR, BLRError, blr_fit
from checks import run_in_new_process

numpyro.enable_x64()

PRIOR_MEAN, PRIOR_SD, SIGMA = 178.0, 20.0, 5.0


def height_model(sex, height=None):
    """Statistical Rethinking's heights by sex (known sigma): one mean per group, as many
    groups as there are distinct values."""
    a = numpyro.sample("a", dist.Normal(PRIOR_MEAN, PRIOR_SD).expand([len(set(sex))]))
    with numpyro.plate("n", len(sex)):
        numpyro.sample("height", dist.Normal(a[sex], SIGMA), obs=height)


def exact_group_means(groups, y, k, prior_mean, prior_sd, sigma):
    """Conjugate posterior (means, variances) of k independent group means with a
    Normal(prior_mean, prior_sd) prior each and Normal(mean[g], sigma) observations."""
    counts = np.bincount(groups, minlength=k)
    sums = np.bincount(groups, weights=y, minlength=k)
    precision = 1.0 / prior_sd**2 + counts / sigma**2
    return (prior_mean / prior_sd**2 + sums / sigma**2) / precision, 1.0 / precision


def heights(seed, n, shift=0.0):
    rng = np.random.default_rng(seed)
    sex = rng.integers(0, 2, n)
    return sex, 150.0 + shift + 10.0 * sex + SIGMA * rng.normal(size=n)


def fit(model, data, **kw):
    kw.setdefault("progress_bar", False)
    return blr_fit(model, data, rng_key=random.PRNGKey(0), **kw)


def assert_exact(q, mean, var):
    np.testing.assert_allclose(np.asarray(q.mean), mean, rtol=1e-8)
    np.testing.assert_allclose(np.diag(np.atleast_2d(q.covariance_matrix)), var, rtol=1e-8)


def test_groups_counted_with_len_set_give_the_exact_posterior_for_each_data_set():
    """Two data sets of the same shape (other heights, sexes swapped): each fit is its own
    data's conjugate posterior, never the program compiled for the other data."""
    sex, height = heights(0, 30)
    first = fit(height_model, {"sex": sex, "height": height})
    assert_exact(first.posterior["a"], *exact_group_means(sex, height, 2, PRIOR_MEAN, PRIOR_SD, SIGMA))
    other_sex, other_height = 1 - sex, height + 7.0
    second = fit(height_model, {"sex": other_sex, "height": other_height})
    assert_exact(second.posterior["a"], *exact_group_means(other_sex, other_height, 2, PRIOR_MEAN, PRIOR_SD, SIGMA))


def index_model(g, y):
    """Groups counted as ``int(g.max()) + 1``, unit-variance observations."""
    k = int(g.max()) + 1
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0).expand([k]))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Normal(mu[g], 1.0), obs=y)


def test_groups_counted_with_int_max_are_exact_and_a_refit_on_the_same_data_compiles_nothing():
    """The compiled fit of a model that holds its data is keyed by their values: the same
    data again are served from the cache (nothing compiled), other values (four groups
    instead of three) compile their own fit."""
    rng = np.random.default_rng(1)
    g = rng.integers(0, 3, 25)
    y = g - 1.0 + rng.normal(size=25)
    first = fit(index_model, (g, y))
    assert_exact(first.posterior["mu"], *exact_group_means(g, y, 3, 0.0, 2.0, 1.0))
    again = fit(index_model, (g.copy(), y.copy()))
    assert again.compile_counts.xla_compilations == 0
    np.testing.assert_array_equal(np.asarray(again.posterior["mu"].mean), np.asarray(first.posterior["mu"].mean))
    g4 = np.where(g == 2, 3, g)
    other = fit(index_model, (g4, y))
    assert_exact(other.posterior["mu"], *exact_group_means(g4, y, 4, 0.0, 2.0, 1.0))


def switch_model(x, y):
    """A Python ``if`` on a data value: the noise of the observations depends on which
    instrument the data came from (``x`` holds its code)."""
    noise = 0.5 if x[0] > 0 else 2.0
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Normal(mu, noise), obs=y)


def exact_mean(y, noise, prior_sd=3.0):
    precision = 1.0 / prior_sd**2 + len(y) / noise**2
    return np.sum(y) / noise**2 / precision, 1.0 / precision


def test_a_python_if_on_a_data_value_through_blr_update_with_new_data():
    """``BLR.update`` with data that take the other branch: the step is the new data's (a fit
    compiled for them), continuing from the state of the first data; after a few steps
    the state is the new data's conjugate posterior."""
    y = np.array([0.3, 1.1, 0.7, 1.6, 0.2])
    svi = BLR(switch_model)
    state = svi.init(random.PRNGKey(0), np.ones(5), y)
    for _ in range(3):
        state, _ = svi.update(state, np.ones(5), y)
    params = svi.get_params(state)
    mean, var = exact_mean(y, 0.5)
    np.testing.assert_allclose(params["mu_blr_mean"], mean, rtol=1e-8)
    for _ in range(3):
        state, loss = svi.update(state, -np.ones(5), y)
    params = svi.get_params(state)
    mean, var = exact_mean(y, 2.0)
    np.testing.assert_allclose(params["mu_blr_mean"], mean, rtol=1e-8)
    np.testing.assert_allclose(np.reshape(params["mu_blr_cov"], ()), var, rtol=1e-8)
    np.testing.assert_allclose(loss, svi.evaluate(state, -np.ones(5), y), rtol=1e-8)


def test_blr_with_new_data_that_change_the_number_of_groups_asks_for_init():
    sex, height = heights(2, 20)
    svi = BLR(height_model)
    state = svi.init(random.PRNGKey(0), sex, height)
    state, _ = svi.update(state, sex, height)
    shifted = height + 10.0
    state, _ = svi.update(state, sex, shifted)
    mean, _ = exact_group_means(sex, shifted, 2, PRIOR_MEAN, PRIOR_SD, SIGMA)
    np.testing.assert_allclose(svi.get_params(state)["a_blr_mean"], mean, rtol=1e-8)
    with pytest.raises(BLRError, match="call init"):
        svi.update(state, np.arange(20) % 3, height)
    # the fit of the data before is kept
    state, _ = svi.update(state, sex, shifted)
    np.testing.assert_allclose(svi.get_params(state)["a_blr_mean"], mean, rtol=1e-8)


def zip_by_hand(y):
    """A zero-inflated Poisson written with boolean masks of the data, as Statistical
    Rethinking's ports write it: zeros from either process, positive counts from the
    Poisson."""
    p = numpyro.sample("p", dist.Beta(1.0, 1.0))
    lam = numpyro.sample("lam", dist.Exponential(1.0))
    log_zero = jnp.log(p + (1.0 - p) * jnp.exp(-lam))
    numpyro.factor("zeros", log_zero * jnp.sum(y == 0))
    numpyro.factor("counts", jnp.sum(jnp.log1p(-p) + dist.Poisson(lam).log_prob(y[y > 0])))


def zip_distribution(y):
    p = numpyro.sample("p", dist.Beta(1.0, 1.0))
    lam = numpyro.sample("lam", dist.Exponential(1.0))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.ZeroInflatedPoisson(p, lam), obs=y)


def grid_posterior(y):
    """Posterior means and sds of (p, lam) by a dense grid over (logit p, log lam): the
    reference, without Monte Carlo error."""
    u = np.linspace(-6.0, 4.0, 801)
    v = np.linspace(-2.0, 3.0, 801)
    U, V = np.meshgrid(u, v, indexing="ij")
    p, lam = 1.0 / (1.0 + np.exp(-U)), np.exp(V)
    zeros, positive = np.sum(y == 0), y[y > 0]
    log_post = (
        zeros * np.log(p + (1 - p) * np.exp(-lam))
        + positive.size * np.log1p(-p)
        + np.sum(positive) * V
        - positive.size * lam
        - lam  # Exponential(1) prior
        + np.log(p * (1 - p)) + V  # the Jacobians of logit and log (the Beta(1, 1) prior is flat)
    )
    w = np.exp(log_post - log_post.max())
    w /= w.sum()
    out = {}
    for name, x in (("p", p), ("lam", lam)):
        m = np.sum(w * x)
        out[name] = (m, np.sqrt(np.sum(w * (x - m) ** 2)))
    return out


def test_zero_inflated_poisson_with_boolean_masks_matches_the_distribution_and_the_posterior():
    """The hand-written likelihood is the same density as ``dist.ZeroInflatedPoisson``: the
    two fits follow the same steps of the same ELBO (summed in another order) and agree to
    rounding (measured: 1e-8). Against the posterior (a dense grid): q is Gaussian on
    (logit p, log lam), here within 0.003 posterior sd of the posterior's means and 0.3 % of
    its sds (measured); 20 000 draws of q add a Monte Carlo error of 0.007 sd to a mean and
    0.5 % to an sd: means within 0.05 sd, sds within 5 %."""
    rng = np.random.default_rng(3)
    y = rng.poisson(2.5, 40) * (rng.random(40) > 0.35)
    by_hand = fit(zip_by_hand, {"y": y})
    reference = fit(zip_distribution, {"y": y})
    for name in ("p", "lam"):
        a, b = by_hand.posterior[name], reference.posterior[name]
        np.testing.assert_allclose(np.asarray(a.base_dist.loc), np.asarray(b.base_dist.loc), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(np.asarray(a.base_dist.scale), np.asarray(b.base_dist.scale), rtol=1e-6)
    draws = by_hand.sample(random.PRNGKey(1), 20_000)
    for name, (mean, sd) in grid_posterior(y).items():
        assert abs(float(np.mean(draws[name])) - mean) < 0.05 * sd, (name, np.mean(draws[name]), mean, sd)
        assert abs(float(np.std(draws[name])) / sd - 1.0) < 0.05, (name, np.std(draws[name]), sd)


def subsampled_index_model(g, y):
    """``int(g.max()) + 1`` groups, the data read per minibatch with jax.numpy indexing."""
    k = int(g.max()) + 1
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0).expand([k]))
    with numpyro.plate("n", len(y), subsample_size=40) as idx:
        numpyro.sample("y", dist.Normal(mu[jnp.asarray(g)[idx]], 1.0), obs=jnp.asarray(y)[idx])


def test_groups_counted_from_the_data_with_a_subsampled_plate():
    """Stochastic BLR over minibatches of a model that holds its data: the model also runs
    at the full plate size (its starting values). The minibatch noise of the means after
    300 steps is about 1e-3 (measured); a quarter of a posterior sd (0.03) catches a
    wrong group count or stale data."""
    rng = np.random.default_rng(4)
    g = rng.integers(0, 3, 400)
    y = g + rng.normal(size=400)
    result = fit(subsampled_index_model, (g, y), num_steps=300)
    mean, var = exact_group_means(g, y, 3, 0.0, 2.0, 1.0)
    assert np.all(np.abs(np.asarray(result.posterior["mu"].mean) - mean) < 0.25 * np.sqrt(var))


FLOAT32 = r"""
import json
import jax, jax.numpy as jnp, numpy as np
import numpyro, numpyro.distributions as dist
from jax import random
from blrppl import BLR, blr_fit
PRIOR_MEAN, PRIOR_SD, SIGMA = 178.0, 20.0, 5.0
MODELS
assert not jax.config.jax_enable_x64

sex, height = heights(0, 30)
height = height.astype(np.float32)
r = blr_fit(height_model, {"sex": sex, "height": height}, rng_key=random.PRNGKey(0), progress_bar=False)
svi = BLR(height_model)
state = svi.init(random.PRNGKey(0), sex, height)
state, _ = svi.update(state, sex, height + np.float32(7.0))
rng = np.random.default_rng(3)
y = rng.poisson(2.5, 40) * (rng.random(40) > 0.35)
z = blr_fit(zip_by_hand, {"y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
draws = z.sample(random.PRNGKey(1), 20_000)
print("RESULT" + json.dumps({
    "a": np.asarray(r.posterior["a"].mean).tolist(), "dtype": str(np.asarray(r.posterior["a"].mean).dtype),
    "a_new_data": np.asarray(svi.get_params(state)["a_blr_mean"]).tolist(),
    "zip": {n: [float(np.mean(draws[n])), float(np.std(draws[n]))] for n in ("p", "lam")},
}))
"""


def test_float32(tmp_path):
    """The same models without x64 (a new process): float32 results, the conjugate
    posteriors to float32 precision (rtol 1e-4), the zero-inflated Poisson as in float64."""
    models = "\n".join(inspect.getsource(f) for f in (height_model, heights, zip_by_hand))
    out = run_in_new_process(FLOAT32.replace("MODELS", models), tmp_path)
    sex, height = heights(0, 30)
    assert out["dtype"] == "float32"
    np.testing.assert_allclose(out["a"], exact_group_means(sex, height, 2, PRIOR_MEAN, PRIOR_SD, SIGMA)[0], rtol=1e-4)
    new_mean = exact_group_means(sex, height + 7.0, 2, PRIOR_MEAN, PRIOR_SD, SIGMA)[0]
    np.testing.assert_allclose(out["a_new_data"], new_mean, rtol=1e-4)
    rng = np.random.default_rng(3)
    y = rng.poisson(2.5, 40) * (rng.random(40) > 0.35)
    for name, (mean, sd) in grid_posterior(y).items():
        assert abs(out["zip"][name][0] - mean) < 0.05 * sd and abs(out["zip"][name][1] / sd - 1.0) < 0.05, name
