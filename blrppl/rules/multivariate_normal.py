"""Closed-form E_q[log MultivariateNormal(value | loc, scale_tril)]."""

from __future__ import annotations

import jax.numpy as jnp
import numpyro.distributions as dist
from jax import lax
from jax.scipy.linalg import solve_triangular

from blrppl.moments import AffineGaussian
from blrppl.rules._common import LOG_2PI, batch_shape, broadcast_batch, const_value
from blrppl.rules.registry import register_rule


def _solve_lower(chol, rhs):
    """L⁻¹ rhs for lower-triangular L (*b, D, D) and rhs (*b', D, K), batch dims broadcast."""
    batch = lax.broadcast_shapes(chol.shape[:-2], rhs.shape[:-2])
    chol = jnp.broadcast_to(chol, batch + chol.shape[-2:])
    rhs = jnp.broadcast_to(rhs, batch + rhs.shape[-2:])
    return solve_triangular(chol, rhs, lower=True)


def _random_part(d: AffineGaussian, size: int) -> AffineGaussian:
    """d with a zero mean and the smallest shape its column stacks need.

    A constant added to d (e.g. N observations minus one latent loc) widens its mean but
    not its covariance; computing ``cov_event`` on this narrower object avoids N copies
    of the same D × D matrix.
    """
    shape = (size,)
    for lft in d.left:
        if lft is not None:
            shape = lax.broadcast_shapes(shape, lft.shape[1:])
    return AffineGaussian(jnp.zeros(shape, dtype=jnp.result_type(d.mean_value, float)), d.left, d.right)


@register_rule(
    dist.MultivariateNormal,
    kinds={
        "value": ("const", "affine_gaussian"),
        "loc": ("const", "affine_gaussian"),
        "scale_tril": ("const",),
    },
    event_ndim=1,
    conjugate=True,
)
def multivariate_normal_expected_log_prob(value, loc, scale_tril):
    r"""E_q[log N(x | loc, L Lᵀ)] for x ∈ R^D, summed over the event dim.

    .. math::
        L = -\tfrac{D}{2}\log 2\pi - \sum_i \log L_{ii}
            - \tfrac12\left[m_d^\top P\, m_d + \operatorname{tr}(P\, \mathrm{Cov}_d)\right],

    with P = (L Lᵀ)⁻¹, d = x − loc, m_d = E[d] and Cov_d = Cov[d] over the event dim
    (the difference object carries the cross-covariance when x and loc share a block).
    Both quadratic terms use triangular solves with L; no inverse is formed.

    Messages λ̃ = ∇_μ L (natural parameters of the Gaussian block):

    * → loc = w (x const): (P x, −½ P);  → x = w (loc const): (P loc, −½ P);
    * in general, for d = J w − c: (Jᵀ P c, −½ Jᵀ P J).

    Args:
        value: x (*, D), const or affine_gaussian.
        loc: (*, D), const or affine_gaussian.
        scale_tril: L (*, D, D), lower Cholesky factor of the covariance, const.

    Returns:
        L with the broadcast batch shape (event dim summed out).
    """
    chol = const_value(scale_tril)
    size = chol.shape[-1]
    d = value - loc
    m_d = jnp.asarray(d.mean())
    z = _solve_lower(chol, m_d[..., None])[..., 0]
    quad = jnp.sum(jnp.square(z), axis=-1)
    half_log_det = jnp.sum(jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)), axis=-1)
    out = -0.5 * size * LOG_2PI - half_log_det - 0.5 * quad
    if isinstance(d, AffineGaussian):
        cov = _random_part(d, size).cov_event(1)
        y = _solve_lower(chol, cov)  # L⁻¹ C
        w = _solve_lower(chol, jnp.swapaxes(y, -1, -2))  # L⁻¹ C L⁻ᵀ
        out = out - 0.5 * jnp.trace(w, axis1=-2, axis2=-1)
    shape = lax.broadcast_shapes(batch_shape(value, loc, event_ndim=1), chol.shape[:-2])
    return broadcast_batch(out, shape)


@register_rule(
    dist.MultivariateNormal,
    kinds={
        "value": ("const", "affine_gaussian"),
        "loc": ("const", "affine_gaussian"),
        "precision_matrix": ("const", "wishart"),
    },
    event_ndim=1,
    given=("precision_matrix",),
    conjugate=True,
)
def multivariate_normal_precision_expected_log_prob(value, loc, precision_matrix):
    r"""E_q[log N(x | loc, Λ⁻¹)] for x ∈ R^D, of a ``MultivariateNormal`` built from its
    precision matrix Λ (a constant, or a Wishart block), summed over the event dim.

    .. math::
        L = -\tfrac{D}{2}\log 2\pi + \tfrac12 E[\log|Λ|]
            - \tfrac12 \operatorname{tr}\!\big(E[Λ]\,(m_d m_d^\top + \mathrm{Cov}_d)\big),

    with d = x − loc, m_d = E[d], Cov_d = Cov[d] over the event dim (Λ is independent of
    x and loc under q). L is linear in the Wishart block's mean parameters
    (E[Λ], E[log|Λ|]) and quadratic in the Gaussian blocks: conjugate to both.

    Messages λ̃ = ∇_μ L (natural parameters):

    * → Wishart block of Λ (T = (Λ, log|Λ|)): (−½ E[d dᵀ], ½);
    * → Gaussian block of loc = w (x const): (E[Λ] x, −½ E[Λ]);  → x = w: (E[Λ] loc, −½ E[Λ]).

    Args:
        value: x (*, D), const or affine_gaussian.
        loc: (*, D), const or affine_gaussian.
        precision_matrix: Λ (*, D, D), const or wishart (whole matrices).

    Returns:
        L with the broadcast batch shape (event dim summed out).
    """
    prec = precision_matrix.mean()
    size = prec.shape[-1]
    d = value - loc
    m_d = jnp.asarray(d.mean())
    quad = jnp.einsum("...i,...ij,...j->...", m_d, prec, m_d)
    out = -0.5 * size * LOG_2PI + 0.5 * precision_matrix.expect_logdet() - 0.5 * quad
    if isinstance(d, AffineGaussian):
        cov = _random_part(d, size).cov_event(1)
        out = out - 0.5 * jnp.sum(prec * cov, axis=(-2, -1))
    shape = lax.broadcast_shapes(batch_shape(value, loc, event_ndim=1), prec.shape[:-2])
    return broadcast_batch(out, shape)
