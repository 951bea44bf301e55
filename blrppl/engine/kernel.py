"""The Bayesian learning rule as a kernel: ``BLRKernel(init, step)``, in the shape of
blackjax's ``SamplingAlgorithm`` and optax's ``GradientTransformation``.

``step(state) -> (state, info)`` is one step of the rule (:mod:`blrppl.engine.step`) with
the fit's data and per-block step sizes ρ bound; a step-size schedule is a function of the
step count the state carries. It is a pure function of the state, so a user's own
``jax.lax.scan`` or ``fori_loop`` can drive it under ``jax.jit``. The fit's loop
(:mod:`blrppl.engine.loop`) runs the same step, adding backtracking, the first step's line
search and the convergence tests, which the kernel leaves to its caller.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import numpyro

from blrppl.engine.state import BLRInfo, BLRState, initial_state
from blrppl.engine.step import with_views
from blrppl.errors import BLRError
from blrppl.graph.data import host_array
from blrppl.inputs import as_key


class BLRKernel(NamedTuple):
    """The rule as a pair of pure functions.

    Attributes:
        init: ``init(position=None, rng_key=None) -> BLRState``: the state a fit starts
            from. ``position`` is None (the start ``blr_fit`` takes), a dict of natural
            parameters by block (as in ``BLRState.nat``), or, when the kernel was built
            from a model, a dict of site values in their constrained space.
        step: ``step(state) -> (BLRState, BLRInfo)``: one step of the rule.
    """

    init: Callable[..., BLRState]
    step: Callable[[BLRState], tuple[BLRState, BLRInfo]]


def bind_step(step: Callable, data, rho: dict) -> Callable[[BLRState], tuple[BLRState, BLRInfo]]:
    """``state → step(state, data, rho)``: the engine's step with its data and per-block
    step sizes bound (a schedule is read from ``state.step`` inside the step)."""

    def kernel_step(state: BLRState) -> tuple[BLRState, BLRInfo]:
        return step(state, data, rho)

    return kernel_step


def fit_kernel(prepared, start_from_values: Callable | None = None) -> BLRKernel:
    """The kernel of a prepared fit (:class:`blrppl.engine.prepare.Prepared`): its compiled
    step, bound to its data and step sizes.

    Args:
        prepared: the fit, as ``blr_fit`` prepares it.
        start_from_values: site values → the state a fit starting there takes (None: the
            kernel's ``init`` accepts natural parameters only).

    Returns:
        :class:`BLRKernel`.
    """
    plan = prepared.plan
    bound = bind_step(prepared.bundle.step_fn, prepared.dyn_data, prepared.rho)
    blocks = {b.name for b in plan.blocks}
    # the state carries its views as inside the fit's loop (each step forms the next ones)
    carry_views = None if plan.subsampled else jax.jit(lambda s: with_views(plan, s))

    def init(position=None, rng_key=None) -> BLRState:
        if position is None:
            state = prepared.state
        elif isinstance(position, dict) and position and set(position) == blocks and all(
            isinstance(v, tuple) for v in position.values()
        ):
            nat = jax.tree.map(lambda x, like: host_array(x, like.dtype), position, prepared.state.nat)
            state = initial_state(nat, prepared.state.rng_key, plan)
        elif isinstance(position, dict) and start_from_values is not None:
            state = start_from_values(position)
        else:
            raise BLRError(
                "init takes None, natural parameters of every block ("
                + ", ".join(sorted(blocks))
                + ") or a dict of site values; got "
                + type(position).__name__
            )
        if rng_key is not None:
            state = state._replace(rng_key=as_key(rng_key))
        state = state._replace(views=None, entropies=None)
        return state if carry_views is None else carry_views(state)

    def step(state: BLRState) -> tuple[BLRState, BLRInfo]:
        # (as when the fit's loop is traced: the model's internal re-runs skip validation)
        with numpyro.validation_enabled(False):
            return bound(state)

    return BLRKernel(init, step)
