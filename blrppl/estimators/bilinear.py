"""Normal factors whose mean multiplies rows of two Gaussian blocks: expectations from data
statistics (the textbook VMP updates of factor models).

A Normal factor with observed y_e whose location is

    loc_e = c_e + s_e a_{i(e)}ᵀ b_{j(e)},

each element reading one row a_i (D scalars) of the Gaussian block A and one row b_j of the
Gaussian block B (``X @ C.T``, ``(U[users] * V[items]).sum(-1)``, ``jnp.einsum("nd,md->nm",
X, C)``; c_e and s_e constants), and whose scale is a constant or c'_e τ^p with τ one scalar
Gamma block (a vector of them: see below), has

    Σ_e ω_e E_q[log N(y_e | loc_e, σ_e²)]
        = −½ t (r − 2 Σ_ij W1_ij m_iᵀ m'_j + Σ_ij W2_ij ⟨S_i, S'_j⟩) − Σ_e ω_e log c'_e
          − p E[log τ] Σ_e ω_e − ½ log(2π) Σ_e ω_e,

with m_i, S_i = Σ_i + m_i m_iᵀ the mean and second moment of row i of A under q (m'_j, S'_j
of B), t = E[τ^(−2p)], ω_e the weight of element e (mask, expansion, the site's scale),
κ_e = c'_e^(−2), and the statistics, computed once per fit from the data,

    W1_ij = Σ_{e: (i(e), j(e)) = (i, j)} ω_e κ_e s_e (y_e − c_e),
    W2_ij = Σ_{e: (i(e), j(e)) = (i, j)} ω_e κ_e s_e²,
    r = Σ_e ω_e κ_e (y_e − c_e)².

The messages, its gradients, are the conjugate ones of VMP: row i of A receives
λ̃_i = (t Σ_j W1_ij m'_j, −½ t Σ_j W2_ij S'_j). When every element carries the same weight
once per pair (no mask: W2 = w 11ᵀ), Σ_ij W2_ij ⟨S_i, S'_j⟩ = w ⟨Σ_i S_i, Σ_j S'_j⟩ and a
step costs O((N_A + N_B) D²) for the factor, else O(N_A N_B D²) (half of it: ⟨S, S'⟩ over
the packed upper triangles). No tangent of either block is pushed through the model.

A vector of Gamma precisions indexed along the rows of one of the two blocks (factor
analysis: ``Normal(X @ W.T, 1 / jnp.sqrt(psi))``, a noise precision ψ_j per observed
dimension, the rows of W) is read the same way: with τ_{k(e)}, k(e) = j(e) for every
element (or k(e) = i(e)), t_j = E[τ_j^(−2p)] and ℓ_j = p E[log τ_j] weight the terms of row j,

    −½ Σ_j t_j (r_j − 2 Σ_i W1_ij m_iᵀ m'_j + Σ_i W2_ij ⟨S_i, S'_j⟩) − Σ_e ω_e log c'_e
      − Σ_j ℓ_j Σ_{e: j(e) = j} ω_e − ½ log(2π) Σ_e ω_e,

with r_j = Σ_{e: j(e) = j} ω_e κ_e (y_e − c_e)² (the statistics r and Σω per row of B): row j
of B receives t_j times its unweighted message, row i of A the t-weighted sums, and τ_j
the conjugate Gamma message of its own rows' residuals.

Whether a factor is read this way is decided exactly (:func:`eligible`): its location's form,
read off the model's program, is bilinear in A and B plus an affine term; which rows each
element reads is read off the same program (:mod:`blrppl.model.elements`): one row of each,
or neither; and the coefficients of that polynomial, its derivatives at A = B = 0, must be
those of c_e + s_e a_iᵀ b_j. A factor that fails (affine terms in A or B, a weighted
contraction, an element reading several rows, a vector τ indexed otherwise) keeps the
elementwise moments. The statistics then read s_e, c_e and the rows from derivatives too:
c_e is loc_e at A = B = 0, and with every row of B equal to 1 the derivative of loc_e along
rows k·1 of A is k s_e D, so i(e) = (derivative along rows (i + 1)·1) / (along rows 1) − 1,
exact in floating point (sums of equal terms, no offset to cancel); j(e) likewise. The index
k(e) of a vector τ is read likewise, from the derivatives of log σ_e along τ = 1 and
τ_k = k + 1.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist

from blrppl.moments import kinds as mom
from blrppl.estimators.registry import estimator_of
from blrppl.model import elements as el
from blrppl.estimators.gram import _LOG_2PI, element_weights, scale_block, scale_terms
from blrppl.runtime.compile import jit as _jit

#: the pairs (i, j) of rows form a dense N_A × N_B grid of weights (a step then does
#: N_A N_B D² work with a mask): used when the grid holds at most ``GRID_PER_ELEMENT`` times
#: the factor's elements (or at most ``SMALL_GRID`` entries), and at most ``MAX_GRID``; a
#: sparser one (a few ratings of many users and items) keeps the elementwise moments
MAX_GRID = 1 << 24
SMALL_GRID = 1 << 16
GRID_PER_ELEMENT = 4


class BilinearStatistics(NamedTuple):
    """The data statistics of one factor (see the module docstring)."""

    cross: jax.Array  # W1 (N_A, N_B)
    quad: jax.Array  # W2 (N_A, N_B)
    uniform: jax.Array  # () bool: W2 = w 11ᵀ
    residual: jax.Array  # r (), or r_j per row of the block τ is indexed along
    weight: jax.Array  # Σ ω (), or per row of that block
    log_coef: jax.Array  # Σ ω log c' ()


@dataclasses.dataclass(frozen=True)
class BilinearSource:
    """An exact factor whose expectation comes from these statistics of the rows of two
    Gaussian blocks (:attr:`blrppl.estimators.exact.ExactSpec.statistics`, set when it is
    :func:`eligible`).

    Attributes:
        pair: ``(A, B)``, the blocks a row of each of which every element's location
            multiplies.
        scale_rows: the block (A or B) along whose rows a vector of Gamma precisions in the
            scale is indexed (factor analysis' noise precision per observed dimension); ""
            for a scalar precision or a constant scale.
    """

    pair: tuple
    scale_rows: str = ""

    #: its elements still count in a step's dense work: its rows' second moments are D²
    #: per row and pair of rows
    dense_work = True

    @property
    def blocks(self) -> tuple:
        """The blocks whose rows the statistics are of: ``(A, B)``."""
        return tuple(self.pair)

    def shown(self, plan) -> bool:
        """Whether the plan table says the factor reads data statistics: always."""
        return True

    def compute(self, fns, factor, blocks: dict, data, rows: bool = False):
        """The factor's statistics on ``data`` (:func:`statistics`; ``rows`` is for
        :class:`blrppl.estimators.gram.GramSource` only)."""
        return statistics(fns, factor, blocks, data)

    def expected_log(self, factor, stats, views) -> jax.Array:
        """Σ_e ω_e E_q[log f_e] from the statistics (:func:`expected_log`)."""
        return expected_log(factor, stats, views)


def candidate(factor, blocks) -> tuple | None:
    """The blocks (A, B) of a factor whose form may allow the statistics (the exact reading
    of :func:`eligible` decides), else None."""
    if not estimator_of(factor).closed_form or factor.rule is None or factor.rule.dist_type is not dist.Normal:
        return None
    if factor.discrete or factor.subsampled or factor.members:
        return None
    kinds, arg_blocks = factor.kinds, dict(factor.arg_blocks)
    if arg_blocks.get("value") or kinds.get("loc") != mom.BilinearGaussian.kind:
        return None
    pairs = dict(factor.spec.pairs).get("loc", ())
    if len(pairs) != 1 or set(arg_blocks["loc"]) != set(pairs[0]):
        return None
    a, b = pairs[0]
    for n in (a, b):
        blk = blocks[n]
        fam = blk.family
        if not (fam.gaussian and fam.dense_event) or fam.banded or fam.arrowhead:
            return None
        if blk.point or blk.members or blk.local is not None or blk.transform is not None:
            return None
    if blocks[a].family.dim != blocks[b].family.dim:
        return None
    if kinds["scale"] == mom.PowerGamma.kind:
        (g,) = arg_blocks["scale"]
        if dict(factor.spec.powers).get("scale") is None:
            return None
        # (a vector τ must be indexed along the rows of A or of B: see scale_rows)
        if blocks[g].size != 1 and blocks[g].size not in (_rows(blocks[a]), _rows(blocks[b])):
            return None
    elif kinds["scale"] != mom.Const.kind:
        return None
    # (a point block, a param, reads as a constant argument, but changes every step)
    if set(factor.neighbours) != {a, b} | set(arg_blocks.get("scale", ())):
        return None
    return a, b


def _scale_rows_of(factor) -> str:
    """The block along whose rows the factor's vector τ is indexed (its
    :class:`BilinearSource`'s ``scale_rows``), or ""."""
    source = factor.spec.statistics
    return source.scale_rows if source is not None else ""


