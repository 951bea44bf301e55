"""Normal factors linear in a large dense Gaussian block read precomputed data statistics
(``blrppl/estimators/gram.py``): the same posteriors as the closed forms, to 1e-8 (float64).

Each model has D ≥ ``gram.MIN_DIM`` coefficients so that the statistics path is taken (the
plan says so); the references are the conjugate posterior and the textbook VB fixed point.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from numpyro import handlers

from blrppl.model.program import ModelProgram
from blrppl import BLR, blr_fit
from blrppl.estimators import gram

numpyro.enable_x64()

D, N = 40, 60
RNG = np.random.default_rng(11)
X = RNG.normal(size=(N, D))
Y = X @ (RNG.normal(size=D) / np.sqrt(D)) + 0.5 * RNG.normal(size=N)
KEEP = RNG.uniform(size=N) > 0.2
assert D >= gram.MIN_DIM


def regression(X, y, keep=None, noise=0.5, prior=2.0):
    b = numpyro.sample("b", dist.Normal(0.0, prior).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]), handlers.mask(mask=True if keep is None else keep):
        numpyro.sample("y", dist.Normal(X @ b + 1.0, noise), obs=y)


def exact(X, y, noise=0.5, prior=2.0):
    prec = np.eye(X.shape[1]) / prior**2 + X.T @ X / noise**2
    cov = np.linalg.inv(prec)
    return cov @ (X.T @ (y - 1.0)) / noise**2, cov


def uses_statistics(result, site="y"):
    return (
        any(f.name == site and isinstance(f.spec.statistics, gram.GramSource) for f in result.plan.factors)
        and "data statistics" in result.plan.describe()
    )


def test_regression_is_exact_in_one_step():
    result = blr_fit(regression, (X, Y), progress_bar=False)
    assert uses_statistics(result)
    assert result.converged and result.num_steps == 1, result.message
    mean, cov = exact(X, Y)
    q = result.posterior["b"]
    np.testing.assert_allclose(q.mean, mean, atol=1e-8)
    np.testing.assert_allclose(q.covariance_matrix, cov, atol=1e-8)
    # the ELBO of a conjugate model at its exact posterior is the log evidence
    evidence = jax.scipy.stats.multivariate_normal.logpdf(
        Y, np.ones(N), X @ X.T * 4.0 + 0.25 * np.eye(N)
    )
    np.testing.assert_allclose(result.elbo[-1], evidence, rtol=1e-10)


def test_masked_rows_drop_out():
    result = blr_fit(regression, (X, Y, KEEP), progress_bar=False)
    assert uses_statistics(result)
    mean, cov = exact(X[KEEP], Y[KEEP])
    np.testing.assert_allclose(result.posterior["b"].mean, mean, atol=1e-8)
    np.testing.assert_allclose(result.posterior["b"].covariance_matrix, cov, atol=1e-8)


def test_unknown_noise_precision_reaches_the_vb_fixed_point():
    a0, b0 = 2.0, 1.0

    def model(X, y):
        tau = numpyro.sample("tau", dist.Gamma(a0, b0))
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0 / jnp.sqrt(tau)), obs=y)

    result = blr_fit(model, (X, Y), tol=1e-14, num_steps=500, progress_bar=False)
    assert uses_statistics(result)
    assert result.converged, result.message
    e_tau = a0 / b0
    for _ in range(2000):
        prec = np.eye(D) + e_tau * X.T @ X
        cov = np.linalg.inv(prec)
        m = e_tau * cov @ X.T @ Y
        a = a0 + N / 2
        b = b0 + 0.5 * (np.sum((Y - X @ m) ** 2) + np.trace(X.T @ X @ cov))
        e_tau = a / b
    # the run stops when λ moves by less than sqrt(tol) = 1e-7 relative per sweep (VMP
    # converges linearly): the fixed point to about that
    np.testing.assert_allclose(result.posterior["w"].mean, m, atol=1e-6)
    np.testing.assert_allclose(result.posterior["w"].covariance_matrix, cov, atol=1e-8)
    np.testing.assert_allclose(result.posterior["tau"].concentration, a, rtol=1e-12)
    np.testing.assert_allclose(result.posterior["tau"].rate, b, rtol=1e-6)
    assert np.all(np.diff(result.elbo) >= -1e-9 * np.abs(result.elbo[1:]))


def test_svi_drop_in_recomputes_statistics_for_new_data():
    svi = BLR(regression)
    state = svi.init(random.PRNGKey(0), X, Y)
    state, _ = svi.update(state, X, Y)
    np.testing.assert_allclose(svi.get_params(state)["b_blr_mean"], exact(X, Y)[0], atol=1e-8)
    # new data of the same shape: the statistics follow the data
    y2 = Y + 1.0
    state, _ = svi.update(state, X, y2)
    np.testing.assert_allclose(svi.get_params(state)["b_blr_mean"], exact(X, y2)[0], atol=1e-8)

    # inside the user's jit (traced data), the statistics are traced too
    @jax.jit
    def jitted(state, X, y):
        return svi.update(state, X, y)

    state, _ = jitted(state, X, Y)
    np.testing.assert_allclose(svi.get_params(state)["b_blr_mean"], exact(X, Y)[0], atol=1e-8)


AFFINE_MAPS = [
    ("residual", lambda u: Y - X @ u),
    ("broadcast and scale", lambda u: jnp.broadcast_to(2.0 * (X @ u)[:, None], (N, 3)) - 1.0),
    ("identity", lambda u: u),
    ("inside jit", jax.jit(lambda u: (X @ u) / 3.0)),
    ("row vector times transpose", lambda u: u @ X.T),
    ("gather", lambda u: u[np.arange(N) % D] * 0.5),  # not read: forward mode
]


def test_affine_jacobian_reads_products_with_constants(monkeypatch):
    """X itself for X @ u, without the product X · I that forward mode computes; other maps
    (a gather) fall back to forward mode: the same Jacobian either way."""
    real = jax.jacfwd
    fallbacks = []

    def spy(fn):
        fallbacks.append(fn)
        return real(fn)

    u0 = jnp.zeros(D)
    for name, fn in AFFINE_MAPS:
        monkeypatch.setattr(gram.jax, "jacfwd", spy)
        got = gram.affine_jacobian(fn, u0)
        monkeypatch.setattr(gram.jax, "jacfwd", real)
        np.testing.assert_allclose(got, jax.jacfwd(fn)(u0), rtol=0, atol=1e-12, err_msg=name)
    assert len(fallbacks) == 1  # the gather only


def test_gram_on_host_matches_the_device_product():
    a = RNG.normal(size=(N, D))
    stats = gram.GramStatistics(jnp.asarray(a), jnp.zeros(D), jnp.zeros(()), jnp.zeros(()), jnp.zeros(()))
    np.testing.assert_allclose(gram.gram_on_host(stats).gram, a.T @ a, rtol=1e-12)
    rows = np.zeros((N, D))
    rows[np.arange(N), np.arange(N) % D] = RNG.normal(size=N)  # one scalar per element: diagonal
    diag = gram.gram_on_host(stats._replace(gram=jnp.asarray(rows))).gram
    np.testing.assert_allclose(diag, rows.T @ rows, rtol=1e-12)


# ------------------------------------------- a prior on a plated block's own values (its rows)

ROWS, WIDTH = 5, 3
ROW_LOC = RNG.normal(size=(ROWS, 1))
ROW_SCALE = 0.5 + RNG.uniform(size=(ROWS, WIDTH))


def rows_prior(layout):
    """Rows with a per-element Normal prior (a location per row, a scale per element), in
    the plate's usual layout (rows first) or with the plate on the last axis (the block's
    canonical layout is then a transpose of the site's)."""
    loc, scale = (ROW_LOC, ROW_SCALE) if layout == "rows" else (ROW_LOC.T, ROW_SCALE.T)
    with numpyro.plate("rows", ROWS, dim=-2 if layout == "rows" else -1):
        x = numpyro.sample("x", dist.Normal(loc, scale))
    numpyro.sample("y", dist.Normal(jnp.sum(x), 1.0), obs=1.0)


