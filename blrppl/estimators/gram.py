"""Normal factors linear in a large Gaussian block: expectations from precomputed statistics.

A Normal factor whose residual d = x − loc is affine in one dense Gaussian block w,
d_n = J_n w + d0_n with J constant (``X @ w + b`` in a regression), and whose scale is a
constant or c_n · τ^a with τ one scalar Gamma block, has

    Σ_n ω_n E_q[log N(x_n | loc_n, σ_n²)]
        = −½ t (mᵀ G m + 2 mᵀ h + r + tr(G Σ)) − Σ_n ω_n log c_n − a E[log τ] Σ_n ω_n
          − ½ log(2π) Σ_n ω_n,

with q(w) = N(m, Σ), t = E[τ^(−2a)] (1 for a constant scale, whose c_n is the scale),
ω_n the weight of element n (its mask, its site's scale, expansion), κ_n = c_n^(−2), and
the statistics G = Jᵀ diag(ω κ) J, h = Jᵀ(ω κ d0), r = Σ_n ω_n κ_n d0_n² computed once
per fit from the data (O(N D²)), not at every step: a step then costs O(D²) for this
factor (plus the family's O(D³) Cholesky), as a hand-written conjugate regression does.
The message is the usual conjugate one, λ̃ = (−t(h), −½ t G) at the gradient.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist

from blrppl.moments import kinds as mom
from blrppl.estimators.exact import reduce_factor
from blrppl.estimators.registry import estimator_of
from blrppl.graph.data import host_array
from blrppl.model.records import reduce_wrapped

#: a Normal factor linear in a dense Gaussian block of at least this many scalars uses the
#: precomputed statistics (smaller blocks compile faster the elementwise way)
MIN_DIM = 32
_LOG_2PI = math.log(2.0 * math.pi)


class GramStatistics(NamedTuple):
    """The data statistics of one factor (see the module docstring)."""

    gram: jax.Array  # G (D, D)
    cross: jax.Array  # h (D,)
    residual: jax.Array  # r ()
    weight: jax.Array  # Σ ω ()
    log_coef: jax.Array  # Σ ω log c ()


class ElementStatistics(NamedTuple):
    """The statistics of a Normal factor on a plated block's own values (see
    :func:`eligible`): per element of the site, κ and κ d0; and r, Σω, Σω log c."""

    kappa: jax.Array  # κ (the block's canonical layout, (*B, D))
    cross: jax.Array  # κ d0 (*B, D)
    residual: jax.Array  # r ()
    weight: jax.Array  # Σ ω ()
    log_coef: jax.Array  # Σ ω log c ()


@dataclasses.dataclass(frozen=True)
class GramSource:
    """An exact factor whose expectation comes from these statistics of one Gaussian block
    (:attr:`blrppl.estimators.exact.ExactSpec.statistics`, set when it is
    :func:`eligible`).

    Attributes:
        block: the dense Gaussian block the factor is linear in.
    """

    block: str

    #: the factor's scale reads no vector of precisions indexed along the block's rows
    scale_rows = ""
    #: its elements no longer count in a step's dense work (its step costs O(D²))
    dense_work = False

    @property
    def blocks(self) -> tuple:
        """The blocks whose rows the statistics are of: the one block."""
        return (self.block,)

    def shown(self, plan) -> bool:
        """Whether the plan table says the factor reads data statistics: not for a plated
        block's own prior, which reads its rows' moments."""
        return not plan.block(self.block).batch_shape

    def compute(self, fns, factor, blocks: dict, data, rows: bool = False):
        """The factor's statistics on ``data`` (:func:`statistics`)."""
        return statistics(fns, factor, blocks[self.block], data, rows=rows)

    def expected_log(self, factor, stats, views) -> jax.Array:
        """Σ_n ω_n E_q[log f_n] from the statistics (:func:`expected_log`)."""
        return expected_log(factor, self.block, stats, views)


