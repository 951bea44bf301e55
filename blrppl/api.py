"""``blr_fit``: fit a NumPyro model by the Bayesian learning rule; ``blr_kernel``: the rule
as a kernel a user's own loop steps."""

import time
import warnings
from typing import Callable

import numpy as np
import numpyro

from blrppl.engine import budget
from blrppl.engine.build import plan_model
from blrppl.engine.cache import COMPILE_LOCK
from blrppl.engine.grid import MAX_SCALES, grid_sites, grid_fit
from blrppl.engine.kernel import BLRKernel, fit_kernel
from blrppl.engine.mixture import mixture_fit
from blrppl.engine.prepare import prepare
from blrppl.engine.refine import refine as refine_fit, summary as refine_summary
from blrppl.engine.run import run
from blrppl.engine.state import BLRState
from blrppl.errors import BLRError, MeshError, MinibatchError, out_of_memory_as_error
from blrppl.graph.minibatches import BatchFeed, Minibatches, batches_note, refuse_options as refuse_minibatch_options
from blrppl.engine.processes import spans_processes
from blrppl.model.program import ModelProgram
from blrppl.inputs import (
    as_key, fit_options, host_fold_in, host_split, model_arguments, refine_options, refuse_transformation,
)
from blrppl.posterior.result import BLRResult


def plan_of(model, data=None, *, rng_key=None, **options):
    """The plan ``blr_fit(model, data, rng_key=rng_key, **options)`` fits, without compiling
    the fit: blocks, factors and estimators (``plan_of(...).describe()``)."""
    refuse_transformation("plan_of", data, rng_key)
    _refuse_minibatches("plan_of", data)
    args, kwargs = model_arguments(data)
    options = fit_options(**options)
    k_trace, k_probe, _, _ = host_split(as_key(rng_key), 4)
    with COMPILE_LOCK:
        program = ModelProgram(model)
        records, data_spec, dyn_data, _ = program.records(args, kwargs, k_trace)
        with numpyro.validation_enabled(False):
            return plan_model(program, records, data_spec, dyn_data, options, None, k_probe)[0]


