"""Sites of one structure stacked into one factor (one site per step of a Python loop).

The stacked factor must give the fit the per-site factors give: the exact posterior of a
conjugate AR(2) written with one site per step (against the closed form), the same fit as
the unstacked plan for a non-conjugate one, and, for constructs that must not be stacked
(masked sites, non-affine arguments, a group too small), the per-site plan.
"""

from __future__ import annotations

import collections

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl.engine import cache as engine
from blrppl.api import blr_fit, plan_of
from blrppl.bench.runner import ar2_loop_model as ar2_unknown_scale  # the bench's AR(2): a1, a2, sigma
from blrppl.graph import stack
from blrppl.model import trace

numpyro.enable_x64()

NUM_STEPS = 40
SIGMA = 0.7


def ar2_series(seed=0, n=NUM_STEPS):
    rng = np.random.default_rng(seed)
    y = np.zeros(n + 2)
    for t in range(2, n + 2):
        y[t] = 0.5 * y[t - 1] - 0.3 * y[t - 2] + SIGMA * rng.normal()
    return y


def ar2_known_scale(y):
    phi = numpyro.sample("phi", dist.Normal(jnp.zeros(2), 0.5).to_event(1))
    for t in range(2, len(y)):
        numpyro.sample(f"y_{t}", dist.Normal(phi[0] * y[t - 1] + phi[1] * y[t - 2], SIGMA), obs=y[t])


def closed_form(y):
    """The exact posterior of ar2_known_scale: Bayesian linear regression on the lags."""
    x = np.column_stack([y[1:-1], y[:-2]])
    precision = np.eye(2) / 0.25 + x.T @ x / SIGMA**2
    cov = np.linalg.inv(precision)
    return cov @ (x.T @ y[2:]) / SIGMA**2, cov


def stacked_rows(plan):
    return [f for f in plan.factors if f.members]


