"""The arrowhead Gaussian family against a dense reference.

:class:`blrppl.families.gaussian_arrowhead.GaussianArrowhead` holds a Gaussian whose
precision is diagonal among its local scalars and dense on the rows and columns of its
global ones. Every map is compared (float64, 1e-10) with numpy's dense linear algebra on
the same precision, n_l = 7 locals and n_g = 3 globals at non-contiguous positions
(0, 8 and 9 of 10), and with :class:`blrppl.families.GaussianDense` for the learning-rule
message.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from jax import random

from blrppl.families import GaussianDense, GaussianNat
from blrppl.families.base import Family
from blrppl.families.gaussian_arrowhead import (
    ArrowheadGaussianNat,
    ArrowheadGaussianView,
    GaussianArrowhead,
)

numpyro.enable_x64()

N = 10
GLOBALS = ((0, 1), (8, 10))
FAMILY = GaussianArrowhead(N, GLOBALS)
GI = np.array([0, 8, 9])
LI = np.array([1, 2, 3, 4, 5, 6, 7])
LOG_2PI = math.log(2.0 * math.pi)


def _arrowhead_spd(rng):
    """A random SPD precision with the arrowhead pattern: S_GG = C + Bᵀ D⁻¹ B with C SPD."""
    nl, ng = len(LI), len(GI)
    d = rng.uniform(0.5, 2.0, size=nl)
    b = rng.normal(size=(nl, ng))
    a = rng.normal(size=(ng, ng))
    c = a @ a.T + np.eye(ng)
    s = np.zeros((N, N))
    s[LI, LI] = d
    s[np.ix_(LI, GI)] = b
    s[np.ix_(GI, LI)] = b.T
    s[np.ix_(GI, GI)] = c + b.T @ (b / d[:, None])
    return s


def _nat(s, m, dtype=np.float64):
    return ArrowheadGaussianNat(
        jnp.asarray(s @ m, dtype),
        jnp.asarray(-0.5 * np.diag(s)[LI], dtype),
        jnp.asarray(-0.5 * s[np.ix_(LI, GI)], dtype),
        jnp.asarray(-0.5 * s[np.ix_(GI, GI)], dtype),
    )


def _pattern(a):
    """The pattern entries of a dense symmetric n × n matrix, in the view's layout."""
    a = np.asarray(a)
    return np.diag(a)[LI], a[np.ix_(LI, GI)], a[np.ix_(GI, GI)]


@pytest.fixture
def case():
    rng = np.random.default_rng(0)
    s, m = _arrowhead_spd(rng), rng.normal(size=N)
    return s, m, _nat(s, m)


def test_configuration():
    assert FAMILY.arrowhead and FAMILY.gaussian and FAMILY.dense_event and not FAMILY.banded
    assert FAMILY.name == "gaussian-arrowhead" and FAMILY.view_type is ArrowheadGaussianView
    assert not Family.arrowhead and not GaussianDense.arrowhead
    assert hash(FAMILY) == hash(GaussianArrowhead(N, [[0, 1], [8, 10]]))  # spans normalised
    np.testing.assert_array_equal(FAMILY.global_index, GI)
    np.testing.assert_array_equal(FAMILY.local_index, LI)
    assert FAMILY.num_globals == 3 and FAMILY.event_shape == (N,)
    assert FAMILY.canonical_batch_shape((N,), ()) == ()
    assert GaussianArrowhead.update is Family.update  # the plain step, no retraction
    for bad in (((2, 5), (4, 6)), ((5, 6), (0, 1)), ((8, 11),), ((3, 3),)):
        with pytest.raises(ValueError):
            GaussianArrowhead(N, bad)
    with pytest.raises(NotImplementedError, match="not supported"):
        FAMILY.view_covariance(FAMILY.view(FAMILY.initial_nat(jnp.zeros(N))))
    # initial_nat: mean x, covariance I; numpy in, numpy out (no XLA program)
    x = np.random.default_rng(1).normal(size=N)
    for init in (FAMILY.initial_nat(x), FAMILY.initial_nat(jnp.asarray(x))):
        view = FAMILY.view(jax.tree.map(jnp.asarray, init))
        np.testing.assert_allclose(view.mean, x, rtol=1e-14)
        np.testing.assert_allclose(FAMILY.marginal_variance(view), np.ones(N), rtol=1e-14)
        np.testing.assert_allclose(view.cross, 0.0, atol=1e-15)
    assert all(isinstance(leaf, np.ndarray) for leaf in FAMILY.initial_nat(x))


