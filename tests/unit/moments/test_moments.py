"""Moment objects (blrppl.moments.kinds): hand-worked tables, Monte Carlo checks, and the
arithmetic of AffineGaussian (sharing blocks, broadcasting, covariance over event dims)."""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import digamma

from blrppl.moments.kinds import AffineGaussian, BetaIdentity, Const, DirichletIdentity, PowerGamma

NUM_DRAWS = 200_000


def assert_mc(draws, expected, n_se=5.0, atol=1e-12):
    """``expected`` lies within ``n_se`` standard errors of the mean of ``draws`` (axis 0)."""
    draws = np.asarray(draws, dtype=np.float64)
    est = draws.mean(0)
    se = draws.std(0, ddof=1) / np.sqrt(draws.shape[0])
    expected = np.broadcast_to(np.asarray(expected, dtype=np.float64), est.shape)
    err = np.abs(est - expected)
    assert np.all(err <= n_se * se + atol), f"MC {est} vs {expected} (se {se})"


def centred_square(x):
    """Draws whose mean estimates Var[x] (centred on the sample mean)."""
    return np.square(x - x.mean(0))


def gaussian_block(rng, dim):
    mean = rng.normal(size=dim)
    a = rng.normal(size=(dim, dim))
    cov = a @ a.T + 0.5 * np.eye(dim)
    return mean, cov


def affine_of_block(mean, cov, jac, offset):
    """x = J w + offset as AffineGaussian, in the columns-first layout
    left[j] = J e_j, right[j] = J Σ e_j (J maps the block (D,) to x's shape)."""
    d = cov.shape[0]
    jac = np.asarray(jac)
    out_shape = jac.shape[:-1]
    left = np.moveaxis(jac, -1, 0)  # (D, *out): J e_j
    right = np.moveaxis(jac @ cov, -1, 0)  # (D, *out): J Σ e_j
    assert left.shape == (d,) + out_shape
    return AffineGaussian(jnp.asarray(jac @ mean + offset), (jnp.asarray(left),), (jnp.asarray(right),))


# -- Const ------------------------------------------------------------------------------


def test_const_table():
    v = np.array([[0.25, 0.5], [2.0, 4.0]])
    c = Const(jnp.asarray(v))
    assert c.kind == "const"
    assert c.shape == (2, 2)
    np.testing.assert_allclose(c.mean(), v)
    np.testing.assert_array_equal(c.var(), np.zeros((2, 2)))
    np.testing.assert_allclose(c.mean_square(), v**2)
    np.testing.assert_allclose(c.expect_log(), np.log(v))
    np.testing.assert_allclose(c.expect_log1m()[0], np.log([0.75, 0.5]))
    np.testing.assert_allclose(c.expect_pow(3.0), v**3)
    np.testing.assert_allclose(c.expect_pow(-0.5), v**-0.5)
    cov = c.cov_event(1)
    assert cov.shape == (2, 2, 2)
    np.testing.assert_array_equal(cov, 0.0)
    assert c.cov_event(2).shape == (4, 4)


def test_const_integer_var_is_float():
    c = Const(jnp.arange(3))
    var = c.var()
    assert jnp.issubdtype(var.dtype, jnp.floating)
    np.testing.assert_array_equal(var, np.zeros(3))


def test_const_arithmetic():
    a, b = Const(jnp.array([1.0, 2.0])), Const(jnp.array([3.0, 5.0]))
    np.testing.assert_allclose((a + b).value, [4.0, 7.0])
    np.testing.assert_allclose((a - b).value, [-2.0, -3.0])
    np.testing.assert_allclose((a * b).value, [3.0, 10.0])
    np.testing.assert_allclose((-a).value, [-1.0, -2.0])
    np.testing.assert_allclose((a + 1.0).value, [2.0, 3.0])
    np.testing.assert_allclose((1.0 - a).value, [0.0, -1.0])
    np.testing.assert_allclose((2.0 * a).value, [2.0, 4.0])
    assert isinstance(a + b, Const)


