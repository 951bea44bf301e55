"""Normal factors whose mean multiplies a row of one Gaussian block by a row of another,
read from data statistics (``blrppl.estimators.bilinear``).

Each case is a likelihood as users write it (``X @ C.T`` with or without a mask,
``(U[users] * V[items]).sum(-1)`` with repeated pairs and an offset, ``C @ X.T`` on the
transposed data), with its hand-worked element map: which row of each block element e reads,
its coefficient s_e and offset c_e, and its weight. The reference is the definition,

    Σ_e ω_e E[log N(y_e | c_e + s_e a_iᵀ b_j, σ_e²)],
    E[(y − c − s aᵀb)²] = (y − c)² − 2 (y − c) s m_aᵀ m_b + s² tr(E[a aᵀ] E[b bᵀ]),

summed element by element in numpy at random rows' means and covariances; its gradients
(the messages) are compared too. Forms that are not a product of two rows (an affine term in
a block, a weighted contraction) keep the elementwise moments.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

import reference_models as rm
from blrppl.model.program import ModelProgram
from blrppl.compiler.families import init_nat
from blrppl.engine.build import plan_model
from blrppl.estimators import bilinear
from blrppl.families.gaussian import GaussianDense, GaussianNat
from blrppl.model.trace import trace_model
from blrppl.inputs import fit_options, model_arguments

numpyro.enable_x64()

N, M, D = 6, 4, 3
SIGMA = 0.7


def pca(Y):
    return rm.ppca_model(Y, D)


def masked_pca(Y, seen):
    with numpyro.plate("M", M):
        C = numpyro.sample("C", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    with numpyro.plate("N", N):
        X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    with numpyro.plate("n", N, dim=-2), numpyro.plate("m", M, dim=-1), numpyro.handlers.mask(mask=seen):
        numpyro.sample("Y", dist.Normal(jnp.einsum("nd,md->nm", X, C), SIGMA), obs=Y)


def _ratings_with(offset, factor):
    """Ratings of (user, item) pairs, r ~ N(offset + factor · U[user]·V[item], σ)."""

    def model(users, items, r):
        with numpyro.plate("users", N):
            U = numpyro.sample("U", dist.Normal(jnp.zeros(D), 1.0).to_event(1))
        with numpyro.plate("items", M):
            V = numpyro.sample("V", dist.Normal(jnp.zeros(D), 1.0).to_event(1))
        with numpyro.plate("ratings", len(users)):
            numpyro.sample("r", dist.Normal(offset + factor * jnp.sum(U[users] * V[items], -1), SIGMA), obs=r)

    return model


ratings = _ratings_with(3.0, 0.5)
BIG = 1e13  # an offset far larger than the product's scale (the indices must not cancel against it)
tiny_product_on_a_big_offset = _ratings_with(BIG, 1e-3)


def transposed(Yt):
    # (M, N) data, C first in the product: the pair is (C, X), C's rows along the data's rows
    with numpyro.plate("M", M):
        C = numpyro.sample("C", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    with numpyro.plate("N", N):
        X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    numpyro.sample("Y", dist.Normal(C @ X.T, SIGMA).to_event(2), obs=Yt)


def factor_analysis(Y):
    # a noise precision per observed dimension: τ_j along the rows of W
    return rm.factor_analysis_model(Y, D)


def row_noise(Y, seen):
    # a precision per row of X, masked entries: τ_i along the rows of X, a grid of weights
    phi = numpyro.sample("phi", dist.Gamma(2.0, 1.0).expand([N]).to_event(1))
    with numpyro.plate("M", M):
        C = numpyro.sample("C", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    with numpyro.plate("N", N):
        X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    with numpyro.plate("n", N, dim=-2), numpyro.plate("m", M, dim=-1), numpyro.handlers.mask(mask=seen):
        numpyro.sample("Y", dist.Normal(X @ C.T, 1 / jnp.sqrt(phi)[:, None]), obs=Y)


def _ratings_with_precisions(index):
    """Ratings with a noise precision per item, read at ``index(users, items)``."""

    def model(users, items, r):
        prec = numpyro.sample("prec", dist.Gamma(2.0, 1.0).expand([M]).to_event(1))
        with numpyro.plate("users", N):
            U = numpyro.sample("U", dist.Normal(jnp.zeros(D), 1.0).to_event(1))
        with numpyro.plate("items", M):
            V = numpyro.sample("V", dist.Normal(jnp.zeros(D), 1.0).to_event(1))
        with numpyro.plate("ratings", len(users)):
            scale = 1 / jnp.sqrt(prec[index(users, items)])
            numpyro.sample("r", dist.Normal(3.0 + 0.5 * jnp.sum(U[users] * V[items], -1), scale), obs=r)

    return model


item_precisions = _ratings_with_precisions(lambda users, items: items)
other_precisions = _ratings_with_precisions(lambda users, items: (items + 1) % M)


_rng = np.random.default_rng(0)
_Y = _rng.normal(size=(N, M))
_SEEN = _rng.random((N, M)) < 0.6
_USERS = np.array([0, 1, 1, 5, 5, 2, 0])
_ITEMS = np.array([3, 0, 0, 2, 1, 1, 3])  # (1, 0) and (0, 3) rated twice
_R = 3.0 + _rng.normal(size=len(_USERS))
_GRID_I, _GRID_J = (x.ravel() for x in np.meshgrid(np.arange(N), np.arange(M), indexing="ij"))
_T_I, _T_J = (x.ravel() for x in np.meshgrid(np.arange(M), np.arange(N), indexing="ij"))

#: (model, data, pair (A, B), element map: rows of A and B, s, c, y, ω, whether σ = τ^(−½):
#: True for one τ, (τ's block, the element of it each element reads, the block along whose
#: rows it runs) for a vector)
CASES = {
    "factor analysis": (factor_analysis, {"Y": _Y}, ("X", "W"), (_GRID_I, _GRID_J, 1.0, 0.0, _Y.ravel(), 1.0, ("psi", _GRID_J, "W"))),
    "precision per row, masked": (
        row_noise, {"Y": _Y, "seen": _SEEN}, ("X", "C"),
        (_GRID_I, _GRID_J, 1.0, 0.0, _Y.ravel(), _SEEN.ravel().astype(float), ("phi", _GRID_I, "X")),
    ),
    "precision per item": (
        item_precisions, {"users": _USERS, "items": _ITEMS, "r": _R}, ("U", "V"),
        (_USERS, _ITEMS, 0.5, 3.0, _R, 1.0, ("prec", _ITEMS, "V")),
    ),
    "X @ C.T, tau": (pca, {"Y": _Y}, ("X", "C"), (_GRID_I, _GRID_J, 1.0, 0.0, _Y.ravel(), 1.0, True)),
    "einsum, masked": (
        masked_pca, {"Y": _Y, "seen": _SEEN}, ("X", "C"),
        (_GRID_I, _GRID_J, 1.0, 0.0, _Y.ravel(), _SEEN.ravel().astype(float), False),
    ),
    "U[users] * V[items], offset": (
        ratings, {"users": _USERS, "items": _ITEMS, "r": _R}, ("U", "V"),
        (_USERS, _ITEMS, 0.5, 3.0, _R, 1.0, False),
    ),
    "big offset": (
        tiny_product_on_a_big_offset, {"users": _USERS, "items": _ITEMS, "r": BIG + _R}, ("U", "V"),
        (_USERS, _ITEMS, 1e-3, BIG, BIG + _R, 1.0, False),
    ),
    "C @ X.T": (transposed, {"Yt": _Y.T}, ("C", "X"), (_T_I, _T_J, 1.0, 0.0, _Y.T.ravel(), 1.0, False)),
}


def _plan(model, data):
    args, kwargs = model_arguments(data)
    records, spec, dyn, _ = trace_model(model, args, kwargs, random.PRNGKey(0))
    with numpyro.validation_enabled(False):
        plan, fns, dyn, init_values, *_ = plan_model(ModelProgram(model), records, spec, dyn, fit_options(), None, random.PRNGKey(1))
    return plan, fns, dyn, init_values


def _views(plan, init_values, seed=1):
    """Every block's view at random natural parameters (random means, and covariances
    I + R Rᵀ/D per row for the Gaussian blocks)."""
    rng = np.random.default_rng(seed)
    views = {}
    for b in plan.blocks:
        nat = init_nat(b.full, init_values[b.name], None)
        if b.family.gaussian:
            rows = nat.eta1.shape
            r = rng.normal(size=rows[:-1] + (rows[-1], rows[-1]))
            prec = np.eye(rows[-1]) + r @ np.swapaxes(r, -1, -2) / rows[-1]
            nat = GaussianNat(jnp.asarray(rng.normal(size=rows)), jnp.asarray(-0.5 * prec))
            # (rows given one covariance by the plan, GaussianTied, are read here as any
            # dense rows: the statistics hold for every covariance per row)
            views[b.name] = GaussianDense(b.family.dim).rule_view(nat)
            continue
        views[b.name] = b.family.rule_view(nat)
    return views


def _definition(views, pair, element_map):
    """Σ_e ω_e E[log N(y_e | c_e + s_e a_iᵀ b_j, σ_e²)], element by element."""
    rows_a, rows_b, s, c, y, omega, gamma = element_map
    a, b = views[pair[0]], views[pair[1]]
    ma, mb = a.mean.reshape(-1, D), b.mean.reshape(-1, D)
    sa = a.cov.reshape(-1, D, D) + ma[:, :, None] * ma[:, None, :]
    sb = b.cov.reshape(-1, D, D) + mb[:, :, None] * mb[:, None, :]
    omega = np.broadcast_to(omega, np.shape(y))
    # (the rule view of a Gamma block holds E[τ] and E[log τ] as leaves of their own)
    if gamma is True:
        t, log_sigma = np.full(len(y), 1.0) * views["tau"].mean, -0.5 * views["tau"].mean_log * np.ones(len(y))
    elif gamma:
        name, k, _ = gamma
        t, log_sigma = views[name].mean[k], -0.5 * views[name].mean_log[k]
    else:
        t, log_sigma = np.full(len(y), SIGMA**-2), np.full(len(y), math.log(SIGMA))
    total = 0.0
    for e in range(len(y)):
        i, j = rows_a[e], rows_b[e]
        r = y[e] - c
        square = r * r - 2 * r * s * (ma[i] @ mb[j]) + s * s * jnp.trace(sa[i] @ sb[j])
        total = total + omega[e] * (-0.5 * t[e] * square - log_sigma[e] - 0.5 * math.log(2 * math.pi))
    return total


def _pair_and_scale_rows(factor) -> tuple:
    """The blocks and the scale's rows of the factor's bilinear statistics (its spec's
    ``statistics``), or ``((), "")`` when it reads none."""
    source = factor.spec.statistics
    return ((), "") if source is None else (source.pair, source.scale_rows)


@pytest.mark.parametrize("case", list(CASES))
def test_expectation_and_messages_equal_the_definition(case):
    model, data, pair, element_map = CASES[case]
    plan, fns, dyn, init_values = _plan(model, data)
    (factor,) = [f for f in plan.factors if f.observed]
    assert _pair_and_scale_rows(factor) == (
        pair, element_map[-1][2] if isinstance(element_map[-1], tuple) else ""
    ), plan.describe()
    assert "exact (data statistics)" in plan.describe()
    blocks = {b.name: b for b in plan.blocks}
    stats = bilinear.statistics(fns, factor, blocks, dyn)
    assert bool(stats.uniform) == (case in ("X @ C.T, tau", "C @ X.T", "factor analysis"))
    views = _views(plan, init_values)

    def got(v):
        return bilinear.expected_log(factor, stats, v)

    def want(v):
        return _definition(v, pair, element_map)

    np.testing.assert_allclose(got(views), want(views), rtol=1e-12)
    # the messages are these gradients, with respect to each block's mean and (symmetric)
    # covariance: the gradient's symmetric part
    g_got, g_want = jax.grad(got)(views), jax.grad(want)(views)
    for n in views:
        for field, g, w in zip(views[n]._fields, g_got[n], g_want[n]):
            if field == "cov":
                g, w = g + np.swapaxes(g, -1, -2), w + np.swapaxes(w, -1, -2)
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=f"{n}.{field}")


def _pca_with(loc_of):
    """A factor model whose likelihood's mean is ``loc_of(X, C)``."""

    def model(Y):
        with numpyro.plate("M", M):
            C = numpyro.sample("C", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        with numpyro.plate("N", N):
            X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        with numpyro.plate("n", N, dim=-2), numpyro.plate("m", M, dim=-1):
            numpyro.sample("Y", dist.Normal(loc_of(X, C), SIGMA), obs=Y)

    return model


_affine_term = _pca_with(lambda X, C: X @ C.T + X[:, :1])
_weighted_contraction = _pca_with(lambda X, C: (X * jnp.arange(1.0, D + 1)) @ C.T)
# a contraction over another coupling of the coordinates: u_k v_{k+1} (W_e off the diagonal)
_shifted_contraction = _pca_with(lambda X, C: X @ jnp.roll(C, 1, axis=1).T)


@pytest.mark.parametrize(
    "model", [_affine_term, _weighted_contraction, _shifted_contraction], ids=["affine term", "weighted", "shifted"]
)
def test_other_products_keep_the_elementwise_moments(model):
    plan, *_ = _plan(model, {"Y": _Y})
    (factor,) = [f for f in plan.factors if f.observed]
    assert factor.kinds["loc"] == "bilinear_gaussian" and _pair_and_scale_rows(factor)[0] == (), plan.describe()


def test_a_precision_read_at_another_row_keeps_the_elementwise_moments():
    """Item j's rating read with item j + 1's precision: τ is not indexed along the rows."""
    plan, *_ = _plan(other_precisions, {"users": _USERS, "items": _ITEMS, "r": _R})
    (factor,) = [f for f in plan.factors if f.observed]
    assert bilinear.candidate(factor, {b.name: b for b in plan.blocks}) == ("U", "V")
    assert _pair_and_scale_rows(factor) == ((), ""), plan.describe()


def test_rows_weighted_by_their_own_precision_keep_their_own_covariances():
    """Factor analysis: the rows of X share one covariance (I + Σ_j E[ψ_j] E[w_j w_jᵀ]); the
    rows of W, each weighted by its own ψ_j, do not."""
    plan, *_ = _plan(factor_analysis, {"Y": _Y})
    assert {n for n, _, _ in plan.tied} == {"X"}, plan.describe()


def _sparse_ratings(users, items, r):
    with numpyro.plate("users", 400):
        U = numpyro.sample("U", dist.Normal(jnp.zeros(D), 1.0).to_event(1))
    with numpyro.plate("items", 300):
        V = numpyro.sample("V", dist.Normal(jnp.zeros(D), 1.0).to_event(1))
    with numpyro.plate("ratings", len(users)):
        numpyro.sample("r", dist.Normal(jnp.sum(U[users] * V[items], -1), SIGMA), obs=r)


def test_a_sparse_grid_of_row_pairs_keeps_the_elementwise_moments():
    """200 ratings of 400 users × 300 items: the grid of row pairs (120,000 entries, 600 per
    rating) would cost a step far more than the ratings themselves."""
    rng = np.random.default_rng(1)
    data = {"users": rng.integers(0, 400, 200), "items": rng.integers(0, 300, 200), "r": rng.normal(size=200)}
    plan, *_ = _plan(_sparse_ratings, data)
    (factor,) = [f for f in plan.factors if f.observed]
    assert bilinear.candidate(factor, {b.name: b for b in plan.blocks}) == ("U", "V")
    assert _pair_and_scale_rows(factor)[0] == (), plan.describe()
