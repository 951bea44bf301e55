"""Batched LAPACK calls run in chunks on the calling thread (blrppl.runtime.lapack), in
blrppl's own programs (lowered by blrppl.runtime.compile).

jaxlib's CPU kernels split a large batch over the thread pool they run on and wait for the
pieces: with every worker running one, nothing runs (a Gaussian mixture fit hung this way).
The deadlock itself is a race and cannot be provoked on demand; what is checked is that a
large batch is lowered as a loop of chunks small enough to stay on the calling thread, a
small batch as jaxlib lowers it, that the results are unchanged, and that programs not
lowered by blrppl keep JAX's rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

from blrppl.runtime import compile as runtime_compile
from blrppl.runtime import lapack as _lapack

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU lowering rules")


def _spd(key, batch, n):
    a = random.normal(key, (batch, n, n))
    return a @ jnp.swapaxes(a, -1, -2) + n * jnp.eye(n)


def _lowered(fn, *args) -> str:
    """``fn`` lowered as one of blrppl's programs."""
    return runtime_compile.jit(fn).lower(*args).as_text()


def _run(fn, *args):
    """``fn`` run as one of blrppl's programs."""
    return runtime_compile.jit(fn)(*args)


@pytest.mark.parametrize(
    "batch, cost, expected",
    [
        (10, 1000, 10),  # 10 000 FLOPs: one call on the calling thread
        (1, 10**9, 1),  # one matrix is never split
        (4000, 1000, 199),  # (200 000 − 1) // 1000: each chunk under the threshold
        (10**6, 10**7, 1),  # one matrix per chunk: jaxlib never splits a batch of one
    ],
)
def test_chunk_size_keeps_each_chunk_under_the_fanout_threshold(batch, cost, expected):
    chunk = _lapack.chunk_size(batch, cost)
    assert chunk == expected
    assert chunk >= batch or chunk == 1 or chunk * cost < _lapack._FANOUT_FLOPS


def _aval(*shape, dtype=jnp.float64):
    return jax.core.ShapedArray(shape, dtype)


@pytest.mark.parametrize(
    "cost_of, avals, cost",
    [
        (_lapack._factorisation_cost, (_aval(2000, 40, 40),), 4 * 40**3),
        (_lapack._factorisation_cost, (_aval(10, 40, 40, dtype=jnp.complex128),), 3 * 4 * 40**3),
        (_lapack._factorisation_cost, (_aval(5, 30, 20),), 4 * 30 * 20 * 20),
        (_lapack._eigh_cost, (_aval(5, 10, 10),), 5 * 10**3),  # real symmetric: 5 n³, as jaxlib
        (_lapack._eigh_cost, (_aval(5, 10, 10, dtype=jnp.complex64),), 12 * 10**3),  # Hermitian: 4 n³ × 3
        (_lapack._solve_cost, (_aval(7, 40, 40), _aval(7, 40, 3)), 40 * 3 * 40),  # rows × cols × order
    ],
)
def test_costs(cost_of, avals, cost):
    assert cost_of(avals, {}) == cost


@pytest.mark.parametrize("n", [1, 2, 10, 16, 40, 100])
def test_costs_bound_jaxlibs_own_estimates(n):
    # jaxlib/cpu/lapack_kernels.cc (0.10) counts n³/3 for a Cholesky factorisation, m n min(m, n)
    # for LU and 5 n³ for a symmetric eigendecomposition: a chunk under the threshold by these
    # bounds is under it by jaxlib's count (4 n³ for every kernel was below the eigendecomposition's)
    a = (_aval(3, n, n),)
    assert _lapack._factorisation_cost(a, {}) >= n**3 // 3
    assert _lapack._factorisation_cost(a, {}) >= n**3
    assert _lapack._eigh_cost(a, {}) >= 5 * n**3
    batch = 3000
    chunk = _lapack.chunk_size(batch, _lapack._eigh_cost(a, {}))
    assert chunk >= batch and batch * 5 * n**3 < _lapack._FANOUT_FLOPS or chunk * 5 * n**3 < _lapack._FANOUT_FLOPS or chunk == 1


def test_large_batches_are_lowered_as_loops_and_agree_with_numpy():
    key = random.PRNGKey(0)
    a = _spd(key, 3000, 10)  # 3000 × 4000 FLOPs (bound): split by jaxlib, chunked here
    b = random.normal(random.PRNGKey(1), (3000, 10, 3))
    text = _lowered(jnp.linalg.cholesky, a)
    assert "stablehlo.while" in text and "potrf" in text

    chol = np.asarray(_run(jnp.linalg.cholesky, a))
    np.testing.assert_allclose(chol, np.linalg.cholesky(np.asarray(a, np.float64)), rtol=1e-4, atol=1e-4)
    solve = _run(lambda c, b: jax.scipy.linalg.solve_triangular(c, b, lower=True), chol, b)
    np.testing.assert_allclose(np.asarray(chol @ solve), np.asarray(b), rtol=1e-4, atol=1e-4)
    assert "stablehlo.while" in _lowered(lambda c, b: jax.scipy.linalg.solve_triangular(c, b, lower=True), chol, b)
    w, v = _run(jnp.linalg.eigh, a)
    np.testing.assert_allclose(np.asarray(w), np.linalg.eigvalsh(np.asarray(a, np.float64)), rtol=1e-4)
    lu_solved = _run(jnp.linalg.solve, a, b)
    np.testing.assert_allclose(np.asarray(a @ lu_solved), np.asarray(b), rtol=1e-3, atol=1e-3)
    # gradients go through the same rules (the Cholesky's JVP solves triangular systems)
    grad = _run(jax.grad(lambda x: jnp.sum(jnp.linalg.cholesky(x)[..., -1, -1])), a)
    assert np.all(np.isfinite(np.asarray(grad)))
    # a batch that does not divide into chunks: the padding is dropped
    odd = a[:2999]
    np.testing.assert_allclose(np.asarray(_run(jnp.linalg.cholesky, odd)), chol[:2999], rtol=1e-5, atol=1e-5)


def test_programs_not_lowered_by_blrppl_keep_jaxlibs_lowering():
    a = _spd(random.PRNGKey(0), 3000, 10)
    text = jax.jit(jnp.linalg.cholesky).lower(a).as_text()
    assert "potrf" in text and "stablehlo.while" not in text


def test_small_batches_keep_jaxlibs_lowering():
    a = _spd(random.PRNGKey(0), 4, 10)
    text = _lowered(jnp.linalg.cholesky, a)
    assert "potrf" in text and "stablehlo.while" not in text