def test_prior_on_a_plated_blocks_own_values_reads_means_and_variances():
    """E[Σ_e log N(x_e | loc_e, s_e²)] = Σ_e (−((m_e − loc_e)² + v_e) / (2 s_e²) − log s_e
    − ½ log 2π), with m_e and v_e each element's mean and variance under q: the statistics
    give the definition at random rows' means and covariances, in both layouts."""
    from blrppl.engine.build import plan_model
    from blrppl.families.gaussian import GaussianNat
    from blrppl.model.trace import trace_model
    from blrppl.inputs import fit_options, model_arguments

    for layout in ("rows", "columns"):
        args, kwargs = model_arguments({"layout": layout})
        records, spec, dyn, _ = trace_model(rows_prior, args, kwargs, random.PRNGKey(0))
        options = fit_options(structure="mean-field")
        plan, fns, dyn, *_ = plan_model(ModelProgram(rows_prior), records, spec, dyn, options, None, random.PRNGKey(1))
        block = plan.block("x")
        assert block.batch_shape == (ROWS,) and block.family.dense_event, plan.describe()
        (factor,) = [f for f in plan.factors if f.name == "x"]
        assert factor.spec.statistics == gram.GramSource("x"), plan.describe()
        stats = gram.statistics(fns, factor, block, dyn)
        rng = np.random.default_rng(5)
        r = rng.normal(size=(ROWS, WIDTH, WIDTH))
        prec = np.eye(WIDTH) + r @ r.transpose(0, 2, 1)
        view = block.family.rule_view(GaussianNat(jnp.asarray(rng.normal(size=(ROWS, WIDTH))), jnp.asarray(-0.5 * prec)))
        got = gram.expected_log(factor, "x", stats, {"x": view})
        m = np.asarray(view.mean)
        v = np.diagonal(np.asarray(view.cov), axis1=-2, axis2=-1)
        terms = -((m - ROW_LOC) ** 2 + v) / (2 * ROW_SCALE**2) - np.log(ROW_SCALE) - 0.5 * np.log(2 * np.pi)
        np.testing.assert_allclose(got, np.sum(terms), rtol=1e-12, err_msg=layout)
