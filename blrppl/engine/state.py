"""The state a fit carries from step to step (:class:`BLRState`), what each step reports
(:class:`BLRInfo`), and the state a run starts from (:func:`start_nat`, :func:`initial_state`;
the kernel's ``init`` composes them, :mod:`blrppl.engine.kernel`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.compiler.families import init_nat
from blrppl.engine.subsample import initial_minibatch_state
from blrppl.graph.data import host_array


class BLRState(NamedTuple):
    """Carried state: natural parameters per block, step count, last ELBO, PRNG key (for
    Monte Carlo estimators and minibatches), the damping factor that backtracking applies
    to every ρ, for models with subsampled plates the
    :class:`blrppl.engine.subsample.MinibatchState` (None otherwise), and the number of
    steps accepted in a row (the damping grows back only after two).

    Inside a run's loop the state also carries each block's rule view and entropy of
    ``nat`` (``views``, ``entropies``: :func:`blrppl.engine.step.views_and_entropies`),
    which a step forms at its end and the next one reads instead of forming them again (a
    chain's view is a forward–backward pass); None elsewhere (see
    :func:`blrppl.engine.step.with_views`). A step that computes the next step's
    messages in the pass that computes its ELBO (:func:`blrppl.engine.step.one_pass_of`) also
    carries ``messages`` (:class:`Ahead`: Σ_i λ̃_ib at ``nat`` of the blocks it reads first;
    a rejected step falls back to the state it came from, with its messages); None
    elsewhere."""

    nat: dict
    step: jax.Array
    elbo: jax.Array
    rng_key: jax.Array
    damping: jax.Array
    minibatch: Any = None
    streak: Any = None
    views: Any = None
    entropies: Any = None
    messages: Any = None


class Ahead(NamedTuple):
    """The messages a step carries for the next (``BLRState.messages``,
    :func:`blrppl.engine.step.one_pass_of`).

    Attributes:
        sums: block → Σ_i λ̃_ib at the state's q.
        valid: non-Gaussian block → whether its sum is a valid natural parameter.
    """

    sums: dict
    valid: dict


class BLRInfo(NamedTuple):
    """Per-step information.

    Attributes:
        elbo: the ELBO after the step.
        valid: every block found a valid update.
        proper: block → whether the sum of its messages was itself a valid natural
            parameter (at a fixed point of the rule it equals λ, so a fit whose messages
            are invalid is not converged; for a conjugate block it means the exact
            posterior is improper, e.g. a flat prior the data do not identify). None under
            subsampling.
    """

    elbo: jax.Array
    valid: jax.Array
    proper: Any = None


def initial_state(nat, rng_key, plan=None) -> BLRState:
    """The state a run starts from (ELBO unknown: NaN); with a ``plan`` that has subsampled
    plates, also the minibatch state (``nat`` then holds every element of local blocks)."""
    dtype = jnp.result_type(float)
    minibatch = None
    if plan is not None and plan.subsampled:
        minibatch = initial_minibatch_state(plan, nat)
    # scalars built on the host (eager jnp.zeros/ones would each compile a program)
    return BLRState(
        nat=nat,
        step=host_array(0, np.int32),
        elbo=host_array(np.nan, dtype),
        rng_key=rng_key,
        damping=host_array(1.0, dtype),
        minibatch=minibatch,
        streak=host_array(0, np.int32),
    )


def start_nat(plan, values: dict, probs: dict, names=None) -> dict:
    """Block → its first natural parameters: centred on its starting value ``values[b]``
    (block space), broad; a discrete block from its responsibilities ``probs[b]``.

    Concrete values are computed on the host (numpy, then placed on the device): no XLA
    program; traced ones (the compiled fit's shapes) through ``jax.numpy``.

    Args:
        plan: the fit's :class:`blrppl.graph.plan.Plan`.
        values: block → starting value in block space (at full plate sizes; discrete
            blocks' are not read).
        probs: discrete block → responsibilities ``(*value_shape, K)``.
        names: the blocks wanted (None: every block).
    """
    blocks = plan.blocks if names is None else [plan.block(n) for n in names]
    return {b.name: jax.tree.map(host_array, init_nat(b.full, values.get(b.name), probs.get(b.name))) for b in blocks}
