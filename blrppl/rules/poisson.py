"""Closed-form E_q[log Poisson(value | rate)]."""

from __future__ import annotations

import numpyro.distributions as dist
from jax.scipy.special import gammaln

from blrppl.rules._common import batch_shape, broadcast_batch, const_value, x_expect_log
from blrppl.rules.registry import register_rule


@register_rule(
    dist.Poisson,
    kinds={"value": ("const",), "rate": ("const", "power_gamma", "exp_gaussian")},
    conjugate_powers={"rate": (1.0,)},
    conjugate=True,
)
def poisson_expected_log_prob(value, rate):
    r"""E_q[log Poisson(y | r)], elementwise.

    .. math::
        L = y\,E[\log r] - E[r] - \log\Gamma(y + 1).

    (numpyro's ``is_sparse`` only changes how ``log_prob`` is computed, not its value.)

    Messages λ̃ = ∇_μ L (natural parameters, T = (log τ, τ)):

    * → Gamma block of the rate (r = τ): (y, −1); with an exposure r = E τ: (y, −E).

    Args:
        value: y (counts), const.
        rate: r, const, power_gamma or exp_gaussian (the log link r = exp(η), η affine
            Gaussian with mean m and variance v: E[log r] = m, E[r] = exp(m + v/2), a
            closed form, not conjugate).

    Returns:
        L with the broadcast batch shape of the arguments.
    """
    y = const_value(value)
    out = x_expect_log(y, rate) - rate.mean() - gammaln(y + 1.0)
    return broadcast_batch(out, batch_shape(value, rate))