def eligible(factor, blocks, fns=None, data=None) -> str | None:
    """The Gaussian block a factor may use precomputed statistics for, else None.

    The factor must be an exact Normal without enumerated neighbours whose value and
    location depend on one dense, non-point Gaussian block, and whose scale is a constant or
    a power of one scalar Gamma block with a known exponent. The block is unplated with at
    least :data:`MIN_DIM` scalars; or plated, with the factor's value the block's own site
    value, elementwise, and a constant location (a prior on a factor model's rows,
    ``Normal(0, 1).expand([D]).to_event(1)`` in a plate): J is then the identity, G
    diagonal, and the expectation reads the rows' means and variances only (the latent's
    own prior; its shape is read off a trace of the model with ``fns`` and ``data``).
    """
    if not estimator_of(factor).closed_form or factor.rule is None or factor.rule.dist_type is not dist.Normal:
        return None
    if factor.discrete or factor.subsampled:
        return None
    kinds, arg_blocks = factor.kinds, dict(factor.arg_blocks)
    gauss = set(arg_blocks.get("value", ())) | set(arg_blocks.get("loc", ()))
    if len(gauss) != 1:
        return None
    (name,) = gauss
    b = blocks[name]
    if not b.family.dense_event or b.family.banded or b.family.arrowhead or b.point:
        return None
    if b.batch_shape:
        if arg_blocks.get("loc") or b.members or b.local is not None or b.transform is not None:
            return None
    elif b.size < MIN_DIM:
        return None
    if kinds["scale"] == mom.PowerGamma.kind:
        (g,) = arg_blocks["scale"]
        power = dict(factor.spec.powers).get("scale")
        if blocks[g].size != 1 or power is None:
            return None
    elif kinds["scale"] != mom.Const.kind:
        return None
    # (a point block, a param, reads as a constant argument: its value changes every step,
    # and the statistics would hold its first one)
    if set(factor.neighbours) != {name} | set(arg_blocks.get("scale", ())):
        return None
    if b.batch_shape and not _reads_own_values(factor, b, fns, data):
        return None
    return name


def _reads_own_values(factor, block, fns, data) -> bool:
    """Whether the factor's value is the block's site value itself, element by element: the
    latent's own prior, whose value has the site's shape (read off a trace of the model, on
    this data)."""
    if fns is None or factor.observed or factor.name != block.name:
        return False
    dtype = jnp.result_type(float)

    def value_at(data, u):
        return _args_fn(fns, factor, block, data)(u)["value"]

    try:
        got = jax.eval_shape(value_at, data, jax.ShapeDtypeStruct((block.size,), dtype))
    except Exception:  # a model the trace cannot evaluate keeps the elementwise moments
        return False
    return tuple(got.shape) == tuple(block.value_shape)


def _args_fn(fns, factor, block, data):
    """u (the block's flat value) → the factor's arguments, τ = 1 for a scale c τ^a."""
    gamma = scale_block(factor)
    fill = {} if gamma is None else {gamma: jnp.ones((), jnp.result_type(float))}

    def args_at(u):
        values = dict(fill)
        canonical = u.reshape(tuple(block.batch_shape) + (-1,)) if block.batch_shape else u
        values[block.name] = u if block.members else block.to_site(canonical)
        return fns.factor_args(factor.name, factor.rule.arg_names, values, data)

    return args_at


def _element_statistics(fns, factor, block, data) -> ElementStatistics:
    """κ, κ d0, r, Σω and Σω log c of a factor on a plated block's own values."""
    dtype = jnp.result_type(float)
    args = _args_fn(fns, factor, block, data)(jnp.zeros((block.size,), dtype))
    shape = tuple(block.value_shape)
    d0 = -jnp.broadcast_to(args["loc"], shape).astype(dtype)  # value − loc at u = 0
    scale = jnp.broadcast_to(args["scale"], shape).astype(dtype)
    omega = element_weights(fns, factor, data, shape)
    kappa = omega / jnp.square(scale)
    return ElementStatistics(  # (κ and κ d0 in the block's canonical layout, its views')
        kappa=block.to_canonical(kappa),
        cross=block.to_canonical(kappa * d0),
        residual=jnp.sum(kappa * jnp.square(d0)),
        weight=jnp.sum(omega),
        log_coef=jnp.sum(omega * jnp.log(scale)),
    )


