"""The Bayesian learning rule as a kernel, in the shape of blackjax's ``SamplingAlgorithm``
and optax's ``GradientTransformation``: a pure ``init(plan, data, key) -> BLRState`` and a
``step(state) -> (BLRState, BLRInfo)``, held together by :class:`BLRKernel`.

``init`` builds the first state from the plan, the :class:`KernelData` a start reads that is
not in the plan (the blocks' starting values, an online fit's previous posterior) and a key:
on the host, without running the model or compiling anything. ``step`` is one step of the
rule (:mod:`blrppl.engine.step`) with the fit's data and per-block step sizes ρ bound; a
step-size schedule is a function of the step count the state carries. It is a pure function
of the state, so a user's own ``jax.lax.scan`` or ``fori_loop`` can drive it under
``jax.jit``. The fit's loop (:mod:`blrppl.engine.loop`) runs the same step, adding
backtracking, the first step's line search and the convergence tests, and a fit with
enumerated latents starts from the E-step start above ``init``
(:func:`blrppl.engine.prepare.prepare`, :mod:`blrppl.engine.start`): both are the fit's,
which the kernel leaves to its caller.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import numpyro

from blrppl.compiler.online import online_blocks
from blrppl.engine.state import BLRInfo, BLRState, initial_state, start_nat
from blrppl.errors import BLRError, InitValueError, TransformationError
from blrppl.graph.data import host_array
from blrppl.graph.plan import Plan
from blrppl.inputs import as_key, host_split


class KernelData(NamedTuple):
    """What the kernel reads that is not in the plan (``kernel.data`` of
    :func:`blrppl.blr_kernel`).

    Attributes:
        values: block → its starting value in the block's space (unconstrained for a
            Gaussian block on a transformed site, its members' values joined for a joint
            block, every element of a local block of a subsampled plate): the model's
            initial values, or the user's ``init_values``. Discrete blocks' values are
            not read (they start from random responsibilities).
        given: the blocks a value given by the user starts (kept where they are: the
            blocks a product multiplies are otherwise moved off its saddle).
        previous: online fits (``prior=``): block → the previous posterior's natural
            parameters, which are both the start and the prior of that block; None
            otherwise.
        run: what ``step`` reads: the model's array data (with an online fit's previous
            posterior and the plan's data statistics). ``init`` does not read it.
    """

    values: dict
    given: frozenset = frozenset()
    previous: dict | None = None
    run: Any = None


def init(plan: Plan, data: KernelData, key) -> BLRState:
    """The first state of a fit: pure, on the host (no run of the model, no XLA program).

    Each continuous block's natural parameters are centred on its starting value and broad;
    the blocks a product of two blocks multiplies (``w * x``) start off its saddle, by a
    standard normal draw in block space (unless ``data.given`` holds them); discrete blocks
    start from Dirichlet(1) responsibilities; an online fit's blocks start at the previous
    posterior. The key is split as :func:`blrppl.blr_fit` splits its ``rng_key`` (its third
    part seeds the draws, its fourth is the state's key), so ``init`` with ``blr_fit``'s key
    gives the state that fit starts from (before the E-step start of enumerated latents,
    which is the fit's, see :func:`blrppl.engine.prepare.prepare`).

    Args:
        plan: the fit's :class:`blrppl.graph.plan.Plan` (``kernel.plan``, or
            :func:`blrppl.plan_of` with the same model, data and options).
        data: the :class:`KernelData` of the fit (``kernel.data``).
        key: a ``jax.random`` key, raw key data or an int seed.

    Returns:
        :class:`blrppl.engine.state.BLRState` (without the views a run's loop carries: the
        step forms them).

    Raises:
        BLRError: ``plan`` is not a plan, ``data`` not a :class:`KernelData` of its blocks,
            ``key`` not a key; ``InitValueError`` when a starting value has another shape
            than its block or is not finite; ``TransformationError`` when called with traced
            values (under ``jax.jit``).
    """
    return start(plan, data, key)[0]


def start(plan: Plan, data: KernelData, key) -> tuple[BLRState, np.random.Generator]:
    """:func:`init`'s state, and the host generator its draws advanced (a fit's E-step start
    continues it for its k-means++ seeds: one stream of draws per key)."""
    _check_data(plan, data)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((key, data.values, data.previous))):
        raise TransformationError(
            "init builds the first state on the host (its draws are numpy's, from the key) and cannot "
            "take traced values: call it outside jax.jit, jax.vmap or lax.scan with a concrete key, and "
            "step the state it returns inside (kernel.step)"
        )
    if key is None:
        raise BLRError("init needs a key: jax.random.key(0), jax.random.PRNGKey(0) or an int seed")
    _, _, k_host, k_loop = host_split(as_key(key, "key"), 4)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(k_host)).ravel())
    values = dict(data.values)  # (the caller's dict is not changed)
    # blocks multiplied by others (``w * x``) start off the symmetric saddle where all their
    # means are zero (a fixed point of the coordinate steps), as the discrete blocks start
    # from random responsibilities; a value the user gave is kept
    for n in sorted(product_blocks(plan)):
        if n not in data.given:
            x = np.asarray(values[n])
            values[n] = x + rng.normal(size=x.shape).astype(x.dtype)
    probs = {
        b.name: rng.dirichlet(np.ones(len(b.support_values)), size=b.full.value_shape)
        for b in plan.blocks
        if b.discrete
    }
    nat = start_nat(plan, values, probs)
    previous = data.previous or {}
    _check_previous(plan, previous, nat)
    return initial_state({**nat, **previous}, k_loop, plan), rng


def product_blocks(plan: Plan) -> set:
    """The blocks some factor multiplies by another block (its ``pairs``)."""
    return {n for f in plan.factors for _, pairs in f.spec.pairs for pair in pairs for n in pair}


def _check_data(plan, data) -> None:
    """Raise a :class:`BLRError` naming what in ``plan`` and ``data`` cannot start a fit."""
    if not isinstance(plan, Plan):
        raise BLRError(f"init takes the fit's Plan (kernel.plan or blrppl.plan_of), not {type(plan).__name__}")
    if not isinstance(data, KernelData):
        raise BLRError(f"init takes the KernelData of the fit (kernel.data of blr_kernel), not {type(data).__name__}")
    names = {b.name for b in plan.blocks}
    values = data.values if isinstance(data.values, dict) else {}
    missing, extra = sorted(names - set(values)), sorted(set(values) - names)
    if missing or extra:
        raise BLRError(
            "init: the data's starting values do not match the plan's blocks"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; not in the plan: {', '.join(extra)}" if extra else "")
            + " (pass the kernel.data made with this plan)"
        )
    for b in plan.blocks:
        if b.discrete:
            continue
        site = b.sites[0] if len(b.sites) == 1 else None
        value = np.asarray(values[b.name])
        if value.shape != tuple(b.full.value_shape):
            raise InitValueError(
                f"init: the starting value of block {b.name!r} has shape {value.shape}, the block's "
                f"values have shape {tuple(b.full.value_shape)}",
                site=site,
            )
        if not np.issubdtype(value.dtype, np.number) or not np.all(np.isfinite(value)):
            raise InitValueError(f"init: the starting value of block {b.name!r} is not finite", site=site)
    unknown = sorted(set(data.given) - names)
    if unknown:
        raise BLRError(f"init: data.given names blocks not in the plan: {', '.join(unknown)}")


def _check_previous(plan, previous, nat) -> None:
    """Raise a :class:`BLRError` unless ``previous`` holds natural parameters of the layout
    of ``nat`` for exactly the plan's online blocks."""
    online = set(online_blocks(plan))
    if set(previous) != online:
        raise BLRError(
            "init: data.previous must hold the previous posterior of the plan's online blocks ("
            + (", ".join(sorted(online)) or "none")
            + "), not of "
            + (", ".join(sorted(previous)) or "none")
        )
    for n, prev in previous.items():
        want = nat[n]
        same = jax.tree.structure(prev) == jax.tree.structure(want) and all(
            np.shape(a) == np.shape(b) for a, b in zip(jax.tree.leaves(prev), jax.tree.leaves(want))
        )
        if not same:
            raise BLRError(f"init: data.previous[{n!r}] does not have the layout of block {n!r}'s natural parameters")


