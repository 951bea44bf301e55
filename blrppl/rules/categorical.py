"""Closed-form E_q[log Categorical(value | probs)]."""

from __future__ import annotations

import jax.numpy as jnp
import numpyro.distributions as dist
from jax import lax

from blrppl.rules._common import const_value
from blrppl.rules.registry import register_rule

#: categories up to which E[log π_z] is picked by a select per category, not a gather
ONE_HOT_MAX = 32


@register_rule(
    dist.CategoricalProbs,
    kinds={"value": ("const",), "probs": ("const", "dirichlet")},
    conjugate=True,
)
def categorical_probs_expected_log_prob(value, probs):
    r"""E_q[log Categorical(z | π)], elementwise over z.

    .. math::
        L = E[\log π_z] \quad (= ψ(α_z) - ψ(α_0) \text{ for a Dirichlet block}).

    ``probs`` has the categories on its last dim; ``value`` holds integer categories
    and broadcasts against the other dims.

    Messages λ̃ = ∇_μ L (natural parameters):

    * → Dirichlet block of π (T = log π): onehot(z);
    * → z (enumerated): E[log π_k] for each k (the rule evaluated at each value).

    ``OrderedLogistic`` (a subclass) is scored through its ``probs`` attribute.

    Args:
        value: z ∈ {0, …, K − 1}, const (integer).
        probs: π (*, K), const or dirichlet.

    Returns:
        L with shape broadcast(z.shape, π.shape[:-1]).
    """
    z = jnp.asarray(const_value(value))
    if not jnp.issubdtype(z.dtype, jnp.integer):
        z = z.astype(jnp.int32)
    log_p = probs.expect_log()
    shape = lax.broadcast_shapes(z.shape, log_p.shape[:-1])
    log_p = jnp.broadcast_to(log_p, shape + log_p.shape[-1:])
    z = jnp.broadcast_to(z, shape)
    k = log_p.shape[-1]
    if k > ONE_HOT_MAX:
        return jnp.take_along_axis(log_p, z[..., None], axis=-1)[..., 0]
    # a select per category: its derivative is elementwise (a gather's is a serial
    # scatter-add, the costliest part of an HMM's enumerated transition runs)
    return jnp.sum(jnp.where(z[..., None] == jnp.arange(k, dtype=z.dtype), log_p, 0.0), axis=-1)