def blr_fit(
    model: Callable,
    data=None,
    *,
    num_steps: int | None = None,
    learning_rate: float | Callable | None = None,
    schedule: str | None = None,
    families: dict | None = None,
    structure: str | None = None,
    point: tuple | list | None = None,
    mc_curvature: str = "auto",
    rng_key=None,
    tol: float | None = None,
    progress_bar: bool = True,
    prior: BLRResult | None = None,
    point_space: str = "unconstrained",
    iterate_average: bool = True,
    num_starts: int = 1,
    refine: bool = True,
    refine_budget: float | None = None,
    mesh=None,
) -> BLRResult:
    """Fit the latent variables of a NumPyro model by the Bayesian learning rule.

    Every latent gets a candidate posterior from an exponential family chosen by its support,
    and all are fitted by λ_b ← (1 − ρ) λ_b + ρ Σ_{i ∋ b} ∇_{μ_b} E_q[log f_i] in one jitted
    loop (stochastic BLR for models with subsampled plates). Every option is described in
    ``docs/api.md`` ("blr_fit"); in short:

    Args:
        model: a NumPyro model.
        data: its arguments: a dict of keyword arguments, a tuple of positional ones, one array, or
            a :class:`blrppl.Minibatches` (one batch a step; docs/scaling.md).
        num_steps: the most steps to run (default 1000).
        learning_rate: ρ, a float or a callable of the step number (default: per block).
        schedule: ``"sequential"`` or ``"parallel"`` (default: parallel for a plan with IVON
            blocks, a network's weights, sequential otherwise).
        families: site → family name overrides (``"grid"``: integrate a scale on a grid;
            ``("gaussian-mixture", K)``: a mixture of K diagonal Gaussians, see
            :mod:`blrppl.engine.mixture`).
        structure: ``"joint"``, ``"mean-field"`` or None (by the Gaussian latents' dimension).
        point: sites fitted by the delta method (Laplace's approximation).
        mc_curvature: the curvature estimator of Monte Carlo messages (default ``"auto"``).
        rng_key: a ``jax.random`` key, raw key data or an int seed.
        tol: relative ELBO change for convergence (default 1e-8 in float64, 1e-5 in float32).
        progress_bar: show a progress bar.
        prior: a previous fit's :class:`BLRResult` whose posterior replaces the prior (online).
        point_space: ``"unconstrained"`` (default) or ``"constrained"`` point estimates.
        iterate_average: under subsampling, report the tail average of the global latents.
        num_starts: fit from this many starting points and keep the best final ELBO.
        refine: when the fit's diagnostics say q is poor, try the remedies its advice names
            (scales on a grid, the other structure, an over-dispersed start, more starts, a Gaussian mixture) and
            keep the best (``result.refinements`` lists them; :mod:`blrppl.engine.refine`).
        refine_budget: the refinement's limit in multiples of the first fit's time, counted as
            at least 6 s (default 5; 0: no refinement).
        mesh: a ``jax.sharding.Mesh`` of one axis, or a device count n (the first n of
            ``jax.devices()``): the data are sharded along their plates over its devices and
            every step runs on all of them (docs/scaling.md). Default None: one device.

    Returns:
        :class:`blrppl.BLRResult`.

    Raises:
        TransformationError: called under ``jax.jit``, ``jax.vmap``, ``jax.grad`` (see
            :func:`blr_kernel` to drive the rule inside one's own jitted loop).
        MeshError: ``mesh=`` is not a mesh of one axis nor a count of devices there are, or
            the model has no plate to shard its data along.
        MinibatchError: ``data`` is a :class:`blrppl.Minibatches` the fit cannot read (docs/api.md).
    """
    refuse_transformation("blr_fit", data, rng_key)
    batches = data if isinstance(data, Minibatches) else None
    args, kwargs = ((), {}) if batches else model_arguments(data)
    options = fit_options(
        num_steps=num_steps,
        learning_rate=learning_rate,
        schedule=schedule,
        families=families,
        structure=structure,
        point=point,
        mc_curvature=mc_curvature,
        tol=tol,
        progress_bar=progress_bar,
        point_space=point_space,
        iterate_average=iterate_average,
        num_starts=num_starts,
        mesh=mesh,
    )
    refine, refine_budget = refine_options(refine, refine_budget)
    key, program = as_key(rng_key), ModelProgram(model)
    grid_asked = bool(grid_sites(options.families_dict))
    _check_fit_kind(options, prior, grid_asked)

    def fit(fit_opts, fit_key, init_values=None, start=0, deadline=None, design=None):
        return _fit(program, args, kwargs, fit_opts, fit_key, prior, init_values, start, deadline, design)

    with out_of_memory_as_error("the fit"):
        t0 = time.perf_counter()
        result, held = fit(options, key) if batches is None else _minibatch_fit(program, batches, options, key, prior)
        refinements = []
        # (not run: a mixture's (its own remedy), over several processes (_check_fit_kind), on batches read once)
        over_processes = options.mesh is not None and spans_processes(options.mesh)
        if refine and prior is None and not options.mixtures and not over_processes and batches is None:
            result, held, refinements = refine_fit(
                fit, result, held, options, key, time.perf_counter() - t0, refine_budget, grid_asked
            )
    result.refinements = refinements
    if refine and over_processes:
        held = [_with_tried(w, (
            "the refinement's remedies (other starts, grids, mixtures) do not run over several processes yet: "
            "fit on one process's devices to try them"
        )) for w in held]
    if refinements:
        tried = refine_summary(refinements)
        result.message += "; " + tried
        held = [_with_tried(w, tried) for w in held]
    # (the fits' warnings, held while they ran, are given at the line that called blr_fit)
    for w in held:
        warnings.warn(w.message, stacklevel=2)
    result.model_call = (program, args, kwargs) if batches is None else None  # (batches are not held)
    return result


