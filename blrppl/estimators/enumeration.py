"""Enumeration of discrete blocks.

A factor touching discrete blocks d_1..d_m (each enumerated over its support values, every
element of a block set to the same value at once, which is exact because each element of
the factor uses the aligned element of each discrete block) has

    L = Σ_{k_1..k_m} Π_j q_j(k_j) · E_q[log f | d_1 = k_1, …, d_m = k_m],

so the message to a Categorical block is ∂L/∂q_j(k) = E_q[log f | d_j = k] (weighted by the
other discrete blocks), the VMP message of a discrete variable.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.estimators.exact import elementwise_expected_log_prob, reduce_factor


def expected_log_factor(fns, factor, blocks, views, data):
    """E_q[log f] of one factor, summed over its elements."""
    if not factor.discrete:
        el = elementwise_expected_log_prob(fns, factor, blocks, views, {}, data)
        return reduce_factor(fns, factor, el, data)
    names = factor.discrete
    sizes = [len(blocks[d].support_values) for d in names]
    combos = jnp.asarray(np.array(list(itertools.product(*[range(k) for k in sizes]))))

    def one(combo):
        dvals, weight = {}, 1.0
        for j, d in enumerate(names):
            b = blocks[d]
            support = jnp.asarray(b.support_values)
            dvals[d] = jnp.full(b.value_shape, support[combo[j]], dtype=support.dtype)
            weight = weight * jnp.take(views[d].probs, combo[j], axis=-1)
        el = elementwise_expected_log_prob(fns, factor, blocks, views, dvals, data)
        return el * weight

    el = jax.vmap(one)(combos).sum(0)
    return reduce_factor(fns, factor, el, data)
