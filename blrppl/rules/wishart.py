"""Closed-form E_q[log Wishart(value | concentration, scale_tril)]."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.linalg import solve_triangular
from jax.scipy.special import multigammaln

from blrppl.rules._common import batch_shape, broadcast_batch, const_value
from blrppl.rules.registry import register_rule


@register_rule(
    dist.Wishart,
    kinds={"value": ("const", "wishart"), "concentration": ("const",), "scale_tril": ("const",)},
    event_ndim=2,
    conjugate=True,
)
def wishart_expected_log_prob(value, concentration, scale_tril):
    r"""E_q[log Wishart(Λ | ν₀, W₀)] for Λ a D × D positive-definite matrix, W₀ = L₀ L₀ᵀ.

    .. math::
        L = \tfrac{ν_0 - D - 1}{2} E[\log|Λ|] - \tfrac12 \operatorname{tr}(W_0^{-1} E[Λ])
            - \tfrac{ν_0 D}{2} \log 2 - ν_0 \log|L_0| - \log Γ_D(ν_0 / 2).

    The trace is ‖L₀⁻¹ E[Λ] L₀⁻ᵀ‖'s diagonal sum (two triangular solves; no inverse).

    Messages λ̃ = ∇_μ L (natural parameters):

    * → Wishart block of Λ (prior factor, T = (Λ, log|Λ|)): (−½ W₀⁻¹, (ν₀ − D − 1)/2).

    Args:
        value: Λ (*, D, D), const or wishart (whole matrices).
        concentration: ν₀ (*,), const.
        scale_tril: L₀ (*, D, D), lower Cholesky factor of the scale matrix, const.

    Returns:
        L with the broadcast batch shape (event dims summed out).
    """
    nu = jnp.asarray(const_value(concentration))
    chol = jnp.asarray(const_value(scale_tril))
    mean = value.mean()
    size = chol.shape[-1]
    batch = jnp.broadcast_shapes(mean.shape[:-2], chol.shape[:-2], nu.shape)
    chol_b = jnp.broadcast_to(chol, batch + (size, size))
    y = solve_triangular(chol_b, jnp.broadcast_to(mean, batch + (size, size)), lower=True)  # L₀⁻¹ E[Λ]
    z = solve_triangular(chol_b, jnp.swapaxes(y, -1, -2), lower=True)  # L₀⁻¹ E[Λ] L₀⁻ᵀ
    log_det_chol = jnp.sum(jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)), axis=-1)
    out = (
        0.5 * (nu - size - 1.0) * value.expect_logdet()
        - 0.5 * jnp.trace(z, axis1=-2, axis2=-1)
        - 0.5 * nu * size * math.log(2.0)
        - nu * log_det_chol
        - multigammaln(0.5 * nu, size)
    )
    return broadcast_batch(out, batch_shape(value, event_ndim=2) if not batch else batch)