class BLRKernel(NamedTuple):
    """The rule as a pair of pure functions, with the plan and data they were built from.

    Attributes:
        init: ``init(position=None, rng_key=None) -> BLRState``: the state a fit starts
            from. ``position`` is None (the start ``blr_fit`` takes), a :class:`KernelData`
            (``kernel.data``: the pure :func:`init` of ``kernel.plan``, from ``rng_key`` or
            else the fit's key), a dict of natural parameters by block (as in
            ``BLRState.nat``), or, when the kernel was built from a model, a dict of site
            values in their constrained space.
        step: ``step(state) -> (BLRState, BLRInfo)``: one step of the rule.
        plan: the :class:`blrppl.graph.plan.Plan` the step was built from (None: not given).
        data: the fit's :class:`KernelData` (None: not given).
    """

    init: Callable[..., BLRState]
    step: Callable[[BLRState], tuple[BLRState, BLRInfo]]
    plan: Plan | None = None
    data: KernelData | None = None


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
            kernel's ``init`` accepts natural parameters and :class:`KernelData` only).

    Returns:
        :class:`BLRKernel`.
    """
    plan, data = prepared.plan, prepared.kernel_data
    bound = bind_step(prepared.bundle.step_fn, prepared.dyn_data, prepared.rho)
    blocks = {b.name for b in plan.blocks}
    # the state carries its views (and the messages its step reads first) as inside the fit's loop
    # (each step forms the next ones)
    carry = prepared.bundle.carry_fn
    # (the data an argument of the program, not a constant folded into it)
    carry_views = None if carry is None else jax.jit(carry)

    def kernel_init(position=None, rng_key=None) -> BLRState:
        if position is None:
            state = prepared.state
        elif isinstance(position, KernelData):
            state = init(plan, position, prepared.rng_key if rng_key is None else rng_key)
            rng_key = None  # (init's key: its draws and the state's key come from it)
        elif isinstance(position, dict) and position and set(position) == blocks and all(
            isinstance(v, tuple) for v in position.values()
        ):
            nat = jax.tree.map(lambda x, like: host_array(x, like.dtype), position, prepared.state.nat)
            state = initial_state(nat, prepared.state.rng_key, plan)
        elif isinstance(position, dict) and start_from_values is not None:
            state = start_from_values(position)
        else:
            raise BLRError(
                "init takes None, the fit's KernelData (kernel.data), natural parameters of every block ("
                + ", ".join(sorted(blocks))
                + ") or a dict of site values; got "
                + type(position).__name__
            )
        if rng_key is not None:
            state = state._replace(rng_key=as_key(rng_key))
        state = state._replace(views=None, entropies=None, messages=None)
        return state if carry_views is None else carry_views(state, prepared.dyn_data)

    def step(state: BLRState) -> tuple[BLRState, BLRInfo]:
        # (as when the fit's loop is traced: the model's internal re-runs skip validation)
        with numpyro.validation_enabled(False):
            return bound(state)

    return BLRKernel(kernel_init, step, plan, data)
