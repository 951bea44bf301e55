"""Batched LAPACK calls run in chunks on the calling thread (blrppl._lapack).

jaxlib's CPU kernels split a large batch over the thread pool they run on and wait for the
pieces: with every worker running one, nothing runs (a Gaussian mixture fit hung this way).
The deadlock itself is a race and cannot be provoked on demand; what is checked is that a
large batch is lowered as a loop of chunks small enough to stay on the calling thread, a
small batch as jaxlib lowers it, and that the results are unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

import blrppl  # noqa: F401  (installs the lowering rules)
from blrppl import _lapack

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU lowering rules")


def _spd(key, batch, n):
    a = random.normal(key, (batch, n, n))
    return a @ jnp.swapaxes(a, -1, -2) + n * jnp.eye(n)


def _lowered(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


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
        # jaxlib's own FLOP estimates per matrix (jaxlib/cpu/lapack_kernels.cc): the chunks
        # must stay under its threshold by its count, not by a looser bound
        (_lapack._cholesky_cost, (_aval(2000, 40, 40),), 40**3 // 3),  # n³/3
        (_lapack._cholesky_cost, (_aval(10, 40, 40, dtype=jnp.complex128),), 3 * (40**3 // 3)),
        (_lapack._lu_cost, (_aval(5, 30, 20),), 30 * 20 * 20),  # m n min(m, n)
        (_lapack._eigh_cost, (_aval(5, 10, 10),), 5 * 10**3),  # real symmetric: 5 n³
        (_lapack._eigh_cost, (_aval(5, 10, 10, dtype=jnp.complex64),), 12 * 10**3),  # Hermitian: 4 n³ × 3
        (_lapack._solve_cost, (_aval(7, 40, 40), _aval(7, 40, 3)), 40 * 3 * 40),  # rows × cols × order
    ],
)
def test_costs_are_jaxlibs_estimates(cost_of, avals, cost):
    assert cost_of(avals, {}) == cost


def test_a_factor_models_rows_are_factorised_nine_at_a_time():
    # 2,000 rows of D = 40 (a matrix factorisation's latent rows with missing entries): a chunk
    # of 9 Cholesky factorisations is 9 × 21,333 < 200,000 FLOPs by jaxlib's count (with a bound
    # of 4 n³ it was one matrix per call, 2,000 calls a step)
    cost = _lapack._cholesky_cost((_aval(2000, 40, 40),), {})
    assert _lapack.chunk_size(2000, cost) == 9
    # an eigendecomposition's chunk by its 5 n³ (4 n³ let jaxlib split 49 matrices of n = 10)
    assert _lapack.chunk_size(3000, _lapack._eigh_cost((_aval(3000, 10, 10),), {})) * 5 * 10**3 < _lapack._FANOUT_FLOPS


def test_large_batches_are_lowered_as_loops_and_agree_with_numpy():
    key = random.PRNGKey(0)
    a = _spd(key, 3000, 10)  # 3000 × 333 FLOPs (jaxlib's n³/3): split by jaxlib, chunked here
    b = random.normal(random.PRNGKey(1), (3000, 10, 3))
    text = _lowered(jnp.linalg.cholesky, a)
    assert "stablehlo.while" in text and "potrf" in text

    chol = np.asarray(jnp.linalg.cholesky(a))
    np.testing.assert_allclose(chol, np.linalg.cholesky(np.asarray(a, np.float64)), rtol=1e-4, atol=1e-4)
    solve = jax.scipy.linalg.solve_triangular(chol, b, lower=True)
    np.testing.assert_allclose(np.asarray(chol @ solve), np.asarray(b), rtol=1e-4, atol=1e-4)
    w, v = jnp.linalg.eigh(a)
    np.testing.assert_allclose(np.asarray(w), np.linalg.eigvalsh(np.asarray(a, np.float64)), rtol=1e-4)
    lu_solved = jnp.linalg.solve(a, b)
    np.testing.assert_allclose(np.asarray(a @ lu_solved), np.asarray(b), rtol=1e-3, atol=1e-3)
    # gradients go through the same rules (the Cholesky's JVP solves triangular systems)
    grad = jax.grad(lambda x: jnp.sum(jnp.linalg.cholesky(x)[..., -1, -1]))(a)
    assert np.all(np.isfinite(np.asarray(grad)))
    # a batch that does not divide into chunks: the padding is dropped
    odd = a[:2999]
    np.testing.assert_allclose(np.asarray(jnp.linalg.cholesky(odd)), chol[:2999], rtol=1e-5, atol=1e-5)


def test_small_batches_keep_jaxlibs_lowering():
    a = _spd(random.PRNGKey(0), 4, 10)
    text = _lowered(jnp.linalg.cholesky, a)
    assert "potrf" in text and "stablehlo.while" not in text
