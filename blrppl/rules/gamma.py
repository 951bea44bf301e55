"""Closed-form E_q[log Gamma(value | concentration, rate)]."""

from __future__ import annotations

import numpyro.distributions as dist
from jax.scipy.special import gammaln

from blrppl.rules._common import batch_shape, broadcast_batch, const_value, x_expect_log
from blrppl.rules.registry import register_rule


@register_rule(
    dist.Gamma,
    kinds={
        "value": ("const", "power_gamma", "exp_gaussian"),
        "concentration": ("const",),
        "rate": ("const", "power_gamma"),
    },
    conjugate_powers={"value": (1.0,), "rate": (1.0,)},
    conjugate=True,
)
def gamma_expected_log_prob(value, concentration, rate):
    r"""E_q[log Gamma(x | a, b)] (shape a, rate b), elementwise.

    .. math::
        L = a\,E[\log b] - \log\Gamma(a) + (a - 1)\,E[\log x] - E[b]\,E[x].

    x and b are independent under q (distinct blocks, or constants).

    Messages λ̃ = ∇_μ L (natural parameters, T = (log τ, τ)):

    * → Gamma block of x (x = τ, prior factor): (a − 1, −E[b]);
    * → Gamma block of the rate (b = τ): (a, −E[x]);
      for b = c τ: (a, −c E[x]).

    ``Chi2`` (a subclass) is scored through its ``concentration`` / ``rate`` attributes.

    Args:
        value: x, const, power_gamma or exp_gaussian (a Gaussian on log x: E[log x] = m,
            E[x] = exp(m + v/2); not conjugate).
        concentration: a, const.
        rate: b, const or power_gamma.

    Returns:
        L with the broadcast batch shape of the arguments.
    """
    a = const_value(concentration)
    out = (
        a * rate.expect_log()
        - gammaln(a)
        + x_expect_log(a - 1.0, value)
        - rate.mean() * value.mean()
    )
    return broadcast_batch(out, batch_shape(value, concentration, rate))