def _check_fit_kind(options, prior, grid_asked: bool) -> None:
    """Refuse the options a mixture or a grid fit does not combine with (a ``BLRError`` naming
    the site and what was given)."""
    if options.mixtures and (grid_asked or prior is not None or options.num_starts > 1):
        raise BLRError(
            "families=('gaussian-mixture', K) works with one start, without prior= and without scales on a grid; "
            f"got {'prior=' if prior is not None else 'a grid' if grid_asked else f'num_starts={options.num_starts}'}",
            site=options.mixtures[0][0],
        )
    if options.mesh is not None and spans_processes(options.mesh) and (options.mixtures or grid_asked):
        site = options.mixtures[0][0] if options.mixtures else grid_sites(options.families_dict)[0]
        raise MeshError(
            "a mixture family or scales on a grid do not run over several processes yet (their weights read the "
            "model's density on the host, which holds this process's rows only): fit on one process's devices "
            "(mesh= of jax.local_devices()), or drop the family",
            site=site,
        )
    if grid_asked and (prior is not None or options.num_starts > 1):
        raise BLRError(
            "families='grid' (scales integrated on a grid) works with one start and without prior=; "
            f"got {'prior=' if prior is not None else f'num_starts={options.num_starts}'}",
            site=grid_sites(options.families_dict)[0],
        )


def _refuse_minibatches(entry: str, data) -> None:
    """Refuse a :class:`blrppl.Minibatches` where one data set is bound (``plan_of``, ``blr_kernel``),
    naming what takes it instead.

    Raises:
        MinibatchError: ``data`` is a :class:`blrppl.Minibatches`.
    """
    if isinstance(data, Minibatches):
        raise MinibatchError(
            f"{entry} takes one data set, not an iterable of minibatches (it would take a batch from it): fit the "
            "iterable with blr_fit or BLR.run, or step BLR.update over it after BLR.init(key, Minibatches(...))"
        )


def _minibatch_fit(program, batches: Minibatches, options, key, prior):
    """The fit of a model on the minibatches of an iterable, one per step, each read ahead on
    a host thread (:mod:`blrppl.graph.minibatches`), its warnings held: ``(result, held
    warnings)``. The model is compiled for the first batch (step 0's). No refinement (its
    candidate fits would need the batches again), and no deterministic sites or latents
    integrated out in ``result.sample`` (they need the model run on data the iterator no
    longer holds).

    Raises:
        MinibatchError: an option that needs several fits or the data at once (``num_starts``,
            grids, mixtures, ``mesh=``), or a model or batch the iterator cannot feed.
    """
    refuse_minibatch_options(options, bool(grid_sites(options.families_dict)))
    args, kwargs = batches.first()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = prepare(program, args, kwargs, options, key, prior, minibatch=True)
        feed = BatchFeed.of_fit(batches, (args, kwargs), prepared)
        result = run(
            prepared, prepared.state, options.num_steps, options.progress_bar, grid_scales=MAX_SCALES, feed=feed
        )
    result.deterministic_sites = prepared.bundle.tracer.meta.get("deterministic")
    result.message += f"; {batches_note(batches)}"
    return result, caught


def _with_tried(w, tried: str):
    """A held warning, with what the refinement tried appended when it is the poor-q one."""
    text = str(w.message)
    if "q may be a poor approximation" not in text:
        return w
    w.message = type(w.message)(text + "; " + tried)
    return w


def _fit(program, args, kwargs, options, key, prior, init_values=None, start=0, deadline=None, design=None):
    """One fit as ``blr_fit`` runs it (scales on a grid, or the best of ``options.num_starts``
    starts from ``start`` on), its warnings held: ``(result, held warnings)``; ``deadline`` and
    ``design``: a grid's (:func:`blrppl.engine.grid.grid_fit`); a single fit checks ``deadline``
    too (:mod:`blrppl.engine.budget`)."""
    with warnings.catch_warnings(record=True) as caught, budget.deadline(deadline):
        warnings.simplefilter("always")
        if options.mixtures:
            return mixture_fit(program, args, kwargs, options, key), caught
        scales = grid_sites(options.families_dict)
        if scales:
            return grid_fit(program, args, kwargs, options, key, scales, deadline, design), caught
        best, finals = None, []
        for index in range(start, start + options.num_starts):
            start_key = key if index == start else host_fold_in(key, index)
            prepared = prepare(program, args, kwargs, options, start_key, prior, init_values=init_values, start=index)
            budget.check("after its compilation")
            # with several starts, each start's warnings (a poor q, a stop) are held back and only
            # the kept start's reach the user
            with warnings.catch_warnings(record=True) as start_caught:
                warnings.simplefilter("always")
                result = run(prepared, prepared.state, options.num_steps, options.progress_bar, grid_scales=MAX_SCALES)
            final = float(result.elbo[-1]) if len(result.elbo) else -np.inf
            finals.append(final)
            if best is None or (np.isfinite(final) and not final <= finals[best[0]]):
                best = (len(finals) - 1, result, start_caught)
        index, result, start_held = best
        caught.extend(start_held)
        result.deterministic_sites = prepared.bundle.tracer.meta.get("deterministic")
        if options.num_starts > 1:
            listed = ", ".join(f"{e:.6g}" for e in finals)
            result.message += f"; best of {options.num_starts} starts (start {index}; final ELBOs {listed})"
        return result, caught