def test_view_entropy_log_partition_and_log_prob_equal_dense(case):
    s, m, nat = case
    sigma = np.linalg.inv(s)
    view = FAMILY.view(nat)
    np.testing.assert_allclose(view.mean, m, rtol=1e-10, atol=1e-12)
    for got, want in zip(view[1:], _pattern(sigma)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(FAMILY.marginal_variance(view), np.diag(sigma), rtol=1e-10)
    logdet = np.linalg.slogdet(s)[1]
    entropy = 0.5 * N * (1.0 + LOG_2PI) - 0.5 * logdet
    log_z = 0.5 * m @ s @ m - 0.5 * logdet + 0.5 * N * LOG_2PI
    np.testing.assert_allclose(FAMILY.entropy(nat), entropy, rtol=1e-10)
    np.testing.assert_allclose(FAMILY.log_partition(nat), log_z, rtol=1e-10)
    rule_view, rule_entropy = FAMILY.rule_view_and_entropy(nat)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-14), rule_view, view)
    np.testing.assert_allclose(rule_entropy, entropy, rtol=1e-10)
    x = np.random.default_rng(2).normal(size=(4, N))
    dx = x - m
    want = -0.5 * np.einsum("ki,ij,kj->k", dx, s, dx) + 0.5 * logdet - 0.5 * N * LOG_2PI
    np.testing.assert_allclose(FAMILY.log_prob(nat, jnp.asarray(x)), want, rtol=1e-10)
    # the exponential-family identities with the leafwise inner product (the base class's
    # log q = ⟨λ, T(x)⟩ − A and H = A − ⟨λ, μ⟩)
    np.testing.assert_allclose(Family.log_prob(FAMILY, nat, jnp.asarray(x)), want, rtol=1e-10)
    np.testing.assert_allclose(Family.entropy(FAMILY, nat), entropy, rtol=1e-10)
    # (jitted: one program compiles faster than numpyro's constructor op by op)
    export_log_prob = jax.jit(lambda nat, x: FAMILY.to_numpyro(nat).log_prob(x))
    np.testing.assert_allclose(export_log_prob(nat, jnp.asarray(x)), want, rtol=1e-10)


