"""Linear-Gaussian state-space models written as users write them (``scan`` with a carry,
one site per time step in a Python loop), with missing observations masked out: the fit is
the exact posterior in one step, equal to a Kalman filter and Rauch–Tung–Striebel smoother
written here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.contrib.control_flow import scan
from numpyro.infer.util import log_density

from blrppl import blr_fit

A, Q, R, M0, P0 = 0.9, 0.5, 0.7, 0.0, 1.0
T = 30


def scan_model(y, observed):
    x0 = numpyro.sample("x0", dist.Normal(M0, np.sqrt(P0)))

    def step(x_prev, inputs):
        y_t, seen = inputs
        x = numpyro.sample("x", dist.Normal(A * x_prev, np.sqrt(Q)))
        numpyro.sample("y", dist.Normal(x, np.sqrt(R)).mask(seen), obs=y_t)
        return x, x

    _, xs = scan(step, x0, (y, observed))
    numpyro.deterministic("states", xs)


def loop_model(y, observed):
    x = numpyro.sample("x0", dist.Normal(M0, np.sqrt(P0)))
    for t in range(len(y)):
        x = numpyro.sample(f"x_{t}", dist.Normal(A * x, np.sqrt(Q)))
        if observed[t]:
            numpyro.sample(f"y_{t}", dist.Normal(x, np.sqrt(R)), obs=y[t])


def kalman_smoother(y, observed):
    """Means and variances of x_0 … x_T given the observed y_t (x_0 is the prior state)."""
    m, p = M0, P0
    filtered, predicted = [(m, p)], []
    for t in range(len(y)):
        m_pred, p_pred = A * m, A * A * p + Q
        predicted.append((m_pred, p_pred))
        if observed[t]:
            gain = p_pred / (p_pred + R)
            m, p = m_pred + gain * (y[t] - m_pred), (1.0 - gain) * p_pred
        else:
            m, p = m_pred, p_pred
        filtered.append((m, p))
    means, variances = [filtered[-1][0]], [filtered[-1][1]]
    for t in range(len(y) - 1, -1, -1):
        (m_f, p_f), (m_p, p_p) = filtered[t], predicted[t]
        g = p_f * A / p_p
        means.insert(0, m_f + g * (means[0] - m_p))
        variances.insert(0, p_f + g * g * (variances[0] - p_p))
    return np.array(means), np.array(variances)


def _data():
    rng = np.random.default_rng(0)
    x, states = rng.normal(), []
    for _ in range(T):
        x = A * x + np.sqrt(Q) * rng.normal()
        states.append(x)
    y = np.array(states) + np.sqrt(R) * rng.normal(size=T)
    observed = np.ones(T, bool)
    observed[10:18] = False  # a gap in the middle
    return y, observed


def _marginals(result, names):
    means, variances = [], []
    for name in names:
        post = result.posterior[name]
        means.append(np.ravel(post.mean))
        variances.append(np.ravel(post.variance))
    return np.concatenate(means), np.concatenate(variances)


@pytest.mark.parametrize("written", ["scan", "loop"])
def test_state_space_fit_is_the_kalman_smoother_in_one_step(written):
    y, observed = _data()
    model = scan_model if written == "scan" else loop_model
    r = blr_fit(model, {"y": y, "observed": observed}, rng_key=random.PRNGKey(0), progress_bar=False)
    assert r.converged and r.num_steps == 1, r.message
    assert all(f.estimator == "exact" for f in r.plan.factors)
    names = ["x0", "x"] if written == "scan" else ["x0"] + [f"x_{t}" for t in range(T)]
    means, variances = _marginals(r, names)
    ref_means, ref_variances = kalman_smoother(y, observed)
    np.testing.assert_allclose(means, ref_means, atol=1e-8)
    np.testing.assert_allclose(variances, ref_variances, rtol=1e-8)


def ar2_scan_model(y):
    """AR(2) with two latent initial states and a latent drift, the lags carried by ``scan``:
    the second lag is x0, then x1, then the chain's own states."""
    x0 = numpyro.sample("x0", dist.Normal(0.0, 1.0))
    x1 = numpyro.sample("x1", dist.Normal(0.0, 1.0))
    drift = numpyro.sample("drift", dist.Normal(0.0, 1.0))

    def step(lags, y_t):
        lag1, lag2 = lags
        x = numpyro.sample("x", dist.Normal(0.6 * lag1 - 0.2 * lag2 + drift, 0.5))
        numpyro.sample("y", dist.Normal(x, 0.3), obs=y_t)
        return (x, lag1), x

    scan(step, (x1, x0), y)


def exact_gaussian(model, data, shapes):
    """Mean and covariance of a posterior whose log joint is quadratic in the latents: one
    Newton step from zero on the log density (autodiff of the model itself)."""
    sizes = [int(np.prod(s)) for s in shapes.values()]

    def log_joint(z):
        parts = jnp.split(z, np.cumsum(sizes)[:-1])
        values = {n: p.reshape(s) for (n, s), p in zip(shapes.items(), parts)}
        return log_density(model, (), data, values)[0]

    z0 = jnp.zeros(sum(sizes))
    precision = -jax.hessian(log_joint)(z0)
    cov = jnp.linalg.inv(precision)
    return np.asarray(cov @ jax.grad(log_joint)(z0)), np.asarray(cov)