# -- AffineGaussian: single block, Monte Carlo -------------------------------------------


def test_affine_gaussian_identity_table():
    # x = w, w ~ N(m, Σ) with a hand-picked Σ
    m = np.array([1.0, -2.0])
    cov = np.array([[2.0, 0.5], [0.5, 1.0]])
    x = AffineGaussian(jnp.asarray(m), (jnp.eye(2),), (jnp.asarray(cov),))
    assert x.kind == "affine_gaussian"
    assert x.shape == (2,)
    np.testing.assert_allclose(x.mean(), m)
    np.testing.assert_allclose(x.var(), [2.0, 1.0])
    np.testing.assert_allclose(x.mean_square(), [3.0, 5.0])
    np.testing.assert_allclose(x.expect_pow(1), m)
    np.testing.assert_allclose(x.expect_pow(2), [3.0, 5.0])
    np.testing.assert_allclose(x.cov_event(1), cov)
    with pytest.raises(NotImplementedError):
        x.expect_log()
    with pytest.raises(NotImplementedError):
        x.expect_log1m()
    with pytest.raises(NotImplementedError):
        x.expect_pow(3)


def test_affine_gaussian_monte_carlo():
    rng = np.random.default_rng(0)
    d, m_out = 3, 4
    mean, cov = gaussian_block(rng, d)
    jac = rng.normal(size=(m_out, d))
    offset = rng.normal(size=m_out)
    x = affine_of_block(mean, cov, jac, offset)
    w = rng.multivariate_normal(mean, cov, size=NUM_DRAWS)
    xs = w @ jac.T + offset
    assert_mc(xs, x.mean())
    assert_mc(centred_square(xs), x.var())
    assert_mc(xs**2, x.mean_square())
    assert_mc(xs**2, x.expect_pow(2))
    # covariance over the event dim: every pair
    xc = xs - xs.mean(0)
    pairs = xc[:, :, None] * xc[:, None, :]
    assert_mc(pairs.reshape(NUM_DRAWS, -1), np.asarray(x.cov_event(1)).reshape(-1))


# -- AffineGaussian: arithmetic -----------------------------------------------------------


def _two_dim_block():
    m = np.array([0.5, -1.5])
    cov = np.array([[2.0, 0.6], [0.6, 0.5]])
    # x = w0, loc = w1 (scalars) sharing the same 2-d block: columns over the block's 2 dims
    x = AffineGaussian(jnp.asarray(m[0]), (jnp.array([1.0, 0.0]),), (jnp.asarray(cov[0]),))
    loc = AffineGaussian(jnp.asarray(m[1]), (jnp.array([0.0, 1.0]),), (jnp.asarray(cov[1]),))
    return m, cov, x, loc


def test_difference_sharing_one_block():
    m, cov, x, loc = _two_dim_block()
    diff = x - loc
    assert isinstance(diff, AffineGaussian)
    # hand-worked: Var[w0 − w1] = Σ00 + Σ11 − 2 Σ01 = 2 + 0.5 − 1.2
    np.testing.assert_allclose(diff.var(), 1.3)
    np.testing.assert_allclose(diff.mean(), 2.0)
    np.testing.assert_allclose(diff.mean_square(), 4.0 + 1.3)
    total = x + loc
    np.testing.assert_allclose(total.var(), 2.0 + 0.5 + 1.2)
    np.testing.assert_allclose(total.mean(), -1.0)
    # reversed order gives the same variance
    np.testing.assert_allclose((loc - x).var(), 1.3)
    np.testing.assert_allclose((loc - x).mean(), -2.0)


