"""Closed-form E_q[log Normal(value | loc, scale)]."""

from __future__ import annotations

import numpyro.distributions as dist

from blrppl.rules._common import LOG_2PI, batch_shape, broadcast_batch
from blrppl.rules.registry import register_rule


@register_rule(
    dist.Normal,
    kinds={
        "value": ("const", "affine_gaussian"),
        "loc": ("const", "affine_gaussian", "bilinear_gaussian"),
        "scale": ("const", "power_gamma", "exp_gaussian"),
    },
    conjugate_powers={"scale": (-0.5,)},
    conjugate=True,
)
def normal_expected_log_prob(value, loc, scale):
    r"""E_q[log N(x | loc, σ²)], elementwise.

    .. math::
        L = -\tfrac12 \log 2\pi - E[\log σ] - \tfrac12 E[σ^{-2}]\, E[(x - loc)^2],

    with E[(x − loc)²] = (E[x] − E[loc])² + Var[x − loc] computed on the difference
    object, so that x and loc may depend on the same Gaussian block (their covariance
    enters). σ is independent of x and loc (it is a Gamma block or a constant). A bilinear
    loc (``w * x``: a product of affine forms of two blocks) adds E[f(d_A, d_B)²] to the
    variance (:class:`blrppl.moments.BilinearGaussian`): L stays quadratic in each block
    given the other, the variational message passing update of factor models.

    Messages λ̃ = ∇_μ L (natural parameters):

    * → Gaussian block w of loc (loc = w, x const): (E[σ⁻²] x, −½ E[σ⁻²]); of x
      (x = w, loc const): (E[σ⁻²] loc, −½ E[σ⁻²]); in general, for
      x − loc = J w − c affine in w: (E[σ⁻²] Jᵀc, −½ E[σ⁻²] JᵀJ) (e.g. x = w₀,
      loc = w₁ couples the two coordinates through −½ E[σ⁻²] [[1, −1], [−1, 1]]).
    * → Gamma precision τ with σ = τ^(−½) (T = (log τ, τ)): (½, −½ E[(x − loc)²]).

    Args:
        value: x, const or affine_gaussian.
        loc: const, affine_gaussian or bilinear_gaussian.
        scale: σ, const, power_gamma or exp_gaussian.

    Returns:
        L with the broadcast batch shape of the arguments.
    """
    expected_sq = (value - loc).mean_square()
    out = -0.5 * LOG_2PI - scale.expect_log() - 0.5 * scale.expect_pow(-2.0) * expected_sq
    return broadcast_batch(out, batch_shape(value, loc, scale))