def _rows(block) -> int:
    return int(np.prod(block.batch_shape))


def _arguments_at(fns, factor, blocks, data):
    """The factor's arguments (broadcast to its elements) at rows of A and B given in the
    blocks' canonical layouts (``(*batch, D)``) and τ (its site's layout; 1 when not given)."""
    a, b = dict(factor.spec.pairs)["loc"][0]
    gamma = scale_block(factor)
    names = factor.rule.arg_names
    dtype = jnp.result_type(float)

    def args_at(xa, xb, tau=None):
        values = {a: blocks[a].to_site(xa), b: blocks[b].to_site(xb)}
        if gamma is not None:
            values[gamma] = jnp.ones(blocks[gamma].value_shape, dtype) if tau is None else tau
        args = fns.factor_args(factor.name, names, values, data)
        shape = jnp.broadcast_shapes(*(jnp.shape(args[k]) for k in ("value", "loc", "scale")))
        return {k: jnp.broadcast_to(args[k], shape).astype(dtype) for k in ("value", "loc", "scale")}

    return args_at


def _structure(args_at, ba, bb):
    """c_e, s_e, i(e), j(e) (flat over the elements) from four evaluations of the model."""
    dtype = jnp.result_type(float)
    shape_a, shape_b = tuple(ba.batch_shape) + (-1,), tuple(bb.batch_shape) + (-1,)
    d = ba.family.dim
    ra, rb = _rows(ba), _rows(bb)
    ones_a, ones_b = jnp.ones((ra, d), dtype), jnp.ones((rb, d), dtype)
    count_a = jnp.arange(1, ra + 1, dtype=dtype)[:, None] * ones_a
    count_b = jnp.arange(1, rb + 1, dtype=dtype)[:, None] * ones_b

    def loc(xa, xb):
        return args_at(xa.reshape(shape_a), xb.reshape(shape_b))["loc"].reshape(-1)

    zero_a, zero_b = 0.0 * ones_a, 0.0 * ones_b
    c = loc(zero_a, zero_b)
    # directional derivatives (loc is linear in A given B): s_e k D along rows k·1 of A, with
    # no cancellation against the offset c_e (in float32 c_e + s_e k D would lose the index
    # when |c_e| is far larger than |s_e| D)
    unit = jax.jvp(lambda xa: loc(xa, ones_b), (zero_a,), (ones_a,))[1]
    along_a = jax.jvp(lambda xa: loc(xa, ones_b), (zero_a,), (count_a,))[1]
    along_b = jax.jvp(lambda xb: loc(ones_a, xb), (zero_b,), (count_b,))[1]
    nonzero = unit != 0
    safe = jnp.where(nonzero, unit, 1.0)
    i = jnp.where(nonzero, jnp.round(along_a / safe) - 1, 0.0)
    j = jnp.where(nonzero, jnp.round(along_b / safe) - 1, 0.0)
    return c, unit / d, i.astype(jnp.int32), j.astype(jnp.int32)


