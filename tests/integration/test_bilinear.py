"""Products of Gaussian latents (``w * x``, ``a[row] * b[col]``): variational message passing.

A Normal observation of a product of affine forms of two Gaussian blocks is quadratic in
each block given the other: its expectation needs only their first and second moments
(E[(a b)²] = E[a²] E[b²] for independent blocks), and each block's update is a conjugate
coordinate step. The blocks stay apart (mean-field between them), the factorisation of
classic VMP. The reference is the textbook coordinate-ascent VB for the model (Bishop 2006,
§10.1; Winn & Bishop 2005), written here in numpy: the fit must be its fixed point. The
fits are the first fit (``refine=False``): where its diagnostics find q poor, the refinement by
default may keep another candidate (a grid over an AR model's constrained persistence and
scale), which is not the VB fixed point these tests check.
"""

from __future__ import annotations

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.contrib.control_flow import scan

from blrppl import blr_fit

ROWS, COLS = 30, 12
MU_SD, TAU_SHAPE, TAU_RATE = 2.0, 2.0, 1.0


def rank_one_model(row, col, y=None):
    """y[k] ~ Normal(mu + a[row[k]] · b[col[k]], τ^(−½)) on the observed entries of a
    matrix (rank-1 matrix factorisation with a mean)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, MU_SD))
    tau = numpyro.sample("tau", dist.Gamma(TAU_SHAPE, TAU_RATE))
    with numpyro.plate("rows", ROWS):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    with numpyro.plate("cols", COLS):
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("entries", len(row)):
        numpyro.sample("y", dist.Normal(mu + a[row] * b[col], tau**-0.5), obs=y)


def rank_one_data(seed=0, seen=0.6):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=ROWS), rng.normal(size=COLS)
    full = 0.5 + 1.5 * np.outer(a, b) + 0.4 * rng.normal(size=(ROWS, COLS))
    row, col = np.nonzero(rng.random((ROWS, COLS)) < seen)
    return {"row": row, "col": col, "y": full[row, col]}


def cavi_sweep(q, row, col, y):
    """One sweep of the textbook updates (q(mu), q(a_i), q(b_j), q(τ)), each a Gaussian
    (mean, variance) or Gamma (shape, rate) given the others' moments."""
    mu_m, mu_v, a_m, a_v, b_m, b_v, t_a, t_b = q
    tau = t_a / t_b
    # q(mu): prior N(0, MU_SD²), residual y − E[a]E[b]
    prec = 1 / MU_SD**2 + tau * len(y)
    mu_m, mu_v = tau * np.sum(y - a_m[row] * b_m[col]) / prec, 1 / prec
    # q(a_i): Σ_k τ E[b²] a² − 2 τ E[b] (y − E mu) a
    b2 = b_m**2 + b_v
    prec = 1 + tau * np.bincount(row, b2[col], ROWS)
    a_m = tau * np.bincount(row, b_m[col] * (y - mu_m), ROWS) / prec
    a_v = 1 / prec
    a2 = a_m**2 + a_v
    prec = 1 + tau * np.bincount(col, a2[row], COLS)
    b_m = tau * np.bincount(col, a_m[row] * (y - mu_m), COLS) / prec
    b_v = 1 / prec
    b2 = b_m**2 + b_v
    # q(τ): E[(y − mu − a b)²] with independent factors
    sq = (y - mu_m - a_m[row] * b_m[col]) ** 2 + mu_v + a2[row] * b2[col] - a_m[row] ** 2 * b_m[col] ** 2
    t_a, t_b = TAU_SHAPE + 0.5 * len(y), TAU_RATE + 0.5 * np.sum(sq)
    return mu_m, mu_v, a_m, a_v, b_m, b_v, t_a, t_b


def q_of(fit):
    post = fit.posterior
    return (
        float(post["mu"].mean), float(post["mu"].variance),
        np.asarray(post["a"].mean), np.asarray(post["a"].variance),
        np.asarray(post["b"].mean), np.asarray(post["b"].variance),
        float(post["tau"].concentration), float(post["tau"].rate),
    )


@pytest.fixture(scope="module")
def rank_one_fit():
    data = rank_one_data()
    fit = blr_fit(rank_one_model, data, rng_key=random.PRNGKey(0), tol=1e-30, num_steps=2000, progress_bar=False, refine=False)
    return data, fit