def test_conjugate_loop_is_exact_in_one_step_and_refits_new_data():
    """One site per step, known scale: the stacked factor's message is the conjugate one; a
    refit with another series of the same length reuses the compiled fit with new tables."""
    for seed in (0, 1):
        y = ar2_series(seed)
        result = blr_fit(ar2_known_scale, {"y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
        (row,) = stacked_rows(result.plan)
        assert row.members == tuple(f"y_{t}" for t in range(2, NUM_STEPS + 2))
        assert f"({NUM_STEPS} sites stacked)" in result.plan.describe()
        mean, cov = closed_form(y)
        q = result.posterior["phi"]
        np.testing.assert_allclose(q.mean, mean, atol=1e-8)
        np.testing.assert_allclose(q.covariance_matrix, cov, atol=1e-8)
    assert result.compile_counts.xla_compilations == 0  # the second series: nothing compiled


@pytest.fixture(scope="module")
def unknown_scale_fits():
    y = ar2_series(2)
    stacked = blr_fit(ar2_unknown_scale, {"y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stack, "MIN_MEMBERS", 10**9)
        mp.setattr(engine, "_CACHE", collections.OrderedDict())  # (compiled anew, per site)
        single = blr_fit(ar2_unknown_scale, {"y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
    return stacked, single


def test_non_conjugate_loop_fits_as_the_per_site_plan(unknown_scale_fits):
    """Quadrature factors with a latent scale: the stacked plan reaches the per-site plan's
    fixed point (same messages; the arguments are computed as c + J s instead of by the
    model's arithmetic, so they agree to rounding), and its diagnostics read the same draws."""
    stacked, single = unknown_scale_fits
    assert len(stacked_rows(stacked.plan)) == 1 and not stacked_rows(single.plan)
    assert stacked.converged and single.converged
    for name in ("a1", "a2", "sigma"):
        a, b = stacked.posterior[name], single.posterior[name]
        sd = float(np.sqrt(b.variance))
        np.testing.assert_allclose(float(a.mean), float(b.mean), atol=1e-6 * sd)
        np.testing.assert_allclose(float(np.sqrt(a.variance)), sd, rtol=1e-6)
    np.testing.assert_allclose(stacked.diagnostics.khat, single.diagnostics.khat, atol=1e-6)


# -------------------------------------------------------- what is stacked, and what is not


def two_kinds(y, counts):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    rate = numpyro.sample("rate", dist.Gamma(2.0, 1.0))
    for t in range(len(y)):
        numpyro.sample(f"y_{t}", dist.Normal(mu + 0.1 * t, 1.0), obs=y[t])
        numpyro.sample(f"c_{t}", dist.Poisson(rate), obs=counts[t])


def masked_steps(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    for t in range(len(y)):
        with numpyro.handlers.mask(mask=t % 2 == 0):
            numpyro.sample(f"y_{t}", dist.Normal(mu, 1.0), obs=y[t])


def squared_loc(y):
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    for t in range(len(y)):
        numpyro.sample(f"y_{t}", dist.Normal(a * a * y[t - 1], 1.0), obs=y[t])


def vector_steps(y):
    w = numpyro.sample("w", dist.Normal(jnp.zeros(3), 1.0).to_event(1))
    for t in range(y.shape[0]):
        numpyro.sample(f"y_{t}", dist.Normal(w * y[t - 1], 1.0).to_event(1), obs=y[t])


def short_loop(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    for t in range(len(y)):
        numpyro.sample(f"y_{t}", dist.Normal(mu, 1.0), obs=y[t])


N = 30
Y = np.linspace(-1.0, 1.0, N)
COUNTS = np.arange(N) % 5

#: model, data, the number of sites of each stacked factor (empty: nothing stacked)
STACKING = [
    (two_kinds, {"y": Y, "counts": COUNTS}, [N, N]),
    (masked_steps, {"y": Y}, []),  # a mask wraps each site: one factor per site
    (squared_loc, {"y": Y}, []),  # a² is not affine in a
    (vector_steps, {"y": np.tile(Y[:, None], (1, 3))}, []),  # wrapped (to_event)
    (short_loop, {"y": Y[:10]}, []),  # fewer than MIN_MEMBERS sites
    (ar2_unknown_scale, {"y": ar2_series(0)}, [NUM_STEPS]),
]


@pytest.mark.parametrize("model,data,sizes", STACKING, ids=[m.__name__ for m, _, _ in STACKING])
def test_which_sites_are_stacked(model, data, sizes):
    plan = plan_of(model, data)
    assert [len(f.members) for f in stacked_rows(plan)] == sizes
    stacked = {m for f in plan.factors for m in f.members}
    single = {f.name for f in plan.factors if not f.members}
    # every site has its factor, once
    assert len(stacked) == sum(sizes) and not stacked & single
    names = single | stacked
    assert {n for n in names if n[:2] in ("y_", "c_")} == {n for n in data_sites(model, data)}


def data_sites(model, data):
    trace = numpyro.handlers.trace(numpyro.handlers.seed(model, 0)).get_trace(**data)
    return [n for n, s in trace.items() if s["type"] == "sample" and s["is_observed"]]


def test_stacked_fit_matches_two_kinds_exactly():
    """Normal sites with a conjugate mean and Poisson sites with a conjugate Gamma rate, one
    of each per step: the stacked plan gives the closed-form posteriors."""
    result = blr_fit(two_kinds, {"y": Y, "counts": COUNTS}, rng_key=random.PRNGKey(0), progress_bar=False)
    assert len(stacked_rows(result.plan)) == 2
    t = np.arange(N)
    precision = 1.0 + N
    np.testing.assert_allclose(float(result.posterior["mu"].mean), np.sum(Y - 0.1 * t) / precision, atol=1e-8)
    np.testing.assert_allclose(float(result.posterior["mu"].variance), 1.0 / precision, atol=1e-8)
    shape, rate = 2.0 + COUNTS.sum(), 1.0 + N
    np.testing.assert_allclose(float(result.posterior["rate"].mean), shape / rate, rtol=1e-8)
    np.testing.assert_allclose(float(result.posterior["rate"].variance), shape / rate**2, rtol=1e-8)


def random_walk_per_step(y):
    x = 0.0
    for t in range(len(y)):
        x = numpyro.sample(f"x_{t}", dist.Normal(x, 1.0))
        numpyro.sample(f"y_{t}", dist.Normal(x, 0.5), obs=y[t])


def test_per_step_latents_and_observations_are_two_stacked_factors_and_update_online():
    """A random walk with one latent and one observed site per step: the latents' priors
    x_t ~ Normal(x_{t-1}, 1) (t ≥ 1) are one stacked factor and the observations another,
    each reading sites of the joint block (J is 29 × 30 and 30 × 30). The fit is the exact
    posterior, whose precision is tridiagonal (written here from the model's densities); an
    online update with a second series of observations (prior=) replaces the stacked priors
    by the previous posterior: the precisions add."""
    n = 30
    rng = np.random.default_rng(3)
    y = np.cumsum(rng.normal(size=n)) + 0.5 * rng.normal(size=n)
    y2 = y + 0.5 * rng.normal(size=n)
    result = blr_fit(random_walk_per_step, {"y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
    assert sorted((f.observed, len(f.members)) for f in stacked_rows(result.plan)) == [(False, n - 1), (True, n)]
    precision = np.diag(np.full(n, 1.0 + 4.0)) + np.diag(np.r_[np.ones(n - 1), 0.0])
    precision -= np.diag(np.ones(n - 1), 1) + np.diag(np.ones(n - 1), -1)

    def check(fit, precision, information):
        cov = np.linalg.inv(precision)
        got_mean = np.array([float(fit.posterior[f"x_{t}"].mean) for t in range(n)])
        got_var = np.array([float(fit.posterior[f"x_{t}"].variance) for t in range(n)])
        np.testing.assert_allclose(got_mean, cov @ information, atol=1e-8)
        np.testing.assert_allclose(got_var, np.diag(cov), atol=1e-8)

    check(result, precision, 4.0 * y)
    online = blr_fit(random_walk_per_step, {"y": y2}, prior=result, rng_key=random.PRNGKey(0), progress_bar=False)
    assert [f.observed for f in stacked_rows(online.plan)] == [True]
    check(online, precision + 4.0 * np.eye(n), 4.0 * (y + y2))


def test_a_long_trace_run_is_evaluated_op_by_op_with_the_same_result(monkeypatch):
    """Every traced run counts as long here: evaluated operation by operation instead of
    compiled, it gives the records the compiled run gives (the fit is the closed form)."""
    monkeypatch.setattr(trace, "EAGER_EQUATIONS", 0)
    monkeypatch.setattr(engine, "_CACHE", collections.OrderedDict())
    y = ar2_series(4)
    result = blr_fit(ar2_known_scale, {"y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
    (bundle,) = engine._CACHE.values()
    assert bundle.tracer.eager
    mean, cov = closed_form(y)
    np.testing.assert_allclose(result.posterior["phi"].mean, mean, atol=1e-8)
    np.testing.assert_allclose(result.posterior["phi"].covariance_matrix, cov, atol=1e-8)


# ------------------------------------- observations that broadcast their site's distribution

NUM_GROUPS = 26
PRIOR_SD = 3.0


def replicated_groups(y):
    """One site per group, each observed as a vector its scalar distribution broadcasts
    over (``obs`` of shape (R,) for a ``Normal`` of batch shape (), as numpyro allows)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SD))
    for g in range(y.shape[0]):
        theta = numpyro.sample(f"theta_{g}", dist.Normal(mu, 1.0))
        numpyro.sample(f"y_{g}", dist.Normal(theta, 1.0), obs=y[g])


def replicated_pairs(y):
    """The same with a distribution of batch shape (2,) observed as (R, 2)."""
    mu = numpyro.sample("mu", dist.Normal(jnp.zeros(2), PRIOR_SD).to_event(1))
    for g in range(y.shape[0]):
        numpyro.sample(f"y_{g}", dist.Normal(mu + 0.1 * g, 1.0), obs=y[g])


def gaussian_posterior(precision, shift):
    cov = np.linalg.inv(precision)
    return cov @ shift, cov


def test_observations_broadcasting_their_distribution_are_stacked_exactly():
    """Each member's leaves broadcast against its own value as they do in numpyro: the
    stacked fit is the closed-form posterior of (mu, theta) (a Gaussian linear model)."""
    y = np.random.default_rng(3).normal(1.0, 1.5, size=(NUM_GROUPS, 5))
    result = blr_fit(replicated_groups, {"y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
    assert sorted(len(f.members) for f in stacked_rows(result.plan)) == [NUM_GROUPS, NUM_GROUPS]
    # joint precision of (mu, theta_0..theta_{G-1})
    size = NUM_GROUPS + 1
    precision = np.zeros((size, size))
    precision[0, 0] = 1 / PRIOR_SD**2 + NUM_GROUPS
    precision[0, 1:] = precision[1:, 0] = -1.0
    precision[1:, 1:] = np.eye(NUM_GROUPS) * (1.0 + y.shape[1])
    shift = np.concatenate([[0.0], y.sum(axis=1)])
    mean, cov = gaussian_posterior(precision, shift)
    got = np.array([result.posterior["mu"].mean] + [result.posterior[f"theta_{g}"].mean for g in range(NUM_GROUPS)])
    np.testing.assert_allclose(got, mean, atol=1e-6)
    sds = np.array([result.posterior[f"theta_{g}"].scale for g in range(NUM_GROUPS)])
    # the marginal sds of a mean-field or a joint q: between the conditional and the marginal
    assert np.all(sds <= np.sqrt(np.diag(cov))[1:] + 1e-8)
    assert np.all(sds >= 1 / np.sqrt(np.diag(precision))[1:] - 1e-8)


def test_vector_observations_of_a_batched_distribution_are_stacked_exactly():
    y = np.random.default_rng(4).normal(size=(NUM_GROUPS, 3, 2))
    result = blr_fit(replicated_pairs, {"y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
    assert [len(f.members) for f in stacked_rows(result.plan)] == [NUM_GROUPS]
    count = NUM_GROUPS * y.shape[1]
    offsets = 0.1 * np.arange(NUM_GROUPS)[:, None, None]
    precision = np.eye(2) * (1 / PRIOR_SD**2 + count)
    mean, cov = gaussian_posterior(precision, (y - offsets).sum(axis=(0, 1)))
    q = result.posterior["mu"]
    np.testing.assert_allclose(q.mean, mean, atol=1e-8)
    np.testing.assert_allclose(np.diag(q.covariance_matrix), np.diag(cov), atol=1e-8)
