"""Conjugate models end to end: one BLR step with ρ = 1 is the exact posterior.

For a factor that is conjugate to a block, E_q[log f] is linear in the block's expectation
parameters, so its message λ̃ = ∇_μ E_q[log f] does not depend on q; with every factor
conjugate and ρ = 1 the first step sets λ to prior + Σ messages, which is the exact
posterior (DESIGN.md §2, "conjugate Bayes"). Every expected posterior below is computed by
hand from the textbook closed form, never from the library.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from blrppl.api import blr_fit
from checks import assert_every_site_exports
from describe_table import factor_rows

ATOL = 1e-6


# ---------------------------------------------------------------------------------------
# cases: model, data, exact posterior parameters, how to read them from the result
# ---------------------------------------------------------------------------------------


def case_linreg():
    """Bayesian linear regression, known noise, intercept column in X."""
    rng = np.random.default_rng(0)
    n, d = 40, 3
    x = np.column_stack([np.ones(n), rng.normal(size=(n, d - 1))])
    w_true = np.array([0.5, 1.0, -2.0])
    s, sigma = 2.0, 0.7
    y = x @ w_true + sigma * rng.normal(size=n)

    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, s).expand([d]).to_event(1))
        with numpyro.plate("n", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)

    precision = np.eye(d) / s**2 + x.T @ x / sigma**2
    cov = np.linalg.inv(precision)
    mean = cov @ (x.T @ y) / sigma**2

    def read(post):
        q = post["w"]
        return {"w.mean": q.mean, "w.cov": q.covariance_matrix}

    return model, {"X": x, "y": y}, {"w.mean": mean, "w.cov": cov}, read


def case_normal_normal():
    """Normal mean with known variance."""
    rng = np.random.default_rng(1)
    m0, s0, sigma = 1.0, 2.0, 0.5
    y = 3.0 + sigma * rng.normal(size=25)

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(m0, s0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, sigma), obs=y)

    precision = 1 / s0**2 + len(y) / sigma**2
    mean = (m0 / s0**2 + y.sum() / sigma**2) / precision

    def read(post):
        q = post["mu"]
        return {"mu.mean": q.mean, "mu.var": q.variance}

    return model, {"y": y}, {"mu.mean": mean, "mu.var": 1 / precision}, read


def case_beta_bernoulli():
    a, b = 2.0, 3.0
    y = np.array([1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1], dtype=float)

    def model(y):
        p = numpyro.sample("p", dist.Beta(a, b))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(p), obs=y)

    def read(post):
        q = post["p"]
        return {"p.a": q.concentration1, "p.b": q.concentration0}

    expected = {"p.a": a + y.sum(), "p.b": b + len(y) - y.sum()}
    return model, {"y": y}, expected, read


def case_uniform_binomial():
    """Per-group success probabilities with uniform priors (a Beta(1, 1) by another name)."""
    total = np.array([10, 25, 4], dtype=float)
    hits = np.array([3, 20, 4], dtype=float)

    def model(total, hits):
        with numpyro.plate("group", total.shape[0]):
            p = numpyro.sample("p", dist.Uniform(0.0, 1.0))
            numpyro.sample("hits", dist.Binomial(total, probs=p), obs=hits)

    def read(post):
        q = post["p"]
        return {"p.a": q.concentration1, "p.b": q.concentration0}

    expected = {"p.a": 1.0 + hits, "p.b": 1.0 + total - hits}
    return model, {"total": total, "hits": hits}, expected, read


def case_dirichlet_multinomial():
    """Each region's category shares, rows of counts with their own totals (NumPyro's
    ``Multinomial(total_count, probs)``): Dirichlet(α + the region's summed counts)."""
    alpha = np.array([1.0, 0.5, 2.0])
    region = np.array([0, 1, 1, 0, 2, 1])
    counts = np.array([[3, 0, 2], [1, 1, 8], [0, 4, 0], [2, 2, 2], [5, 0, 1], [0, 0, 3]], dtype=float)

    def model(region, counts):
        with numpyro.plate("regions", 3):
            shares = numpyro.sample("shares", dist.Dirichlet(jnp.asarray(alpha)))
        with numpyro.plate("rows", counts.shape[0]):
            numpyro.sample("counts", dist.Multinomial(counts.sum(-1), shares[region]), obs=counts)

    def read(post):
        return {"shares.alpha": post["shares"].concentration}

    expected = alpha + np.stack([counts[region == r].sum(0) for r in range(3)])
    return model, {"region": region, "counts": counts}, {"shares.alpha": expected}, read


def case_gamma_poisson():
    a, b = 2.0, 1.5
    y = np.array([3, 4, 2, 5, 0, 7, 3], dtype=float)

    def model(y):
        lam = numpyro.sample("lam", dist.Gamma(a, b))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Poisson(lam), obs=y)

    def read(post):
        q = post["lam"]
        return {"lam.shape": q.concentration, "lam.rate": q.rate}

    return model, {"y": y}, {"lam.shape": a + y.sum(), "lam.rate": b + len(y)}, read


def case_dirichlet_categorical():
    alpha = np.array([1.0, 0.5, 2.0, 1.5])
    y = np.array([0, 1, 1, 2, 2, 2, 3, 0, 2, 2, 1], dtype=np.int32)

    def model(y):
        pi = numpyro.sample("pi", dist.Dirichlet(jnp.asarray(alpha)))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Categorical(pi), obs=y)

    counts = np.bincount(y, minlength=len(alpha)).astype(float)

    def read(post):
        return {"pi.alpha": post["pi"].concentration}

    return model, {"y": y}, {"pi.alpha": alpha + counts}, read