def _zeros(block):
    return jnp.zeros(tuple(block.batch_shape) + (block.family.dim,), jnp.result_type(float))


def _scale_index(args_at, factor, blocks):
    """k(e), the element of the vector τ each element's scale reads (flat over the elements;
    −1 where the scale does not read τ), from two derivatives of log σ_e at τ = 1."""
    a, b = dict(factor.spec.pairs)["loc"][0]
    gb = blocks[scale_block(factor)]
    dtype = jnp.result_type(float)
    ones = jnp.ones(gb.value_shape, dtype)
    count = jnp.arange(1, gb.size + 1, dtype=dtype).reshape(gb.value_shape)
    za, zb = _zeros(blocks[a]), _zeros(blocks[b])

    def log_scale(tau):
        return jnp.log(args_at(za, zb, tau)["scale"]).reshape(-1)

    unit = jax.jvp(log_scale, (ones,), (ones,))[1]  # p at every element that reads τ
    along = jax.jvp(log_scale, (ones,), (count,))[1]  # p (k(e) + 1)
    reads = unit != 0
    return jnp.where(reads, jnp.round(along / jnp.where(reads, unit, 1.0)) - 1, -1).astype(jnp.int32)


def statistics(fns, factor, blocks, data) -> BilinearStatistics:
    """W1, W2 (dense over the pairs of rows), whether W2 is uniform, r, Σω and Σω log c' of
    one eligible factor, from the model and the data (r and Σω per row of the block a vector
    τ is indexed along, the spec's ``statistics.scale_rows``: NaN when on these data an element's τ is
    not its row's, which stops the fit at its first step)."""
    a, b = dict(factor.spec.pairs)["loc"][0]
    ba, bb = blocks[a], blocks[b]
    args_at = _arguments_at(fns, factor, blocks, data)
    c, s, i, j = _structure(args_at, ba, bb)
    args = args_at(_zeros(ba), _zeros(bb))
    omega = element_weights(fns, factor, data, args["value"].shape)
    kappa = (omega / jnp.square(args["scale"])).reshape(-1)
    resid = args["value"].reshape(-1) - c
    grid = jnp.zeros((_rows(ba), _rows(bb)), resid.dtype)
    w1 = grid.at[i, j].add(kappa * s * resid)
    w2 = grid.at[i, j].add(kappa * s * s)
    square, weight = kappa * jnp.square(resid), jnp.broadcast_to(omega, args["value"].shape).reshape(-1)
    along = _scale_rows_of(factor)
    if along:
        rows = j if along == b else i
        per_row = jnp.zeros((_rows(blocks[along]),), resid.dtype)
        same = jnp.all(_scale_index(args_at, factor, blocks) == rows)
        residual = jnp.where(same, per_row.at[rows].add(square), jnp.nan)
        weight = per_row.at[rows].add(weight)
    else:
        residual, weight = jnp.sum(square), jnp.sum(weight)
    return BilinearStatistics(
        cross=w1,
        quad=w2,
        uniform=jnp.all(w2 == w2[0, 0]),
        residual=residual,
        weight=weight,
        log_coef=jnp.sum(omega * jnp.log(args["scale"])),
    )