def element_weights(fns, factor, data, shape) -> jax.Array:
    """The weight ω of each element of a factor in its total (its mask, expansion and the
    site's scale): the total is linear in the elementwise terms, so ω is its gradient."""
    fn, site_scale = fns.factor_wrappers([factor.name], data)[factor.name]
    zeros = jnp.zeros(shape, jnp.result_type(float))
    return jax.grad(lambda x: reduce_factor(reduce_wrapped(fn, x), site_scale))(zeros)


def scale_block(factor):
    """The Gamma block τ of a factor whose scale is c τ^a, else None."""
    return dict(factor.arg_blocks)["scale"][0] if factor.kinds["scale"] == mom.PowerGamma.kind else None


def statistics(fns, factor, block, data, rows: bool = False) -> GramStatistics | ElementStatistics:
    """G, h, r, Σω and Σω log c of one eligible factor, from the model and the data; with
    ``rows``, the ``gram`` field holds the rows A = diag(√(ωκ)) J whose Gram matrix AᵀA is G
    (for :func:`gram_on_host`), or only the diagonal of A when J is the identity (a prior
    on the block's own scalars: no D × D identity is formed). For a plated block, the
    :class:`ElementStatistics` of a factor on its own values."""
    if block.batch_shape:
        return _element_statistics(fns, factor, block, data)
    dtype = jnp.result_type(float)
    args_at = _args_fn(fns, factor, block, data)  # c τ^a at τ = 1 reads c

    def residual(u):
        args = args_at(u)
        shape = jnp.broadcast_shapes(*(jnp.shape(args[k]) for k in ("value", "loc", "scale")))
        return jnp.broadcast_to(args["value"] - args["loc"], shape).astype(dtype)

    u0 = jnp.zeros((block.size,), dtype)
    d0 = residual(u0)
    jac = affine_jacobian(residual, u0, identity=_EYE)  # (*elements, D), or _EYE
    args = args_at(u0)
    scale = jnp.broadcast_to(args["scale"], d0.shape).astype(dtype)
    omega = element_weights(fns, factor, data, d0.shape)
    kappa = omega / jnp.square(scale)
    flat_k = kappa.reshape(-1)
    flat_d = d0.reshape(-1)
    if isinstance(jac, str) and flat_k.shape == (block.size,):
        # each element reads its own scalar of the block (its prior): G is diagonal; as
        # rows, the diagonal of A (a vector, see gram_on_host)
        return GramStatistics(
            gram=jnp.sqrt(flat_k) if rows else jnp.diag(flat_k),
            cross=flat_k * flat_d,
            residual=jnp.sum(flat_k * jnp.square(flat_d)),
            weight=jnp.sum(omega),
            log_coef=jnp.sum(omega * jnp.log(scale)),
        )
    flat_j = _materialise(jac, block.size, dtype).reshape((-1, block.size))
    if rows:
        gram = jnp.sqrt(flat_k)[:, None] * flat_j
    else:
        gram = flat_j.T @ (flat_k[:, None] * flat_j)
    return GramStatistics(
        gram=gram,
        cross=flat_j.T @ (flat_k * flat_d),
        residual=jnp.sum(flat_k * jnp.square(flat_d)),
        weight=jnp.sum(omega),
        log_coef=jnp.sum(omega * jnp.log(scale)),
    )