def test_difference_sharing_one_block_monte_carlo():
    m, cov, x, loc = _two_dim_block()
    rng = np.random.default_rng(1)
    w = rng.multivariate_normal(m, cov, size=NUM_DRAWS)
    d = w[:, 0] - w[:, 1]
    diff = x - loc
    assert_mc(d, diff.mean())
    assert_mc(centred_square(d), diff.var())
    assert_mc(d**2, diff.mean_square())
    # 2 x − 3 loc + 1
    comb = 2.0 * x - loc * 3.0 + 1.0
    v = 2 * w[:, 0] - 3 * w[:, 1] + 1
    assert_mc(v, comb.mean())
    assert_mc(centred_square(v), comb.var())
    np.testing.assert_allclose(comb.var(), 4 * 2.0 + 9 * 0.5 - 12 * 0.6)


def test_combine_different_blocks():
    # x uses block 0 only, loc uses block 1 only: variances add
    cov0 = np.array([[1.5, 0.3], [0.3, 0.7]])
    cov1 = np.array([[0.4]])
    x = AffineGaussian(jnp.array([1.0, 2.0]), (jnp.eye(2), None), (jnp.asarray(cov0), None))
    loc = AffineGaussian(jnp.array(0.5), (None, jnp.ones((1,))), (None, jnp.asarray(cov1[0])))
    diff = x - loc  # loc broadcasts over x's shape
    assert diff.shape == (2,)
    np.testing.assert_allclose(diff.mean(), [0.5, 1.5])
    np.testing.assert_allclose(diff.var(), [1.5 + 0.4, 0.7 + 0.4])
    np.testing.assert_allclose(diff.cov_event(1), cov0 + 0.4)


@pytest.mark.parametrize("side", ["left", "right", "const"])
def test_multiply_by_higher_rank_constant(side):
    rng = np.random.default_rng(2)
    n, d = 5, 3
    mean, cov = gaussian_block(rng, d)
    x = affine_of_block(mean, cov, np.eye(d), 0.0)  # x = w, shape (D,)
    c = rng.normal(size=(n, d))
    if side == "left":
        y = jnp.asarray(c) * x
    elif side == "right":
        y = x * jnp.asarray(c)
    else:
        y = Const(jnp.asarray(c)) * x
    assert isinstance(y, AffineGaussian)
    assert y.shape == (n, d)
    np.testing.assert_allclose(y.mean(), c * mean)
    np.testing.assert_allclose(y.var(), c**2 * np.diag(cov))
    np.testing.assert_allclose(y.mean_square(), (c * mean) ** 2 + c**2 * np.diag(cov))
    ce = np.asarray(y.cov_event(1))
    assert ce.shape == (n, d, d)
    for i in range(n):
        np.testing.assert_allclose(ce[i], np.diag(c[i]) @ cov @ np.diag(c[i]))
    # the whole (N, D) array over one dense event: C_ab = c_a c_b Σ_{d(a) d(b)}
    full = np.asarray(y.cov_event(2))
    cf = c.reshape(-1)
    idx = np.tile(np.arange(d), n)
    np.testing.assert_allclose(full, np.outer(cf, cf) * cov[np.ix_(idx, idx)])


def test_multiply_then_combine_same_block():
    # (c * x) − x with c of higher rank: Var = (c − 1)² Σ_dd
    rng = np.random.default_rng(3)
    n, d = 4, 2
    mean, cov = gaussian_block(rng, d)
    x = affine_of_block(mean, cov, np.eye(d), 0.0)
    c = rng.normal(size=(n, d))
    y = jnp.asarray(c) * x - x
    np.testing.assert_allclose(y.mean(), (c - 1) * mean)
    np.testing.assert_allclose(y.var(), (c - 1) ** 2 * np.diag(cov))
    for i in range(n):
        np.testing.assert_allclose(y.cov_event(1)[i], np.diag(c[i] - 1) @ cov @ np.diag(c[i] - 1))


