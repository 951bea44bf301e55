"""ImproperUniform (flat prior): log f = 0 on its support.

    L = E_q[log f] = 0,     λ̃ = 0,

so a flat prior sends no message and the posterior is made by the likelihood alone.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpyro.distributions as dist

from blrppl.moments import KINDS
from blrppl.rules.registry import register_rule


@register_rule(dist.ImproperUniform, kinds={"value": KINDS}, conjugate=True)
def improper_uniform_expected_log_prob(value):
    """Zero (a scalar, which broadcasts against any batch, mask or scale)."""
    return jnp.zeros((), jnp.result_type(float))
