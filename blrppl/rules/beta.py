"""Closed-form E_q[log Beta(value | concentration1, concentration0)]."""

from __future__ import annotations

import numpyro.distributions as dist
from jax.scipy.special import gammaln

from blrppl.rules._common import (
    batch_shape,
    broadcast_batch,
    const_value,
    x_expect_log,
    x_expect_log1m,
)
from blrppl.rules.registry import register_rule


@register_rule(
    dist.Beta,
    kinds={
        "value": ("const", "beta"),
        "concentration1": ("const",),
        "concentration0": ("const",),
    },
    conjugate=True,
)
def beta_expected_log_prob(value, concentration1, concentration0):
    r"""E_q[log Beta(x | a, b)] (a = concentration1, b = concentration0), elementwise.

    .. math::
        L = -\log B(a, b) + (a - 1)\,E[\log x] + (b - 1)\,E[\log(1 - x)].

    Messages λ̃ = ∇_μ L (natural parameters):

    * → Beta block of x (prior factor, T = (log x, log(1 − x))): (a − 1, b − 1).

    ``BetaProportion`` (a subclass) is scored through its concentration attributes.

    Args:
        value: x ∈ (0, 1), const or beta.
        concentration1: a, const.
        concentration0: b, const.

    Returns:
        L with the broadcast batch shape of the arguments.
    """
    a = const_value(concentration1)
    b = const_value(concentration0)
    log_beta_fn = gammaln(a) + gammaln(b) - gammaln(a + b)
    out = -log_beta_fn + x_expect_log(a - 1.0, value) + x_expect_log1m(b - 1.0, value)
    return broadcast_batch(out, batch_shape(value, concentration1, concentration0))
