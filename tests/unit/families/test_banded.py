"""Chains of Gaussian latents: the banded family against the dense one, the bandwidth the
compiler finds for the models users write, and exact fits of long chains.

The family rows compare every map of :class:`blrppl.families.GaussianBanded` with the dense
Gaussian on the same precision (float64, 1e-10). The model rows are random walks, AR(p)
and state-space models written with ``scan``, ``GaussianRandomWalk`` or vectors of sites,
and models that are no chain (a global sum, random indexing), which must stay dense or
mean-field.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.contrib.control_flow import scan

from blrppl.model.program import ModelProgram
from blrppl import blr_fit
from blrppl.families import (
    BandedGaussianNat,
    GaussianBanded,
    GaussianDense,
    GaussianNat,
    GaussianView,
)
from blrppl.families import _band
from blrppl.families.gaussian_banded import _colour_rows
from blrppl.model.trace import trace_model
from blrppl.compiler.pipeline import compile_model


def _banded_spd(rng, n, b):
    a = rng.normal(size=(n, n))
    near = np.abs(np.subtract.outer(np.arange(n), np.arange(n))) <= b
    s = np.where(near, a @ a.T, 0.0)
    return s + np.eye(n) * (np.abs(s).sum(1).max() + 1.0)  # diagonally dominant: SPD


SHAPES = [(1, 1), (2, 1), (5, 1), (7, 2), (12, 3), (6, 5), (9, 0), (40, 2)]


@pytest.mark.parametrize("n,b", SHAPES)
def test_band_linear_algebra_equals_dense(n, b):
    rng = np.random.default_rng(n * 10 + b)
    s = _banded_spd(rng, n, b)
    upper = _band.from_dense(s, b)
    np.testing.assert_array_equal(_band.to_dense(upper), s)
    rows = _band.cholesky(jnp.asarray(upper))
    chol = np.linalg.cholesky(s)
    want_rows = np.array([[chol[i, i - d] if i >= d else 0.0 for d in range(b + 1)] for i in range(n)])
    np.testing.assert_allclose(rows, want_rows, atol=1e-12)
    v = rng.normal(size=n)
    np.testing.assert_allclose(_band.solve(rows, jnp.asarray(v)), np.linalg.solve(s, v), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(_band.matvec(jnp.asarray(upper), jnp.asarray(v)), s @ v, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(_band.inverse_band(rows), _band.from_dense(np.linalg.inv(s), b), atol=1e-12)
    np.testing.assert_allclose(_band.logdet(rows), np.linalg.slogdet(s)[1], rtol=1e-12)
    # the two-pass forms: factor and L⁻¹ v down the rows, L⁻ᵀ y and the band of M⁻¹ up
    rows2, white = _band.cholesky_and_solve_lower(jnp.asarray(upper), jnp.asarray(v))
    np.testing.assert_allclose(rows2, want_rows, atol=1e-12)
    np.testing.assert_allclose(white, np.linalg.solve(chol, v), rtol=1e-10, atol=1e-12)
    x, band = _band.solve_upper_and_inverse_band(rows2, white)
    np.testing.assert_allclose(x, np.linalg.solve(s, v), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(band, _band.from_dense(np.linalg.inv(s), b), atol=1e-12)
    full = _band.full_band(jnp.asarray(upper))
    want = np.array([[s[i, i + d] if 0 <= i + d < n else 0.0 for d in range(-b, b + 1)] for i in range(n)])
    np.testing.assert_array_equal(full, want)


def test_band_cholesky_of_an_indefinite_matrix_is_not_finite():
    s = np.diag([1.0, -1.0, 1.0])
    assert not np.all(np.isfinite(_band.cholesky(jnp.asarray(_band.from_dense(s, 1)))))


@pytest.mark.parametrize("b", [1, 2])
def test_banded_validity_is_positive_definiteness(b):
    """A precision is valid exactly when it is positive definite, whether or not it is
    diagonally dominant (the elementwise shortcut), and never with a NaN."""
    n = 12
    rng = np.random.default_rng(b)
    dominant = _banded_spd(rng, n, b)
    walk = np.diag(np.r_[2.0 * np.ones(n - 1), 1.0]) - np.eye(n, k=1) - np.eye(n, k=-1)  # PD, not dominant
    walk = walk + 1e-3 * np.eye(n)
    indefinite = walk - 0.5 * np.eye(n)
    family = GaussianBanded(n, b)

    def valid(s, eta1=None):
        nat = BandedGaussianNat(jnp.asarray(np.zeros(n) if eta1 is None else eta1), jnp.asarray(-0.5 * _band.from_dense(s, b)))
        return bool(jax.jit(family.is_valid)(nat))

    assert np.all(np.linalg.eigvalsh(walk) > 0) and np.any(np.linalg.eigvalsh(indefinite) < 0)
    assert valid(dominant) and valid(walk)
    assert not valid(indefinite) and not valid(-dominant)
    assert not valid(dominant, np.r_[np.nan, np.zeros(n - 1)])


@pytest.mark.parametrize("n,b", [(6, 1), (9, 2), (3, 2), (1, 1), (40, 3)])
def test_banded_family_equals_dense_family(n, b):
    rng = np.random.default_rng(n + 100 * b)
    s, m = _banded_spd(rng, n, b), rng.normal(size=n)
    banded, dense = GaussianBanded(n, b), GaussianDense(n)
    nat_b = BandedGaussianNat(jnp.asarray(s @ m), jnp.asarray(-0.5 * _band.from_dense(s, b)))
    nat_d = GaussianNat(jnp.asarray(s @ m), jnp.asarray(-0.5 * s))
    view_b, view_d = banded.view(nat_b), dense.view(nat_d)
    np.testing.assert_allclose(view_b.mean, view_d.mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(view_b.cov, _band.from_dense(np.asarray(view_d.cov), b), atol=1e-12)
    np.testing.assert_allclose(banded.entropy(nat_b), dense.entropy(nat_d), rtol=1e-12)
    np.testing.assert_allclose(banded.log_partition(nat_b), dense.log_partition(nat_d), rtol=1e-12)
    x = rng.normal(size=(4, n))
    np.testing.assert_allclose(banded.log_prob(nat_b, x), dense.log_prob(nat_d, x), rtol=1e-12)
    # the exponential-family identities with the leafwise inner product
    stats, mean_params = banded.sufficient_stats(jnp.asarray(x)), banded.mean_params(nat_b)
    inner = (stats.eta1 * nat_b.eta1).sum(-1) + (stats.eta2 * nat_b.eta2).sum((-1, -2))
    np.testing.assert_allclose(inner - banded.log_partition(nat_b), banded.log_prob(nat_b, x), rtol=1e-10)
    inner_mu = (mean_params.eta1 * nat_b.eta1).sum() + (mean_params.eta2 * nat_b.eta2).sum()
    np.testing.assert_allclose(banded.log_partition(nat_b) - inner_mu, banded.entropy(nat_b), rtol=1e-10)
    # the band of Σ determines the chain: round trips through the view and the mean parameters
    for back in (banded.nat_from_view(view_b), banded.nat_from_mean(mean_params)):
        np.testing.assert_allclose(back.eta1, nat_b.eta1, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(back.eta2, nat_b.eta2, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(banded.to_numpyro(nat_b).log_prob(x), dense.log_prob(nat_d, x), rtol=1e-12)


def test_banded_message_is_the_dense_message_restricted_to_the_band():
    n, b = 8, 2
    rng = np.random.default_rng(3)
    s, m = _banded_spd(rng, n, b), rng.normal(size=n)
    near = np.abs(np.subtract.outer(np.arange(n), np.arange(n))) <= b
    weights, g = rng.normal(size=(n, n)), rng.normal(size=n)
    weights = np.where(near, weights + weights.T, 0.0)

    def objective(view):  # linear in m and in the band of Σ, as a conjugate factor's E log f
        return jnp.dot(g, view.mean) + jnp.sum(jnp.asarray(weights) * view.cov)

    banded, dense = GaussianBanded(n, b), GaussianDense(n)
    nat_b = BandedGaussianNat(jnp.asarray(s @ m), jnp.asarray(-0.5 * _band.from_dense(s, b)))
    nat_d = GaussianNat(jnp.asarray(s @ m), jnp.asarray(-0.5 * s))
    view_b = banded.view(nat_b)
    grad_b = jax.grad(lambda v: objective(GaussianView(v.mean, _band.to_dense(v.cov))))(view_b)
    msg_b = banded.message_from_view_grad(nat_b, grad_b)
    msg_d = dense.message_from_view_grad(nat_d, jax.grad(objective)(dense.view(nat_d)))
    for family, nat, grad, msg in ((banded, nat_b, grad_b, msg_b), (dense, nat_d, jax.grad(objective)(dense.view(nat_d)), msg_d)):
        at = family.message_at(nat, family.view(nat), grad)  # (the view's mean, no refactorisation)
        np.testing.assert_allclose(at.eta1, msg.eta1, rtol=1e-12)
        np.testing.assert_allclose(at.eta2, msg.eta2, rtol=1e-12)
    np.testing.assert_allclose(msg_b.eta1, msg_d.eta1, rtol=1e-10)
    np.testing.assert_allclose(msg_b.eta2, _band.from_dense(np.asarray(msg_d.eta2), b), rtol=1e-10)
    fixed = banded.message_from_fixed_view_grad(
        jax.grad(lambda v: objective(GaussianView(v.mean, _band.to_dense(v.cov))))(banded.fixed_view(view_b))
    )
    np.testing.assert_allclose(fixed.eta2, msg_b.eta2, rtol=1e-12)


@pytest.mark.parametrize("b", [1, 2, 3])
def test_colour_rows_gradient_is_the_gathers(b):
    """The covariance rows per colour are a permutation of each row's diagonals with a
    hand-written gradient (the inverse permutation): value and gradient equal those of the
    plain gather (whose gradient is a scatter-add), batched rows included; neither is a
    gather or a scatter in the compiled program (selects, one elementwise loop)."""
    k, n = 2 * b + 1, 17
    rng = np.random.default_rng(b)
    x = jnp.asarray(rng.normal(size=(2, n, k)))
    g = jnp.asarray(rng.normal(size=(2, n, k)))
    offset = (np.arange(k)[None, :] - (np.arange(n) % k)[:, None] + b) % k

    def plain(x):
        return jnp.sum(x[..., np.arange(n)[:, None], offset] * g)

    def rows(x):
        return jnp.sum(jnp.moveaxis(_colour_rows(x, b), 0, -1) * g)

    np.testing.assert_array_equal(rows(x), plain(x))
    np.testing.assert_allclose(jax.grad(rows)(x), jax.grad(plain)(x), rtol=0, atol=0)
    hlo = jax.jit(jax.value_and_grad(rows)).lower(x).compile().as_text()
    assert "gather(" not in hlo and "scatter(" not in hlo


@pytest.mark.parametrize("b", [1, 2, 3])
def test_colour_tangents_give_every_windowed_covariance(b):
    """Σ_c (aᵀ left_c)(a'ᵀ right_c) = aᵀ Σ a' whenever a and a' share a window of b + 1."""
    n = 23
    rng = np.random.default_rng(b)
    s = _banded_spd(rng, n, b)
    family = GaussianBanded(n, b)
    view = family.view(BandedGaussianNat(jnp.zeros(n), jnp.asarray(-0.5 * _band.from_dense(s, b))))
    sets = family.tangent_sets(view, True)
    left, right = np.asarray(sets["left"]), np.asarray(sets["right"])
    sigma = np.linalg.inv(s)
    for t in range(n):
        lo = max(0, t - b)
        a, a2 = np.zeros(n), np.zeros(n)
        a[lo : t + 1], a2[lo : t + 1] = rng.normal(size=t + 1 - lo), rng.normal(size=t + 1 - lo)
        np.testing.assert_allclose((left @ a) @ (right @ a2), a @ sigma @ a2, rtol=1e-10)


def test_banded_draws_have_the_chain_covariance():
    n, b, draws = 6, 1, 100_000
    rng = np.random.default_rng(5)
    s = _banded_spd(rng, n, b)
    family = GaussianBanded(n, b)
    nat = BandedGaussianNat(jnp.asarray(s @ np.ones(n)), jnp.asarray(-0.5 * _band.from_dense(s, b)))
    x = np.asarray(family.sample(nat, random.PRNGKey(0), (draws,)))
    sigma = np.linalg.inv(s)
    # each entry of the sample covariance has sd ≈ √((Σ_ii Σ_jj + Σ_ij²)/N): 5 sd of the largest
    tol = 5 * np.sqrt(2 * np.max(np.diag(sigma)) ** 2 / draws)
    np.testing.assert_allclose(np.cov(x.T), sigma, atol=tol)
    np.testing.assert_allclose(x.mean(0), np.ones(n), atol=5 * np.sqrt(np.max(np.diag(sigma)) / draws))


# -- the bandwidth of the models users write ---------------------------------------------------

T = 60


def rw_scan(y):
    def step(prev, y_t):
        x = numpyro.sample("x", dist.Normal(prev, 0.3))
        numpyro.sample("y", dist.Normal(x, 0.5), obs=y_t)
        return x, x

    scan(step, 0.0, y)


def rw_grw(y):
    x = numpyro.sample("x", dist.GaussianRandomWalk(0.3, num_steps=len(y)))
    with numpyro.plate("t", len(y)):
        numpyro.sample("y", dist.Normal(x, 0.5), obs=y)


def rw_vector(y):
    """Steps as a plated vector, the walk written with slices (no scan)."""
    with numpyro.plate("t", len(y)):
        x = numpyro.sample("x", dist.Normal(0.0, 10.0))
        numpyro.sample("y", dist.Normal(x, 0.5), obs=y)
    numpyro.sample("walk", dist.Normal(x[:-1], 0.3), obs=x[1:])


def ar2_scan(y):
    def step(carry, y_t):
        lag1, lag2 = carry
        x = numpyro.sample("x", dist.Normal(0.6 * lag1 - 0.2 * lag2, 0.3))
        numpyro.sample("y", dist.Normal(x, 0.5), obs=y_t)
        return (x, lag1), x

    scan(step, (0.0, 0.0), y)


def local_trend(y):
    """A 2-dimensional state (level, slope), stored time-major: the level reads the previous
    level and slope, two positions back (bandwidth 2)."""

    def step(state, y_t):
        level, slope = state[0], state[1]
        new = numpyro.sample("state", dist.Normal(jnp.stack([level + slope, slope]), jnp.array([0.3, 0.05])).to_event(1))
        numpyro.sample("y", dist.Normal(new[0], 0.5), obs=y_t)
        return new, new

    scan(step, jnp.zeros(2), y)


def global_sum(y):
    """Every observation reads the sum of all steps: no chain."""
    with numpyro.plate("t", len(y)):
        x = numpyro.sample("x", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(x + 0.1 * jnp.sum(x), 0.5), obs=y)


def random_pairs(y):
    """Each observation reads two steps far apart: no chain."""
    idx = np.random.default_rng(0).permutation(len(y))
    with numpyro.plate("t", len(y)):
        x = numpyro.sample("x", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(x - x[idx], 0.5), obs=y)


def _plan(model, y, structure=None):
    records, spec, dyn, _ = trace_model(model, (jnp.asarray(y),), {}, random.PRNGKey(0))
    plan, *_ = compile_model(ModelProgram(model), records, spec, dyn, rng_key=random.PRNGKey(1), structure=structure)
    return plan


@pytest.mark.parametrize(
    "model,bandwidth",
    [(rw_scan, 1), (rw_grw, 1), (rw_vector, 1), (ar2_scan, 2), (local_trend, 2), (global_sum, None), (random_pairs, None)],
)
def test_chain_bandwidth_of_user_models(model, bandwidth):
    y = np.random.default_rng(0).normal(size=T)
    plan = _plan(model, y)
    (block,) = [b for b in plan.blocks if not b.discrete]
    if bandwidth is None:
        assert not block.family.banded
    else:
        assert block.family.banded and block.family.bandwidth == bandwidth, plan.describe()
        assert f"gaussian-banded (bandwidth {bandwidth})" in plan.describe()


def volatility_scan(r):
    """Stochastic volatility with an unknown step scale, one site per day."""
    sigma = numpyro.sample("sigma", dist.HalfNormal(0.5))

    def step(h_prev, r_t):
        h = numpyro.sample("h", dist.Normal(h_prev, sigma))
        numpyro.sample("r", dist.Normal(0.0, jnp.exp(h / 2)), obs=r_t)
        return h, None

    scan(step, 0.0, r)


def local_level_scan(y):
    """A local level with unknown step and observation scales, one site per step."""
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    noise = numpyro.sample("noise", dist.HalfNormal(2.0))

    def step(x_prev, y_t):
        x = numpyro.sample("x", dist.Normal(x_prev, sigma))
        numpyro.sample("y", dist.Normal(x, noise), obs=y_t)
        return x, None

    scan(step, 0.0, y)


def local_level_grw(y):
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    noise = numpyro.sample("noise", dist.HalfNormal(2.0))
    x = numpyro.sample("x", dist.GaussianRandomWalk(sigma, num_steps=len(y)))
    with numpyro.plate("t", len(y)):
        numpyro.sample("y", dist.Normal(x, noise), obs=y)


def poisson_level_scan(c):
    """Counts around a level ``mu`` that every step adds to a walk with an unknown scale."""
    sigma = numpyro.sample("sigma", dist.LogNormal(-2.0, 0.5))
    mu = numpyro.sample("mu", dist.Normal(1.0, 1.0))

    def step(x_prev, c_t):
        x = numpyro.sample("x", dist.Normal(x_prev, sigma))
        numpyro.sample("c", dist.Poisson(jnp.exp(mu + x)), obs=c_t)
        return x, None

    scan(step, 0.0, c)


def test_chain_keeps_its_level_and_leaves_its_scale():
    """The walk's scale leaves the joint block (its factor closed-form); the level ``mu``,
    read with the walk in one argument exp(mu + x), stays with it: their sum is what the
    counts identify, so apart (mean-field) each would have too small an sd."""
    y = np.random.default_rng(0).poisson(3.0, size=T).astype(float)
    plan = _plan(poisson_level_scan, y)
    assert plan.block("sigma").sites == ("sigma",), plan.describe()
    joint = [b for b in plan.blocks if "x" in b.sites]
    assert joint[0].sites == ("mu", "x") and not joint[0].family.banded, plan.describe()
    assert {f.name: f.estimator for f in plan.factors}["x"] == "exact", plan.describe()
    assert {f.name: f.estimator for f in plan.factors}["c"] == "exact", plan.describe()


@pytest.mark.parametrize(
    "model,chain,structure",
    [
        (volatility_scan, "h", None),
        (local_level_scan, "x", None),
        (local_level_grw, "x", None),
        (volatility_scan, "h", "mean-field"),
        (local_level_scan, "x", "mean-field"),
    ],
)
def test_chain_keeps_apart_from_its_scales_below_the_dense_limit(model, chain, structure):
    """A chain of fewer than 500 scalars whose steps read scales on log space: joined with
    them in the default dense block, each step's factor would be a quadrature over a dense
    block (a minute for 400 days); apart, the chain is banded and every factor closed-form,
    as at any length. Under mean-field a scan's stacked steps (one site, one dense block)
    are banded too: the same q, fitted in O(n)."""
    y = np.random.default_rng(0).normal(size=T)
    plan = _plan(model, y, structure)
    (block,) = [b for b in plan.blocks if chain in b.sites]
    assert block.family.banded and block.family.bandwidth == 1, plan.describe()
    assert block.sites == (chain,), plan.describe()
    assert all(f.estimator == "exact" for f in plan.factors if f.dist_name != "log|det J| (ExpTransform)"), plan.describe()


# -- long chains fit exactly -------------------------------------------------------------------


def _exact_walk(y, seen, q, r):
    """The exact posterior of x_t = x_{t−1} + N(0, q), x_0 ~ N(0, q), y_t ~ N(x_t, r) (dense)."""
    n = len(y)
    diff = np.eye(n) - np.eye(n, k=-1)
    prec = diff.T @ diff / q + np.diag(seen / r)
    cov = np.linalg.inv(prec)
    return cov @ (seen * y / r), np.sqrt(np.diag(cov))


def rw_masked(y, seen):
    x = numpyro.sample("x", dist.GaussianRandomWalk(0.3, num_steps=len(y)))
    with numpyro.plate("t", len(y)):
        numpyro.sample("y", dist.Normal(x, 0.5).mask(seen), obs=y)


def rw_masked_scan(y, seen):
    def step(prev, inputs):
        y_t, seen_t = inputs
        x = numpyro.sample("x", dist.Normal(prev, 0.3))
        numpyro.sample("y", dist.Normal(x, 0.5).mask(seen_t), obs=y_t)
        return x, x

    _, xs = scan(step, 0.0, (y, seen))
    numpyro.deterministic("level", xs)


@pytest.mark.parametrize("model", [rw_masked, rw_masked_scan])
def test_random_walk_with_a_gap_is_exact_in_one_step(model):
    """A walk of 1,500 steps (beyond any dense block) with 150 missing observations."""
    n = 1500
    rng = np.random.default_rng(1)
    y = np.cumsum(rng.normal(size=n) * 0.3) + rng.normal(size=n) * 0.5
    seen = np.ones(n, bool)
    seen[600:750] = False
    res = blr_fit(model, (jnp.asarray(y), jnp.asarray(seen)), progress_bar=False)
    assert res.plan.block("x").family.banded
    mean, sd = _exact_walk(y, seen, 0.09, 0.25)
    np.testing.assert_allclose(res.posterior["x"].mean, mean, atol=1e-8)
    np.testing.assert_allclose(np.sqrt(res.posterior["x"].variance), sd, atol=1e-8)
    assert len(res.elbo) <= 2  # the exact step, then the check that nothing moves


FLOAT32_WALK = r"""
import json
import jax, jax.numpy as jnp, numpy as np
import numpyro, numpyro.distributions as dist
assert not jax.config.jax_enable_x64
from blrppl import blr_fit

n = 1500
rng = np.random.default_rng(1)
y = (np.cumsum(rng.normal(size=n) * 0.3) + rng.normal(size=n) * 0.5).astype(np.float32)
seen = np.ones(n, bool)
seen[600:750] = False

def walk(y, seen):
    x = numpyro.sample("x", dist.GaussianRandomWalk(0.3, num_steps=len(y)))
    with numpyro.plate("t", len(y)):
        numpyro.sample("y", dist.Normal(x, 0.5).mask(seen), obs=y)

res = blr_fit(walk, (jnp.asarray(y), jnp.asarray(seen)), progress_bar=False)
post = res.posterior["x"]
print("RESULT" + json.dumps({
    "banded": bool(res.plan.block("x").family.banded), "dtype": str(post.mean.dtype),
    "mean": np.asarray(post.mean, float).tolist(), "var": np.asarray(post.variance, float).tolist(),
    "y": y.astype(float).tolist(),
}))
"""


def test_random_walk_in_float32(tmp_path):
    """The banded family's scans in float32: the 1,500-step walk with a gap equals the exact
    posterior to float32 accuracy (the band Cholesky of a diagonally dominant precision loses
    a few ulps per row at most)."""
    from checks import run_in_new_process

    out = run_in_new_process(FLOAT32_WALK, tmp_path, JAX_ENABLE_X64="0")
    assert out["banded"] and out["dtype"] == "float32"
    seen = np.ones(1500, bool)
    seen[600:750] = False
    mean, sd = _exact_walk(np.asarray(out["y"]), seen, 0.09, 0.25)
    np.testing.assert_allclose(out["mean"], mean, atol=2e-4 * np.max(np.abs(mean)))
    np.testing.assert_allclose(np.sqrt(out["var"]), sd, rtol=1e-4)


def test_state_space_with_its_initial_state_is_one_banded_block_equal_to_kalman():
    """The linear-Gaussian state-space model of ``test_state_space.py`` (latent initial state
    ``x0``, then ``x`` carried by ``scan``) at T = 400, with a gap: x0 joins the chain (one
    banded block over 401 scalars in model order) and the fit equals the Kalman/RTS
    smoother in one step."""
    from integration import test_state_space as ss

    n = 400
    rng = np.random.default_rng(7)
    x, states = rng.normal(), []
    for _ in range(n):
        x = ss.A * x + np.sqrt(ss.Q) * rng.normal()
        states.append(x)
    y = np.array(states) + np.sqrt(ss.R) * rng.normal(size=n)
    observed = np.ones(n, bool)
    observed[150:190] = False
    r = blr_fit(ss.scan_model, {"y": y, "observed": observed}, rng_key=random.PRNGKey(0), progress_bar=False)
    (block,) = r.plan.blocks
    assert block.family.banded and block.family.bandwidth == 1 and block.sites == ("x0", "x"), r.plan.describe()
    assert r.converged and r.num_steps == 1, r.message
    means, variances = ss.kalman_smoother(y, observed)
    np.testing.assert_allclose(float(r.posterior["x0"].mean), means[0], atol=1e-8)
    np.testing.assert_allclose(float(r.posterior["x0"].variance), variances[0], rtol=1e-8)
    np.testing.assert_allclose(r.posterior["x"].mean, means[1:], atol=1e-8)
    np.testing.assert_allclose(r.posterior["x"].variance, variances[1:], rtol=1e-8)


# -- observations that read one scalar of a chain ------------------------------------------------


def poisson_walk(c):
    x = numpyro.sample("x", dist.GaussianRandomWalk(0.1, num_steps=c.shape[0]))
    with numpyro.plate("t", c.shape[0]):
        numpyro.sample("c", dist.Poisson(jnp.exp(x)), obs=c)


def logistic_scan(y):
    """One site per step, Bernoulli observations through a logit (quadrature)."""

    def step(prev, y_t):
        x = numpyro.sample("x", dist.Normal(0.9 * prev, 0.5))
        numpyro.sample("y", dist.Bernoulli(logits=x), obs=y_t)
        return x, None

    scan(step, 0.0, y)


def shuffled_counts(c):
    """Each count reads one step of the walk, in a shuffled order (a gather)."""
    idx = np.random.default_rng(3).permutation(c.shape[0])
    x = numpyro.sample("x", dist.GaussianRandomWalk(0.1, num_steps=c.shape[0]))
    with numpyro.plate("t", c.shape[0]):
        numpyro.sample("c", dist.Poisson(jnp.exp(x[idx])), obs=c)


def neighbour_counts(c):
    """Each count reads two neighbouring steps (the chain's band, not one scalar)."""
    x = numpyro.sample("x", dist.GaussianRandomWalk(0.1, num_steps=c.shape[0] + 1))
    with numpyro.plate("t", c.shape[0]):
        numpyro.sample("c", dist.Poisson(jnp.exp(0.5 * (x[1:] + x[:-1]))), obs=c)


def _counts(n=T):
    rng = np.random.default_rng(5)
    return rng.poisson(np.exp(1.0 + np.cumsum(0.1 * rng.normal(size=n)))).astype(float)


def _binary(n=600):
    # (beyond the dense joint block: a logistic chain of 60 steps is fitted as one dense block)
    return (np.random.default_rng(6).uniform(size=n) < 0.6).astype(float)


@pytest.mark.parametrize(
    "model,data,scalar",
    [
        (rw_grw, np.zeros(T), {"y"}),
        (rw_vector, np.zeros(T), {"x", "y"}),  # (x's own prior reads each step alone)
        (ar2_scan, np.zeros(T), {"y"}),
        (local_trend, np.zeros(T), {"y"}),
        (logistic_scan, _binary(), {"y"}),
        (shuffled_counts, _counts(), {"c"}),
        (neighbour_counts, _counts(), set()),
    ],
)
def test_factors_reading_one_scalar_of_a_chain(model, data, scalar):
    """Observations of one step each (in order or gathered) read the chain through its
    diagonal (``"scalar"`` columns); the chain's own factors and observations of two steps
    keep the colour rows."""
    plan = _plan(model, data)
    (block,) = [b for b in plan.blocks if not b.discrete]
    assert block.family.banded, plan.describe()
    modes = {f.name: dict(f.columns).get(block.name) for f in plan.factors if block.name in f.neighbours}
    assert {n for n, mode in modes.items() if mode == "scalar"} == scalar, modes


@pytest.mark.parametrize(
    "model,data", [(poisson_walk, _counts()), (logistic_scan, _binary()), (neighbour_counts, _counts())]
)
def test_scalar_reads_give_the_colour_rows_moments(model, data, monkeypatch):
    """A fit whose observations read the chain's diagonal (two pushed rows) takes the same
    steps as one through the 2(2b + 1) colour rows (float64, 1e-10): closed-form (Poisson),
    quadrature (logit) and an observation of two steps (colour rows in both)."""
    import blrppl.compiler.estimators as compile_mod
    from checks import fresh_fit

    args = (jnp.asarray(data),)
    fast = fresh_fit(model, args, monkeypatch, num_steps=8)
    monkeypatch.setattr(compile_mod, "_scalar_columns", lambda f, chains: f)
    slow = fresh_fit(model, args, monkeypatch, num_steps=8)
    assert fast.plan.block("x").family.banded
    assert [dict(f.columns).get("x") for f in slow.plan.factors] != [dict(f.columns).get("x") for f in fast.plan.factors] or model is neighbour_counts
    np.testing.assert_allclose(np.asarray(fast.elbo), np.asarray(slow.elbo), rtol=1e-10)
    np.testing.assert_allclose(fast.posterior["x"].mean, slow.posterior["x"].mean, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(fast.posterior["x"].variance, slow.posterior["x"].variance, rtol=1e-10)


def three_sines(y):
    """Each observation reads three neighbouring steps through sines: a chain (bandwidth 2)
    whose observations have neither closed form nor quadrature (three projections)."""
    x = numpyro.sample("x", dist.GaussianRandomWalk(0.3, num_steps=len(y) + 2))
    with numpyro.plate("t", len(y)):
        numpyro.sample("y", dist.Normal(jnp.sin(x[:-2]) + jnp.sin(x[1:-1]) + jnp.sin(x[2:]), 0.5), obs=y)


def test_chain_observed_through_quadrature_is_banded_and_through_draws_is_not():
    """A logistic AR(1) (quadrature observations, decided on the final blocks) is a chain;
    a chain whose observations need draws is compiled again without the band (its view gives
    no draws of the whole chain), not refused."""
    logistic = _plan(logistic_scan, _binary())
    estimators = {f.name: f.estimator for f in logistic.factors}
    assert logistic.block("x").family.banded and estimators["y"] == "quadrature", logistic.describe()
    sines = _plan(three_sines, np.zeros(T))
    estimators = {f.name: f.estimator for f in sines.factors}
    assert not sines.block("x").family.banded and estimators["y"] == "monte_carlo", sines.describe()


@pytest.mark.parametrize("shape", [(1,), (15,), (16,), (17,), (3, 1000), (10_000,)])
def test_sum_log_equals_the_sum_of_logs(shape):
    # magnitudes over e^±90: the grouped fractions and the exponents carry them apart
    x = np.exp(np.random.default_rng(sum(shape)).normal(scale=30.0, size=shape))
    got = np.asarray(_band.sum_log(jnp.asarray(x)))
    ref = np.log(x).sum(-1)
    np.testing.assert_allclose(got, ref, rtol=1e-14, atol=1e-12)


@pytest.mark.parametrize(
    "x, expected",
    [([1.0, 0.0, 2.0], -np.inf), ([1.0, np.inf], np.inf), ([1.0, np.nan], np.nan), ([1.0, -1.0, -1.0], np.nan)],
)
def test_sum_log_edge_values(x, expected):
    np.testing.assert_equal(float(_band.sum_log(jnp.asarray(x))), expected)


def test_sum_log_keeps_float32():
    x = np.exp(np.random.default_rng(1).normal(size=1000)).astype(np.float32)
    got = _band.sum_log(jnp.asarray(x))
    assert got.dtype == jnp.float32
    # (float32 sums of 10³ logs: a few 10⁻⁵ of rounding)
    np.testing.assert_allclose(float(got), np.log(x.astype(np.float64)).sum(), atol=1e-4)


def test_time_major_members_layout():
    """A joint block with its last two members stored step by step (a scalar a, then b of
    shape (3,) and c of shape (3, 2)): block positions [a, b0, c00, c01, b1, c10, c11, b2,
    c20, c21]; split and join are inverses, with leading sample dims too."""
    from blrppl.graph.plan import Block

    def member(name, shape):
        return Block(name, GaussianDense(int(np.prod(shape))), "gaussian", shape)

    members = (member("a", ()), member("b", (3,)), member("c", (3, 2)))
    block = Block("(a, b, c)", GaussianDense(10), "gaussian", (10,), members=members, interleaved=2)
    positions = block.member_positions()
    assert [p.tolist() for p in positions] == [[0], [1, 4, 7], [2, 3, 5, 6, 8, 9]]
    parts = block.split(jnp.arange(10.0))
    np.testing.assert_array_equal(parts["a"], 0.0)
    np.testing.assert_array_equal(parts["b"], [1.0, 4.0, 7.0])
    np.testing.assert_array_equal(parts["c"], [[2.0, 3.0], [5.0, 6.0], [8.0, 9.0]])
    np.testing.assert_array_equal(block.join({k: np.asarray(v) for k, v in parts.items()}), np.arange(10.0))
    draws = jnp.arange(20.0).reshape(2, 10)
    np.testing.assert_array_equal(block.split(draws)["c"][1], [[12.0, 13.0], [15.0, 16.0], [18.0, 19.0]])