@pytest.mark.parametrize("order", ["const_minus_loc", "loc_minus_const", "loc_plus_array", "const_plus_loc"])
def test_wider_const_then_cov_event(order):
    # Const of shape (N, D) combined with loc, an AffineGaussian of shape (D,) over a D-dim
    # dense block: every row has covariance Σ (regression test for a broadcasting bug)
    rng = np.random.default_rng(4)
    n, d = 6, 3
    mean, cov = gaussian_block(rng, d)
    loc = affine_of_block(mean, cov, np.eye(d), 0.0)
    data = rng.normal(size=(n, d))
    if order == "const_minus_loc":
        y, ymean = Const(jnp.asarray(data)) - loc, data - mean
    elif order == "loc_minus_const":
        y, ymean = loc - Const(jnp.asarray(data)), mean - data
    elif order == "loc_plus_array":
        y, ymean = loc + jnp.asarray(data), mean + data
    else:
        y, ymean = Const(jnp.asarray(data)) + loc, data + mean
    assert isinstance(y, AffineGaussian)
    assert y.shape == (n, d)
    np.testing.assert_allclose(y.mean(), ymean)
    np.testing.assert_allclose(y.var(), np.broadcast_to(np.diag(cov), (n, d)))
    np.testing.assert_allclose(y.mean_square(), ymean**2 + np.diag(cov))
    ce = np.asarray(y.cov_event(1))
    assert ce.shape == (n, d, d)
    for i in range(n):
        np.testing.assert_allclose(ce[i], cov, rtol=1e-12)
    # rows share the block, so over both dims the covariance is Σ tiled
    np.testing.assert_allclose(y.cov_event(2), np.tile(cov, (n, n)))


