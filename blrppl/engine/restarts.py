"""Fresh starts again from a narrower q: a start from which no step keeps the ELBO finite
(a quadrature's outer nodes overflowing at unit variances), or whose Monte Carlo ELBO diverged
(a power law's messages overflowing at unit variances), is run again with its Gaussian blocks'
precisions scaled up (:func:`narrowed`).
"""

from __future__ import annotations


import jax
import numpy as np

from blrppl.engine.state import BLRState
from blrppl.graph.data import host_array


#: a fresh start that takes no step is started again with its Gaussian blocks' variances this
#: many times smaller, at most :data:`NARROWED_STARTS` times
NARROWING = 100.0


NARROWED_STARTS = 3


def narrowed(plan, state: BLRState, factor: float = NARROWING) -> BLRState:
    """``state`` with the precision of every Gaussian block (not point blocks) ``factor``
    times larger and the same means (their natural parameters, S m and the parts of −S/2,
    all scaled by ``factor``), and its ELBO unknown."""
    nat = dict(state.nat)
    for b in plan.blocks:
        if b.family.gaussian and not b.point and b.name in nat:
            nat[b.name] = jax.tree.map(lambda x: host_array(np.asarray(x) * factor, np.asarray(x).dtype), nat[b.name])
    return state._replace(nat=nat, elbo=host_array(np.nan, np.asarray(state.elbo).dtype))