def test_product_is_read_as_bilinear_and_blocks_stay_apart(rank_one_fit):
    _, fit = rank_one_fit
    text = fit.plan.describe()
    assert "loc:bilinear_gaussian" in text, text
    assert [b.name for b in fit.plan.blocks] == ["mu", "tau", "a", "b"]
    assert all(conj for _, conj in fit.plan.conjugate), text


def test_rank_one_factorisation_is_the_cavi_fixed_point(rank_one_fit):
    """The fit is a fixed point of the textbook updates (100 sweeps from it move nothing
    beyond 1e-8), not the saddle where both factors are zero, and its ELBO never falls."""
    data, fit = rank_one_fit
    assert fit.converged
    q = q_of(fit)
    moved = q
    for _ in range(100):
        moved = cavi_sweep(moved, data["row"], data["col"], data["y"])
    for got, want in zip(q, moved):
        np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)
    assert np.max(np.abs(q[2])) > 0.5 and np.max(np.abs(q[4])) > 0.5  # not the a = b = 0 saddle
    elbo = np.asarray(fit.elbo)
    assert np.all(np.diff(elbo) >= -1e-9 * np.abs(elbo[1:]))


def test_cavi_from_another_start_reaches_the_same_optimum(rank_one_fit):
    """The numpy updates from their own random start converge to the fit's q (up to the
    sign symmetry a, b → −a, −b of the product)."""
    data, fit = rank_one_fit
    rng = np.random.default_rng(7)
    q = (0.0, 1.0, rng.normal(size=ROWS), np.ones(ROWS), rng.normal(size=COLS), np.ones(COLS), 1.0, 1.0)
    for _ in range(3000):
        q = cavi_sweep(q, data["row"], data["col"], data["y"])
    got = q_of(fit)
    sign = np.sign(np.dot(q[2], got[2]))
    for k, (x, y) in enumerate(zip(got, q)):
        want = sign * y if k in (2, 4) else y
        np.testing.assert_allclose(x, want, rtol=1e-6, atol=1e-8)


def test_masked_dense_product_matches_the_index_form(rank_one_fit):
    """The same model written over the whole matrix with a mask (two plates, an outer
    product a[:, None] * b[None, :]) has the same fixed point."""
    data, fit = rank_one_fit
    seen = np.zeros((ROWS, COLS), bool)
    seen[data["row"], data["col"]] = True
    y = np.zeros((ROWS, COLS))
    y[data["row"], data["col"]] = data["y"]

    def masked(y, seen):
        mu = numpyro.sample("mu", dist.Normal(0.0, MU_SD))
        tau = numpyro.sample("tau", dist.Gamma(TAU_SHAPE, TAU_RATE))
        rows, cols = numpyro.plate("rows", ROWS, dim=-2), numpyro.plate("cols", COLS, dim=-1)
        with rows:
            a = numpyro.sample("a", dist.Normal(0.0, 1.0))  # (ROWS, 1)
        with cols:
            b = numpyro.sample("b", dist.Normal(0.0, 1.0))  # (COLS,)
        with rows, cols:
            numpyro.sample("y", dist.Normal(mu + a * b, tau**-0.5).mask(seen), obs=y)

    other = blr_fit(masked, {"y": y, "seen": seen}, rng_key=random.PRNGKey(0), tol=1e-30, num_steps=2000, progress_bar=False, refine=False)
    q, p = q_of(fit), q_of(other)
    sign = np.sign(np.dot(np.ravel(p[2]), q[2]))
    for k, (x, y_) in enumerate(zip(q, p)):
        want = sign * np.ravel(y_) if k in (2, 4) else np.ravel(y_)
        np.testing.assert_allclose(np.ravel(x), want, rtol=1e-7, atol=1e-9)


# -- a chain's lags times latent coefficients: an AR(2) state with unknown coefficients --------

AR_T, AR_STEP, AR_NOISE, AR_PRIOR = 40, 0.5, 0.3, 1.0


