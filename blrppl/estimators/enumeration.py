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
from blrppl.expressions import group_moments


def expected_log_factors(fns, factors, blocks, views, data):
    """Σ_i E_q[log f_i] over ``factors``, each summed over its elements.

    Factors sharing the same discrete neighbours are evaluated together: one run of the
    model per enumerated assignment.
    """
    if not factors:
        return 0.0
    wrappers = fns.factor_wrappers([f.name for f in factors], data)
    groups: dict = {}
    for f in factors:
        groups.setdefault(f.discrete, []).append(f)
    total = 0.0
    for names, group in groups.items():
        if not names:
            moments = group_moments(fns, group, blocks, views, {}, data)
            els = {
                f.name: elementwise_expected_log_prob(f, moments[f.name], wrappers[f.name][0])
                for f in group
            }
        else:
            sizes = [len(blocks[d].support_values) for d in names]
            combos = jnp.asarray(np.array(list(itertools.product(*[range(k) for k in sizes]))))

            def one(combo, names=names, group=group):
                dvals, weight = {}, 1.0
                for j, d in enumerate(names):
                    b = blocks[d]
                    support = jnp.asarray(b.support_values)
                    dvals[d] = jnp.full(b.value_shape, support[combo[j]], dtype=support.dtype)
                    weight = weight * jnp.take(views[d].probs, combo[j], axis=-1)
                moments = group_moments(fns, group, blocks, views, dvals, data)
                return {
                    f.name: elementwise_expected_log_prob(f, moments[f.name], wrappers[f.name][0]) * weight
                    for f in group
                }

            els = jax.tree.map(lambda x: x.sum(0), jax.vmap(one)(combos))
        for f in group:
            total = total + reduce_factor(els[f.name], wrappers[f.name][1])
    return total