def gram_on_host(stats: GramStatistics) -> GramStatistics:
    """``stats`` whose ``gram`` field holds the rows A (``statistics(..., rows=True)``) with
    G = AᵀA formed by NumPy's BLAS (it recognises AᵀA: a symmetric rank-k update)."""
    a = np.asarray(stats.gram)
    if a.ndim == 1:  # the diagonal of diagonal rows: G = diag(a²)
        return stats._replace(gram=host_array(np.diag(a * a)))
    if np.all(np.count_nonzero(a, axis=1) <= 1):
        # each element reads one scalar of the block (a prior): G is diagonal, O(N D)
        return stats._replace(gram=host_array(np.diag(np.einsum("ij,ij->j", a, a))))
    return stats._replace(gram=host_array(a.T @ a))


def expected_log(factor, block_name, stats: GramStatistics, views) -> jax.Array:
    """Σ_n ω_n E_q[log f_n] of an eligible factor from its statistics and the views (for a
    plated block's own values, Σ κ (m² + v) + 2 Σ m κ d0 + r with m and v each element's
    mean and variance)."""
    view = views[block_name]
    m, cov = view.mean, view.cov
    if isinstance(stats, ElementStatistics):
        # (rows sharing one covariance, ``GaussianTied``: its diagonal broadcasts over them)
        var = jnp.diagonal(cov, axis1=-2, axis2=-1)
        quad = jnp.sum(stats.kappa * (m * m + var)) + 2.0 * jnp.sum(m * stats.cross) + stats.residual
    else:
        g = stats.gram
        quad = m @ (g @ m) + 2.0 * (m @ stats.cross) + stats.residual + jnp.sum(g * cov)
    t, log_tau_term = scale_terms(factor, views)
    return -0.5 * t * quad - stats.log_coef - log_tau_term * stats.weight - 0.5 * _LOG_2PI * stats.weight


def scale_terms(factor, views) -> tuple:
    """(t, a E[log τ]) of a factor whose scale is c τ^a (t = E[τ^(−2a)]; elementwise, flat,
    for a vector of τ: :mod:`blrppl.estimators.bilinear`), or (1, 0) for a constant scale."""
    gamma = scale_block(factor)
    if gamma is None:
        return 1.0, 0.0
    power = dict(factor.spec.powers)["scale"]
    gv = views[gamma]
    shape = () if np.size(gv.shape) == 1 else (-1,)
    concentration = jnp.reshape(gv.shape, shape)
    tau = mom.PowerGamma(
        jnp.ones_like(concentration), float(power), concentration, jnp.reshape(gv.rate, shape),
        *(jnp.reshape(x, shape) if x is not None else None for x in (getattr(gv, "mean_log", None), getattr(gv, "mean", None))),
    )
    return tau.expect_pow(-2.0), tau.expect_log()  # E[σ⁻²] / c⁻² = E[τ^(−2a)]; a E[log τ]


def affine_jacobian(fn, u0, identity=None):
    """The Jacobian (*out, D) of a function affine in u (D,): read off its linearisation when
    that is made of products with constant matrices and layout and elementwise-linear
    operations (``X @ w`` gives X itself), else by forward-mode autodiff (D JVPs: for
    ``X @ w`` a product of X with the identity, as costly as XᵀX). When the map is u itself,
    ``identity`` is returned if given (a prior's D × D identity is then never formed)."""
    _, lin = jax.linearize(fn, u0)
    closed = jax.make_jaxpr(lin)(u0)
    dim = u0.shape[0]
    try:
        (out,) = _linear_map(closed.jaxpr, closed.consts, dim)
    except _NotRead:
        return jax.jacfwd(fn)(u0)
    if isinstance(out, str) and identity is not None:
        return identity
    return _materialise(out, dim, u0.dtype)


class _NotRead(Exception):
    """A linear map with an operation :func:`_linear_map` does not read."""


_EYE = "eye"  # the input u itself: its Jacobian is the identity, never materialised unless needed


def _materialise(m, dim, dtype):
    return jnp.eye(dim, dtype=dtype) if isinstance(m, str) else m


