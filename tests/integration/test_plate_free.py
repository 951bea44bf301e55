"""Latent matrices written without plates are fitted as if their rows were declared in one.

Users write latent matrices as ``numpyro.sample("X", dist.Normal(0, 1).expand([N, D]).to_event(2))``
as often as with ``numpyro.plate``. The prior holds the rows independent, and each row of
the likelihood reads one row (``X @ C.T``, ``b[group]``): the compiler reads the rows from
the site's distribution (:meth:`blrppl.model.records.SiteRecord.row_axes`) and the factors'
forms, so the plate-free model gets the plate version's plan and posterior. Before, the
matrix was one dense Gaussian whose likelihood was read by Monte Carlo (PCA at N = 500:
unfinished after 16 minutes). Each model here is fitted both ways and compared; the time
of the PCA at full size is in the bench.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import blr_fit

numpyro.enable_x64()

# ----------------------------------------------------------------------- probabilistic PCA

N, M, D = 500, 20, 10


def pca_plates(Y):
    with numpyro.plate("features", M):
        C = numpyro.sample("C", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("rows", N):
        X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        numpyro.sample("Y", dist.Normal(X @ C.T, sigma).to_event(1), obs=Y)


def pca_free(Y):
    X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([N, D]).to_event(2))
    C = numpyro.sample("C", dist.Normal(0.0, 1.0).expand([M, D]).to_event(2))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    numpyro.sample("Y", dist.Normal(X @ C.T, sigma).to_event(2), obs=Y)


def pca_data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, D)) @ rng.normal(size=(M, D)).T + 0.5 * rng.normal(size=(N, M))


def draws(result, site, n=4000):
    return np.asarray(result.sample(random.PRNGKey(1), n)[site])


@pytest.fixture(scope="module")
def pca_fits():
    Y = pca_data()
    kw = dict(rng_key=random.PRNGKey(0), progress_bar=False)
    return blr_fit(pca_plates, Y, **kw), blr_fit(pca_free, Y, **kw)


def test_plate_free_pca_gets_the_plate_versions_plan(pca_fits):
    plates, free = pca_fits
    shapes = {b.name: b.batch_shape for b in free.plan.blocks}
    assert shapes["X"] == (N,) and shapes["C"] == (M,)
    (likelihood,) = [f for f in free.plan.factors if f.name == "Y"]
    assert likelihood.estimator == "exact", free.plan.describe()
    assert free.posterior["X"].event_shape == (N, D)  # the site's own shape


def test_plate_free_pca_gets_the_plate_versions_posterior(pca_fits):
    plates, free = pca_fits
    a, b = draws(plates, "sigma"), draws(free, "sigma")
    # the noise sd within 1 % (its posterior sd is about 0.4 % of its mean: 4,000 draws put
    # the draws' mean within 0.01 % and their sd within 2.5 % of q's)
    np.testing.assert_allclose(b.mean(), a.mean(), rtol=0.01)
    np.testing.assert_allclose(b.std(), a.std(), rtol=0.1)
    # the identified reconstruction X Cᵀ (the factors themselves only up to rotation)
    recon = lambda r: np.asarray(r.posterior["X"].mean) @ np.asarray(r.posterior["C"].mean).T  # noqa: E731
    scale = np.std(recon(plates))
    assert np.max(np.abs(recon(free) - recon(plates))) < 0.05 * scale


# ----------------------------------------------------------------- random effects per group

G, PER_GROUP = 12, 8
SIGMA_Y = 0.5


def effects_data():
    rng = np.random.default_rng(1)
    group = np.repeat(np.arange(G), PER_GROUP)
    x = rng.normal(size=G * PER_GROUP)
    b = rng.normal(size=(G, 2))
    y = b[group, 0] + b[group, 1] * x + SIGMA_Y * rng.normal(size=G * PER_GROUP)
    return {"group": group, "x": x, "y": y}


def effects_plates(group, x, y):
    with numpyro.plate("groups", G):
        b = numpyro.sample("b", dist.Normal(jnp.zeros(2), 1.0).to_event(1))
    numpyro.sample("y", dist.Normal(b[group, 0] + b[group, 1] * x, SIGMA_Y).to_event(1), obs=y)


def effects_free(group, x, y):
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([G, 2]).to_event(2))
    numpyro.sample("y", dist.Normal(b[group, 0] + b[group, 1] * x, SIGMA_Y).to_event(1), obs=y)


def test_plate_free_random_effects_are_exact_as_with_a_plate():
    """A conjugate model: both plans give the exact posterior, each group's (intercept,
    slope) an independent Gaussian (to 1e-8)."""
    data = effects_data()
    kw = dict(rng_key=random.PRNGKey(0), progress_bar=False)
    free = blr_fit(effects_free, data, **kw)
    assert {b.name: b.batch_shape for b in free.plan.blocks}["b"] == (G,)
    plates = blr_fit(effects_plates, data, **kw)
    q = free.posterior["b"].base_dist
    for g in range(G):
        rows = data["group"] == g
        design = np.column_stack([np.ones(rows.sum()), data["x"][rows]])
        precision = np.eye(2) + design.T @ design / SIGMA_Y**2
        cov = np.linalg.inv(precision)
        mean = cov @ design.T @ data["y"][rows] / SIGMA_Y**2
        np.testing.assert_allclose(q.mean[g], mean, atol=1e-8)
        np.testing.assert_allclose(q.covariance_matrix[g], cov, atol=1e-8)
    np.testing.assert_allclose(q.mean, plates.posterior["b"].mean, atol=1e-8)


# ------------------------------------------------------------------------- a factor model

NF, MF, DF = 40, 6, 2


def factor_data():
    rng = np.random.default_rng(2)
    return rng.normal(size=(NF, DF)) @ rng.normal(size=(MF, DF)).T + rng.normal(size=MF) + 0.3 * rng.normal(size=(NF, MF))


def factor_plates(Y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([MF]).to_event(1))
    psi = numpyro.sample("psi", dist.Gamma(1.0, 1.0).expand([MF]).to_event(1))
    with numpyro.plate("columns", MF):
        W = numpyro.sample("W", dist.Normal(0.0, 1.0).expand([DF]).to_event(1))
    with numpyro.plate("rows", NF):
        X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([DF]).to_event(1))
        numpyro.sample("Y", dist.Normal(jnp.einsum("nd,md->nm", X, W) + mu, 1 / jnp.sqrt(psi)).to_event(1), obs=Y)


def factor_free(Y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([MF]).to_event(1))
    psi = numpyro.sample("psi", dist.Gamma(1.0, 1.0).expand([MF]).to_event(1))
    W = numpyro.sample("W", dist.Normal(0.0, 1.0).expand([MF, DF]).to_event(2))
    X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([NF, DF]).to_event(2))
    numpyro.sample("Y", dist.Normal(jnp.einsum("nd,md->nm", X, W) + mu, 1 / jnp.sqrt(psi)).to_event(2), obs=Y)


def test_plate_free_factor_model_gets_the_plate_versions_fit():
    """Both plans are the same coordinate steps (variational message passing): after the
    same number of steps the identified quantities agree to rounding."""
    Y = factor_data()
    kw = dict(rng_key=random.PRNGKey(0), progress_bar=False, num_steps=30, tol=1e-30)
    plates, free = blr_fit(factor_plates, Y, **kw), blr_fit(factor_free, Y, **kw)
    assert {b.name: b.batch_shape for b in free.plan.blocks}["X"] == (NF,)
    for site in ("mu", "psi"):
        np.testing.assert_allclose(free.posterior[site].mean, plates.posterior[site].mean, rtol=1e-6)
    recon = lambda r: np.asarray(r.posterior["X"].mean) @ np.asarray(r.posterior["W"].mean).T  # noqa: E731
    np.testing.assert_allclose(recon(free), recon(plates), atol=1e-6)


# ------------------------------------------------- rows that a factor mixes: dense again

ROWS_MIXED = 300


def column_sums(y):
    """y_j ~ N(Σ_i X_ij, 1): the sum over the rows couples them (600 scalars in all)."""
    X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([ROWS_MIXED, 2]).to_event(2))
    numpyro.sample("y", dist.Normal(X.sum(0), 1.0).to_event(1), obs=y)


def test_rows_a_factor_mixes_are_one_dense_block_at_any_size():
    """No plate declared the rows, so a factor mixing them makes the site one dense block
    again (past the 500 scalars a declared plate would stay row-wise at): the exact
    posterior, each column's precision I + 11ᵀ."""
    y = np.array([3.0, -1.5])
    result = blr_fit(column_sums, {"y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
    (block,) = result.plan.blocks
    assert block.batch_shape == () and block.size == 2 * ROWS_MIXED
    q = result.posterior["X"]
    np.testing.assert_allclose(np.asarray(q.mean), np.tile(y / (ROWS_MIXED + 1), (ROWS_MIXED, 1)), atol=1e-8)
    sds = np.asarray(result.sample(random.PRNGKey(1), 20000)["X"]).std(axis=0)
    # 20,000 draws: an sd within about 1 % of q's (3 of its standard errors: 1.5 %)
    np.testing.assert_allclose(sds, np.sqrt(1 - 1 / (ROWS_MIXED + 1)), rtol=0.03)
