"""Conditionally conjugate models: the sequential schedule with ρ = 1 is variational message
passing (Winn & Bishop), so the fit must land on the mean-field fixed point, and the ELBO
must never decrease along the run (each block update is an exact coordinate ascent step).

The references are computed here by iterating the textbook closed-form mean-field updates
to convergence (Bishop, PRML §10.1.3, eqs. 10.26–10.30 for the Normal–Gamma model).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from blrppl.api import blr_fit

ATOL = 1e-6


def _load_sibling(name):
    """Models of another test module (loaded by path: independent of pytest's import mode)."""
    spec = importlib.util.spec_from_file_location(f"_blrppl_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fit(model, data, **kw):
    kw.setdefault("rng_key", jax.random.key(0))
    return blr_fit(model, data, progress_bar=False, **kw)


# ---------------------------------------------------------------------------------------
# (a) Normal with unknown mean and precision: PRML 10.26–10.30
# ---------------------------------------------------------------------------------------

NG = dict(a0=2.0, b0=1.5, mu0=0.5, lambda0=2.0)


def normal_gamma_model(y):
    tau = numpyro.sample("tau", dist.Gamma(NG["a0"], NG["b0"]))
    mu = numpyro.sample("mu", dist.Normal(NG["mu0"], 1 / jnp.sqrt(NG["lambda0"] * tau)))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1 / jnp.sqrt(tau)), obs=y)


def normal_gamma_data():
    rng = np.random.default_rng(10)
    return 1.3 + 2.0 * rng.normal(size=30)


def prml_fixed_point(x, a0, b0, mu0, lambda0, iters=10_000):
    """Iterate PRML eqs. 10.26–10.30 to convergence."""
    n, xbar = len(x), x.mean()
    mu_n = (lambda0 * mu0 + n * xbar) / (lambda0 + n)  # 10.26, fixed
    a_n = a0 + (n + 1) / 2  # 10.29, fixed
    e_tau = a0 / b0
    for _ in range(iters):
        lambda_n = (lambda0 + n) * e_tau  # 10.27
        var_mu = 1 / lambda_n
        # E_mu[Σ(x_n − μ)² + λ0(μ − μ0)²]
        e_sq = np.sum((x - mu_n) ** 2) + n * var_mu + lambda0 * ((mu_n - mu0) ** 2 + var_mu)
        b_n = b0 + 0.5 * e_sq  # 10.30
        new = a_n / b_n
        if abs(new - e_tau) < 1e-14 * new:
            e_tau = new
            break
        e_tau = new
    else:
        raise AssertionError("PRML iteration did not converge")
    lambda_n = (lambda0 + n) * e_tau
    return {"mu.mean": mu_n, "mu.var": 1 / lambda_n, "tau.shape": a_n, "tau.rate": b_n}


@pytest.fixture(scope="module")
def normal_gamma_fit():
    y = normal_gamma_data()
    return fit(normal_gamma_model, {"y": y}, tol=1e-14, num_steps=500), y


def test_normal_gamma_matches_prml_fixed_point(normal_gamma_fit):
    result, y = normal_gamma_fit
    assert result.converged, result.message
    want = prml_fixed_point(y, **NG)
    q_mu, q_tau = result.posterior["mu"], result.posterior["tau"]
    got = {
        "mu.mean": q_mu.mean,
        "mu.var": q_mu.variance,
        "tau.shape": q_tau.concentration,
        "tau.rate": q_tau.rate,
    }
    for key, value in want.items():
        np.testing.assert_allclose(np.asarray(got[key]), value, rtol=0, atol=ATOL, err_msg=key)


# ---------------------------------------------------------------------------------------
# (b) linear regression with a Gamma noise precision
# ---------------------------------------------------------------------------------------

LR = dict(s=3.0, a0=2.0, b0=1.0)


def linreg_gamma_model(X, y):
    w = numpyro.sample("w", dist.Normal(0.0, LR["s"]).expand([X.shape[1]]).to_event(1))
    tau = numpyro.sample("tau", dist.Gamma(LR["a0"], LR["b0"]))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1 / jnp.sqrt(tau)), obs=y)


def linreg_gamma_data():
    rng = np.random.default_rng(11)
    n = 35
    x = np.column_stack([np.ones(n), rng.normal(size=(n, 2))])
    y = x @ np.array([1.0, -0.5, 2.0]) + 0.6 * rng.normal(size=n)
    return x, y


def linreg_fixed_point(x, y, s, a0, b0, iters=10_000):
    """Mean-field q(w) q(τ): iterate the closed-form coordinate updates to convergence."""
    n, d = x.shape
    s0 = np.eye(d) / s**2
    m0 = np.zeros(d)
    xtx, xty = x.T @ x, x.T @ y
    a_n = a0 + n / 2
    e_tau = a0 / b0
    for _ in range(iters):
        precision = s0 + e_tau * xtx
        cov = np.linalg.inv(precision)
        m = cov @ (e_tau * xty + s0 @ m0)
        b_n = b0 + 0.5 * (np.sum((y - x @ m) ** 2) + np.trace(xtx @ cov))
        new = a_n / b_n
        if abs(new - e_tau) < 1e-14 * new:
            e_tau = new
            break
        e_tau = new
    else:
        raise AssertionError("mean-field iteration did not converge")
    precision = s0 + e_tau * xtx
    cov = np.linalg.inv(precision)
    m = cov @ (e_tau * xty + s0 @ m0)
    return {"w.mean": m, "w.cov": cov, "tau.shape": a_n, "tau.rate": b_n}