def ar2_latent_model(y):
    """x_t ~ Normal(a1 x_{t−1} + a2 x_{t−2}, s), y_t ~ Normal(x_t, r), written as NumPyro's
    time-series examples write a chain (``scan`` carrying the two lags, from zeros)."""
    a1 = numpyro.sample("a1", dist.Normal(0.0, AR_PRIOR))
    a2 = numpyro.sample("a2", dist.Normal(0.0, AR_PRIOR))

    def step(lags, y_t):
        lag1, lag2 = lags
        x = numpyro.sample("x", dist.Normal(a1 * lag1 + a2 * lag2, AR_STEP))
        numpyro.sample("y", dist.Normal(x, AR_NOISE), obs=y_t)
        return (x, lag1), None

    scan(step, (0.0, 0.0), y)


def ar2_data() -> np.ndarray:
    """Noisy observations of an AR(2) state with coefficients (0.7, −0.3)."""
    rng = np.random.default_rng(4)
    x = np.zeros(AR_T)
    for t in range(AR_T):
        x[t] = 0.7 * (x[t - 1] if t else 0) - 0.3 * (x[t - 2] if t > 1 else 0) + AR_STEP * rng.normal()
    return x + AR_NOISE * rng.normal(size=AR_T)


def ar2_cavi_sweep(q, y):
    """The textbook updates of q(a1) q(a2) q(x), x one Gaussian over all steps (dense),
    each given the others' first and second moments (E[a1 a2] = E[a1] E[a2])."""
    (m1, v1), (m2, v2), (mx, cov) = q
    n = len(y)
    # lags as matrices: (L1 x)_t = x_{t−1}, (L2 x)_t = x_{t−2} (zeros before the start)
    l1, l2 = np.eye(n, k=-1), np.eye(n, k=-2)
    eye = np.eye(n)
    # E[(x − a1 L1 x − a2 L2 x)ᵀ(·)] = xᵀ E[DᵀD] x with D = I − a1 L1 − a2 L2
    dd = (
        eye - m1 * (l1 + l1.T) - m2 * (l2 + l2.T) + (m1**2 + v1) * l1.T @ l1 + (m2**2 + v2) * l2.T @ l2
        + m1 * m2 * (l1.T @ l2 + l2.T @ l1)
    )
    prec = dd / AR_STEP**2 + eye / AR_NOISE**2
    cov = np.linalg.inv(prec)
    mx = cov @ (y / AR_NOISE**2)
    second = cov + np.outer(mx, mx)  # E[x xᵀ]
    # Σ_t E[x_{t−1}²], E[x_{t−2}²], E[x_{t−1} x_{t−2}], E[x_t x_{t−1}], E[x_t x_{t−2}]
    s11, s22, s12 = np.trace(l1 @ second @ l1.T), np.trace(l2 @ second @ l2.T), np.trace(l1 @ second @ l2.T)
    s01, s02 = np.trace(second @ l1.T), np.trace(second @ l2.T)
    p1 = 1 / AR_PRIOR**2 + s11 / AR_STEP**2
    m1 = (s01 - m2 * s12) / AR_STEP**2 / p1
    p2 = 1 / AR_PRIOR**2 + s22 / AR_STEP**2
    m2 = (s02 - m1 * s12) / AR_STEP**2 / p2
    return (m1, 1 / p1), (m2, 1 / p2), (mx, cov)


