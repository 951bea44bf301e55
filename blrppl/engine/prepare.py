"""Preparing a fit: trace the model, fetch its compiled fit from the cache or compile it,
read what its start needs off the trace (:class:`blrppl.engine.kernel.KernelData`: starting
values, an online fit's previous posterior, the run data), build its first state with the
kernel's pure ``init`` (:mod:`blrppl.engine.kernel`), then, for enumerated latents, the
fit's E-step start above it (:mod:`blrppl.engine.start`), and the step sizes.

:func:`blrppl.api.blr_fit` and :class:`blrppl.svi.BLR` both fit through :func:`prepare`
and :func:`blrppl.engine.run.run`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro

from blrppl.engine import build, cache
from blrppl.engine import start as start_mod
from blrppl.engine.build import CHUNK_SIZE, MONTE_CARLO_RHO, CompiledFit, Compiling
from blrppl.engine.cache import COMPILE_LOCK, cache_key, data_digest, support_signature
from blrppl.engine.kernel import KernelData, start as kernel_start
from blrppl.engine.loop import empty_history
from blrppl.engine.sharding import check_plated, sharded_chunk
from blrppl.engine.state import BLRState, start_nat
from blrppl.errors import BLRError, InitValueError, MinibatchError
from blrppl.estimators.registry import estimator_of
from blrppl.compiler.blocks import block_init_values as _block_init_values
from blrppl.compiler.pipeline import reverse_only_error
from blrppl.graph import host_rows
from blrppl.graph.data import DataSpec, host_array
from blrppl.runtime.collection import fewer_full_collections
from blrppl.runtime.counting import background_compilations, xla_compilations
from blrppl.graph.derivatives import is_no_reverse_error, is_reverse_only_error, reverse_only_mode
from blrppl.model.checks import check_plate_sizes
from blrppl.model.trace import model_runs, subsampled_plates
from blrppl.inputs import FitOptions, host_split
from blrppl.posterior.online import previous_nat, previous_spec
from blrppl.posterior.result import CompileCounts


@dataclasses.dataclass
class Prepared:
    """A fit ready to run: the compiled bundle, the data it runs on and its first state."""

    bundle: CompiledFit
    plan: Any
    records: dict
    data_spec: DataSpec
    dyn_data: tuple
    state: BLRState
    rho: dict
    tol: float
    chunk_size: int
    start_time: float
    iterate_average: bool = True
    compile_counts: CompileCounts | None = None
    num_starts: int = 1
    #: what the kernel's ``init`` read to build ``state`` (before an E-step start)
    kernel_data: KernelData | None = None
    #: the key ``state`` was built from (``init``'s)
    rng_key: Any = None
    #: the chunk run over a device mesh (``mesh=``, :mod:`blrppl.engine.sharding`); None: the
    #: compiled fit's own
    chunk: Any = None

    @property
    def run_chunk(self):
        """The chunk the fit's loop runs: over the mesh, or the compiled fit's own."""
        return self.bundle.chunk if self.chunk is None else self.chunk

    def history(self):
        """An empty ring buffer of recent ELBOs for the convergence tests."""
        return empty_history(self.bundle.window)


def prepare(
    program, args, kwargs, options: FitOptions, rng_key, prior=None, init_values=None, start=0, minibatch=False
) -> Prepared:
    """Trace and compile (or fetch from the cache) a model and build its first state.

    ``program`` is the model's :class:`blrppl.model.program.ModelProgram`, the engine's only
    handle on it (every run of the model goes through it);
    ``args``/``kwargs`` are the model's arguments after :func:`blrppl.inputs.model_arguments`,
    ``options`` the checked :class:`blrppl.inputs.FitOptions` and ``rng_key`` a typed key;
    ``init_values`` optionally maps sites to starting values in their constrained space;
    ``start`` numbers the starting point of fits with enumerated latents (0: an E-step
    under the prior; others: k-means++ seeds, see :mod:`blrppl.engine.start`);
    ``minibatch``: the arguments are one minibatch of a :class:`blrppl.Minibatches` (the
    subsampled plates' data are not checked against the plates' sizes, and the model never
    runs at them).
    Tracing and compilation hold :data:`COMPILE_LOCK` (numpyro's effect handlers keep a
    process-wide stack, so two models cannot be traced at once).
    """
    with COMPILE_LOCK, fewer_full_collections():
        return _prepare_locked(program, args, kwargs, options, rng_key, prior, init_values, start, minibatch)


def _prepare_locked(program, args, kwargs, options, rng_key, prior, init_values, start, minibatch=False) -> Prepared:
    """:func:`prepare` while holding :data:`COMPILE_LOCK`."""
    t0 = time.perf_counter()
    runs0, compilations0, background0 = model_runs(), xla_compilations(), background_compilations()
    # (the key's other two parts are init's: blrppl.engine.kernel.init splits it alike)
    k_trace, k_probe, _, _ = host_split(rng_key, 4)
    prior_spec = None if prior is None else previous_spec(prior)
    bundle, key, records, data_spec, dyn_data, init_records = _fetch_or_compile(
        program, args, kwargs, options, k_trace, k_probe, prior_spec, minibatch
    )
    plan = bundle.plan
    block_values, given = _start_values(plan, init_records, init_values)
    prior_nat = {}
    if bundle.online:  # the previous posterior is run-time data, and the starting point
        prior_nat = previous_nat(prior, bundle.online, _online_layout(plan, bundle.online, block_values))
    dyn_data = bundle.run_data(dyn_data, prior_nat)
    data = KernelData(block_values, given, prior_nat or None, dyn_data)
    # the first state is the kernel's (one code path); the E-step start below is the fit's
    state, rng = kernel_start(plan, data, rng_key)
    rho = _initial_rho(plan, options.learning_rate)
    if isinstance(bundle.chunk, Compiling):
        try:
            bundle.chunk = bundle.chunk.wait()
        except Exception:
            cache.forget(key)  # a compilation that failed is not kept: the next fit retries
            raise
    if any(b.discrete for b in plan.blocks) and not plan.subsampled:
        state = _discrete_start(bundle, plan, init_records, state, dyn_data, start, rng, options.tol)
    sharded = None if options.mesh is None else sharded_chunk(bundle, options.mesh, records)
    jax.block_until_ready(state)
    counts = CompileCounts(
        model_runs() - runs0, xla_compilations() - compilations0, background_compilations() - background0
    )
    return Prepared(
        bundle, plan, records, data_spec, dyn_data, state, rho, options.tol, CHUNK_SIZE, t0, options.iterate_average,
        counts, options.num_starts, data, rng_key, sharded,
    )


def _fetch_or_compile(program, args, kwargs, options, k_trace, k_probe, prior_spec, minibatch=False) -> tuple:
    """Trace the model and fetch its compiled fit from the cache, or compile it:
    ``(bundle, cache key, records, data spec, array data, records to initialise from)``
    (the last at full plate sizes for a model with subsampled plates)."""
    # one trace of the model's program (cheap: no compilation) gives its fingerprint; a
    # compiled fit is reused only for the same program, data layout and options
    host_rows.activate((args, kwargs))  # (the rows this fit's steps read ahead, if any)
    tracer = program.trace(args, kwargs, k_trace)
    dyn_now = DataSpec.split(args, kwargs, all_static=tracer.spec.all_static)[1]
    key = cache_key(program, tracer, dyn_now, options, prior_spec)
    bundle = cache.lookup(key)
    if bundle is not None and getattr(bundle, "data_digest", None) not in (None, data_digest(dyn_now)):
        # (a fit whose structure was probed on the data, a hidden Markov chain, is compiled
        # again for other data: an index array or a layout may read the chain differently)
        bundle = None
    records, data_spec, dyn_data, tracer = program.records(
        args, kwargs, k_trace, tracer=bundle.tracer if bundle else tracer
    )
    if bundle is not None and not bundle.ties_hold(dyn_data):
        # (rows the compiled data gave one precision do not share it in this data: a mask
        # that differs; the plan is made again, with those rows' own covariances)
        bundle = None
    if options.mesh is not None:
        check_plated(records, options.mesh)  # (before compiling a fit it would refuse)
    plates = subsampled_plates(records)
    init_records = records
    if minibatch:
        _check_minibatch(records, plates, tracer.spec.all_static)
        plates = ()  # (a minibatch's rows are not the plates': the model never runs at their full sizes)
    if plates:
        check_plate_sizes(plates, args, kwargs, records)
    if plates and host_rows.in_data((args, kwargs)) and not _local_latents(records, plates):
        # (data read from the host a minibatch at a time are never read whole: a model whose
        # latents are all global starts from the same values at the minibatch's size)
        plates = ()
    if plates:
        # every observed value is checked and every element of a local latent initialised
        # from one run of the model at the full plate sizes
        full_tracer = bundle.full_tracer if bundle else None
        init_records, _, _, full_tracer = program.at_full_size(plates).records(
            args, kwargs, k_trace, tracer=full_tracer
        )
    supports = support_signature(records)
    if bundle is not None and bundle.supports != supports:
        # a latent's support computed from the data changed: its bijection is compiled in
        bundle = None
        records, data_spec, dyn_data, tracer = program.records(args, kwargs, k_trace, tracer=tracer)
    if bundle is None:
        bundle = _compile_checked(program, records, data_spec, dyn_data, tracer, options, prior_spec, k_probe, supports)
        bundle.supports = supports
        bundle.data_digest = data_digest(dyn_now) if any(b.chain for b in bundle.plan.blocks) else None
        if key is not None:
            cache.remember(key, bundle)
    if plates:
        bundle.full_tracer = full_tracer
    return bundle, key, records, data_spec, dyn_data, init_records


def _check_minibatch(records, plates, all_static: bool) -> None:
    """Refuse a model that minibatches of a :class:`blrppl.Minibatches` cannot feed: no
    subsampled plate, latents inside one (their elements would need the batch's row
    numbers), or data used as concrete values (compiled into the fit).

    Raises:
        MinibatchError: naming the plate or site, and what to do instead.
    """
    if not plates:
        raise MinibatchError(
            "Minibatches feeds a subsampled plate a minibatch at a time, and the model has none: declare the data's "
            "plate as numpyro.plate('n', N, subsample_size=M) with N the whole data set's size and M a batch's"
        )
    names = {p.name for p in plates}
    local = [r.name for r in records.values() if not r.observed and any(p.name in names for p in r.plates)]
    if local:
        raise MinibatchError(
            "a latent inside a subsampled plate needs the rows' numbers in the data set, which an iterator's "
            "batches do not carry: pass the data as arrays (blr_fit(model, (X, y)), or HostRows for data on "
            "disk) and index them with the plate's indices",
            site=local[0],
        )
    if all_static:
        raise MinibatchError(
            "this model uses its data as concrete values (len(set(x)), a boolean mask, int() or `if` on them), so "
            "its compiled fit holds each batch as constants: compute those values outside the model and pass "
            "them as arguments, or pass the data as arrays"
        )


def _local_latents(records, plates) -> bool:
    """Whether a latent sits in one of the subsampled ``plates``."""
    names = {p.name for p in plates}
    return any(not r.observed and any(p.name in names for p in r.plates) for r in records.values())


def _compile_checked(program, records, data_spec, dyn_data, tracer, options, prior_spec, k_probe, supports):
    """:func:`compile_fit`, again with reverse-over-reverse second derivatives for a function
    with a custom reverse-mode rule only (``jax.custom_vjp``)."""
    # the model was run with validation before; its many internal re-runs skip it (each
    # check of a constant argument would otherwise compile on its own)
    with numpyro.validation_enabled(False):
        try:
            return build.compile_fit(program, records, data_spec, dyn_data, tracer, options, prior_spec, k_probe, supports)
        except TypeError as exc:
            if not is_reverse_only_error(exc):
                raise
        try:
            with reverse_only_mode():
                return build.compile_fit(program, records, data_spec, dyn_data, tracer, options, prior_spec, k_probe, supports)
        except (TypeError, ValueError) as again:
            if not (is_reverse_only_error(again) or is_no_reverse_error(again)):
                raise
            raise reverse_only_error(program, data_spec, dyn_data, records) from None


def _start_values(plan, init_records, init_values) -> tuple[dict, frozenset]:
    """``(block → its starting value (unconstrained), the blocks the user's values start)``:
    the model's initial values, or the user's ``init_values`` (checked). (The blocks a
    product multiplies are moved off the symmetric saddle by the kernel's ``init``,
    :func:`blrppl.engine.kernel.product_blocks`.)"""
    site_values = {n: np.asarray(init_records[n].init_value) for b in plan.blocks for n in b.sites}
    unconstrained = {
        n: init_records[n].unconstrained_init
        for n in site_values
        if init_records[n].unconstrained_init is not None and n not in (init_values or {})
    }
    for name, value in (init_values or {}).items():
        if name in plan.barren:
            continue  # integrated out: drawn given the others, never fitted
        if name not in site_values:
            raise BLRError(f"init value given for '{name}', which is not a latent site", site=name)
        site_values[name] = _checked_init_value(init_records[name], value)
    block_values = _block_init_values({b.name: b.full for b in plan.blocks}, site_values, unconstrained)
    given = set(init_values or {})
    return block_values, frozenset(b.name for b in plan.blocks if set(b.sites) & given)


def _online_layout(plan, online, block_values) -> dict:
    """The layout of the online blocks' first natural parameters (what the previous
    posterior is checked against, :func:`blrppl.posterior.online.previous_nat`)."""
    probs = {
        n: np.full(tuple(plan.block(n).full.value_shape) + (len(plan.block(n).support_values),), 1.0)
        for n in online
        if plan.block(n).discrete
    }
    return start_nat(plan, block_values, probs, online)


def _initial_rho(plan, learning_rate) -> dict:
    """Block → its constant step size ρ (the run-time argument of the compiled step)."""
    dtype = jnp.result_type(float)
    if plan.subsampled:
        # local blocks take ρ = 1 and global ones the schedule inside the step (times a
        # constant user ρ); conjugacy detection would need exact ρ = 1 steps: not run
        base = 1.0 if learning_rate is None or callable(learning_rate) else float(learning_rate)
        return {n: host_array(base, dtype) for n in plan.order}
    if learning_rate is None:
        sampled = {n for f in plan.factors if estimator_of(f).decaying_steps for n in f.neighbours}
        return {n: host_array(MONTE_CARLO_RHO if n in sampled else 1.0, dtype) for n in plan.order}
    if callable(learning_rate):
        return {n: host_array(1.0, dtype) for n in plan.order}
    return {n: host_array(float(learning_rate), dtype) for n in plan.order}


def _checked_init_value(record, value):
    """A user's starting value of a latent site, as an array of the site's shape.

    Raises:
        InitValueError: the value is not numeric, not finite, of another shape or outside
            the site's support (which would start the fit from NaN natural parameters).
    """
    name, shape = record.name, record.value_shape
    try:
        arr = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise InitValueError(f"init value must be numeric, not {type(value).__name__}", site=name) from None
    try:
        arr = np.broadcast_to(arr, shape)
    except ValueError:
        raise InitValueError(f"init value has shape {arr.shape}, the site's values have shape {shape}", site=name) from None
    if not np.all(np.isfinite(arr)):
        raise InitValueError(f"init value is not finite ({_some(arr[~np.isfinite(arr)])})", site=name)
    try:
        inside = np.asarray(record.support(arr))
    except Exception:  # (a support with parameters it cannot check here)
        inside = np.ones((), bool)
    if not np.all(inside):
        outside = arr if inside.shape != arr.shape else arr[~inside]
        raise InitValueError(
            f"init value {_some(outside)} is outside the site's support ({record.support}); give a value "
            "inside it (e.g. a positive scale)",
            site=name,
        )
    return jnp.asarray(arr, jnp.result_type(float))


def _some(values) -> str:
    """A few of ``values``, for a message."""
    flat = np.ravel(values)
    shown = ", ".join(f"{v:g}" for v in flat[:3])
    return shown + (", ..." if flat.size > 3 else "")


def _discrete_start(bundle, plan, records, state, data, start, rng, tol):
    """The starting state of a fit with enumerated latents (see :mod:`blrppl.engine.start`):
    start 0 takes an E-step under the prior means unless it leaves two values of a
    discrete block tied; other starts, and tied ones, start from k-means++ responsibilities."""
    history = empty_history(bundle.window)
    if start == 0:
        after = start_mod.estep_first(bundle.chunk, plan, state, data, history, tol)
        probs = start_mod.discrete_probs(plan, after.nat)
        if not any(start_mod.tied(p) for p in probs.values()):
            return after
    seeded = start_mod.seeded_probs(plan, records, rng)
    return state._replace(nat={**state.nat, **start_nat(plan, {}, seeded, seeded)})
