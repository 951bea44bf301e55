"""Online fits (``prior=``) of models with subsampled plates: stochastic BLR whose global blocks'
prior is a previous fit's posterior.

The minibatch step (:mod:`blrppl.engine.subsample`) reads the previous posterior beside the
minibatch of the model's arrays (:func:`blrppl.engine.subsample.minibatch_data`); the previous
posterior's pseudo-factor is a prior of a global block, so it carries no N/M scale.

A Bayesian linear regression with known noise, N = 2,000 rows, D = 3, in minibatches of
M = 200 (the indexing idiom ``y[idx]``), fitted on the first half, then on the second half
with ``prior=`` the first fit:

* its posterior is within 0.1 posterior sd of the closed form of both halves (precision
  I + XᵀX, mean its inverse times Xᵀy), and within 0.03 sd of the online fit without
  subsampling (the same model with a plain plate, exact in one step);
* a model with a local latent per datum (mean field) reaches the online fixed point computed
  by hand from the first fit's posterior;
* ``blr_kernel(..., prior=)`` of a subsampled model steps.
"""

from __future__ import annotations

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import blr_fit, blr_kernel
from describe_table import factor_rows

N, D, M = 2_000, 3, 200
HALF = N // 2
#: steps of each fit: 40 epochs of the half's 5 minibatches (see the tolerances below)
STEPS = 200


def subsampled(X, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    with numpyro.plate("n", X.shape[0], subsample_size=M) as idx:
        numpyro.sample("y", dist.Normal(X[idx] @ w, 1.0), obs=y[idx])


def full_batch(X, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N, D))
    y = X @ np.array([1.0, -0.5, 0.2]) + rng.normal(size=N)
    return X, y


@pytest.fixture(scope="module")
def fits(data):
    X, y = data
    first = blr_fit(subsampled, (X[:HALF], y[:HALF]), num_steps=STEPS, rng_key=random.PRNGKey(0), progress_bar=False)
    online = blr_fit(
        subsampled, (X[HALF:], y[HALF:]), prior=first, num_steps=STEPS, rng_key=random.PRNGKey(1), progress_bar=False
    )
    exact = blr_fit(full_batch, (X[:HALF], y[:HALF]), rng_key=random.PRNGKey(0), progress_bar=False)
    exact = blr_fit(full_batch, (X[HALF:], y[HALF:]), prior=exact, rng_key=random.PRNGKey(1), progress_bar=False)
    return first, online, exact


def closed_form(X, y):
    cov = np.linalg.inv(np.eye(D) + X.T @ X)
    return cov @ X.T @ y, np.sqrt(np.diag(cov))


def moments(result):
    q = result.posterior["w"]
    return np.asarray(q.mean), np.sqrt(np.diag(np.asarray(q.covariance_matrix)))


def test_online_minibatch_fit_reaches_the_closed_form_of_both_halves(data, fits):
    """Means within 0.1 posterior sd of the closed form of all N rows, sds within 1 %.

    Measured (6 keys, 200 steps a fit): at most 0.008 sd off, sds within 3e-4. Dropping the
    previous posterior (the model's N(0, 1) prior instead) would make the sds √2 too wide;
    scaling its pseudo-factor by N/M = 5 like the likelihood would make them ~1.7× too
    narrow."""
    mean, sd = closed_form(*data)
    _, online, _ = fits
    got_mean, got_sd = moments(online)
    assert np.max(np.abs(got_mean - mean) / sd) < 0.1, (got_mean - mean) / sd
    np.testing.assert_allclose(got_sd, sd, rtol=0.01)
    assert np.all(np.isfinite(online.elbo)) and len(online.elbo) <= STEPS


def test_online_minibatch_fit_agrees_with_the_online_fit_without_subsampling(data, fits):
    """The online fit without subsampling is the exact conjugate update (1e-8 of the closed
    form here); the minibatch fit is within 0.03 of its sds in the mean (about 4× the largest
    error measured over 6 keys, 0.008 sd: the tail average's minibatch noise), sds within 1 %."""
    _, online, exact = fits
    mean, sd = moments(exact)
    np.testing.assert_allclose(mean, closed_form(*data)[0], rtol=0, atol=1e-8)
    got_mean, got_sd = moments(online)
    assert np.max(np.abs(got_mean - mean) / sd) < 0.03, (got_mean - mean) / sd
    np.testing.assert_allclose(got_sd, sd, rtol=0.01)


def test_previous_posterior_is_a_prior_without_the_plate_scale(fits):
    """The previous posterior's pseudo-factor is the prior of the global block: scale 1,
    while the likelihood carries N/M."""
    _, online, _ = fits
    rows = factor_rows(online.plan.describe())
    assert set(rows) == {"w:previous", "y"}
    # (the last cell of a row is its scale: the pseudo-factor's empty arguments cell is not split off)
    assert list(rows["w:previous"].values())[-1] == "1"
    assert rows["y"]["scale"] == "N/M = 5"
    assert not next(f for f in online.plan.factors if f.name == "w:previous").subsampled


def test_local_latents_reach_the_online_fixed_point():
    """y_n ~ N(μ + z_n, 1), z_n ~ N(0, 1) local in the subsampled plate, μ ~ N(0, 10²) global
    (mean field). Given the first fit's q₁(μ) = N(m₁, v₁) as the prior, the mean-field fixed
    point on the second half (n rows) is q(μ) = N(m, v), 1/v = 1/v₁ + n and
    m = (m₁/v₁ + Σy/2) / (1/v₁ + n/2) (q(z_n) = N((y_n − m)/2, 1/2)). Measured (4 keys,
    200 steps): mean within 0.0034 sd, variance within 3e-4; tolerances 0.03 sd and 1 %.
    Without the previous posterior the variance would double."""
    n, m_batch = 500, 50
    rng = np.random.default_rng(1)
    y = 2.0 + np.sqrt(2.0) * rng.normal(size=2 * n)

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("n", y.shape[0], subsample_size=m_batch) as idx:
            z = numpyro.sample("z", dist.Normal(0.0, 1.0))
            numpyro.sample("y", dist.Normal(mu + z, 1.0), obs=y[idx])

    first = blr_fit(model, (y[:n],), num_steps=STEPS, rng_key=random.PRNGKey(0), progress_bar=False)
    online = blr_fit(model, (y[n:],), prior=first, num_steps=STEPS, rng_key=random.PRNGKey(1), progress_bar=False)
    assert set(factor_rows(online.plan.describe())) == {"mu:previous", "z", "y"}
    m1, v1 = float(first.posterior["mu"].mean), float(first.posterior["mu"].variance)
    v = 1 / (1 / v1 + n)
    m = (m1 / v1 + y[n:].sum() / 2) / (1 / v1 + n / 2)
    q = online.posterior["mu"]
    assert abs(float(q.mean) - m) / np.sqrt(v) < 0.03
    np.testing.assert_allclose(float(q.variance), v, rtol=0.01)


def test_kernel_of_an_online_subsampled_fit_steps(data, fits):
    """``blr_kernel(model, data, prior=)`` binds the previous posterior beside the data; its
    jitted step runs on a minibatch and keeps the state valid."""
    X, y = data
    first, _, _ = fits
    kernel, state = blr_kernel(subsampled, (X[HALF:], y[HALF:]), prior=first, rng_key=random.PRNGKey(0))
    assert set(kernel.data.previous) == {"w"}
    new, info = jax.jit(kernel.step)(state)
    assert bool(info.valid) and np.isfinite(float(info.elbo))
    assert int(new.step) == int(state.step) + 1
