"""Linear algebra of symmetric banded matrices in O(n·b²): Cholesky, solves, selected inverse.

A symmetric n × n matrix M with half-bandwidth b (M_ij = 0 for |i − j| > b) is stored by its
*upper band* ``U`` of shape ``(n, b + 1)``: ``U[i, d] = M[i, i + d]``, zero where i + d ≥ n.
Its lower Cholesky factor L (M = L Lᵀ, same bandwidth) is stored by rows,
``R[i, d] = L[i, i − d]``, zero where i − d < 0. Every routine is one ``lax.scan`` over the
n rows with O(b²) work per row (Rue & Held 2005, ch. 2: band Cholesky; the selected inverse
is Takahashi's recursion), for one matrix: batch with ``jax.vmap``. The factorisation and a
forward solve share one pass down the rows, a backward solve and the selected inverse one
pass up: a chain's mean and covariance band cost two passes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

#: rows per iteration of the scans (1 measured fastest on CPU)
_UNROLL = 1


def _shift_down(x: jax.Array, k: int) -> jax.Array:
    """x[i − k] along axis 0 (zero for i < k)."""
    if k == 0:
        return x
    return jnp.concatenate([jnp.zeros((k,) + x.shape[1:], x.dtype), x[:-k]], axis=0)


def _shift_up(x: jax.Array, k: int) -> jax.Array:
    """x[i + k] along axis 0 (zero for i + k ≥ n)."""
    if k == 0:
        return x
    return jnp.concatenate([x[k:], jnp.zeros((k,) + x.shape[1:], x.dtype)], axis=0)


def lower_rows(upper: jax.Array) -> jax.Array:
    """Upper band ``U`` → rows of the lower band, ``out[i, d] = M[i, i − d] = U[i − d, d]``."""
    return jnp.stack([_shift_down(upper[:, d], d) for d in range(upper.shape[1])], axis=1)


def full_band(upper: jax.Array) -> jax.Array:
    """Upper band ``U`` → ``F`` of shape ``(n, 2b + 1)``, ``F[i, b + d] = M[i, i + d]`` for
    −b ≤ d ≤ b (zero outside the matrix)."""
    b = upper.shape[1] - 1
    below = lower_rows(upper)
    return jnp.concatenate([below[:, ::-1][:, :b], upper], axis=1)


def matvec(upper: jax.Array, x: jax.Array) -> jax.Array:
    """M x for M symmetric banded (upper band ``U``)."""
    out = upper[:, 0] * x
    for d in range(1, upper.shape[1]):
        out = out + upper[:, d] * _shift_up(x, d)  # M[i, i + d] x[i + d]
        out = out + _shift_down(upper[:, d] * x, d)  # M[i, i − d] x[i − d] = U[i − d, d] x[i − d]
    return out


def cholesky_and_solve_lower(upper: jax.Array, v: jax.Array | None = None):
    """One pass down the rows: the rows ``R`` of the lower Cholesky factor of M (upper band
    ``U``; NaN where M is not positive definite) and, given ``v``, y = L⁻¹ v (else None).

    Row i from the previous b rows: with W = L[i−b:i, i−b:i] (lower triangular) and
    s = M[i, i−b:i], the off-diagonal part l = W⁻¹ s (forward substitution) and the
    diagonal √(M_ii − |l|²); then y_i = (v_i − Σ_{d≥1} L[i, i − d] y_{i−d}) / L_ii, in the
    same iteration. Rows before the first are taken as identity rows.
    """
    n, w = upper.shape
    b = w - 1
    rows = lower_rows(upper)  # rows[i, d] = M[i, i − d]
    vs = jnp.zeros((n,), upper.dtype) if v is None else v
    if b == 0:
        r = jnp.sqrt(rows)
        return r, None if v is None else v / r[:, 0]
    if b == 1:  # (tridiagonal, the common chain: see :func:`_tridiagonal_down`)
        return _tridiagonal_down(rows, vs, v is not None)

    def body(carry, inp):  # prev[d − 1] = y_{i − d}
        window, prev = carry
        row, vi = inp
        s = row[::-1]  # s[q] = M[i, i − b + q], q = 0 … b
        off = []
        for q in range(b):
            acc = s[q]
            for r in range(q):
                acc = acc - off[r] * window[q, r]
            off.append(acc / window[q, q])
        off = jnp.stack(off)
        diag = jnp.sqrt(s[b] - jnp.sum(off**2))
        new = jnp.zeros_like(window)
        new = new.at[: b - 1, : b - 1].set(window[1:, 1:])
        new = new.at[b - 1, : b - 1].set(off[1:])
        new = new.at[b - 1, b - 1].set(diag)
        row_out = jnp.concatenate([diag[None], off[::-1]])  # R[i, d] = L[i, i − d]
        if v is None:
            return (new, prev), (row_out, vi)
        y = (vi - jnp.dot(row_out[1:], prev)) / diag
        return (new, jnp.concatenate([y[None], prev[:-1]])), (row_out, y)

    init = (jnp.eye(b, dtype=upper.dtype), jnp.zeros((b,), upper.dtype))
    _, (out, y) = jax.lax.scan(body, init, (rows, vs), unroll=_UNROLL)
    return out, None if v is None else y


def cholesky(upper: jax.Array) -> jax.Array:
    """Rows ``R`` of the lower Cholesky factor of M (see :func:`cholesky_and_solve_lower`)."""
    return cholesky_and_solve_lower(upper)[0]


def logdet(chol_rows: jax.Array) -> jax.Array:
    """log |M| = 2 Σ log L_ii."""
    return 2.0 * sum_log(chol_rows[:, 0])


#: factors multiplied together before one logarithm in :func:`sum_log`
_LOG_GROUP = 16


def sum_log(x: jax.Array) -> jax.Array:
    """Σ log x over the last axis (x ≥ 0: a Cholesky factor's diagonal), with one logarithm
    per :data:`_LOG_GROUP` elements: with x = f 2ᵉ (``frexp``, f in [½, 1)),

        Σ log x = Σ_groups log Π f + log 2 · Σ e,

    where a product of 16 fractions lies in [2⁻¹⁶, 1) (no underflow) and is exact to a few
    ulps. A chain's entropy reads it at every step: a float64 logarithm costs as much as
    an element of the banded factorisation's passes (T = 10⁴: 68 → 32 µs). A zero gives
    −inf, inf and NaN themselves and a negative element NaN, as Σ log x does."""
    frac, expo = jnp.frexp(x)
    frac = jnp.where(x < 0, jnp.nan, frac)  # (two negative fractions would multiply to a positive)
    n = x.shape[-1]
    pad = -n % _LOG_GROUP
    widths = [(0, 0)] * (x.ndim - 1) + [(0, pad)]
    frac = jnp.pad(frac, widths, constant_values=1.0)  # (log 1 = 0, exponent 0: exact)
    groups = jnp.prod(frac.reshape(frac.shape[:-1] + (-1, _LOG_GROUP)), axis=-1)
    return jnp.sum(jnp.log(groups), -1) + math.log(2.0) * jnp.sum(expo, -1).astype(x.dtype)


def solve_lower(chol_rows: jax.Array, v: jax.Array) -> jax.Array:
    """L⁻¹ v: y_i = (v_i − Σ_{d≥1} L[i, i − d] y_{i−d}) / L_ii."""
    b = chol_rows.shape[1] - 1
    if b == 0:
        return v / chol_rows[:, 0]
    if b == 1:

        def step(y_prev, inp):
            row, vi = inp
            y = (vi - row[1] * y_prev) / row[0]
            return y, y

        return jax.lax.scan(step, jnp.zeros((), v.dtype), (chol_rows, v), unroll=_UNROLL)[1]

    def body(prev, inp):  # prev[d − 1] = y_{i − d}
        row, vi = inp
        y = (vi - jnp.dot(row[1:], prev)) / row[0]
        return jnp.concatenate([y[None], prev[:-1]]), y

    _, out = jax.lax.scan(body, jnp.zeros((b,), v.dtype), (chol_rows, v), unroll=_UNROLL)
    return out


def _columns(chol_rows: jax.Array) -> jax.Array:
    """``C[i, d] = L[i + d, i]`` (the factor's columns below the diagonal, d = 0 … b)."""
    return jnp.stack([_shift_up(chol_rows[:, d], d) for d in range(chol_rows.shape[1])], axis=1)


def solve_upper_and_inverse_band(chol_rows: jax.Array, y: jax.Array | None = None, band: bool = True):
    """One pass up the rows: given ``y``, x = L⁻ᵀ y (else None), and with ``band`` the upper
    band of M⁻¹ (else None).

    x_i = (y_i − Σ_{d≥1} L[i + d, i] x_{i+d}) / L_ii. The band is Takahashi's recursion: with
    Σ = M⁻¹ = L⁻ᵀ L⁻¹, Lᵀ Σ = L⁻¹ is lower triangular with diagonal 1/L_ii, so for j ≥ i
    Σ_ij = (δ_ij / L_ii − Σ_{k=1..b} L[i+k, i] Σ[i+k, j]) / L_ii, computed from the last row
    up with the window Σ[i+1:i+b+1, i+1:i+b+1] carried; both in the same iteration.
    """
    n, w = chol_rows.shape
    b = w - 1
    dtype = chol_rows.dtype
    ys = jnp.zeros((n,), dtype) if y is None else y
    if b == 0:
        lii = chol_rows[:, 0]
        return None if y is None else y / lii, (1.0 / lii**2)[:, None] if band else None
    cols = _columns(chol_rows)
    if b == 1:  # (see :func:`_tridiagonal_up`)
        return _tridiagonal_up(cols, ys, y is not None, band)

    def body(carry, inp):  # nxt[d − 1] = x_{i + d}
        nxt, window = carry
        col, yi = inp
        lii, below = col[0], col[1:]
        x = (yi - jnp.dot(below, nxt)) / lii if y is not None else nxt[0]
        if band:
            off = -(below @ window) / lii  # Σ[i, i + q], q = 1 … b
            diag = (1.0 / lii - jnp.dot(below, off)) / lii
            new = jnp.zeros_like(window)
            new = new.at[1:, 1:].set(window[:-1, :-1])
            new = new.at[0, 0].set(diag)
            new = new.at[0, 1:].set(off[:-1])
            new = new.at[1:, 0].set(off[:-1])
            row = jnp.concatenate([diag[None], off])
        else:
            new, row = window, jnp.zeros((w,), dtype)
        return (jnp.concatenate([x[None], nxt[:-1]]), new), (x, row)

    init = (jnp.zeros((b,), dtype), jnp.zeros((b, b), dtype))
    _, (x, rows) = jax.lax.scan(body, init, (cols, ys), reverse=True, unroll=_UNROLL)
    return None if y is None else x, rows if band else None


def solve_upper(chol_rows: jax.Array, y: jax.Array) -> jax.Array:
    """L⁻ᵀ y (a backward pass, see :func:`solve_upper_and_inverse_band`)."""
    return solve_upper_and_inverse_band(chol_rows, y, band=False)[0]


def solve(chol_rows: jax.Array, v: jax.Array) -> jax.Array:
    """M⁻¹ v from the Cholesky rows of M."""
    return solve_upper(chol_rows, solve_lower(chol_rows, v))


def inverse_band(chol_rows: jax.Array) -> jax.Array:
    """The upper band of M⁻¹: the entries within the bandwidth only (Takahashi's recursion,
    see :func:`solve_upper_and_inverse_band`)."""
    return solve_upper_and_inverse_band(chol_rows)[1]


def to_dense(upper) -> np.ndarray | jax.Array:
    """The n × n matrix of an upper band (for tests and small exports)."""
    xp = np if isinstance(upper, np.ndarray) else jnp
    n, w = upper.shape
    out = xp.zeros((n, n), dtype=upper.dtype)
    for d in range(w):
        diag = upper[: n - d, d]
        if xp is np:
            out = out + np.diag(diag, d) + (np.diag(diag, -d) if d else 0)
        else:
            out = out + jnp.diag(diag, d) + (jnp.diag(diag, -d) if d else 0)
    return out


def from_dense(mat, b: int):
    """The upper band (half-bandwidth b) of a symmetric matrix."""
    xp = np if isinstance(mat, np.ndarray) else jnp
    cols = []
    for d in range(b + 1):
        diag = xp.diagonal(mat, d)
        cols.append(xp.concatenate([diag, xp.zeros((d,), mat.dtype)]))
    return xp.stack(cols, axis=1)


def _tridiagonal_down(rows: jax.Array, v: jax.Array, solve: bool):
    """:func:`cholesky_and_solve_lower` for b = 1 through the LDLᵀ pivots D_i = L_ii²:
    D_i = M_ii − M_{i,i−1}² / D_{i−1} and z_i = v_i − (M_{i,i−1} / D_{i−1}) z_{i−1}, so the
    loop's dependency chain is one division and one multiply-add per row, as in the Thomas
    algorithm (the Cholesky recursion chains a division and a square root: 1.7× slower);
    L_ii = √D_i and y_i = z_i / L_ii come off the chain, L[i, i−1] = M_{i,i−1} / L_{i−1,i−1}
    after the loop (each output of the loop is one more buffer written per row)."""
    one = jnp.ones((), rows.dtype)

    def step(carry, inp):
        d_prev, z_prev = carry
        m_ii, m_off, vi = inp
        r = 1.0 / d_prev
        d = m_ii - m_off * m_off * r
        z = vi - (m_off * r) * z_prev if solve else z_prev
        lii = jnp.sqrt(d)
        return (d, z), (lii, z / lii) if solve else (lii, None)

    # (the band's columns go in as 1-D sequences: a scan over the rows of an (n, 2) array
    # computed in the same program ran 1.8× slower on CPU, its layout chosen column-major)
    xs = (rows[:, 0], rows[:, 1], v)
    _, (diag, y) = jax.lax.scan(step, (one, jnp.zeros((), rows.dtype)), xs, unroll=_UNROLL)
    off = rows[:, 1] / _shift_down(diag, 1).at[0].set(1.0)
    return jnp.stack([diag, off], axis=1), y if solve else None


def _tridiagonal_up(cols: jax.Array, y: jax.Array, solve: bool, band: bool):
    """:func:`solve_upper_and_inverse_band` for b = 1 with g_i = L[i+1, i] / L_ii:
    x_i = y_i / L_ii − g_i x_{i+1}, Σ_ii = 1 / L_ii² + g_i² Σ_{i+1,i+1} and
    Σ_{i,i+1} = −g_i Σ_{i+1,i+1} (Takahashi's recursion through the unit factor): two
    multiply-add chains, the divisions off them, Σ_{i,i+1} after the loop."""
    zero = jnp.zeros((), cols.dtype)

    def step(carry, inp):
        x_next, var_next = carry
        l_ii, l_off, yi = inp
        inv = 1.0 / l_ii
        g = l_off * inv
        x = yi * inv - g * x_next if solve else x_next
        var = inv * inv + g * g * var_next if band else var_next
        return (x, var), (x if solve else None, var if band else None)

    xs = (cols[:, 0], cols[:, 1], y)  # (1-D: see _tridiagonal_down)
    _, (x, var) = jax.lax.scan(step, (zero, zero), xs, reverse=True, unroll=_UNROLL)
    if not band:
        return x if solve else None, None
    off = -cols[:, 1] / cols[:, 0] * _shift_up(var, 1)
    return x if solve else None, jnp.stack([var, off], axis=1)