def test_ar2_with_latent_coefficients_is_the_cavi_fixed_point():
    """The sum of two products ``a1 * lag1 + a2 * lag2`` is bilinear (the coefficients on one
    side, the chain on the other): every factor closed-form, the chain banded (bandwidth 2),
    and the fit the fixed point of the textbook updates to 1e-8 (before, the sum was opaque:
    one dense block fitted by Monte Carlo, far from the posterior)."""
    y = ar2_data()
    fit = blr_fit(ar2_latent_model, {"y": y}, rng_key=random.PRNGKey(0), tol=1e-30, num_steps=3000, progress_bar=False, refine=False)
    plan = fit.plan.describe()
    assert all(f.estimator == "exact" for f in fit.plan.factors), plan
    assert fit.plan.block("x").family.banded and fit.plan.block("x").family.bandwidth == 2, plan
    post = fit.posterior
    q = ((float(post["a1"].mean), float(post["a1"].variance)), (float(post["a2"].mean), float(post["a2"].variance)),
         (np.asarray(post["x"].mean), None))
    moved = ar2_cavi_sweep((q[0], q[1], (q[2][0], np.eye(AR_T))), y)
    for _ in range(200):
        moved = ar2_cavi_sweep(moved, y)
    np.testing.assert_allclose([q[0][0], q[0][1], q[1][0], q[1][1]],
                               [moved[0][0], moved[0][1], moved[1][0], moved[1][1]], rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(q[2][0], moved[2][0], rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(np.asarray(post["x"].variance), np.diag(moved[2][1]), rtol=1e-7)
    assert 0.3 < q[0][0] < 1.2 and -0.8 < q[1][0] < 0.2  # near the simulated (0.7, −0.3)


# -- a chain's lag times a persistence on a bounded support: an AR(1) with phi ~ Uniform(-1, 1) --

PERSIST_T, PERSIST_STEP, PERSIST_NOISE = 40, 0.5, 0.3


def ar1_bounded_model(y):
    """x_t ~ Normal(phi x_{t−1}, s), y_t ~ Normal(x_t, r), the persistence on (−1, 1) as
    time-series models write it (its q: a Gaussian on the interval's logit space)."""
    phi = numpyro.sample("phi", dist.Uniform(-1.0, 1.0))

    def step(prev, y_t):
        x = numpyro.sample("x", dist.Normal(phi * prev, PERSIST_STEP))
        numpyro.sample("y", dist.Normal(x, PERSIST_NOISE), obs=y_t)
        return x, None

    scan(step, 0.0, y)


def _persistence_moments(m, v, nodes=200):
    """E[φ], E[φ²] and E[log|dφ/du|] under u ~ N(m, v), φ = 2 sigmoid(u) − 1 (Gauss–Hermite)."""
    t, w = np.polynomial.hermite_e.hermegauss(nodes)
    w = w / w.sum()
    u = m + np.sqrt(v) * t
    s = 1 / (1 + np.exp(-u))
    phi = 2 * s - 1
    return w @ phi, w @ phi**2, w @ np.log(2 * s * (1 - s))


def ar1_bounded_cavi_sweep(q, y):
    """q(x) given E[φ], E[φ²] (closed form), then q(u) = N(m, v) maximising
    E_q[log p(x | φ) + log|dφ/du|] + ½ log v over (m, v) given q(x) (no closed form: a
    two-dimensional optimisation, the fixed point the learning rule must reach)."""
    from scipy.optimize import minimize

    (m, v), _ = q
    n = len(y)
    l1, eye = np.eye(n, k=-1), np.eye(n)
    e1, e2, _ = _persistence_moments(m, v)
    dd = eye - e1 * (l1 + l1.T) + e2 * l1.T @ l1
    cov = np.linalg.inv(dd / PERSIST_STEP**2 + eye / PERSIST_NOISE**2)
    mx = cov @ (y / PERSIST_NOISE**2)
    second = cov + np.outer(mx, mx)
    cross, lagged = np.trace(second @ l1.T), np.trace(l1 @ second @ l1.T)  # Σ E[x_t x_{t−1}], Σ E[x_{t−1}²]

    def negative(p):
        f1, f2, logjac = _persistence_moments(p[0], np.exp(p[1]))
        return -((f1 * cross - 0.5 * f2 * lagged) / PERSIST_STEP**2 + logjac + 0.5 * p[1])

    best = minimize(negative, [m, np.log(v)], method="BFGS", options={"gtol": 1e-12})
    return (best.x[0], np.exp(best.x[1])), (mx, cov)


def test_persistence_on_a_bounded_support_is_the_vb_fixed_point():
    """``phi * x_prev`` with ``phi ~ Uniform(-1, 1)`` (its q on logit space): the product is
    read through E[φ] and Var[φ] under q (exact for the Normal's expectation), so φ stays
    apart, the chain is banded, every Normal factor closed-form, and the fit is the fixed
    point of the coordinate updates written above to 1e-6 (before, φ's logit space made the
    product opaque: one dense block fitted by Monte Carlo, far from the posterior)."""
    rng = np.random.default_rng(7)
    x = np.zeros(PERSIST_T)
    for t in range(PERSIST_T):
        x[t] = 0.7 * (x[t - 1] if t else 0.0) + PERSIST_STEP * rng.normal()
    y = x + PERSIST_NOISE * rng.normal(size=PERSIST_T)
    fit = blr_fit(ar1_bounded_model, {"y": y}, rng_key=random.PRNGKey(0), tol=1e-30, num_steps=3000, progress_bar=False, refine=False)
    plan = fit.plan.describe()
    assert fit.plan.block("phi").value_moments and fit.plan.block("x").family.banded, plan
    assert all(f.estimator == "exact" for f in fit.plan.factors if f.name in ("x", "y")), plan
    # q(φ) as the fit holds it: a Gaussian on the logit space of (−1, 1)
    u = fit.posterior["phi"].base_dist
    q = ((float(u.mean), float(u.variance)), None)
    moved = ar1_bounded_cavi_sweep(q, y)
    np.testing.assert_allclose(moved[0], q[0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(fit.posterior["x"].mean), moved[1][0], rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(np.asarray(fit.posterior["x"].variance), np.diag(moved[1][1]), rtol=1e-6)
    assert 0.4 < _persistence_moments(*q[0])[0] < 0.95  # near the simulated 0.7


def ar2_bounded_model(y):
    """The AR(2) above with its coefficients one vector on (−1, 1)² (q: a dense Gaussian on
    the logit space of the square), as NumPyro models write a coefficient vector."""
    coef = numpyro.sample("coef", dist.Uniform(-1.0, 1.0).expand([2]).to_event(1))

    def step(lags, y_t):
        lag1, lag2 = lags
        x = numpyro.sample("x", dist.Normal(coef[0] * lag1 + coef[1] * lag2, AR_STEP))
        numpyro.sample("y", dist.Normal(x, AR_NOISE), obs=y_t)
        return (x, lag1), None

    scan(step, (0.0, 0.0), y)


def _coefficient_moments(m, chol, nodes=40):
    """E[φ], E[φ φᵀ] and E[log|dφ/du|] under u ~ N(m, L Lᵀ) in two dimensions, φ = 2 sigmoid(u) − 1."""
    t, w = np.polynomial.hermite_e.hermegauss(nodes)
    w = w / w.sum()
    z = np.stack(np.meshgrid(t, t, indexing="ij"), -1).reshape(-1, 2)
    wz = np.outer(w, w).reshape(-1)
    s = 1 / (1 + np.exp(-(m + z @ chol.T)))
    phi = 2 * s - 1
    return wz @ phi, np.einsum("k,ki,kj->ij", wz, phi, phi), wz @ np.sum(np.log(2 * s * (1 - s)), -1)


def ar2_bounded_cavi_sweep(q, y):
    """q(x) given E[φ], E[φ φᵀ] (closed form), then q(u) = N(m, L Lᵀ) maximising
    E_q[log p(x | φ) + log|dφ/du|] + log|L| given q(x) (scipy)."""
    from scipy.optimize import minimize

    (m, chol), _ = q
    n = len(y)
    l1, l2, eye = np.eye(n, k=-1), np.eye(n, k=-2), np.eye(n)
    e1, e2, _ = _coefficient_moments(m, chol)
    dd = (
        eye - e1[0] * (l1 + l1.T) - e1[1] * (l2 + l2.T) + e2[0, 0] * l1.T @ l1 + e2[1, 1] * l2.T @ l2
        + e2[0, 1] * (l1.T @ l2 + l2.T @ l1)
    )
    cov = np.linalg.inv(dd / AR_STEP**2 + eye / AR_NOISE**2)
    mx = cov @ (y / AR_NOISE**2)
    second = cov + np.outer(mx, mx)
    lags = (l1, l2)
    cross = np.array([np.trace(second @ lag.T) for lag in lags])  # Σ_t E[x_t x_{t−k}]
    gram = np.array([[np.trace(a @ second @ b.T) for b in lags] for a in lags])  # Σ_t E[x_{t−j} x_{t−k}]

    def unpack(p):
        return p[:2], np.array([[np.exp(p[2]), 0.0], [p[3], np.exp(p[4])]])

    def negative(p):
        f1, f2, logjac = _coefficient_moments(*unpack(p))
        return -((f1 @ cross - 0.5 * np.sum(gram * f2)) / AR_STEP**2 + logjac + p[2] + p[4])

    start = np.array([m[0], m[1], np.log(chol[0, 0]), chol[1, 0], np.log(chol[1, 1])])
    best = minimize(negative, start, method="BFGS", options={"gtol": 1e-12})
    return unpack(best.x), (mx, cov)


def test_bounded_coefficient_vector_is_the_vb_fixed_point():
    """A vector of bounded coefficients (dense q over its two scalars) is read through E[φ]
    and Cov[φ] (a two-dimensional rule): the same closed-form plan as for separate Normal
    coefficients, at the fixed point of the coordinate updates above (before, one dense block
    of everything fitted by Monte Carlo, its noise scale collapsed)."""
    y = ar2_data()
    fit = blr_fit(ar2_bounded_model, {"y": y}, rng_key=random.PRNGKey(0), tol=1e-30, num_steps=3000, progress_bar=False, refine=False)
    plan = fit.plan.describe()
    assert fit.plan.block("coef").value_moments and fit.plan.block("x").family.bandwidth == 2, plan
    assert all(f.estimator in ("exact", "quadrature") for f in fit.plan.factors), plan
    u = fit.posterior["coef"].base_dist  # q(u): the Gaussian on the square's logit space
    q = ((np.asarray(u.mean), np.linalg.cholesky(np.asarray(u.covariance_matrix))), None)
    (m, chol), (mx, cov) = ar2_bounded_cavi_sweep(q, y)
    np.testing.assert_allclose(m, q[0][0], rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(chol @ chol.T, q[0][1] @ q[0][1].T, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(np.asarray(fit.posterior["x"].mean), mx, rtol=1e-6, atol=1e-8)
    phi = _coefficient_moments(m, chol)[0]
    assert 0.3 < phi[0] < 1.0 and -0.8 < phi[1] < 0.2  # near the simulated (0.7, −0.3)


# -- a scalar coefficient times a chain's lag, in a scan: z_t ~ Normal(a z_{t−1}, 1) --


def ar1_scan_model(ys):
    """The local AR(1) state space as users write it in a scan: a latent coefficient (a plain
    Normal: a scalar) times the carried state."""
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))

    def step(z_prev, y_t):
        z = numpyro.sample("z", dist.Normal(a * z_prev, 1.0))
        numpyro.sample("y", dist.Normal(z, 0.5), obs=y_t)
        return z, None

    scan(step, 0.0, ys)


def test_a_scalar_coefficient_times_a_carried_state_is_the_cavi_fixed_point():
    """``a * z_prev`` with a scalar a and the scan's stacked lag: the product of a scalar and a
    vector was broadcast on the wrong axes (JAX's ValueError reached the user). The fit is the
    fixed point of the textbook mean-field updates, q(a) q(z): q(z) Gaussian with precision
    I + E[a²] (lags) − E[a] (off-diagonals) + 4 I, mean from the observations; q(a) with
    precision 1 + Σ E[z_{t−1}²] and mean Σ E[z_t z_{t−1}] / precision (1e-7)."""
    ys = np.random.default_rng(0).normal(size=15)
    fit = blr_fit(ar1_scan_model, (ys,), rng_key=random.PRNGKey(0), tol=1e-30, num_steps=500, progress_bar=False, refine=False)
    t = len(ys)
    ma, va = 0.0, 1.0
    for _ in range(500):
        ea, ea2 = ma, va + ma**2
        prec = np.eye(t) * (1.0 + 4.0)
        prec[np.arange(t - 1), np.arange(t - 1)] += ea2
        prec[np.arange(t - 1), np.arange(1, t)] = prec[np.arange(1, t), np.arange(t - 1)] = -ea
        cov = np.linalg.inv(prec)
        mz = cov @ (4.0 * ys)
        second = cov + np.outer(mz, mz)
        pa = 1.0 + np.trace(second[:-1, :-1])
        ma, va = np.sum(np.diag(second, 1)) / pa, 1.0 / pa
    post = fit.posterior
    np.testing.assert_allclose([float(post["a"].mean), float(post["a"].variance)], [ma, va], rtol=1e-7)
    np.testing.assert_allclose(np.asarray(post["z"].mean), mz, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(np.asarray(post["z"].variance), np.diag(cov), rtol=1e-7)
