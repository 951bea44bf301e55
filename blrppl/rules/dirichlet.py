"""Closed-form E_q[log Dirichlet(value | concentration)]."""

from __future__ import annotations

import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.special import gammaln

from blrppl.rules._common import batch_shape, broadcast_batch, const_value, x_expect_log
from blrppl.rules.registry import register_rule


@register_rule(
    dist.Dirichlet,
    kinds={"value": ("const", "dirichlet"), "concentration": ("const",)},
    event_ndim=1,
    conjugate=True,
)
def dirichlet_expected_log_prob(value, concentration):
    r"""E_q[log Dirichlet(x | α)] for x on the simplex, summed over the event dim.

    .. math::
        L = \log\Gamma(α_0) - \sum_k \log\Gamma(α_k) + \sum_k (α_k - 1)\,E[\log x_k],
        \qquad α_0 = \sum_k α_k.

    Messages λ̃ = ∇_μ L (natural parameters):

    * → Dirichlet block of x (prior factor, T = log x): α − 1.

    Args:
        value: x (*, K), const or dirichlet (whole probability vectors).
        concentration: α (*, K), const.

    Returns:
        L with the broadcast batch shape (event dim summed out).
    """
    alpha = const_value(concentration)
    log_norm = gammaln(jnp.sum(alpha, axis=-1)) - jnp.sum(gammaln(alpha), axis=-1)
    out = log_norm + jnp.sum(x_expect_log(alpha - 1.0, value), axis=-1)
    return broadcast_batch(out, batch_shape(value, concentration, event_ndim=1))