def scale_rows(factor, blocks, fns, data) -> str:
    """The block (A or B) along whose rows the factor's vector τ is indexed, on this data:
    every element's τ is that of the row of the block it reads; "" for a scalar τ or a
    constant scale, None when a vector τ is indexed otherwise (an element reading another
    row's τ, or none)."""
    gamma = scale_block(factor)
    if gamma is None or blocks[gamma].size == 1:
        return ""
    a, b = dict(factor.spec.pairs)["loc"][0]
    ba, bb = blocks[a], blocks[b]

    def index(data):
        args_at = _arguments_at(fns, factor, blocks, data)
        _, _, i, j = _structure(args_at, ba, bb)
        k = _scale_index(args_at, factor, blocks)
        return jnp.all(k == i) & (blocks[gamma].size == _rows(ba)), jnp.all(k == j) & (blocks[gamma].size == _rows(bb))

    try:
        along_a, along_b = _jit(index)(data)
    except Exception:  # (a model whose arguments cannot be evaluated keeps the elementwise moments)
        return None
    return b if bool(along_b) else a if bool(along_a) else None


def eligible(factor, blocks, fns, data, reads: dict | None = None) -> tuple | None:
    """``(A, B, scale rows)`` when the factor's location is c_e + s_e a_iᵀ b_j on this data,
    its grid of row pairs is small enough and a vector τ is indexed along the rows of A or B
    (:func:`scale_rows`: its block, or "" for a scalar τ or a constant scale), else None.

    The location's form (read off the model's program) is f(a, b) + g with f bilinear and g
    affine; ``reads`` (key → :class:`blrppl.model.elements.Reads` of its ``loc`` and
    ``scale``, keys ``(block, "plate")`` for A's and B's rows and ``(block, "scalar")`` for
    τ) say which rows each element reads. Where every element reads one row of A and one of
    B (or neither) and at most one τ, its location as a function of those rows u, v is
    c_e + p_eᵀu + q_eᵀv + uᵀ W_e v exactly, and the coefficients, the derivatives at
    u = v = 0, must be p_e = q_e = 0 and W_e = s_e I (:func:`_coefficients_hold`): an exact
    reading, no random point. None without the reads."""
    pair = candidate(factor, blocks)
    if pair is None or reads is None:
        return None
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(data)):
        return None  # (traced inside a user's jit: the coefficients need values)
    if not _one_row_each(reads, pair, scale_block(factor)):
        return None
    ba, bb = blocks[pair[0]], blocks[pair[1]]
    ra, rb = _rows(ba), _rows(bb)

    def check(data):
        return _coefficients_hold(_arguments_at(fns, factor, blocks, data), ba, bb)

    try:
        ok, size = _jit(check)(data)
    except Exception:  # a model whose arguments cannot be evaluated keeps the elementwise moments
        return None
    if not bool(ok) or ra * rb > min(MAX_GRID, max(SMALL_GRID, GRID_PER_ELEMENT * int(size))):
        return None
    side = scale_rows(factor, blocks, fns, data)
    return None if side is None else (*pair, side)