def test_round_trips_and_mean_parameters(case):
    s, m, nat = case
    sigma = np.linalg.inv(s)
    second = sigma + np.outer(m, m)
    mean_params = FAMILY.mean_params(nat)
    np.testing.assert_allclose(mean_params.eta1, m, rtol=1e-10)
    diag, cross, glob = _pattern(second)
    np.testing.assert_allclose(mean_params.diag, diag, rtol=1e-10)
    np.testing.assert_allclose(mean_params.cross, 2.0 * cross, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(mean_params.glob, glob, rtol=1e-10, atol=1e-12)
    for back in (FAMILY.nat_from_view(FAMILY.view(nat)), FAMILY.nat_from_mean(mean_params)):
        for got, want in zip(back, nat):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    # μ = ∇A(λ), leafwise
    grad = jax.jit(jax.grad(FAMILY.log_partition))(nat)
    for got, want in zip(grad, mean_params):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def _rows(rng, num, locals_per_row=1):
    """Rows of coefficients, each on ``locals_per_row`` random locals and a random non-empty
    subset of the globals."""
    a = np.zeros((num, N))
    for r in range(num):
        a[r, rng.choice(LI, locals_per_row, replace=False)] = rng.normal(size=locals_per_row)
        g = rng.choice(GI, rng.integers(1, len(GI) + 1), replace=False)
        a[r, g] = rng.normal(size=len(g))
    return a


def test_message_is_the_dense_message_on_the_pattern(case):
    """L = Σ_e E[log N(y_e | a_eᵀx, 1)], each a_e on one local and some globals: quadratic
    in x, so λ̃ = (Σ_e y_e a_e, −½ Σ_e a_e a_eᵀ) at every q, on the pattern."""
    s, m, nat = case
    rng = np.random.default_rng(4)
    a, y = _rows(rng, 6), rng.normal(size=6)
    a_l, a_g = a[:, LI], a[:, GI]

    def objective(mean, quad):  # quad = a_eᵀ Σ a_e
        return jnp.sum(-0.5 * ((y - a @ mean) ** 2 + quad) - 0.5 * LOG_2PI)

    def dense_objective(view):
        return objective(view.mean, jnp.einsum("ei,ij,ej->e", a, view.cov, a))

    def arrow_objective(view):  # a_eᵀ Σ a_e from the pattern entries (a_e has one local)
        quad = a_l**2 @ view.var + 2.0 * jnp.einsum("el,lg,eg->e", a_l, view.cross, a_g)
        return objective(view.mean, quad + jnp.einsum("eg,gh,eh->e", a_g, view.glob, a_g))

    dense = GaussianDense(N)
    nat_d = GaussianNat(jnp.asarray(s @ m), jnp.asarray(-0.5 * s))
    view_d = dense.view(nat_d)
    msg_d = dense.message_from_view_grad(nat_d, jax.grad(dense_objective)(view_d))
    # the dense message lives on the pattern: nothing between two different locals
    off = np.asarray(msg_d.eta2)[np.ix_(LI, LI)]
    np.testing.assert_allclose(off - np.diag(np.diag(off)), 0.0, atol=1e-12)
    np.testing.assert_allclose(msg_d.eta2, -0.5 * a.T @ a, atol=1e-12)

    view = FAMILY.view(nat)
    np.testing.assert_allclose(arrow_objective(view), dense_objective(view_d), rtol=1e-12)
    grad = jax.grad(arrow_objective)(view)
    msg = FAMILY.message_from_view_grad(nat, grad)
    np.testing.assert_allclose(msg.eta1, msg_d.eta1, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(msg.eta1, a.T @ y, rtol=1e-10, atol=1e-12)
    for got, want in zip(msg[1:], _pattern(msg_d.eta2)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    at = FAMILY.message_at(nat, view, grad)
    fixed = FAMILY.message_from_fixed_view_grad(jax.grad(arrow_objective)(FAMILY.fixed_view(view)))
    for other in (at, fixed):  # (L is linear in μ: the fixed view's message is the same)
        for got, want in zip(other, msg):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_tangent_sets_give_covariances_of_one_local_arguments(case):
    """Σ_c (J_x left_c)_n (J_y right_c)_n = (J_x Σ J_yᵀ)_nn when the paired rows n read the
    same single local; not when a row reads two locals (Σ between locals is not held)."""
    s, m, nat = case
    sigma = np.linalg.inv(s)
    view = FAMILY.view(nat)
    sets = FAMILY.tangent_sets(view, False)
    left, right = np.asarray(sets["left"]), np.asarray(sets["right"])
    assert left.shape == right.shape == (2 * len(GI) + 1, N)
    full = FAMILY.tangent_sets(view, True)
    np.testing.assert_array_equal(full["left"], left)
    np.testing.assert_array_equal(full["right"], right)
    rng = np.random.default_rng(5)
    jx = _rows(rng, 12)
    jy = rng.normal(size=jx.shape) * (jx != 0)  # the same local, other coefficients
    jy[:, GI] = rng.normal(size=(12, len(GI))) * (rng.random((12, len(GI))) < 0.6)

    def engine(jx, jy):
        return np.sum((jx @ left.T) * (jy @ right.T), -1)

    np.testing.assert_allclose(engine(jx, jy), np.einsum("ni,ij,nj->n", jx, sigma, jy), rtol=1e-10)
    np.testing.assert_allclose(engine(jx, jx), np.einsum("ni,ij,nj->n", jx, sigma, jx), rtol=1e-10)
    two = _rows(rng, 3, locals_per_row=2)
    assert not np.allclose(engine(two, two), np.einsum("ni,ij,nj->n", two, sigma, two), rtol=1e-3)


def test_draws_have_the_mean_and_covariance(case):
    s, m, nat = case
    draws = 200_000
    x = np.asarray(FAMILY.sample(nat, random.PRNGKey(0), (draws,)))
    assert x.shape == (draws, N)
    sigma = np.linalg.inv(s)
    v = np.diag(sigma)
    # the sample mean of x_i has sd √(Σ_ii/N) and the sample covariance of (i, j) has sd
    # ≈ √((Σ_ii Σ_jj + Σ_ij²)/N) (Gaussian fourth moments): 5 standard errors per entry
    # (110 entries: a false failure has probability ~1e-4, and the key is fixed)
    assert np.all(np.abs(x.mean(0) - m) < 5 * np.sqrt(v / draws))
    assert np.all(np.abs(np.cov(x.T) - sigma) < 5 * np.sqrt((np.outer(v, v) + sigma**2) / draws))


def test_is_valid(case):
    s, m, nat = case
    assert bool(FAMILY.is_valid(nat))
    assert not bool(FAMILY.is_valid(nat._replace(diag=nat.diag.at[2].set(0.3))))  # S_ii < 0
    # every d > 0, but the Schur complement is indefinite: S_GG too small for the couplings
    small = nat._replace(glob=-0.5 * jnp.eye(len(GI)) * 1e-3)
    assert np.any(np.linalg.eigvalsh(-2.0 * np.asarray(small.glob) - _schur_term(s)) < 0)
    assert not bool(FAMILY.is_valid(small))
    assert not bool(FAMILY.is_valid(nat._replace(eta1=nat.eta1.at[0].set(jnp.nan))))


def _schur_term(s):
    b, d = s[np.ix_(LI, GI)], np.diag(s)[LI]
    return b.T @ (b / d[:, None])


def test_batched_nat_matches_each_element(case):
    """Leading batch dims (not used by the compiler, which builds one joint block): each
    element's view and tangents are the unbatched ones."""
    s, m, nat = case
    s2 = _arrowhead_spd(np.random.default_rng(7))
    nat2 = _nat(s2, -m)
    both = jax.tree.map(lambda a, b: jnp.stack([a, b]), nat, nat2)
    view = FAMILY.view(both)
    for k, one in enumerate((nat, nat2)):
        for got, want in zip(view, FAMILY.view(one)):
            np.testing.assert_allclose(got[k], want, rtol=1e-12)
    sets = FAMILY.tangent_sets(view, False)
    assert sets["left"].shape == sets["right"].shape == (2 * len(GI) + 1, 2, N)
    for k, one in enumerate((nat, nat2)):
        for tag, stack in FAMILY.tangent_sets(FAMILY.view(one), False).items():
            np.testing.assert_allclose(sets[tag][:, k], stack, rtol=1e-12)


def test_float32_view(case):
    """A float32 smoke check: the view in single precision stays float32 and agrees with
    float64 (the precision is well conditioned, so 1e-4 is ample)."""
    s, m, nat = case
    nat32 = _nat(s, m, np.float32)
    view32, view = FAMILY.view(nat32), FAMILY.view(nat)
    for got, want in zip(view32, view):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