def test_wider_const_then_multiply_then_cov_event():
    # (data − loc) * c with everything (N, D): row i covariance diag(c_i) Σ diag(c_i)
    rng = np.random.default_rng(5)
    n, d = 3, 2
    mean, cov = gaussian_block(rng, d)
    loc = affine_of_block(mean, cov, np.eye(d), 0.0)
    data, c = rng.normal(size=(n, d)), rng.normal(size=(n, d))
    y = (Const(jnp.asarray(data)) - loc) * jnp.asarray(c)
    np.testing.assert_allclose(y.mean(), (data - mean) * c)
    for i in range(n):
        np.testing.assert_allclose(y.cov_event(1)[i], np.diag(c[i]) @ cov @ np.diag(c[i]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cov_event_random_jacobian(seed):
    rng = np.random.default_rng(10 + seed)
    d, m_out = 4, 3
    mean, cov = gaussian_block(rng, d)
    jac = rng.normal(size=(m_out, d))
    x = affine_of_block(mean, cov, jac, rng.normal(size=m_out))
    expected = jac @ cov @ jac.T
    np.testing.assert_allclose(x.cov_event(1), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(x.var(), np.diag(expected), rtol=1e-12)
    np.testing.assert_allclose(x.cov_event(0), np.diag(expected)[:, None, None], rtol=1e-12)


def test_cov_event_two_blocks_batched_jacobian():
    # x of shape (K, M): x_k = J1_k w1 + J2_k w2 with two independent blocks
    rng = np.random.default_rng(20)
    k, m_out, d1, d2 = 2, 3, 4, 2
    m1, c1 = gaussian_block(rng, d1)
    m2, c2 = gaussian_block(rng, d2)
    j1 = rng.normal(size=(k, m_out, d1))
    j2 = rng.normal(size=(k, m_out, d2))
    mean = j1 @ m1 + j2 @ m2
    left = (jnp.asarray(np.moveaxis(j1, -1, 0)), jnp.asarray(np.moveaxis(j2, -1, 0)))
    right = (jnp.asarray(np.moveaxis(j1 @ c1, -1, 0)), jnp.asarray(np.moveaxis(j2 @ c2, -1, 0)))
    x = AffineGaussian(jnp.asarray(mean), left, right)
    ce = np.asarray(x.cov_event(1))
    assert ce.shape == (k, m_out, m_out)
    for i in range(k):
        np.testing.assert_allclose(ce[i], j1[i] @ c1 @ j1[i].T + j2[i] @ c2 @ j2[i].T, rtol=1e-12)
    # over both dims: flatten (K, M) row-major
    jf1, jf2 = j1.reshape(k * m_out, d1), j2.reshape(k * m_out, d2)
    np.testing.assert_allclose(x.cov_event(2), jf1 @ c1 @ jf1.T + jf2 @ c2 @ jf2.T, rtol=1e-12)
    # Monte Carlo for the elementwise moments
    w1 = rng.multivariate_normal(m1, c1, size=NUM_DRAWS)
    w2 = rng.multivariate_normal(m2, c2, size=NUM_DRAWS)
    xs = np.einsum("kmd,nd->nkm", j1, w1) + np.einsum("kmd,nd->nkm", j2, w2)
    assert_mc(xs, x.mean())
    assert_mc(centred_square(xs), x.var())


# -- PowerGamma ----------------------------------------------------------------------------


def test_power_gamma_table():
    # τ ~ Gamma(3, 2): E[τ] = 3/2, Var[τ] = 3/4, E[log τ] = ψ(3) − log 2
    tau = PowerGamma(jnp.array(1.0), jnp.array(1.0), jnp.array(3.0), jnp.array(2.0))
    assert tau.kind == "power_gamma"
    np.testing.assert_allclose(tau.mean(), 1.5)
    np.testing.assert_allclose(tau.var(), 0.75)
    np.testing.assert_allclose(tau.mean_square(), 0.75 + 2.25)
    np.testing.assert_allclose(tau.expect_log(), 1.5 - np.euler_gamma - np.log(2.0))
    # E[1/τ] = β/(α − 1) = 1
    np.testing.assert_allclose(tau.expect_pow(-1.0), 1.0)
    # scale = 1/sqrt(τ): E[scale²] = E[1/τ] = 1; E[log scale] = −½ E[log τ]
    scale = PowerGamma(jnp.array(1.0), jnp.array(-0.5), jnp.array(3.0), jnp.array(2.0))
    np.testing.assert_allclose(scale.mean_square(), 1.0)
    np.testing.assert_allclose(scale.expect_pow(-2.0), 1.5)
    np.testing.assert_allclose(scale.expect_log(), -0.5 * (1.5 - np.euler_gamma - np.log(2.0)))
    # c τ^a with c = 4: E[x] = 4 · 3/2, E[log x] = log 4 + E[log τ]
    x = PowerGamma(jnp.array(4.0), jnp.array(1.0), jnp.array(3.0), jnp.array(2.0))
    np.testing.assert_allclose(x.mean(), 6.0)
    np.testing.assert_allclose(x.var(), 16 * 0.75)
    np.testing.assert_allclose(x.expect_log(), np.log(4.0) + 1.5 - np.euler_gamma - np.log(2.0))
    with pytest.raises(NotImplementedError):
        x.expect_log1m()


# (coef, power, shape α, rate β): chosen so that E[x^(2k)] exists for every k tested
POWER_GAMMA_CASES = [
    (1.0, 1.0, 3.0, 2.0),
    (2.5, -0.5, 6.0, 1.5),
    (0.3, 2.0, 4.0, 3.0),
    (1.7, -1.0, 9.0, 0.7),
]


@pytest.mark.parametrize("case", POWER_GAMMA_CASES)
def test_power_gamma_monte_carlo(case):
    coef, power, alpha, rate = case
    rng = np.random.default_rng(30)
    tau = rng.gamma(alpha, 1.0 / rate, size=NUM_DRAWS)
    xs = coef * tau**power
    x = PowerGamma(jnp.array(coef), jnp.array(power), jnp.array(alpha), jnp.array(rate))
    assert x.shape == ()
    assert_mc(xs, x.mean())
    assert_mc(centred_square(xs), x.var())
    assert_mc(xs**2, x.mean_square())
    assert_mc(np.log(xs), x.expect_log())
    for k in (0.5, -1.0, 1.5):
        assert_mc(xs**k, x.expect_pow(k))


def test_power_gamma_elementwise_arrays():
    # each element uses its own (c, a, α, β); compare with the scalar formulas
    coef = np.array([1.0, 2.0, 0.5])
    power = np.array([1.0, -0.5, 2.0])
    alpha = np.array([2.0, 5.0, 3.0])
    rate = np.array([1.0, 2.0, 4.0])
    x = PowerGamma(*(jnp.asarray(v) for v in (coef, power, alpha, rate)))
    assert x.shape == (3,)
    np.testing.assert_allclose(x.expect_log(), np.log(coef) + power * (digamma(alpha) - np.log(rate)))
    # first element: E[τ] = α/β
    np.testing.assert_allclose(x.mean()[0], 2.0)
    # third element: E[0.5 τ²] = 0.5 α(α+1)/β²
    np.testing.assert_allclose(x.mean()[2], 0.5 * 3.0 * 4.0 / 16.0)
    # second element: E[(2 τ^-½)²] = 4 β/(α − 1)
    np.testing.assert_allclose(x.mean_square()[1], 4 * 2.0 / 4.0)


# -- BetaIdentity ----------------------------------------------------------------------------


def test_beta_identity_table():
    # Beta(1, 1) = uniform: E = ½, Var = 1/12, E[log p] = E[log(1−p)] = −1, E[p²] = 1/3
    p = BetaIdentity(jnp.array(1.0), jnp.array(1.0))
    assert p.kind == "beta"
    np.testing.assert_allclose(p.mean(), 0.5)
    np.testing.assert_allclose(p.var(), 1.0 / 12.0)
    np.testing.assert_allclose(p.mean_square(), 1.0 / 3.0)
    np.testing.assert_allclose(p.expect_log(), -1.0)
    np.testing.assert_allclose(p.expect_log1m(), -1.0)
    np.testing.assert_allclose(p.expect_pow(2.0), 1.0 / 3.0)
    np.testing.assert_allclose(p.expect_pow(3.0), 0.25)
    # Beta(2, 1): density 2p: E = 2/3, E[log p] = −½, E[log(1−p)] = −3/2
    q = BetaIdentity(jnp.array(2.0), jnp.array(1.0))
    np.testing.assert_allclose(q.mean(), 2.0 / 3.0)
    np.testing.assert_allclose(q.var(), 2.0 / (9.0 * 4.0))
    np.testing.assert_allclose(q.expect_log(), -0.5)
    np.testing.assert_allclose(q.expect_log1m(), -1.5)


@pytest.mark.parametrize("ab", [(0.7, 2.5), (3.0, 3.0), (12.0, 1.5)])
def test_beta_identity_monte_carlo(ab):
    a, b = ab
    rng = np.random.default_rng(40)
    ps = rng.beta(a, b, size=NUM_DRAWS)
    p = BetaIdentity(jnp.array(a), jnp.array(b))
    assert_mc(ps, p.mean())
    assert_mc(centred_square(ps), p.var())
    assert_mc(ps**2, p.mean_square())
    assert_mc(np.log(ps), p.expect_log())
    assert_mc(np.log1p(-ps), p.expect_log1m())
    for k in (0.5, 2.0, 3.0):
        assert_mc(ps**k, p.expect_pow(k))


def test_beta_identity_elementwise():
    a, b = np.array([1.0, 2.0, 5.0]), np.array([1.0, 1.0, 0.5])
    p = BetaIdentity(jnp.asarray(a), jnp.asarray(b))
    assert p.shape == (3,)
    np.testing.assert_allclose(p.mean(), a / (a + b))
    np.testing.assert_allclose(p.expect_log(), digamma(a) - digamma(a + b))
    np.testing.assert_allclose(p.expect_log1m(), digamma(b) - digamma(a + b))


# -- DirichletIdentity -------------------------------------------------------------------------


def test_dirichlet_identity_table():
    # Dirichlet(1, 1, 1): each π_k ~ Beta(1, 2)
    conc = jnp.ones(3)
    pi = DirichletIdentity(conc, jnp.full(3, 3.0))
    assert pi.kind == "dirichlet"
    np.testing.assert_allclose(pi.mean(), np.full(3, 1.0 / 3.0))
    np.testing.assert_allclose(pi.var(), np.full(3, 1.0 / 18.0))
    np.testing.assert_allclose(pi.mean_square(), np.full(3, 1.0 / 18.0 + 1.0 / 9.0))
    np.testing.assert_allclose(pi.expect_log(), np.full(3, -1.5))  # ψ(1) − ψ(3)
    np.testing.assert_allclose(pi.expect_log1m(), np.full(3, -0.5))  # ψ(2) − ψ(3)
    np.testing.assert_allclose(pi.expect_pow(2.0), np.full(3, 1.0 / 6.0))


@pytest.mark.parametrize("alpha", [(0.5, 1.0, 2.0), (4.0, 0.8, 3.0, 1.2)])
def test_dirichlet_identity_monte_carlo(alpha):
    alpha = np.asarray(alpha)
    rng = np.random.default_rng(50)
    draws = rng.dirichlet(alpha, size=NUM_DRAWS)
    pi = DirichletIdentity(jnp.asarray(alpha), jnp.full(alpha.shape, alpha.sum()))
    assert pi.shape == alpha.shape
    assert_mc(draws, pi.mean())
    assert_mc(centred_square(draws), pi.var())
    assert_mc(draws**2, pi.mean_square())
    assert_mc(np.log(draws), pi.expect_log())
    assert_mc(np.log1p(-draws), pi.expect_log1m())
    for k in (0.5, 2.0):
        assert_mc(draws**k, pi.expect_pow(k))


def test_dirichlet_identity_gathered():
    # rows of a (2, 3) Dirichlet block gathered by an index: total is per row
    alpha = np.array([[1.0, 2.0, 3.0], [0.5, 0.5, 4.0]])
    idx = np.array([1, 0, 1, 1])
    conc = alpha[idx]
    total = np.broadcast_to(alpha.sum(-1, keepdims=True), alpha.shape)[idx]
    pi = DirichletIdentity(jnp.asarray(conc), jnp.asarray(total))
    assert pi.shape == (4, 3)
    np.testing.assert_allclose(pi.mean()[0], alpha[1] / 5.0)
    np.testing.assert_allclose(pi.mean()[1], alpha[0] / 6.0)
    np.testing.assert_allclose(pi.expect_log()[1], digamma(alpha[0]) - digamma(6.0))


@pytest.mark.parametrize("case", POWER_GAMMA_CASES)
@pytest.mark.parametrize("with_means", [False, True])
def test_power_gamma_static_power_matches_the_gamma_function_ratio(case, with_means):
    """A power known at trace time (a Python number, as the compiler passes the argument
    form's exponent) turns E[x^k] with integer a k into a rising product: same values and
    same derivatives in (α, β, E[log τ], E[τ]) as the log-gamma formula."""
    import jax

    coef, power, alpha, rate = case

    def moments(params, static):
        a, b = params["alpha"], params["rate"]
        means = (params["mean_log"], params["mean"]) if with_means else (None, None)
        x = PowerGamma(jnp.asarray(coef), power if static else jnp.asarray(power), a, b, *means)
        return jnp.stack([x.expect_pow(k) for k in (-2.0, -1.0, 1.0, 2.0) if alpha + power * k > 0])

    params = {"alpha": jnp.asarray(alpha), "rate": jnp.asarray(rate), "mean_log": jnp.asarray(digamma(alpha) - np.log(rate)),
              "mean": jnp.asarray(alpha / rate)}
    np.testing.assert_allclose(moments(params, True), moments(params, False), rtol=1e-12)
    jac_static, jac_ratio = (jax.jacobian(moments)(params, s) for s in (True, False))
    for name in params:
        np.testing.assert_allclose(jac_static[name], jac_ratio[name], rtol=1e-10, atol=1e-12)