def blr_kernel(model: Callable, data=None, *, rng_key=None, prior: BLRResult | None = None, **options) -> tuple[BLRKernel, BLRState]:
    """The Bayesian learning rule of a model as a kernel: ``(kernel, state)`` with
    ``kernel.step(state) -> (state, info)`` one step of the rule, a pure function of the
    state (the data and step sizes are bound), for a user's own ``jax.lax.scan`` or
    ``fori_loop`` under ``jax.jit``.

    The model is compiled as ``blr_fit`` compiles it (and the compiled fit is shared with
    ``blr_fit`` through its cache), and ``state`` is the start ``blr_fit`` would take. The
    kernel's step is the rule alone: ``blr_fit``'s backtracking, first-step line search and
    convergence tests are its caller's to add (``info.elbo``, ``info.valid``).

    Args:
        model: a NumPyro model.
        data: its arguments: a dict of keyword arguments, a tuple of positional ones, or one array.
        rng_key: a ``jax.random`` key, raw key data or an int seed.
        prior: a previous fit's :class:`BLRResult` whose posterior replaces the prior (online).
        **options: ``blr_fit``'s options of the rule (``learning_rate``, ``schedule``,
            ``families``, ``structure``, ``point``, ``mc_curvature``, ``point_space``).

    Returns:
        ``(kernel, state)``: a :class:`blrppl.engine.kernel.BLRKernel` (``init``, ``step``,
        and the ``plan`` and :class:`blrppl.engine.kernel.KernelData` they were built from:
        ``blrppl.engine.kernel.init(kernel.plan, kernel.data, key)`` is the pure start) and
        its first :class:`blrppl.engine.state.BLRState` (natural parameters by block in
        ``state.nat``); see ``docs/api.md`` ("blr_kernel").

    Raises:
        BLRError: an option of the fit's loop, not of the rule (``families='grid'``,
            ``num_starts`` > 1).
        TransformationError: called under a JAX transformation (the kernel is made outside,
            its ``step`` called inside).
    """
    refuse_transformation("blr_kernel", data, rng_key)
    _refuse_minibatches("blr_kernel", data)
    args, kwargs = model_arguments(data)
    options = fit_options(**options)
    if grid_sites(options.families_dict) or options.num_starts > 1 or options.mixtures:
        raise BLRError(
            "blr_kernel steps the rule of one start: families='grid', families=('gaussian-mixture', K) and "
            "num_starts > 1 are options of blr_fit"
        )
    if options.mesh is not None:
        raise MeshError(
            "blr_kernel's step runs on one device: mesh= is an option of blr_fit and BLR (or shard the "
            "state and data yourself around kernel.step under jax.jit)"
        )
    key, program = as_key(rng_key), ModelProgram(model)
    with out_of_memory_as_error("the kernel's compilation"):
        prepared = prepare(program, args, kwargs, options, key, prior)

    def start_from_values(values):
        # (a start of the user's values: prepared again, from the compiled fit's cache)
        return prepare(program, args, kwargs, options, key, prior, init_values=values).state

    kernel = fit_kernel(prepared, start_from_values)
    return kernel, kernel.init()