def case_plated_gaussian():
    """Per-group means a_g in a plate, observations y_n ~ N(a[group_n], σ) in another
    plate; group 4 has no observation (its posterior is the prior)."""
    rng = np.random.default_rng(2)
    g_size, n = 5, 30
    m0, s0, sigma = 0.5, 3.0, 0.8
    group = rng.integers(0, g_size - 1, size=n).astype(np.int32)
    a_true = np.array([-2.0, 0.0, 1.0, 4.0, 0.0])
    y = a_true[group] + sigma * rng.normal(size=n)

    def model(group, y):
        with numpyro.plate("g", g_size):
            a = numpyro.sample("a", dist.Normal(m0, s0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(a[group], sigma), obs=y)

    counts = np.bincount(group, minlength=g_size)
    sums = np.bincount(group, weights=y, minlength=g_size)
    precision = 1 / s0**2 + counts / sigma**2
    mean = (m0 / s0**2 + sums / sigma**2) / precision
    assert counts[-1] == 0

    def read(post):
        q = post["a"]
        return {"a.mean": q.mean, "a.var": q.variance}

    return model, {"group": group, "y": y}, {"a.mean": mean, "a.var": 1 / precision}, read


def case_grouped_regression():
    """A regression per group with 20 coefficients each (more than the 16 rows from which a
    batch of dense precisions is inverted by halves), known noise, each group its own design."""
    rng = np.random.default_rng(5)
    g, d, n = 3, 20, 90
    group = np.repeat(np.arange(g), n // g)
    x = rng.normal(size=(n, d))
    beta_true = rng.normal(size=(g, d))
    s, sigma = 1.5, 0.4
    y = np.sum(x * beta_true[group], -1) + sigma * rng.normal(size=n)

    def model(X, group, y):
        with numpyro.plate("groups", g):
            beta = numpyro.sample("beta", dist.Normal(0.0, s).expand([d]).to_event(1))
        with numpyro.plate("n", X.shape[0]):
            numpyro.sample("y", dist.Normal(jnp.sum(X * beta[group], -1), sigma), obs=y)

    precision = np.stack([np.eye(d) / s**2 + x[group == k].T @ x[group == k] / sigma**2 for k in range(g)])
    cov = np.linalg.inv(precision)
    mean = np.stack([cov[k] @ x[group == k].T @ y[group == k] / sigma**2 for k in range(g)])

    def read(post):
        q = post["beta"]
        return {"beta.mean": q.mean, "beta.cov": q.covariance_matrix}

    return model, {"X": x, "group": group, "y": y}, {"beta.mean": mean, "beta.cov": cov}, read


CASES = {
    "linreg": case_linreg,
    "normal_normal": case_normal_normal,
    "beta_bernoulli": case_beta_bernoulli,
    "uniform_binomial": case_uniform_binomial,
    "gamma_poisson": case_gamma_poisson,
    "dirichlet_categorical": case_dirichlet_categorical,
    "dirichlet_multinomial": case_dirichlet_multinomial,
    "plated_gaussian": case_plated_gaussian,
    "grouped_regression": case_grouped_regression,
}


# ---------------------------------------------------------------------------------------
# fits, shared between tests
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    model, data, expected, read = CASES[request.param]()
    one_step = blr_fit(
        model, data, num_steps=1, learning_rate=1.0, rng_key=jax.random.key(0), progress_bar=False
    )
    default = blr_fit(model, data, rng_key=jax.random.key(0), progress_bar=False)
    return {"expected": expected, "read": read, "one_step": one_step, "default": default, "model": (model, data)}


def assert_params(result, case):
    got = case["read"](result.posterior)
    assert set(got) == set(case["expected"])
    for key, want in case["expected"].items():
        np.testing.assert_allclose(np.asarray(got[key]), want, rtol=0, atol=ATOL, err_msg=key)
        assert np.all(np.isfinite(np.asarray(got[key]))), key



# ---------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------


def test_one_step_is_exact_posterior(case):
    result = case["one_step"]
    assert result.num_steps == 1
    assert len(result.elbo) == 1 and np.isfinite(result.elbo[0])
    assert_params(result, case)


def test_default_call_converges_to_exact_posterior(case):
    result = case["default"]
    assert result.converged, result.message
    assert np.all(np.isfinite(result.elbo))
    assert_params(result, case)


def test_every_factor_is_exact(case):
    for result in (case["one_step"], case["default"]):
        plan = result.plan
        assert plan.factors
        for factor in plan.factors:
            assert factor.estimator == "exact", (factor.name, factor.estimator)
        rows = factor_rows(plan.describe())
        assert set(rows) == {f.name for f in plan.factors}
        for name, row in rows.items():
            assert row["estimator"] == "exact", (name, row)


def test_default_detects_every_block_conjugate(case):
    conj = dict(case["default"].plan.conjugate)
    assert conj and all(conj.values()), conj


def test_samples_match_posterior_shapes(case):
    result = case["one_step"]
    draws = result.sample(jax.random.key(3), 7)
    for name, q in result.posterior.items():
        shape = tuple(q.batch_shape) + tuple(q.event_shape)
        assert np.shape(draws[name]) == (7,) + shape, name
        assert np.all(np.isfinite(np.asarray(draws[name]))), name


def test_every_site_exports_mean_variance_and_draws(case):
    assert_every_site_exports(case["default"], *case["model"])