def test_ar2_with_latent_initial_states_carried_by_scan_is_exact():
    y = np.sin(np.arange(20) / 3.0) + 0.1 * np.random.default_rng(3).normal(size=20)
    r = blr_fit(ar2_scan_model, {"y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
    assert r.converged and r.num_steps == 1, r.message
    shapes = {"x0": (), "x1": (), "drift": (), "x": (20,)}
    mean, cov = exact_gaussian(ar2_scan_model, {"y": y}, shapes)
    means, variances = _marginals(r, list(shapes))
    np.testing.assert_allclose(means, mean, atol=1e-8)
    np.testing.assert_allclose(variances, np.diag(cov), rtol=1e-8)


def local_linear_trend_scan(y):
    """A local linear trend as users write it: the state's two components as two sites of one
    ``scan`` (known scales: a linear-Gaussian model)."""
    level0 = numpyro.sample("level0", dist.Normal(0.0, 2.0))
    slope0 = numpyro.sample("slope0", dist.Normal(0.0, 0.5))

    def step(carry, y_t):
        level, slope = carry
        level = numpyro.sample("level", dist.Normal(level + slope, 0.3))
        slope = numpyro.sample("slope", dist.Normal(slope, 0.05))
        numpyro.sample("y", dist.Normal(level, 1.0), obs=y_t)
        return (level, slope), None

    scan(step, (level0, slope0), y)


def _trend_data(n):
    rng = np.random.default_rng(0)
    slope = 0.1 + np.cumsum(0.05 * rng.normal(size=n))
    return np.cumsum(slope + 0.3 * rng.normal(size=n)) + rng.normal(size=n)


def test_two_component_state_is_one_chain_exact_in_one_step():
    """Level and slope sites of the same length are stored step by step in one banded block
    (in model order, level's scalars then slope's, its precision has no band): the exact
    posterior in one step, correlations between the components kept in the draws."""
    n = 40
    y = _trend_data(n)
    r = blr_fit(local_linear_trend_scan, {"y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
    assert r.converged and r.num_steps == 1, r.message
    (block,) = r.plan.blocks
    assert block.family.banded and block.family.bandwidth <= 3 and block.size == 2 * n + 2
    assert block.interleaved == 2 and "level, slope step by step" in r.plan.describe()
    shapes = {"level0": (), "slope0": (), "level": (n,), "slope": (n,)}
    mean, cov = exact_gaussian(local_linear_trend_scan, {"y": y}, shapes)
    means, variances = _marginals(r, list(shapes))
    np.testing.assert_allclose(means, mean, atol=1e-8)
    np.testing.assert_allclose(variances, np.diag(cov), rtol=1e-8)
    # the last level and slope are correlated a posteriori (the slope is read off the
    # levels' trend): joint draws hold it, within 4 Monte Carlo sds of ρ's estimate
    last_level, last_slope = n + 1, 2 * n + 1
    rho = cov[last_level, last_slope] / np.sqrt(cov[last_level, last_level] * cov[last_slope, last_slope])
    draws = r.sample(random.PRNGKey(1), 4000)
    found = np.corrcoef(np.asarray(draws["level"])[:, -1], np.asarray(draws["slope"])[:, -1])[0, 1]
    assert abs(rho) > 0.3
    assert abs(found - rho) < 4 * (1 - rho**2) / np.sqrt(4000)


def test_one_site_per_step_beyond_the_dense_limit_is_a_chain(monkeypatch):
    """More scalar sites than a dense block holds (one per step of a Python loop; here the
    limit is lowered to 16 so that 41 states are beyond it): one banded block over them in
    model order, the Kalman smoother in one step (before: a block per site, a program per
    block; 600 steps did not fit in 5 minutes and 7 GB)."""
    from blrppl.compiler import structure as compile_module

    monkeypatch.setattr(compile_module, "JOINT_MAX_DIM", 16)
    rng = np.random.default_rng(1)
    n = 40
    y = np.cumsum(rng.normal(size=n))
    observed = np.ones(n, bool)
    r = blr_fit(loop_model, {"y": y, "observed": observed}, rng_key=random.PRNGKey(0), progress_bar=False)
    assert r.converged and r.num_steps == 1, r.message
    (block,) = r.plan.blocks
    assert block.family.banded and block.size == n + 1, r.plan.describe()
    means, variances = _marginals(r, ["x0"] + [f"x_{t}" for t in range(n)])
    ref_means, ref_variances = kalman_smoother(y, observed)
    np.testing.assert_allclose(means, ref_means, atol=1e-8)
    np.testing.assert_allclose(variances, ref_variances, rtol=1e-8)