def _one_row_each(reads: dict, pair, gamma) -> bool:
    """Whether every element of the location reads one row of each block of ``pair`` or none
    of either, and every element of the scale at most one scalar of the Gamma block ``gamma``."""
    loc = reads.get("loc", {})
    rows = [el.single(loc[(n, "plate")]) if (n, "plate") in loc else None for n in pair]
    if any(r is None for r in rows):
        return False
    a, b = np.broadcast_arrays(*rows)
    both = (a >= 0) & (b >= 0)
    neither = (a == el.NONE) & (b == el.NONE)
    if not np.all(both | neither):
        return False
    if gamma is not None:
        tau = reads.get("scale", {}).get((gamma, "scalar"))
        if tau is not None and np.any(el.single(tau) < el.NONE):
            return False
    return True


def _coefficients_hold(args_at, ba, bb):
    """``(ok, size)``: whether the location, as a function of every row of A at u and every
    row of B at v (each element reads one of each: c_e + p_eᵀu + q_eᵀv + uᵀ W_e v), has
    p_e = q_e = 0 and W_e = s_e I (s_e = W_e[0, 0]) at every element, to rounding; and the
    number of elements."""
    dtype = jnp.result_type(float)
    d = ba.family.dim
    shape_a, shape_b = tuple(ba.batch_shape) + (d,), tuple(bb.batch_shape) + (d,)

    def loc(u, v):
        xa = jnp.broadcast_to(u, shape_a)
        xb = jnp.broadcast_to(v, shape_b)
        return args_at(xa, xb)["loc"].reshape(-1)

    zero = jnp.zeros((d,), dtype)
    c = loc(zero, zero)
    p = jax.jacfwd(loc, 0)(zero, zero)  # (N, D)
    q = jax.jacfwd(loc, 1)(zero, zero)
    eye = jnp.eye(d, dtype=dtype)

    def row(k):
        # W_e[k, :] = ∂/∂v of the derivative along u = e_k (exact: the form is bilinear)
        return jax.jacfwd(lambda v: jax.jvp(lambda u: loc(u, v), (zero,), (eye[k],))[1])(zero)

    w = jax.lax.map(row, jnp.arange(d))  # (D, N, D): W_e[k, l] at [k, e, l]
    s = w[0, :, 0]
    eps = jnp.finfo(dtype).eps
    scale = jnp.abs(s) + jnp.max(jnp.abs(w), axis=(0, 2))
    exact_w = jnp.abs(w - s[None, :, None] * eye[:, None, :]) <= 64 * eps * d * scale[None, :, None]
    affine = jnp.maximum(jnp.max(jnp.abs(p), -1), jnp.max(jnp.abs(q), -1)) <= 64 * eps * d * (scale + jnp.abs(c))
    return jnp.all(exact_w) & jnp.all(affine), c.size


