"""Closed-form E_q[log Exponential(value | rate)]."""

from __future__ import annotations

import numpyro.distributions as dist

from blrppl.rules._common import batch_shape, broadcast_batch
from blrppl.rules.registry import register_rule


@register_rule(
    dist.Exponential,
    kinds={"value": ("const", "power_gamma", "exp_gaussian"), "rate": ("const", "power_gamma", "exp_gaussian")},
    conjugate_powers={"value": (1.0,), "rate": (1.0,)},
    conjugate=True,
)
def exponential_expected_log_prob(value, rate):
    r"""E_q[log Exponential(x | r)], elementwise.

    .. math::
        L = E[\log r] - E[r]\,E[x].

    x and r are independent under q (distinct blocks, or constants).

    Messages λ̃ = ∇_μ L (natural parameters, T = (log τ, τ)):

    * → Gamma block of the rate (r = τ): (1, −E[x]);
    * → Gamma block of x (x = τ, prior factor): (0, −E[r]).

    Args:
        value: x, const, power_gamma or exp_gaussian.
        rate: r, const, power_gamma or exp_gaussian (log-normal: E[log r] = m,
            E[r] = exp(m + v/2); not conjugate).

    Returns:
        L with the broadcast batch shape of the arguments.
    """
    out = rate.expect_log() - rate.mean() * value.mean()
    return broadcast_batch(out, batch_shape(value, rate))
