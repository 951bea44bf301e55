"""Closed-form E_q[log Multinomial(value | total_count, probs)]."""

from __future__ import annotations

import jax.numpy as jnp
import numpyro.distributions as dist
from jax import lax
from jax.scipy.special import gammaln

from blrppl.rules._common import batch_shape, broadcast_batch, const_value, x_expect_log
from blrppl.rules.registry import register_rule


@register_rule(
    dist.MultinomialProbs,
    kinds={"value": ("const",), "probs": ("const", "dirichlet"), "total_count": ("const",)},
    event_ndim=1,
    conjugate=True,
)
def multinomial_probs_expected_log_prob(value, probs, total_count):
    r"""E_q[log Multinomial(y | n, π)] for counts y over K categories, summed over the event dim.

    .. math::
        L = \log n! - \sum_k \log y_k! + \sum_k y_k\,E[\log π_k]
        \quad (E[\log π_k] = ψ(α_k) - ψ(α_0) \text{ for a Dirichlet block}).

    As numpyro scores it, n is the ``total_count`` given (not the sum of y).

    Messages λ̃ = ∇_μ L (natural parameters):

    * → Dirichlet block of π (T = log π): y (the counts: each row of counts adds to the
      posterior's concentration, the Dirichlet–multinomial conjugacy).

    Args:
        value: y (*, K), const.
        probs: π (*, K), const or dirichlet (whole probability vectors).
        total_count: n (*), const.

    Returns:
        L with the broadcast batch shape (event dim summed out).
    """
    y = const_value(value)
    n = const_value(total_count)
    log_coef = gammaln(jnp.asarray(n, jnp.result_type(float)) + 1.0) - jnp.sum(gammaln(y + 1.0), axis=-1)
    out = log_coef + jnp.sum(x_expect_log(y, probs), axis=-1)
    shape = lax.broadcast_shapes(batch_shape(value, probs, event_ndim=1), batch_shape(total_count))
    return broadcast_batch(out, shape)
