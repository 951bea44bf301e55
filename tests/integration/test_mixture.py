"""Mixture models with discrete latents: Categorical and Bernoulli blocks, enumerated exactly.

Tolerances. The data are well-separated 1-D clusters (gaps ≥ 5 within-cluster sd), so
essentially every point is assigned to its own cluster and the fit is the conjugate posterior
given the true labels:

* a cluster mean is estimated to within sd/sqrt(N_k) ≈ 0.7/sqrt(60) ≈ 0.09 for the smallest
  cluster (N=300, weight 0.2); 0.2 is over 2 standard errors, and the test checks it for the
  fixed seed only;
* a weight's sampling error is sqrt(w(1−w)/N) ≈ sqrt(0.25/300) ≈ 0.029 at most, and the
  posterior mean under a Dirichlet(1) prior is (N_k + 1)/(N + K), a shift below 0.003;
  0.07 is over 2 standard errors.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from blrppl.api import blr_fit
from describe_table import factor_rows

N = 300
TRUE_MU = np.array([-5.0, 0.0, 6.0])
TRUE_W = np.array([0.2, 0.3, 0.5])
SD = 0.7
K = 3


def mixture_data(seed=0):
    rng = np.random.default_rng(seed)
    z = rng.choice(K, size=N, p=TRUE_W)
    return z, TRUE_MU[z] + SD * rng.normal(size=N)


def gmm_precisions(y):
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(K)))
    with numpyro.plate("k", K):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        tau = numpyro.sample("tau", dist.Gamma(2.0, 2.0))
    with numpyro.plate("n", y.shape[0]):
        z = numpyro.sample("z", dist.Categorical(w))
        numpyro.sample("y", dist.Normal(mu[z], 1 / jnp.sqrt(tau[z])), obs=y)


def gmm_known_scale(y):
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(K)))
    with numpyro.plate("k", K):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", y.shape[0]):
        z = numpyro.sample("z", dist.Categorical(w))
        numpyro.sample("y", dist.Normal(mu[z], SD), obs=y)


def two_component(y):
    p = numpyro.sample("p", dist.Beta(1.0, 1.0))
    with numpyro.plate("k", 2):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", y.shape[0]):
        z = numpyro.sample("z", dist.Bernoulli(p))
        numpyro.sample("y", dist.Normal(mu[z], SD), obs=y)


def fit(model, y):
    return blr_fit(model, {"y": y}, rng_key=jax.random.key(0), progress_bar=False)


@pytest.fixture(scope="module")
def data():
    return mixture_data()


@pytest.fixture(scope="module")
def fit_precisions(data):
    return fit(gmm_precisions, data[1])


@pytest.fixture(scope="module")
def fit_known_scale(data):
    return fit(gmm_known_scale, data[1])


# two clusters for the Bernoulli variant: component 1 has weight 0.35
TWO_MU = np.array([-2.0, 3.0])
TWO_P = 0.35


@pytest.fixture(scope="module")
def two_data():
    rng = np.random.default_rng(1)
    z = (rng.uniform(size=N) < TWO_P).astype(int)
    return z, TWO_MU[z] + SD * rng.normal(size=N)


@pytest.fixture(scope="module")
def fit_two(two_data):
    return fit(two_component, two_data[1])


def assert_recovers(result, true_mu, true_w, weights):
    """Cluster means (matched by sorting) within 0.2, weights within 0.07."""
    assert result.converged, result.message
    mu = np.asarray(result.posterior["mu"].mean)
    order = np.argsort(mu)
    np.testing.assert_allclose(mu[order], true_mu, atol=0.2)
    np.testing.assert_allclose(np.asarray(weights)[order], true_w, atol=0.07)
    return order



def block_rows(describe: str) -> dict:
    lines = describe.splitlines()
    header = re.split(r"\s{2,}", lines[0].strip())
    assert header[0] == "block"
    rows = {}
    for line in lines[2:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def assert_plan(result, discrete_family):
    plan = result.plan
    assert all(f.estimator == "exact" for f in plan.factors), plan.describe()
    text = plan.describe()
    rows = factor_rows(text)
    assert set(rows) == {f.name for f in plan.factors}
    assert all(row["estimator"] == "exact" for row in rows.values()), text
    blocks = block_rows(text)
    assert blocks["z"]["family"] == discrete_family, text
    assert plan.block("z").kind == discrete_family
    assert plan.block("z").discrete
    assert plan.block("z").value_shape == (N,)
    # z's neighbours: its prior and the likelihood, both enumerated over z
    y_factor = next(f for f in plan.factors if f.name == "y")
    assert "z" in y_factor.discrete


def label_conditioned_mean_field(y, z):
    """q(μ_k) q(τ_k) given the true labels: iterate the closed-form mean-field updates for
    μ_k ~ N(0, 10²), τ_k ~ Gamma(2, 2), y ~ N(μ_k, τ_k^(−1/2)) per cluster."""
    means, taus = [], []
    for k in range(K):
        yk = y[z == k]
        n, e_tau = len(yk), 1.0
        for _ in range(1000):
            precision = 1 / 10.0**2 + n * e_tau
            m = e_tau * yk.sum() / precision
            e_tau = (2.0 + n / 2) / (2.0 + 0.5 * (np.sum((yk - m) ** 2) + n / precision))
        means.append(m)
        taus.append(e_tau)
    return np.array(means), np.array(taus)


def test_gmm_with_precisions_recovers_clusters(fit_precisions, data):
    result = fit_precisions
    order = assert_recovers(result, TRUE_MU, TRUE_W, result.posterior["w"].mean)
    # With near-0/1 responsibilities the fit is the mean-field posterior given the true
    # labels, up to the two or three points lying between clusters (responsibility
    # 0.9–0.99): means within 0.02 (sd/sqrt(N_k) ≈ 0.09), precisions within 5%.
    want_mu, want_tau = label_conditioned_mean_field(data[1], data[0])
    mu = np.asarray(result.posterior["mu"].mean)[order]
    tau = np.asarray(result.posterior["tau"].mean)[order]
    np.testing.assert_allclose(mu, want_mu, atol=0.02)
    np.testing.assert_allclose(tau, want_tau, rtol=0.05)


def test_gmm_with_precisions_plan(fit_precisions):
    assert_plan(fit_precisions, "categorical")
    families = {b.name: b.kind for b in fit_precisions.plan.blocks}
    assert families == {"w": "dirichlet", "mu": "gaussian", "tau": "gamma", "z": "categorical"}


def test_gmm_with_precisions_assignments(fit_precisions, data):
    """The posterior responsibilities put almost every point in its true cluster."""
    result = fit_precisions
    z_true = data[0]
    order = np.argsort(np.asarray(result.posterior["mu"].mean))
    rank = np.argsort(order)  # fitted component -> rank of its mean = index of true cluster
    probs = np.asarray(result.posterior["z"].probs)
    assert probs.shape == (N, K)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-9)
    assigned = rank[np.argmax(probs, axis=-1)]
    assert np.mean(assigned == z_true) >= 0.99


def test_gmm_known_scale_recovers_clusters(fit_known_scale):
    result = fit_known_scale
    assert_recovers(result, TRUE_MU, TRUE_W, result.posterior["w"].mean)


def test_gmm_known_scale_plan(fit_known_scale):
    assert_plan(fit_known_scale, "categorical")


def test_bernoulli_mixture_recovers_clusters(fit_two, two_data):
    result = fit_two
    p = float(result.posterior["p"].mean)
    # weights of components 0 and 1 are (1 − p, p)
    assert_recovers(result, TWO_MU, np.array([1 - TWO_P, TWO_P]), np.array([1 - p, p]))
    probs = np.asarray(result.posterior["z"].probs)
    assert probs.shape == (N,)
    mu = np.asarray(result.posterior["mu"].mean)
    z_hat = (probs > 0.5).astype(int)
    if mu[0] > mu[1]:  # label switching
        z_hat = 1 - z_hat
    assert np.mean(z_hat == two_data[0]) >= 0.99


def test_bernoulli_mixture_plan(fit_two):
    assert_plan(fit_two, "bernoulli")
    families = {b.name: b.kind for b in fit_two.plan.blocks}
    assert families == {"p": "beta", "mu": "gaussian", "z": "bernoulli"}


@pytest.mark.parametrize("which", ["precisions", "known_scale", "bernoulli"])
def test_mixture_elbo_monotone(which, fit_precisions, fit_known_scale, fit_two):
    result = {"precisions": fit_precisions, "known_scale": fit_known_scale, "bernoulli": fit_two}[which]
    elbo = np.asarray(result.elbo)
    assert np.all(np.isfinite(elbo))
    assert np.all(np.diff(elbo) >= -1e-9 * np.abs(elbo[1:])), np.diff(elbo).min()


# ------------------------------------ labels enumerated with size-1 plate dims when the model allows


def _labelled(use):
    """The known-scale mixture with the label read in one of several ways."""

    def model(y):
        w = numpyro.sample("w", dist.Dirichlet(jnp.ones(K)))
        with numpyro.plate("k", K):
            mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("n", y.shape[0]):
            z = numpyro.sample("z", dist.Categorical(w))
            numpyro.sample("y", dist.Normal(use(mu, z, y.shape[0]), SD), obs=y)

    return model


LABEL_USES = {
    # (how the component mean is read, whether labels of shape (1,) give the same arguments)
    "gather": (lambda mu, z, n: mu[z], True),
    "one_hot": (lambda mu, z, n: jax.nn.one_hot(z, K) @ mu + 0.0 * z.size, True),  # (z.size: 0 × it either way)
    "reshape": (lambda mu, z, n: mu[z].reshape(n), False),  # (1,) cannot be reshaped to (N,)
    "per_element": (lambda mu, z, n: mu[z] * jnp.ones(z.shape[0]) + 1e-3 * jnp.arange(z.shape[0]), False),
}
REFERENCE = _labelled(LABEL_USES["reshape"][0])  # full labels: every element its own copy


def _fit_labelled(model, y):
    return blr_fit(model, {"y": y}, num_steps=4, tol=1e-30, rng_key=jax.random.key(0), progress_bar=False)


@pytest.mark.parametrize("name", ["gather", "one_hot", "per_element"])
def test_labels_are_broadcast_only_when_the_arguments_agree(name, data):
    use, broadcast = LABEL_USES[name]
    y = data[1][:60]
    result = _fit_labelled(_labelled(use), y)
    flags = {f.name: f.enumeration is not None and f.enumeration.broadcast for f in result.plan.factors}
    assert flags["y"] is broadcast and flags["z"] is True, flags
    # every variant takes the full labels' steps (the per-element shift: on shifted data)
    shift = 1e-3 * np.arange(60) if name == "per_element" else 0.0
    reference = _fit_labelled(REFERENCE, y - shift)
    assert not {f.name: f.enumeration is not None and f.enumeration.broadcast for f in reference.plan.factors}["y"]
    np.testing.assert_allclose(np.asarray(result.elbo), np.asarray(reference.elbo), rtol=1e-9)
    np.testing.assert_allclose(result.posterior["mu"].loc, reference.posterior["mu"].loc, rtol=1e-9, atol=1e-9)
