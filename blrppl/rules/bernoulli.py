"""Closed-form E_q[log Bernoulli(value | probs)]."""

from __future__ import annotations

import numpyro.distributions as dist

from blrppl.rules._common import (
    batch_shape,
    broadcast_batch,
    const_value,
    x_expect_log,
    x_expect_log1m,
)
from blrppl.rules.registry import register_rule


@register_rule(
    dist.BernoulliProbs,
    kinds={"value": ("const",), "probs": ("const", "beta", "dirichlet")},
    conjugate=True,
)
def bernoulli_probs_expected_log_prob(value, probs):
    r"""E_q[log Bernoulli(y | p)], elementwise.

    .. math::
        L = y\,E[\log p] + (1 - y)\,E[\log(1 - p)].

    Messages λ̃ = ∇_μ L (natural parameters):

    * → Beta block of p (T = (log p, log(1 − p))): (y, 1 − y);
    * → Dirichlet block with p = π_k (T = log π): y on k; 1 − y reaches the other
      components only when K = 2 (then (y, 1 − y)); for K > 2, E[log(1 − π_k)] is not
      linear in μ and the message comes from autodiff.

    Args:
        value: y ∈ {0, 1}, const.
        probs: p, const, beta or dirichlet.

    Returns:
        L with the broadcast batch shape of the arguments.
    """
    y = const_value(value)
    out = x_expect_log(y, probs) + x_expect_log1m(1.0 - y, probs)
    return broadcast_batch(out, batch_shape(value, probs))
