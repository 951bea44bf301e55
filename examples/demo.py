"""Fit a few models with blr_fit and print each posterior next to its exact answer.

Run with ``make demo`` (or ``python examples/demo.py``).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

numpyro.enable_x64()

from blrppl import blr_fit  # noqa: E402


def show(title, rows, result, seconds):
    print(f"\n== {title}  ({result.num_steps} steps, {seconds:.2f} s; {result.message})")
    width = max(len(r[0]) for r in rows)
    print(f"  {'quantity'.ljust(width)}  {'blr_fit':>12}  {'exact':>12}")
    for name, got, want in rows:
        for g, w in zip(np.ravel(got), np.ravel(want)):
            print(f"  {name.ljust(width)}  {g:12.6f}  {w:12.6f}")


def fit(model, data, **kw):
    t = time.perf_counter()
    result = blr_fit(model, data, progress_bar=False, **kw)
    return result, time.perf_counter() - t


def normal_normal():
    def model(y):
        mu = numpyro.sample("mu", dist.Normal(1.0, 2.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 0.5), obs=y)

    y = 3.0 + jax.random.normal(jax.random.key(1), (20,))
    res, sec = fit(model, {"y": y})
    prec = 1 / 2.0**2 + y.size / 0.5**2
    mean = (1.0 / 2.0**2 + y.sum() / 0.5**2) / prec
    post = res.posterior["mu"]
    show("Normal-Normal", [("mean mu", post.mean, mean), ("var mu", post.variance, 1 / prec)], res, sec)


def beta_bernoulli():
    def model(y):
        p = numpyro.sample("p", dist.Beta(2.0, 3.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(p), obs=y)

    y = jnp.array([1, 0, 1, 1, 1, 0, 1, 1, 0, 1.0])
    res, sec = fit(model, {"y": y})
    post = res.posterior["p"]
    rows = [
        ("alpha", post.concentration1, 2.0 + y.sum()),
        ("beta", post.concentration0, 3.0 + y.size - y.sum()),
    ]
    show("Beta-Bernoulli", rows, res, sec)


def gamma_poisson():
    def model(y):
        rate = numpyro.sample("rate", dist.Gamma(2.0, 1.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Poisson(rate), obs=y)

    y = jnp.array([3, 4, 2, 5, 6, 3.0])
    res, sec = fit(model, {"y": y})
    post = res.posterior["rate"]
    rows = [("shape", post.concentration, 2.0 + y.sum()), ("rate", post.rate, 1.0 + y.size)]
    show("Gamma-Poisson", rows, res, sec)


def linear_regression():
    n, d, sigma = 100, 3, 0.3
    x = jnp.concatenate([jnp.ones((n, 1)), jax.random.normal(jax.random.key(2), (n, d - 1))], 1)
    y = x @ jnp.array([0.5, -1.0, 2.0]) + sigma * jax.random.normal(jax.random.key(3), (n,))

    def model(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
        with numpyro.plate("n", x.shape[0]):
            numpyro.sample("y", dist.Normal(x @ w, sigma), obs=y)

    res, sec = fit(model, (x, y))
    prec = jnp.eye(d) + x.T @ x / sigma**2
    mean = jnp.linalg.solve(prec, x.T @ y / sigma**2)
    post = res.posterior["w"]
    rows = [("mean w", post.mean, mean), ("var w", jnp.diag(post.covariance_matrix), jnp.diag(jnp.linalg.inv(prec)))]
    show("Bayesian linear regression (known noise)", rows, res, sec)


def normal_gamma():
    a0, b0, mu0, lam0 = 2.0, 1.0, 0.0, 0.5

    def model(y):
        tau = numpyro.sample("tau", dist.Gamma(a0, b0))
        mu = numpyro.sample("mu", dist.Normal(mu0, 1 / jnp.sqrt(lam0 * tau)))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1 / jnp.sqrt(tau)), obs=y)

    y = 1.0 + 2.0 * jax.random.normal(jax.random.key(4), (30,))
    res, sec = fit(model, {"y": y}, tol=1e-14)
    # fixed point of Bishop PRML eqs. 10.26-10.30
    n, ybar = y.size, y.mean()
    e_tau = a0 / b0
    for _ in range(500):
        mu_n = (lam0 * mu0 + n * ybar) / (lam0 + n)
        lam_n = (lam0 + n) * e_tau
        a_n = a0 + (n + 1) / 2
        e_sq = jnp.sum((y - mu_n) ** 2) + n / lam_n + lam0 * ((mu_n - mu0) ** 2 + 1 / lam_n)
        b_n = b0 + 0.5 * e_sq
        e_tau = a_n / b_n
    rows = [
        ("mean mu", res.posterior["mu"].mean, mu_n),
        ("var mu", res.posterior["mu"].variance, 1 / lam_n),
        ("shape tau", res.posterior["tau"].concentration, a_n),
        ("rate tau", res.posterior["tau"].rate, b_n),
    ]
    show("Normal with unknown mean and precision (VMP vs PRML 10.26-10.30)", rows, res, sec)


def gaussian_mixture():
    k = 3

    # (the components' sd is known: with a Gamma precision per component as well, each
    # component's mean and precision are fitted apart, and the fit warns, rightly, that the
    # precisions' sds come out about 20 % too small)
    def model(y):
        w = numpyro.sample("w", dist.Dirichlet(jnp.ones(k)))
        with numpyro.plate("components", k):
            mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("n", y.shape[0]):
            z = numpyro.sample("z", dist.Categorical(w))
            numpyro.sample("y", dist.Normal(mu[z], 0.7), obs=y)

    rng = np.random.default_rng(0)
    true_mu, true_w = np.array([-5.0, 0.0, 6.0]), np.array([0.2, 0.3, 0.5])
    z = rng.choice(k, 300, p=true_w)
    y = jnp.asarray(true_mu[z] + 0.7 * rng.normal(size=300))
    res, sec = fit(model, {"y": y})
    order = np.argsort(np.asarray(res.posterior["mu"].mean))
    rows = [
        ("mean mu (sorted)", np.asarray(res.posterior["mu"].mean)[order], true_mu),
        ("weight", np.asarray(res.posterior["w"].mean)[order], true_w),
    ]
    show("Gaussian mixture by VMP (vs the values that generated the data)", rows, res, sec)
    print("\n" + res.plan.describe())


if __name__ == "__main__":
    normal_normal()
    beta_bernoulli()
    gamma_poisson()
    linear_regression()
    normal_gamma()
    gaussian_mixture()