@pytest.fixture(scope="module")
def linreg_gamma_fit():
    x, y = linreg_gamma_data()
    return fit(linreg_gamma_model, {"X": x, "y": y}, tol=1e-14, num_steps=500), (x, y)


def test_linreg_gamma_matches_mean_field_fixed_point(linreg_gamma_fit):
    result, (x, y) = linreg_gamma_fit
    assert result.converged, result.message
    want = linreg_fixed_point(x, y, **LR)
    q_w, q_tau = result.posterior["w"], result.posterior["tau"]
    got = {
        "w.mean": q_w.mean,
        "w.cov": q_w.covariance_matrix,
        "tau.shape": q_tau.concentration,
        "tau.rate": q_tau.rate,
    }
    for key, value in want.items():
        np.testing.assert_allclose(np.asarray(got[key]), value, rtol=0, atol=ATOL, err_msg=key)


# ---------------------------------------------------------------------------------------
# (c) monotone ELBO along VMP runs
# ---------------------------------------------------------------------------------------


def random_intercepts_model(group, y, num_groups):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    tau_a = numpyro.sample("tau_a", dist.Gamma(2.0, 1.0))
    tau_y = numpyro.sample("tau_y", dist.Gamma(2.0, 1.0))
    with numpyro.plate("g", num_groups):
        a = numpyro.sample("a", dist.Normal(mu, 1 / jnp.sqrt(tau_a)))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(a[group], 1 / jnp.sqrt(tau_y)), obs=y)


def random_intercepts_data():
    rng = np.random.default_rng(12)
    num_groups, n = 6, 60
    group = rng.integers(0, num_groups, size=n).astype(np.int32)
    a = 2.0 + 1.5 * rng.normal(size=num_groups)
    y = a[group] + 0.7 * rng.normal(size=n)
    return {"group": group, "y": y, "num_groups": num_groups}


def gmm_model(y):
    k = 3
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(k)))
    with numpyro.plate("k", k):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        tau = numpyro.sample("tau", dist.Gamma(2.0, 2.0))
    with numpyro.plate("n", y.shape[0]):
        z = numpyro.sample("z", dist.Categorical(w))
        numpyro.sample("y", dist.Normal(mu[z], 1 / jnp.sqrt(tau[z])), obs=y)


def gmm_data():
    rng = np.random.default_rng(13)
    z = rng.choice(3, size=150, p=[0.2, 0.3, 0.5])
    return {"y": np.array([-5.0, 0.0, 6.0])[z] + 0.7 * rng.normal(size=150)}


def _vmp_cases():
    conj = _load_sibling("test_conjugate")
    cases = {}
    for name, build in conj.CASES.items():
        model, data, _, _ = build()
        cases[f"conjugate-{name}"] = (model, data)
    cases["random_intercepts"] = (random_intercepts_model, random_intercepts_data())
    cases["gmm"] = (gmm_model, gmm_data())
    return cases


VMP_CASES = _vmp_cases()


def assert_monotone(elbo):
    elbo = np.asarray(elbo)
    assert elbo.size >= 1 and np.all(np.isfinite(elbo))
    drops = elbo[:-1] - elbo[1:]
    allowed = 1e-9 * np.abs(elbo[1:])
    worst = int(np.argmax(drops - allowed)) if drops.size else 0
    assert np.all(drops <= allowed), (
        f"ELBO decreased at step {worst + 1}: {elbo[worst]!r} -> {elbo[worst + 1]!r}"
    )


@pytest.mark.parametrize("name", list(VMP_CASES))
def test_vmp_elbo_is_monotone(name):
    model, data = VMP_CASES[name]
    # VMP: sequential schedule, ρ = 1 for every block
    result = fit(model, data, schedule="sequential", learning_rate=1.0, num_steps=300)
    assert_monotone(result.elbo)
    assert result.converged, result.message


def test_vmp_elbo_is_monotone_normal_gamma(normal_gamma_fit):
    result, _ = normal_gamma_fit
    assert result.num_steps > 2
    assert_monotone(result.elbo)


def test_vmp_elbo_is_monotone_linreg_gamma(linreg_gamma_fit):
    result, _ = linreg_gamma_fit
    assert result.num_steps > 2
    assert_monotone(result.elbo)


def test_default_rho_is_one_for_conditionally_conjugate_blocks(normal_gamma_fit, linreg_gamma_fit):
    for result, _ in (normal_gamma_fit, linreg_gamma_fit):
        conj = dict(result.plan.conjugate)
        assert conj and all(conj.values()), conj
        assert all(f.estimator == "exact" for f in result.plan.factors)