def _linear_map(jaxpr, consts, dim, inputs=None) -> list:
    """The Jacobian of every output of a linear jaxpr in its one input, (*shape, D) each."""
    env = {}
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = ("const", c)
    for v, x in zip(jaxpr.invars, inputs if inputs is not None else [("lin", _EYE)]):
        env[v] = x

    def read(v):
        if hasattr(v, "val"):  # a literal
            return ("const", v.val)
        return env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _linear_rule(eqn, ins, dim)
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    out = [read(v) for v in jaxpr.outvars]
    if any(tag != "lin" for tag, _ in out):
        raise _NotRead
    return [m for _, m in out]


def _linear_rule(eqn, ins, dim) -> list:
    name = eqn.primitive.name
    tags = [k for k, _ in ins]
    if all(k == "const" for k in tags):
        raise _NotRead  # constants are folded into the jaxpr's consts by linearize
    sub = eqn.params.get("jaxpr")
    if name in ("pjit", "jit") and sub is not None:
        return [("lin", m) for m in _linear_map(sub.jaxpr, sub.consts, dim, ins)]
    lins = [m for k, m in ins if k == "lin"]
    consts = [c for k, c in ins if k == "const"]
    out_aval = eqn.outvars[0].aval

    def full(m):
        return _materialise(m, dim, out_aval.dtype)

    if name == "dot_general" and len(lins) == 1:
        (contract_a, contract_b), (batch_a, batch_b) = eqn.params["dimension_numbers"]
        if batch_a or batch_b:
            raise _NotRead
        (c,), (m,) = consts, lins
        lin_first = tags[0] == "lin"
        contract_c, contract_m = (contract_b, contract_a) if lin_first else (contract_a, contract_b)
        if isinstance(m, str):
            # C · u: the Jacobian is C with its contracted axis last (and the output's order)
            (k,) = contract_c
            return [("lin", jnp.moveaxis(jnp.asarray(c), k, -1).astype(out_aval.dtype))]
        res = jax.lax.dot_general(c, m, ((tuple(contract_c), tuple(contract_m)), ((), ())))
        if lin_first:  # output order: the lin operand's free axes first, D last
            n_c = jnp.ndim(c) - len(contract_c)
            res = jnp.moveaxis(res, tuple(range(n_c)), tuple(range(res.ndim - 1 - n_c, res.ndim - 1)))
        return [("lin", res)]
    if name == "neg" and len(lins) == 1:
        return [("lin", -full(lins[0]))]
    if name in ("convert_element_type", "copy", "copy_p") and len(lins) == 1:
        m = lins[0]  # the identity stays symbolic
        return [("lin", m if isinstance(m, str) else m.astype(out_aval.dtype))]
    if name in ("mul", "div") and len(lins) == 1 and not (name == "div" and tags[1] == "lin"):
        (c,), m = consts, full(lins[0])
        c = jnp.asarray(c)[..., None]
        return [("lin", m * c if name == "mul" else m / c)]
    if name in ("add", "sub", "add_any") and len(lins) == 2:
        a, b = (full(m) for m in lins)
        return [("lin", a + b if name != "sub" else a - b)]
    if name in ("reshape", "broadcast_in_dim", "transpose", "squeeze") and len(lins) == 1 and not consts:
        m = full(lins[0])
        shape = tuple(out_aval.shape) + (dim,)
        if name == "reshape":
            return [("lin", m.reshape(shape))]
        if name == "broadcast_in_dim":
            dims = tuple(eqn.params["broadcast_dimensions"]) + (len(shape) - 1,)
            return [("lin", jax.lax.broadcast_in_dim(m, shape, dims))]
        if name == "transpose":
            perm = tuple(eqn.params["permutation"]) + (m.ndim - 1,)
            return [("lin", jnp.transpose(m, perm))]
        return [("lin", m.reshape(shape))]
    raise _NotRead
