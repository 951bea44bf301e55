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

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as dist

from blrppl import moments as mom
from blrppl.estimators.exact import reduce_factor
from blrppl.graph.trace import reduce_wrapped

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


def eligible(factor, blocks) -> str | None:
    """The Gaussian block a factor may use precomputed statistics for, else None.

    The factor must be an exact Normal without enumerated neighbours whose value and
    location depend on one dense, unplated, non-point Gaussian block of at least
    :data:`MIN_DIM` scalars, and whose scale is a constant or a power of one scalar Gamma
    block with a known exponent.
    """
    if factor.estimator != "exact" or factor.rule is None or factor.rule.dist_type is not dist.Normal:
        return None
    if factor.discrete or factor.subsampled:
        return None
    kinds, arg_blocks = factor.kinds, dict(factor.arg_blocks)
    gauss = set(arg_blocks.get("value", ())) | set(arg_blocks.get("loc", ()))
    if len(gauss) != 1:
        return None
    (name,) = gauss
    b = blocks[name]
    if b.kind != "gaussian" or b.point or b.batch_shape or b.size < MIN_DIM:
        return None
    if kinds["scale"] == "power_gamma":
        (g,) = arg_blocks["scale"]
        power = dict(factor.powers).get("scale")
        if blocks[g].size != 1 or power is None:
            return None
    elif kinds["scale"] != "const":
        return None
    return name


def _scale_block(factor):
    return dict(factor.arg_blocks)["scale"][0] if factor.kinds["scale"] == "power_gamma" else None


def statistics(fns, factor, block, data) -> GramStatistics:
    """G, h, r, Σω and Σω log c of one eligible factor, from the model and the data."""
    gamma = _scale_block(factor)
    names = factor.rule.arg_names
    dtype = jnp.result_type(float)
    fill = {} if gamma is None else {gamma: jnp.ones((), dtype)}  # c τ^a at τ = 1 reads c

    def args_at(u):
        values = dict(fill)
        values[block.name] = u if block.members else block.to_site(u)
        return fns.factor_args(factor.name, names, values, data)

    def residual(u):
        args = args_at(u)
        shape = jnp.broadcast_shapes(*(jnp.shape(args[k]) for k in ("value", "loc", "scale")))
        return jnp.broadcast_to(args["value"] - args["loc"], shape).astype(dtype)

    u0 = jnp.zeros((block.size,), dtype)
    d0 = residual(u0)
    jac = jax.jacfwd(residual)(u0)  # (*elements, D)
    args = args_at(u0)
    scale = jnp.broadcast_to(args["scale"], d0.shape).astype(dtype)
    fn, site_scale = fns.factor_wrappers([factor.name], data)[factor.name]
    # the weight of each element in the factor's total (mask, expansion, the site's scale):
    # the total is linear in the elementwise terms
    omega = jax.grad(lambda x: reduce_factor(reduce_wrapped(fn, x), site_scale))(jnp.zeros(d0.shape, dtype))
    kappa = omega / jnp.square(scale)
    flat_j = jac.reshape((-1, block.size))
    flat_k = kappa.reshape(-1)
    flat_d = d0.reshape(-1)
    return GramStatistics(
        gram=flat_j.T @ (flat_k[:, None] * flat_j),
        cross=flat_j.T @ (flat_k * flat_d),
        residual=jnp.sum(flat_k * jnp.square(flat_d)),
        weight=jnp.sum(omega),
        log_coef=jnp.sum(omega * jnp.log(scale)),
    )


def expected_log(factor, block_name, stats: GramStatistics, views) -> jax.Array:
    """Σ_n ω_n E_q[log f_n] of an eligible factor from its statistics and the views."""
    view = views[block_name]
    m, cov = view.mean, view.cov
    g = stats.gram
    quad = m @ (g @ m) + 2.0 * (m @ stats.cross) + stats.residual + jnp.sum(g * cov)
    gamma = _scale_block(factor)
    if gamma is None:
        t, log_tau_term = 1.0, 0.0
    else:
        power = dict(factor.powers)["scale"]
        gv = views[gamma]
        tau = mom.PowerGamma(
            jnp.ones(()), jnp.asarray(power), jnp.reshape(gv.shape, ()), jnp.reshape(gv.rate, ()),
            *(jnp.reshape(x, ()) if x is not None else None for x in (getattr(gv, "mean_log", None), getattr(gv, "mean", None))),
        )
        t = tau.expect_pow(-2.0)  # E[σ⁻²] / c⁻² = E[τ^(−2a)]
        log_tau_term = tau.expect_log()  # a E[log τ]
    return -0.5 * t * quad - stats.log_coef - log_tau_term * stats.weight - 0.5 * _LOG_2PI * stats.weight