def _rows_of(view):
    """Means ``(N, D)`` and covariances ``(N, D, D)`` of the rows of a dense Gaussian block,
    or ``(1, D, D)``: the one covariance of rows that share it (``GaussianTied``)."""
    d = view.mean.shape[-1]
    return view.mean.reshape(-1, d), view.cov.reshape(-1, d, d)


def _second_moment_sum(m, c, t=None):
    """Σ_i S_i = Σ_i Σ_i + Mᵀ M (N Σ for rows sharing Σ), or Σ_i t_i S_i with weights t."""
    if t is None:
        return jnp.sum(c, 0) * (m.shape[0] // c.shape[0]) + m.T @ m
    shared = c.shape[0] == 1 and m.shape[0] > 1
    cov = c[0] * jnp.sum(t) if shared else jnp.einsum("i,ijk->jk", t, c)
    return cov + m.T @ (t[:, None] * m)


def _uniform_quad(w2, ma, ca, mb, cb, ta=None, tb=None):
    """w ⟨Σ_i ta_i S_i, Σ_j tb_j S'_j⟩ (weights 1 when not given)."""
    return w2[0, 0] * jnp.sum(_second_moment_sum(ma, ca, ta) * _second_moment_sum(mb, cb, tb))


def _grid_quad(w2, ma, ca, mb, cb):
    """Σ_ij W2_ij ⟨S_i, S'_j⟩ over the packed upper triangles (off-diagonal entries twice)."""
    d = ma.shape[-1]
    upper = np.triu_indices(d)
    twice = jnp.asarray(np.where(upper[0] == upper[1], 1.0, 2.0), ma.dtype)

    def packed(m, c):  # (a shared covariance, (1, D, D), broadcasts over the rows)
        return c[:, upper[0], upper[1]] + m[:, upper[0]] * m[:, upper[1]]

    return jnp.sum((w2 @ packed(mb, cb)) * (twice * packed(ma, ca)))


def expected_log(factor, stats: BilinearStatistics, views) -> jax.Array:
    """Σ_e ω_e E_q[log f_e] of an eligible factor from its statistics and the views."""
    a, b = dict(factor.spec.pairs)["loc"][0]
    ma, ca = _rows_of(views[a])
    mb, cb = _rows_of(views[b])
    along = _scale_rows_of(factor)
    if along:
        # τ_j per row j of B (or of A): t_j weights row j's terms, inside the sums
        t, log_tau_term = scale_terms(factor, views)
        ta, tb = (None, t) if along == b else (t, None)
        lead, per_row = 1.0, t
    else:
        t, log_tau_term = scale_terms(factor, views)
        ta = tb = None
        lead, per_row = t, 1.0
    cross = jnp.sum((stats.cross @ (mb if tb is None else tb[:, None] * mb)) * (ma if ta is None else ta[:, None] * ma))

    def uniform(w2, ma, ca, mb, cb):
        return _uniform_quad(w2, ma, ca, mb, cb, ta, tb)

    def grid(w2, ma, ca, mb, cb):
        w2 = w2 if tb is None else w2 * tb[None, :]
        return _grid_quad(w2 if ta is None else w2 * ta[:, None], ma, ca, mb, cb)

    quad = jax.lax.cond(stats.uniform, uniform, grid, stats.quad, ma, ca, mb, cb)
    return (
        -0.5 * lead * (jnp.sum(per_row * stats.residual) - 2.0 * cross + quad)
        - stats.log_coef - jnp.sum(log_tau_term * stats.weight) - 0.5 * _LOG_2PI * jnp.sum(stats.weight)
    )
