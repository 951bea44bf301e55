"""Uniform(low, high) with constant bounds: log f = −log(high − low) on its support.

    L = E_q[log f] = −log(high − low),     λ̃ = 0,

when q puts no mass outside [low, high]: for observed values (checked against the support
when the model is traced), and for the prior of the site itself, whose block is a Gaussian on
the logit space of the interval (its bijection keeps every draw inside) or, for
``Uniform(0, 1)``, a Beta (the compiler reads such a value as a constant, see
``blrppl.compiler.classify._own_uniform_priors``). The prior sends no message: the posterior is
made by the likelihood (and the Jacobian of the bijection).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpyro.distributions as dist

from blrppl.rules._common import const_value
from blrppl.rules.registry import register_rule


@register_rule(dist.Uniform, kinds={"value": ("const",), "low": ("const",), "high": ("const",)}, conjugate=True)
def uniform_expected_log_prob(value, low, high):
    """−log(high − low), broadcast to the batch of the value and bounds."""
    low, high = const_value(low), const_value(high)
    out = -jnp.log(high - low)
    return jnp.broadcast_to(out, jnp.broadcast_shapes(jnp.shape(out), jnp.shape(const_value(value))))
