"""Closed-form E_q[log HalfNormal(value | scale)]."""

from __future__ import annotations

import math

import numpyro.distributions as dist

from blrppl.rules._common import LOG_2PI, batch_shape, broadcast_batch
from blrppl.rules.registry import register_rule


@register_rule(
    dist.HalfNormal,
    kinds={"value": ("const", "power_gamma", "exp_gaussian"), "scale": ("const", "power_gamma", "exp_gaussian")},
    conjugate_powers={"value": (0.5,), "scale": (-0.5,)},
    conjugate=True,
)
def half_normal_expected_log_prob(value, scale):
    r"""E_q[log HalfNormal(x | σ)], elementwise (x ≥ 0).

    .. math::
        L = \log 2 - \tfrac12 \log 2\pi - E[\log σ] - \tfrac12 E[σ^{-2}]\, E[x^2].

    x and σ are independent under q (distinct blocks, or constants).

    Messages λ̃ = ∇_μ L (natural parameters):

    * → Gamma precision τ with σ = τ^(−½) (T = (log τ, τ)): (½, −½ E[x²]);
    * → Gamma block of x: not conjugate (E[x²] is not linear in μ = (E log x, E x));
      the rule is still exact, the family takes ∇_μ L by autodiff.

    Args:
        value: x, const or power_gamma.
        scale: σ, const, power_gamma or exp_gaussian.

    Returns:
        L with the broadcast batch shape of the arguments.
    """
    out = (
        math.log(2.0)
        - 0.5 * LOG_2PI
        - scale.expect_log()
        - 0.5 * scale.expect_pow(-2.0) * value.mean_square()
    )
    return broadcast_batch(out, batch_shape(value, scale))
