"""Closed-form E_q[log Binomial(value | total_count, probs)]."""

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
    dist.BinomialProbs,
    kinds={
        "value": ("const",),
        "probs": ("const", "beta", "dirichlet"),
        "total_count": ("const",),
    },
    conjugate=True,
)
def binomial_probs_expected_log_prob(value, probs, total_count):
    r"""E_q[log Binomial(y | n, p)], elementwise.

    .. math::
        L = \log\binom{n}{y} + y\,E[\log p] + (n - y)\,E[\log(1 - p)].

    Messages λ̃ = ∇_μ L (natural parameters):

    * → Beta block of p (T = (log p, log(1 − p))): (y, n − y);
    * → Dirichlet block with p = π_k: y on k (and n − y on the other one when K = 2).

    Args:
        value: y ∈ {0, …, n}, const.
        probs: p, const, beta or dirichlet.
        total_count: n, const.

    Returns:
        L with the broadcast batch shape of the arguments.
    """
    y = const_value(value)
    n = const_value(total_count)
    log_binom = gammaln(n + 1.0) - gammaln(y + 1.0) - gammaln(n - y + 1.0)
    out = log_binom + x_expect_log(y, probs) + x_expect_log1m(n - y, probs)
    return broadcast_batch(out, batch_shape(value, probs, total_count))
