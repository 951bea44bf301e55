"""The compiled fit: a model's plan, its jitted chunk of steps and its exports, compiled once
per (model program, data layout, options) and cached; preparing a fit (trace, compile or
reuse, initial state) and running it to a :class:`blrppl.result.BLRResult`.

:func:`blrppl.api.blr_fit` and :class:`blrppl.svi.BLR` both fit through :func:`prepare`
and :func:`run`. XLA compilations run on worker threads (:data:`_COMPILER`): XLA releases
the GIL, so a fit's programs compile while its setup runs.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import math
import threading
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro

from blrppl.engine.loop import BAD_RATE, CONVERGED, NONFINITE, STATIONARY, STATIONARY_STEPS, empty_history, history_size, make_chunk, run_loop
from blrppl.engine import start as start_mod
from blrppl.engine.step import BLRState, initial_state, make_step, with_views
from blrppl import families as fam
from blrppl.errors import BLRError, InitValueError, is_out_of_memory, out_of_memory_detail
from blrppl.graph.compile import (
    MC_JOINT_MAX_DIM, _block_init_values, compile_model, conjugate_blocks, init_nat, reverse_only_error,
    rows_share_precision,
)
from blrppl.graph.derivatives import is_no_reverse_error, is_reverse_only_error, reverse_only_mode
from blrppl.graph.plan import FactorRole
from blrppl.estimators import bilinear, gram
from blrppl.expressions import table_key
from blrppl.graph.deps import output_dependencies
from blrppl.graph.stack import stack_table
from blrppl.diagnostics import ESS_CLOSE, ESS_POOR, KHAT_WARN, Diagnostics, make_log_weights, psis_khat, relative_ess
from blrppl.graph.data import DataSpec, RunData, split_run_data
from blrppl.graph.data import host_array
from blrppl.runtime.compile import SMALL_DATA, compiler_options as _compiler_options, jit as _jit
from blrppl.runtime.counting import background_compilations, xla_compilations
from blrppl.runtime.program_store import compile_program, fit_program_key, jit as store_jit, program_key
from blrppl.engine.subsample import averaged_nat, svi_rate
from blrppl.graph.trace import (
    check_plate_sizes, full_size_model, model_runs, subsampled_plates, trace_model, trace_program,
)
from blrppl.inputs import FitOptions, host_fold_in, host_split
from blrppl.online import online_plan, previous_nat, previous_spec
from blrppl.export import posterior_builder
from blrppl.result import BLRResult, CompileCounts

#: default initial ρ of blocks with Monte Carlo messages (then decaying); other blocks start
#: at ρ = 1 (exact coordinate steps for conjugate blocks, Newton-like natural-gradient
#: steps for the others), backtracking on the exact ELBO when a step does not improve it
MONTE_CARLO_RHO = 0.5
#: window of the windowed-mean convergence test when the ELBO is a Monte Carlo estimate
MC_WINDOW = 25
#: steps per compiled chunk (the progress bar updates between chunks); fixed, so that fits
#: with different ``num_steps`` share one compiled chunk
CHUNK_SIZE = 100


@dataclasses.dataclass
class CompiledFit:
    """Everything built once per (model, data shapes, options) and reused across fits."""

    tracer: Any
    plan: Any
    graph: Any
    init_fn: Callable
    chunk: Callable
    posterior_fn: Callable
    window: int = 0
    chunk_fn: Callable | None = None  # the chunk before compilation (traceable inside a user's jit)
    elbo_fn: Callable | None = None  # jitted ELBO(nat, data, key)
    #: online fits: the blocks whose prior is the previous posterior (run-time data)
    online: tuple = ()
    #: for models with subsampled plates: the tracer of the model at full plate sizes
    full_tracer: Any = None
    #: the latents' support parameters the bijections were compiled with
    supports: tuple = ()
    #: data → the precomputed statistics of the plan's ``gram_block`` factors (None: none)
    statistics_fn: Callable | None = None
    _statistics_compiled: Any = None
    _last_statistics: Any = None  # (data, its statistics): the last data set's
    #: data → the tables of the plan's stacked factors (:mod:`blrppl.graph.stack`; None: none)
    tables_fn: Callable | None = None

    #: (nat, model data, key) → importance log-weights of q (None: not computed for this plan)
    log_weights_fn: Callable | None = None
    _log_weights_compiled: Any = None
    #: :func:`_dense_work` of the plan (the diagnostics' program compiles optimised from the
    #: same measure as the chunk)
    dense_work: int = 0
    #: the fit's key in the program store (None: its programs are not stored), see
    #: :func:`_stored_fit_key`
    stored_key: str | None = None

    def _stored(self, name: str, options) -> str | None:
        return fit_program_key(self.stored_key, name, options)

    def compile_log_weights(self, nat, dyn, key) -> None:
        """Start compiling :meth:`log_weights` for arguments of these shapes (on a worker
        thread: the fit runs meanwhile), or load it from the program store."""
        options = _compiler_options(dyn, None, self.dense_work, once=True)
        with numpyro.validation_enabled(False):
            self._log_weights_compiled = compile_program(
                self._stored("log_weights", options),
                store_jit(self.log_weights_fn, "log_weights").lower,
                (nat, dyn, key),
                options,
                _COMPILER.submit,
                background=True,
            )

    def log_weights(self, nat, dyn, key):
        """The importance log-weights of q (:mod:`blrppl.diagnostics`): one compiled call."""
        if self._log_weights_compiled is None:
            self.compile_log_weights(nat, dyn, key)
        return self._log_weights_compiled.result()(nat, dyn, key)

    def statistics(self, dyn) -> dict:
        """The data statistics of the plan's ``gram_block`` factors: one compiled call (XLA's
        backend optimisations off: matrix products, as fast without), traced inside a
        user's ``jit``. On a CPU the Gram matrices AᵀA are then formed by the host's BLAS
        (a symmetric rank-k update: half the work of XLA's general product)."""
        if self._last_statistics is not None and self._last_statistics[0] is dyn:
            return self._last_statistics[1]  # (checked by ties_hold, then read by run_data)
        tables = self.tables_fn(dyn) if self.tables_fn is not None else {}
        if self.statistics_fn is None:
            return tables
        data = RunData(dyn, {}, tables) if tables else dyn  # (stacked factors read their tables)
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(data)):
            return {**self.statistics_fn(data), **tables}
        host = jax.default_backend() == "cpu"
        if self._statistics_compiled is None:
            options = _compiler_options(dyn, 0)
            self._statistics_compiled = compile_program(
                self._stored(f"statistics rows={host}", options),
                store_jit(functools.partial(self.statistics_fn, rows=host), "statistics").lower,
                (data,),
                options,
            )
        stats = self._statistics_compiled(data)
        if host:
            stats = {k: gram.gram_on_host(v) if isinstance(v, gram.GramStatistics) else v for k, v in stats.items()}
        self._last_statistics = (dyn, {**stats, **tables})
        return self._last_statistics[1]

    def ties_hold(self, dyn) -> bool:
        """Whether the rows of the plan's tied blocks (:class:`blrppl.families.GaussianTied`)
        still share one precision on this data (a mask may differ from the data the plan
        was compiled on; statistics that read no data cannot change)."""
        return not self.plan.tied or bool(rows_share_precision(self.plan.tied, self.statistics(dyn)))

    def run_data(self, dyn, previous=None):
        """What the compiled chunk reads: the model's array data, and the previous
        posterior (online fits) and data statistics when the plan has them."""
        stats = self.statistics(dyn)
        self._last_statistics = None  # (the data is not held past its fit's start)
        if not (previous or stats):
            return dyn
        return RunData(dyn, dict(previous or {}), stats)


#: held while a model is traced and compiled, and while posteriors are exported (numpyro's
#: effect handlers live on one process-wide stack: two threads must not run models at once)
COMPILE_LOCK = threading.RLock()

#: worker threads for XLA compilations (which release the GIL): a fit's programs compile
#: while the next one is traced, or while the fit runs
_COMPILER = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="blrppl-compile")

#: compiled fits, most recent last
_CACHE: "collections.OrderedDict" = collections.OrderedDict()
CACHE_SIZE = 16


def _program_parts(tracer, dyn, options, prior_spec) -> tuple | None:
    """What a compiled fit depends on besides the model function: the fingerprint of its
    traced program (its code path and every value it closes over), the data's structure,
    static values and array shapes, the options, the previous fit's block layout (online
    fits) and the float precision; None when the model needed concrete data (the compiled
    fit then holds this data)."""
    spec = tracer.spec
    if spec.all_static:
        return None
    shapes = tuple((jnp.shape(x), jnp.result_type(x)) for x in dyn)
    return (
        tracer.fingerprint, spec.treedef, spec.static, shapes, options.compiled(), prior_spec, jnp.result_type(float)
    )


def _cache_key(model, tracer, dyn, options, prior_spec):
    """Hashable key of the compiled-fit cache in memory (the model and
    :func:`_program_parts`), or None if something is unhashable (then nothing is cached)."""
    parts = _program_parts(tracer, dyn, options, prior_spec)
    if parts is None:
        return None
    key = (model, *parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _data_digest(dyn) -> str:
    """A digest of the values of the model's array data."""
    h = hashlib.blake2b(digest_size=16)
    for x in dyn:
        x = np.asarray(x)
        h.update(f"{x.dtype}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def _stored_fit_key(tracer, dyn, options, prior_spec, supports, plan) -> str | None:
    """The key of a compiled fit's programs in the program store
    (:mod:`blrppl.runtime.program_store`): :func:`_program_parts`, the sites' static facts
    (names, distributions, event dims, plates, supports, ``infer``), the latents' support
    values and the plan; None when the fit is not stored."""
    parts = _program_parts(tracer, dyn, options, prior_spec)
    if parts is None:
        return None
    return program_key(parts, tracer.meta.get("sites"), supports, plan.describe(), plan.structure_digest())


def _statistics_fns(plan, fns, data) -> tuple:
    """``(statistics, constant)``: data → the statistics of the plan's ``gram_block`` and
    ``gram_pair`` factors that read the data (computed once per data set, see
    :meth:`CompiledFit.statistics`), and → those of the factors that read none (a Gaussian
    prior's: constants); None for none."""
    gram_factors = [f for f in plan.factors if f.from_statistics]
    if not gram_factors:
        return None, None
    blocks = {b.name: b for b in plan.blocks}

    def of(factors):
        def statistics(data, rows=False):
            return {
                f.name: gram.statistics(fns, f, blocks[f.gram_block], data, rows=rows) if f.gram_block
                else bilinear.statistics(fns, f, blocks, data)
                for f in factors
            }

        return statistics

    reads = output_dependencies(lambda d: of(gram_factors)(d["data"]), {"data": data})
    constant = [f for f in gram_factors if not any(jax.tree.leaves(reads[f.name], is_leaf=lambda x: isinstance(x, frozenset)))]
    varying = [f for f in gram_factors if f not in constant]
    return (of(varying) if varying else None), (of(constant) if constant else None)


def _with_statistics(fn, constant):
    """``fn(x, data, *rest)`` reading, besides ``data``'s statistics, those ``constant``
    computes from it."""

    def with_statistics(x, data, *rest):
        model, previous, statistics = split_run_data(data)
        return fn(x, RunData(model, previous, {**statistics, **constant(data)}), *rest)

    return with_statistics


def _elementwise_work(plan, records) -> int:
    """The number of factor elements a step evaluates one by one (factors with precomputed
    statistics excluded): the measure of the data a compiled step works through."""
    return sum(
        int(np.prod(records[n].value_shape)) if n in records else 0
        for f in plan.factors
        if not f.from_statistics
        for n in (f.members or (f.name,))
    )


#: at most this many label states counted per factor by :func:`_dense_work`
_MAX_COUNTED_STATES = 1024


def _dense_work(plan, records) -> int:
    """The arithmetic a step spends on each factor element beyond reading it, summed:
    elements × (event size × enumerated label states + Σ over products of two Gaussian
    blocks of their element sizes' product), and for each hidden Markov chain its states ×
    K² × :data:`_CHAIN_WORK`. A mixture of N points in D dimensions with K
    labels counts N·D·D·K, ``X @ C.T`` with D latent dimensions N·M·D²: the measure by which
    small data still gets optimised code (:func:`blrppl.runtime.compile.compiler_options`)."""
    blocks = {b.name: b for b in plan.blocks}
    total = 0
    for f in plan.factors:
        # (a product read from statistics, ``gram_pair``, still counts: its rows' second
        # moments are D² per row and pair of rows, and optimised code runs them 2-4x faster)
        if f.gram_block:
            continue
        states = 1
        for d in f.discrete:
            values = blocks[d].support_values if d in blocks else None
            states = min(states * max(len(values or ()), 1), _MAX_COUNTED_STATES)
        pairs = sum(blocks[a].element_size * blocks[b].element_size for _, ps in f.pairs for a, b in ps)
        for n in f.members or (f.name,):
            if n not in records:
                continue
            shape = records[n].value_shape
            event = int(np.prod(shape[len(shape) - records[n].event_ndim :])) if records[n].event_ndim else 1
            total += int(np.prod(shape)) * (event * states + pairs)
    for b in plan.blocks:
        if b.chain:
            # forward–backward: K² work per state, twice per sweep, in loops of one state per
            # iteration, whose few small operations run ~3× slower unoptimised (K = 5 HMM,
            # T = 1,000: 11.9 → 3.4 ms per step at level 1, for 1.1 s more compiling)
            k = len(b.support_values)
            total += b.size * k * k * _CHAIN_WORK
    return total


#: :func:`_dense_work` of one state of a hidden Markov chain per K² (from T = 1,000 at K = 5
#: on, a chain's fit compiles optimised)
_CHAIN_WORK = 8


def _step_work(plan, dense_work: int) -> int:
    """The :func:`_dense_work` by which a fit's loop is compiled: at least
    :data:`SMALL_DATA` (optimised code) for a plan with a Wishart block, whose step is many
    small matrix kernels (Cholesky factors and triangular solves per matrix, log-determinants
    and digammas, D × D quadratic forms per point and label) that unoptimised code runs 4-5×
    slower: BayesPy's small mixture (K = 10, N = 200, D = 2) 0.38 → 0.08 ms per step, for
    0.7 s more compiling on its first fit (a stored program costs nothing the next time).
    The diagnostics' program, run once per fit, keeps the plain measure."""
    if any(isinstance(b.family, fam.Wishart) for b in plan.blocks):
        return max(dense_work, SMALL_DATA)
    return dense_work


def _support_signature(records) -> tuple:
    """The values of every latent's support parameters (those computed from the data differ
    between data sets of the same shape; a compiled fit holds the bijections they give)."""
    out = []
    for name, r in records.items():
        if r.observed:
            continue
        for x in jax.tree.leaves(r.support):
            arr = np.asarray(x)
            out.append((name, arr.shape, arr.tobytes()))
    return tuple(out)


def _remember(key, bundle):
    _CACHE[key] = bundle
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)


def plan_model(model, records, data_spec, dyn_data, options, prior_spec, k_probe):
    """The plan of a traced model (blocks, factors, estimators, conjugacy) and what
    :func:`compile_model` builds with it."""
    plan, fns, dyn_data, init_values, graph = compile_model(
        model,
        records,
        data_spec,
        dyn_data,
        families=options.families_dict,
        rng_key=k_probe,
        structure=options.structure,
        point=options.point,
        point_space=options.point_space,
        subsampled=subsampled_plates(records),
    )
    online = ()
    if prior_spec is not None:
        plan, graph, online = online_plan(plan, graph, records, prior_spec)
    plan = dataclasses.replace(plan, conjugate=conjugate_blocks(plan))
    return plan, fns, dyn_data, init_values, graph, online


def _compile(model, records, data_spec, dyn_data, tracer, options, prior_spec, k_probe, supports=()):
    """Compile a model: plan, initialisation, the jitted chunk of steps, posterior export."""
    rate_fn, chunk_size, curvature = options.rate_fn, CHUNK_SIZE, options.mc_curvature
    default_rate = options.learning_rate is None
    plan, fns, dyn_data, init_values, graph, online = plan_model(
        model, records, data_spec, dyn_data, options, prior_spec, k_probe
    )
    # (the latents integrated out have no block, no factor, no term of log p in the diagnostics)
    records = {n: r for n, r in records.items() if n not in plan.barren}
    blocks = {b.name: b.full for b in plan.blocks}
    # the programs run at every step evaluate the model's scans as maps (the plan is made)
    fns = fns.vectorised()

    def init_fn(values, probs):
        # on the host for concrete values (numpy, then placed on the device): no XLA program
        # before the first step but the trace run's and the chunk's
        nat = {n: init_nat(b, values[n], probs.get(n)) for n, b in blocks.items()}
        return jax.tree.map(host_array, nat)

    sampled = [f for f in plan.factors if f.estimator == "monte_carlo"]
    decay = {n for f in sampled for n in f.neighbours} if default_rate else set()
    window = MC_WINDOW if sampled else 0
    epoch = 0
    if plan.subsampled:
        # windows of whole epochs (the longest plate's), at least MC_WINDOW steps
        epoch = max(p.steps_per_epoch for p in plan.subsampled)
        window = epoch * -(-MC_WINDOW // epoch)
    step, elbo_fn, _ = make_step(
        plan,
        fns,
        options.schedule,
        rate_fn,
        decay_blocks=decay,
        curvature=curvature,
        global_rate=svi_rate if default_rate else None,
    )
    tables_fn, tables = None, {}
    if fns.stacks:
        # (evaluated op by op, never compiled: see blrppl.graph.stack)
        tables_fn = functools.partial(fns.stack_tables, compute=stack_table)
        tables = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tables_fn(dyn_data))
    stats_data = RunData(dyn_data, {}, tables) if tables else dyn_data  # (stacked factors read their tables)
    statistics_fn, constant = _statistics_fns(plan, fns, stats_data)
    if constant is not None:
        # statistics that read no data are computed inside the programs (XLA folds them):
        # no program of their own to compile before the first step
        step, elbo_fn = _with_statistics(step, constant), _with_statistics(elbo_fn, constant)
    exact_block = _one_exact_block(plan)
    chunk = make_chunk(
        step, chunk_size, window, epoch, rate_fn, () if plan.subsampled else tuple(plan.order),
        elbo_fn=None if plan.subsampled else elbo_fn, exact_block=exact_block,
        views_fn=None if plan.subsampled else functools.partial(with_views, plan),
        first_search=_first_search(plan, window, default_rate),
    )
    init_shapes = {
        n: jax.ShapeDtypeStruct(blocks[n].value_shape, jnp.result_type(v)) if blocks[n].local else v
        for n, v in init_values.items()
    }
    dtype = jnp.result_type(float)
    state = jax.eval_shape(
        lambda v, p: initial_state(init_fn(v, p), jax.random.key(0), plan),
        init_shapes,
        {b.name: np.ones(b.value_shape + (len(b.support_values),)) for b in blocks.values() if b.discrete},
    )
    rho = {n: jax.ShapeDtypeStruct((), dtype) for n in plan.order}
    steps = jax.ShapeDtypeStruct((), jnp.int32)
    history = jax.ShapeDtypeStruct((history_size(window),), dtype)
    stats = dict(tables)
    if statistics_fn is not None:
        stats.update(jax.eval_shape(statistics_fn, stats_data))
    previous = {n: state.nat[n] for n in online}
    run_data = RunData(dyn_data, previous, stats) if (online or stats) else dyn_data
    # a program stored on disk by an earlier process running this fit is loaded, not traced
    fit_key = _stored_fit_key(tracer, dyn_data, options, prior_spec, supports, plan)
    # XLA compiles outside the GIL: the chunk compiles on a worker thread while the
    # diagnostics' program is traced here, then both compile at once
    dense_work = _dense_work(plan, records)
    chunk_options = _compiler_options(dyn_data, _elementwise_work(plan, records), _step_work(plan, dense_work))
    chunk_future = compile_program(
        fit_program_key(fit_key, "chunk", chunk_options),
        store_jit(chunk, "chunk").lower,
        (state, run_data, steps, rho, history, jax.ShapeDtypeStruct((), dtype)),
        chunk_options,
        _COMPILER.submit,
    )
    log_weights_fn = None if plan.subsampled or online else make_log_weights(plan, fns, records, dyn_data)
    posterior_fn = posterior_builder(plan, records, _COMPILER.submit)
    bundle = CompiledFit(
        tracer, plan, graph, init_fn, None, posterior_fn, window,
        chunk_fn=chunk, elbo_fn=_jit(elbo_fn), online=online, statistics_fn=statistics_fn,
        log_weights_fn=log_weights_fn, tables_fn=tables_fn, stored_key=fit_key, dense_work=dense_work,
    )
    if log_weights_fn is not None and not (len(plan.blocks) == 1 and exact_block is not None):
        # (a lone conjugate block needs no draws, see _diagnose)
        bundle.compile_log_weights(state.nat, _model_data(plan, run_data), state.rng_key)
    if not plan.subsampled:  # (subsampled plans export their local blocks at full size)
        posterior_fn.prepare(state.nat, fit_key)
    # (the fit's setup, e.g. its data statistics, runs while the chunk compiles)
    bundle.chunk = _Compiling(chunk_future)
    return bundle


class _Compiling:
    """A compiled function still compiling on a worker thread: calls wait for it."""

    def __init__(self, future):
        self.future = future

    def wait(self):
        """The compiled function (once its compilation has finished)."""
        return self.future.result()

    def __call__(self, *args):
        return self.future.result()(*args)


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

    def history(self):
        """An empty ring buffer of recent ELBOs for the convergence tests."""
        return empty_history(self.bundle.window)


def prepare(model, args, kwargs, options: FitOptions, rng_key, prior=None, init_values=None, start=0) -> Prepared:
    """Trace and compile (or fetch from the cache) a model and build its first state.

    ``args``/``kwargs`` are the model's arguments after :func:`blrppl.inputs.model_arguments`,
    ``options`` the checked :class:`blrppl.inputs.FitOptions` and ``rng_key`` a typed key;
    ``init_values`` optionally maps sites to starting values in their constrained space;
    ``start`` numbers the starting point of fits with enumerated latents (0: an E-step
    under the prior; others: k-means++ seeds, see :mod:`blrppl.engine.start`).
    Tracing and compilation hold :data:`COMPILE_LOCK` (numpyro's effect handlers keep a
    process-wide stack, so two models cannot be traced at once).
    """
    with COMPILE_LOCK:
        return _prepare_locked(model, args, kwargs, options, rng_key, prior, init_values, start)


def _prepare_locked(model, args, kwargs, options, rng_key, prior, init_values, start) -> Prepared:
    t0 = time.perf_counter()
    runs0, compilations0, background0 = model_runs(), xla_compilations(), background_compilations()
    k_trace, k_probe, k_host, k_loop = host_split(rng_key, 4)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(k_host)).ravel())
    learning_rate, tol = options.learning_rate, options.tol
    prior_spec = None if prior is None else previous_spec(prior)

    # one trace of the model's program (cheap: no compilation) gives its fingerprint; a
    # compiled fit is reused only for the same program, data layout and options
    tracer = trace_program(model, args, kwargs, k_trace)
    dyn_now = DataSpec.split(args, kwargs, all_static=tracer.spec.all_static)[1]
    key = _cache_key(model, tracer, dyn_now, options, prior_spec)
    bundle = _CACHE.get(key) if key is not None else None
    if bundle is not None and getattr(bundle, "data_digest", None) not in (None, _data_digest(dyn_now)):
        # (a fit whose structure was probed on the data, a hidden Markov chain, is compiled
        # again for other data: an index array or a layout may read the chain differently)
        bundle = None
    records, data_spec, dyn_data, tracer = trace_model(
        model, args, kwargs, k_trace, tracer=bundle.tracer if bundle else tracer
    )
    if bundle is not None and not bundle.ties_hold(dyn_data):
        # (rows the compiled data gave one precision do not share it in this data: a mask
        # that differs; the plan is made again, with those rows' own covariances)
        bundle = None
    plates = subsampled_plates(records)
    init_records = records
    if plates:
        # every observed value is checked and every element of a local latent initialised
        # from one run of the model at the full plate sizes
        check_plate_sizes(plates, args, kwargs, records)
        full_tracer = bundle.full_tracer if bundle else None
        init_records, _, _, full_tracer = trace_model(
            full_size_model(model, plates), args, kwargs, k_trace, tracer=full_tracer
        )
    supports = _support_signature(records)
    if bundle is not None and bundle.supports != supports:
        # a latent's support computed from the data changed: its bijection is compiled in
        bundle = None
        records, data_spec, dyn_data, tracer = trace_model(model, args, kwargs, k_trace, tracer=tracer)
    if bundle is None:
        # the model was run with validation above; its many internal re-runs skip it (each
        # check of a constant argument would otherwise compile on its own)
        with numpyro.validation_enabled(False):
            try:
                bundle = _compile(model, records, data_spec, dyn_data, tracer, options, prior_spec, k_probe, supports)
            except TypeError as exc:
                if not is_reverse_only_error(exc):
                    raise
                # (a function with a custom reverse-mode rule only, jax.custom_vjp: compiled
                # again with reverse-over-reverse second derivatives)
                try:
                    with reverse_only_mode():
                        bundle = _compile(
                            model, records, data_spec, dyn_data, tracer, options, prior_spec, k_probe, supports
                        )
                except (TypeError, ValueError) as again:
                    if not (is_reverse_only_error(again) or is_no_reverse_error(again)):
                        raise
                    raise reverse_only_error(model, data_spec, dyn_data, records) from None
        bundle.supports = supports
        bundle.data_digest = _data_digest(dyn_now) if any(b.chain for b in bundle.plan.blocks) else None
        if key is not None:
            _remember(key, bundle)
    if plates:
        bundle.full_tracer = full_tracer
    plan = bundle.plan
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
    # blocks multiplied by others (``w * x``) start off the symmetric saddle where all their
    # means are zero (a fixed point of the coordinate steps), as the discrete blocks start
    # from random responsibilities; a value the user gave is kept
    given = set(init_values or {})
    for n in sorted({n for f in plan.factors for _, pairs in f.pairs for pair in pairs for n in pair}):
        if not set(plan.block(n).sites) & given:
            x = np.asarray(block_values[n])
            block_values[n] = x + rng.normal(size=x.shape).astype(x.dtype)
    probs0 = {
        b.name: rng.dirichlet(np.ones(len(b.support_values)), size=b.full.value_shape)
        for b in plan.blocks
        if b.discrete
    }
    nat0 = bundle.init_fn(block_values, probs0)
    prior_nat = {}
    if bundle.online:  # the previous posterior is run-time data, and the starting point
        prior_nat = previous_nat(prior, bundle.online, nat0)
        nat0 = {**nat0, **prior_nat}
    dyn_data = bundle.run_data(dyn_data, prior_nat)
    dtype = jnp.result_type(float)
    state = initial_state(nat0, k_loop, plan)
    if plan.subsampled:
        # local blocks take ρ = 1 and global ones the schedule inside the step (times a
        # constant user ρ); conjugacy detection would need exact ρ = 1 steps: not run
        base = 1.0 if learning_rate is None or callable(learning_rate) else float(learning_rate)
        rho = {n: host_array(base, dtype) for n in plan.order}
    elif learning_rate is None:
        sampled = {n for f in plan.factors if f.estimator == "monte_carlo" for n in f.neighbours}
        rho = {n: host_array(MONTE_CARLO_RHO if n in sampled else 1.0, dtype) for n in plan.order}
    elif callable(learning_rate):
        rho = {n: host_array(1.0, dtype) for n in plan.order}
    else:
        rho = {n: host_array(float(learning_rate), dtype) for n in plan.order}
    if isinstance(bundle.chunk, _Compiling):
        try:
            bundle.chunk = bundle.chunk.wait()
        except Exception:
            _CACHE.pop(key, None)  # a compilation that failed is not kept: the next fit retries
            raise
    if any(b.discrete for b in plan.blocks) and not plan.subsampled:
        state = _discrete_start(bundle, plan, init_records, state, dyn_data, start, rng, block_values, tol)
    jax.block_until_ready(state)
    counts = CompileCounts(
        model_runs() - runs0, xla_compilations() - compilations0, background_compilations() - background0
    )
    return Prepared(
        bundle, plan, records, data_spec, dyn_data, state, rho, tol, CHUNK_SIZE, t0, options.iterate_average, counts,
        options.num_starts,
    )


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


def _discrete_start(bundle, plan, records, state, data, start, rng, block_values, tol):
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
    nat = bundle.init_fn(block_values, seeded)
    return state._replace(nat={**state.nat, **{n: nat[n] for n in seeded}})


def _first_search(plan, window: int, default_rate: bool) -> bool:
    """Whether the first step is a line search over ρ (:mod:`blrppl.engine.loop`): exact
    ELBOs, the default step sizes, and a block whose messages depend on its own q (a
    conjugate block's step at ρ = 1 is its exact update given the others)."""
    conjugate = dict(plan.conjugate)
    return (
        default_rate and not window and not plan.subsampled
        and any(not conjugate.get(b.name, False) and not b.point for b in plan.blocks)
    )


def _one_exact_block(plan) -> str | None:
    """The plan's only updated block when it is conjugate and not a point block (one step at
    ρ = 1 is then its exact posterior), else None."""
    if plan.subsampled or len(plan.order) != 1:
        return None
    (name,) = plan.order
    return name if dict(plan.conjugate).get(name) and not plan.block(name).point else None


def _stop_message(outcome, plan, window: int, tol: float, num_steps: int) -> str:
    if outcome.stop == CONVERGED and plan.subsampled:
        message = (
            f"converged after {outcome.num_steps} steps (minibatch ELBO: the mean over the last "
            f"{window} steps, whole epochs, changed by less than {tol:g} relative to the "
            f"{window} before)"
        )
    elif outcome.stop == CONVERGED and window:
        message = (
            f"converged after {outcome.num_steps} steps (Monte Carlo ELBO: the mean over the "
            f"last {window} steps no longer improves on the {window} before)"
        )
    elif outcome.stop == CONVERGED and _one_exact_block(plan) and outcome.num_steps == 1:
        message = (
            "converged after 1 step (the model's only block is conjugate: one step with ρ = 1 is "
            "its exact posterior)"
        )
    elif outcome.stop == CONVERGED:
        message = f"converged after {outcome.num_steps} steps (relative ELBO change below {tol:g})"
    elif outcome.stop == STATIONARY:
        message = (
            f"converged after {outcome.num_steps} steps (the ELBO moved by less than {tol:g} relative "
            f"over the last {STATIONARY_STEPS} accepted steps; some natural parameters still move by "
            f"more than {math.sqrt(tol):.1g}, along directions the ELBO hardly sees)"
        )
    elif outcome.stop == NONFINITE:
        message = (
            f"stopped after {outcome.num_steps} steps: no step size found that keeps the ELBO "
            "and the natural parameters finite (and, for exact ELBOs, does not lower it); check "
            "the data for NaN or infinite values and the priors for expectations that do not "
            "exist" + _zero_probability_hint(outcome, plan, ", and whether") + "; the last valid state is returned"
        )
    elif outcome.stop == BAD_RATE:
        message = (
            f"stopped after {outcome.num_steps} steps: learning_rate(step) gave a step size that "
            "is not a finite number ≥ 0 for the next step; the last valid state is returned"
        )
    else:
        message = f"reached num_steps={num_steps} without meeting the convergence test"
        if _never_finite(outcome):
            message += (
                " (no step had a finite ELBO: check the data for NaN or infinite values and the priors for "
                "expectations that do not exist" + _zero_probability_hint(outcome, plan, "; check whether") + ")"
            )
        if plan.subsampled:
            epochs = outcome.num_steps / max(p.steps_per_epoch for p in plan.subsampled)
            message += (
                f" ({epochs:g} epochs of minibatches; the minibatch noise of the global "
                "blocks shrinks with more steps)"
            )
    improper = _improper_blocks(outcome, plan)
    if improper:
        message += "; " + _improper_note(plan, outcome.state.nat, improper)
    if outcome.invalid_steps:
        message += (
            f"; in {outcome.invalid_steps} step(s) a block found no valid update and kept its "
            "parameters"
        )
    return message


#: a fit's last ELBO this many times its best's magnitude below the best: it diverged
DIVERGED_FALL = 10.0


def divergence_note(elbo) -> str | None:
    """The note for a fit whose ELBO fell far below its best and stayed there (its last
    value below best − :data:`DIVERGED_FALL` · max(|best|, 100)), else None. A Monte Carlo
    step is taken whenever its ELBO is finite, so a fit can drift away step by step (a poor
    start whose steps overshoot: −2·10⁸ at the first step, −2·10³⁸ at the 35th); the state
    returned is the last step's."""
    elbo = np.asarray(elbo, float)
    finite = np.flatnonzero(np.isfinite(elbo))
    if finite.size < 2 or not np.isfinite(elbo[-1]):
        return None
    best = int(finite[np.argmax(elbo[finite])])
    if elbo[-1] >= elbo[best] - DIVERGED_FALL * max(abs(elbo[best]), 100.0):
        return None
    return (
        f"the fit diverged: its ELBO fell from {elbo[best]:.3g} (step {best + 1}) to {elbo[-1]:.3g} (step "
        f"{elbo.size}), and q is the last step's; try mc_curvature='reparam', a smaller learning_rate, or "
        "another rng_key"
    )


def _never_finite(outcome) -> bool:
    """Whether the fit took steps and none had a finite ELBO."""
    elbo = np.asarray(outcome.elbo)
    return bool(elbo.size) and not np.any(np.isfinite(elbo))


def _zero_probability_hint(outcome, plan, lead: str) -> str:
    """When no step had a finite ELBO and the plan has enumerated latents: the likely cause
    (a value of one that the model gives probability 0 given the data, which q, giving every
    value some probability, makes E_q[log p] = -inf) and the fix; else ''."""
    discrete = [b.name for b in plan.blocks if b.discrete]
    if not discrete or not _never_finite(outcome):
        return ""
    listed = ", ".join(f"'{n}'" for n in discrete)
    return (
        f"{lead} the model gives some value of the enumerated latents ({listed}) probability 0 given the "
        "data (a count observed as Poisson(z * rate) with z = 0, a Bernoulli probability of exactly 0 or 1 "
        "picked by a discrete latent): q gives every value some probability, so its expected log-density "
        "is -inf; marginalise that latent in the model (dist.ZeroInflatedPoisson, dist.MixtureGeneral) or "
        "keep such probabilities inside (0, 1)"
    )


def _model_data(plan, run_data):
    """What the model functions read of a fit's run-time data: the model's data, and the
    tables of the plan's stacked factors when it has some."""
    model, _, statistics = split_run_data(run_data)
    stacked = {table_key(f.name): statistics[table_key(f.name)] for f in plan.factors if f.members}
    return RunData(model, {}, stacked) if stacked else model


def _diagnose(prepared, outcome, nat) -> Diagnostics:
    """The fit's :class:`blrppl.diagnostics.Diagnostics`: PSIS k̂ of q from one compiled call,
    and what the ELBO trace says."""
    bundle, plan = prepared.bundle, prepared.plan
    elbo = np.asarray(outcome.elbo, dtype=float)
    finite = elbo.size >= 2 and bool(np.all(np.isfinite(elbo[-2:])))
    change = float(abs(elbo[-1] - elbo[-2]) / max(1.0, abs(elbo[-1]))) if finite else math.nan
    last = elbo[-bundle.window :] if bundle.window else elbo[:0]
    # (a window with a non-finite ELBO has no noise to measure: NaN, without numpy's
    # warning about ∞ − ∞)
    noise = (float(np.std(last)) if np.all(np.isfinite(last)) else math.nan) if last.size else 0.0
    base = dict(elbo_rel_change=change, rejected_steps=int(outcome.rejected_steps), elbo_noise=noise)
    if bundle.log_weights_fn is None:
        why = "subsampled plates" if plan.subsampled else "online fit (prior=)"
        return Diagnostics(khat=math.nan, num_draws=0, note=f"not computed: {why}", **base)
    if outcome.stop == CONVERGED and len(plan.blocks) == 1 and _one_exact_block(plan):
        # the model's only latent block is conjugate: its closed-form step is the exact
        # posterior, whose importance weights are all equal (k̂ = −∞) without drawing any
        return Diagnostics(khat=-math.inf, num_draws=0, note="one conjugate block in closed form: no draws needed", **base)
    key = host_fold_in(outcome.state.rng_key, 7)
    try:
        log_weights = np.asarray(bundle.log_weights(nat, _model_data(plan, prepared.dyn_data), key))
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        # (the fit is done; only its check cannot run: the result is returned without it)
        note = (
            "not computed: the model's log density at q's draws needs more memory than this machine has "
            f"({out_of_memory_detail(exc)})"
        )
        warnings.warn(f"blr_fit: PSIS k-hat {note}; q's quality is unchecked", UserWarning, stacklevel=5)
        return Diagnostics(khat=math.nan, num_draws=0, note=note, **base)
    return Diagnostics(
        khat=psis_khat(log_weights), num_draws=int(log_weights.size), ess=relative_ess(log_weights), **base
    )


def _improper_blocks(outcome, plan) -> tuple:
    """Blocks whose exact posterior is improper: every factor of the block has a closed form
    (so its messages do not depend on its own q: they sum to the exact conditional
    posterior's natural parameter) and at the last step that sum was not a valid natural
    parameter. (Other blocks with invalid messages were merely not at a fixed point.)"""
    if outcome.converged or not np.any(np.isfinite(np.asarray(outcome.elbo))):
        # (no step ever had a finite ELBO: the data, not the priors, are the likely cause,
        # and the stop message says so)
        return ()
    return tuple(
        n for n in outcome.improper if all(f.estimator == "exact" for f in plan.factors_of(n))
    )


def _improper_note(plan, nat, names) -> str:
    """Which latents an improper (or not yet valid) posterior is about: for a Gaussian block,
    the sites that the direction of its smallest precision eigenvalue moves."""
    sites = []
    for n in names:
        b = plan.block(n)
        if isinstance(b.family, fam.GaussianDense) and b.members:
            prec = -2.0 * np.asarray(nat[n].eta2)
            _, vecs = np.linalg.eigh(0.5 * (prec + prec.T))
            v = np.abs(vecs[:, 0])
            offset = 0
            for m in b.members:
                if v[offset : offset + m.size].max() > 0.1:
                    sites.append(m.name)
                offset += m.size
        else:
            sites.extend(b.sites)
    listed = ", ".join(f"'{x}'" for x in sites)
    return (
        f"the posterior of {listed} is improper: the closed-form messages to it do not form a "
        "valid distribution (a singular precision), e.g. flat (ImproperUniform) priors the data "
        "do not identify (only a sum or difference of them is); give them proper priors"
    )


#: a latent scale read by at least this many latents' prior makes the poor-q advice speak of
#: a funnel (eight schools' effects and their spread)
FUNNEL_MIN_LATENTS = 8


def _funnel(plan):
    """``(scale, the sites it scales, their number of scalars, the scale's sites if a grid can
    integrate them, "scale" or "concentration")`` of a latent scale that the priors of at
    least :data:`FUNNEL_MIN_LATENTS` latents read (a random walk's step size, a hierarchical
    model's group sd, a volatility's shock size; summed over one site per step), or of a
    latent concentration they read (a Beta's or Dirichlet's pooling κ, a Gamma's shape:
    their spread shrinks as it grows), quoted for display; None when the plan has none. The
    scale is named by the latent sites the priors' spread arguments read (``Factor.spread``:
    read off the model's program, whatever the blocks and estimators, so eight schools' τ
    in one joint block with the effects as well).

    A Gaussian q, even one dense block over the scale and its latents, does not hold their
    joint posterior: the sd of a random walk's step scale is 0.32× NUTS's fitted apart and
    0.39× for a full-rank Gaussian fitted by SVI, a stochastic volatility's shock size 0.26×
    for both and 0.28× in one joint block (``make bench``: "Scales of many latents")."""
    sizes = {s: m.size for b in plan.blocks for m in (b.members or (b,)) for s in m.sites}
    scaled: dict = {}  # scale → (sites it scales, their scalars); one site per step adds up
    words: dict = {}  # scale → what it is to the latents: "scale" or "concentration"
    for f in plan.factors:
        if f.observed or f.role != FactorRole.SITE or not f.spread:
            continue
        sites = f.members or (f.name,)
        scale = tuple(dict.fromkeys(s for _, read in f.spread for s in read if s not in sites))
        if not scale:
            continue
        if all(arg.startswith("concentration") for arg, _ in f.spread):
            words[scale] = "concentration"
        names, count = scaled.get(scale, ((), 0))
        scaled[scale] = (names + sites, count + sum(sizes.get(s, 0) for s in sites))
    for scale, (names, count) in scaled.items():
        if count >= FUNNEL_MIN_LATENTS:
            # (at most two scalar sites can be integrated on a grid: families={site: "grid"})
            scalars = tuple(s for s in scale if sizes.get(s) == 1) if len(scale) <= 2 else ()
            shown = ", ".join(f"'{s}'" for s in scale)
            latents = f"'{names[0]}'" if len(names) == 1 else f"'{names[0]}' … '{names[-1]}'"
            return shown, latents, count, scalars if len(scalars) == len(scale) else (), words.get(scale, "scale")
    return None


def poor_q_advice(plan, num_starts: int = 1) -> str:
    """What the poor-q warning advises for this plan: why q may be poor given its blocks and
    estimators, and what to try (the generic advice when nothing in the plan says more;
    ``num_starts``: the fit's, several starts are offered to a fit from one)."""
    # (structure='joint' merges the dense Gaussian blocks: a plan with one of them, e.g. one
    # fitted with structure='joint', has none left to join)
    apart = sum(1 for b in plan.blocks if b.family.dense_event and not b.point) > 1
    tries = ["structure='joint'"] if apart else []
    tries.append("other families=")
    if num_starts == 1:
        # (NumPyro's Holt–Winters example stopped at a level smoothing of 0.70 against NUTS's
        # 0.03 with k̂ 1.0; num_starts=4 found NUTS's mode: docs/limitations.md)
        tries.append("several starts (num_starts=4: a Gaussian q finds one mode, and another start may find a better one)")
    advice = "compare with NUTS, or try " + (", ".join(tries[:-1]) + " or " if len(tries) > 1 else "") + tries[-1]
    pairs = [pair for f in plan.factors for _, ps in f.pairs for pair in ps]
    sizes = {b.name: b.size for b in plan.blocks}
    # a Monte Carlo factor whose blocks were kept apart by the joint limit: joined (what
    # structure='joint' asks), its noisy updates ran off (an imputed covariate's logistic
    # regression: the ELBO fell for 60 steps, coefficients of the wrong sign). Only the
    # blocks a dense joint block could hold count: not enumerated ones, nor chains
    # (a capture–recapture model's 1,771 survival states next to 7 probabilities)
    joinable = {
        b.name: b.size for b in plan.blocks
        if not b.discrete and not b.family.banded and not b.family.arrowhead
    }
    spread = next(
        (
            (f.name, total) for f in plan.factors if f.estimator == "monte_carlo"
            for parts in [[joinable[n] for n in f.neighbours if n in joinable]]
            for total in [sum(parts)] if len(parts) > 1 and total > MC_JOINT_MAX_DIM
        ),
        None,
    )
    funnel = _funnel(plan)
    if spread is not None:
        advice = (
            f"the Monte Carlo factor '{spread[0]}' reads {spread[1]} scalars in blocks fitted apart, which holds "
            f"no correlation between them (a Gaussian block read by Monte Carlo holds at most {MC_JOINT_MAX_DIM} "
            "scalars: joined, its updates are too noisy to converge); compare with NUTS, and prefer a form whose "
            "factors the fit reads in closed form or by quadrature (e.g. states sampled at each step rather than "
            "built from a vector of innovations)"
        )
    elif pairs:
        # (joined, the product would be fitted by Monte Carlo: slower, and no better for a
        # factor model's sign and rotation symmetries, which no unimodal q holds)
        factor_model = any(sizes.get(a, 1) > 1 and sizes.get(b, 1) > 1 for a, b in pairs)
        advice = "the blocks a product of latents multiplies are fitted apart (variational message passing), " + (
            "and a factor model's posterior is symmetric under sign changes and rotations of its factors; "
            "compare means of identified quantities with NUTS"
            if factor_model else
            "which holds no correlation between them (a coefficient's sd may come out small); compare with NUTS"
        )
    elif funnel is not None:
        scale, latents, count, scalars, word = funnel
        grid = ", ".join(f"'{n}': 'grid'" for n in scalars)
        if word == "scale":
            # (Neal's funnel as NumPyro's example writes it, no data: the scale's sd 0.15× the
            # exact one, the latents' 0.03–0.11×)
            advice = (
                f"the {count} latents of {latents} have a latent scale ({scale}): the posterior of a scale and the "
                "latents it scales is a funnel (their spread shrinks with it), which no Gaussian q holds, fitted apart "
                "or in one joint block (structure='joint' is no better; a full-rank Gaussian fitted by SVI neither): "
                "the sds of the scale, and of the latents where the data say little of them, may come out several "
                "times too small; "
            )
        else:
            # (NumPyro's baseball example, Beta(m κ, (1 − m) κ) abilities of 18 players: m's sd
            # 0.59× NUTS's, κ's 0.08×; with both on a grid, m's 1.02×)
            advice = (
                f"the {count} latents of {latents} have a latent concentration ({scale}): the posterior of a "
                "concentration and the latents it pools is a funnel (their spread shrinks as it grows), which no "
                "Gaussian q holds: the sds of what sets the concentration may come out several times too small; "
            )
        advice += (
            f"integrate the {word} on a grid of fits with it fixed, families={{{grid}}}, or compare it with NUTS"
            if grid else f"compare the {word} with NUTS"
        )
    elif plan.conjugate and all(conj for _, conj in plan.conjugate):
        # (every factor closed-form: no Monte Carlo to replace, no joint block to merge into)
        advice = (
            "every factor is closed-form, so q is the best of its factorisation into blocks (variational "
            "message passing), which holds no correlation between blocks"
            + (
                ", and a mixture's posterior is multimodal under relabelling of its components"
                if any(b.discrete and not b.chain for b in plan.blocks) else ""
            )
            + "; compare means of identified quantities with NUTS"
        )
    return advice


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


def run(prepared: Prepared, state: BLRState, num_steps: int, progress_bar: bool) -> BLRResult:
    """Run the jitted loop from ``state`` and package the result.

    A fresh start from which no step size keeps the ELBO finite is started again with its
    Gaussian blocks narrowed (:func:`narrowed`): with unit variances on a log scale, a
    Weibull's (y/λ)^k overflows at the quadrature's outer nodes (k = 2e^4.5, λ = 2e^−4.5),
    its expectation is infinite, and the fit stopped after 0 steps."""
    bundle = prepared.bundle
    t1 = time.perf_counter()
    outcome = run_loop(
        bundle.chunk, state, prepared.dyn_data, prepared.rho, prepared.tol, num_steps, prepared.chunk_size,
        progress_bar, bundle.window,
    )
    first, fresh = outcome, int(state.step) == 0
    for _ in range(NARROWED_STARTS if fresh else 0):
        if outcome.num_steps > 0 or outcome.stop != NONFINITE:
            break
        state = narrowed(prepared.plan, state)
        outcome = run_loop(
            bundle.chunk, state, prepared.dyn_data, prepared.rho, prepared.tol, num_steps, prepared.chunk_size,
            progress_bar, bundle.window,
        )
    if outcome.num_steps == 0 and outcome.stop == NONFINITE:
        outcome = first  # (no narrowed start took a step either: the model's own start is returned)
    jax.block_until_ready(outcome.state)
    t2 = time.perf_counter()
    plan = prepared.plan
    nat = averaged_nat(plan, outcome.state) if prepared.iterate_average and plan.subsampled else outcome.state.nat
    return finish(prepared, outcome, nat, num_steps, t1, t2)


def finish(prepared: Prepared, outcome, nat: dict, num_steps: int, t1: float, t2: float, grid=None) -> BLRResult:
    """Package a run of the loop (``outcome``, reporting ``nat``): the posterior export, the
    diagnostics, the stop message and its warnings (at the line that called ``blr_fit`` or
    ``BLR.run``). ``grid``: the note of the scales integrated on a grid
    (:mod:`blrppl.engine.grid`), whose marginals ``nat`` holds."""
    bundle, plan = prepared.bundle, prepared.plan
    with COMPILE_LOCK:
        posterior = bundle.posterior_fn(nat)
        diagnostics = _diagnose(prepared, outcome, nat)
    t3 = time.perf_counter()
    improper = _improper_blocks(outcome, plan)
    if improper:
        warnings.warn("blr_fit: " + _improper_note(plan, outcome.state.nat, improper), UserWarning, stacklevel=4)
    message = _stop_message(outcome, plan, bundle.window, prepared.tol, num_steps)
    if outcome.stop == NONFINITE or _never_finite(outcome):
        # (the result holds the last valid state, or no step's: without a warning only the
        # message says so)
        warnings.warn("blr_fit: " + message, UserWarning, stacklevel=4)
    diverged = divergence_note(outcome.elbo)
    if diverged is not None:
        message += "; " + diverged
        warnings.warn("blr_fit: " + diverged, UserWarning, stacklevel=4)
    if grid is not None:
        message += "; " + grid
    if diagnostics.khat > KHAT_WARN and diagnostics.ess >= ESS_CLOSE:
        # (nearly equal weights: q's bulk is the posterior's; k̂ reads the tail of a ratio
        # that hardly varies, no warning)
        message += (
            f"; PSIS k-hat = {diagnostics.khat:.2f} > {KHAT_WARN}, but importance sampling from q keeps "
            f"{100 * diagnostics.ess:.0f} % of its draws effective: q's tails differ from the posterior's, "
            "its bulk is close"
        )
    elif diagnostics.khat > KHAT_WARN or diagnostics.ess < ESS_POOR:
        advice = poor_q_advice(plan, prepared.num_starts) if grid is None else (
            "the scales integrated on a grid have their marginals from it, but q draws them independently of "
            "the other latents (their dependence is not held); compare with NUTS"
        )
        if diagnostics.khat > KHAT_WARN:
            why = f"PSIS k-hat = {diagnostics.khat:.2f} > {KHAT_WARN}"
        else:
            # (k̂ fits the tail of the weights only; their spread says how far q's bulk is:
            # see blrppl.diagnostics.ESS_POOR)
            why = (
                f"importance sampling from q keeps only {100 * diagnostics.ess:.0f} % of its draws effective "
                f"(PSIS k-hat = {diagnostics.khat:.2f}): q's bulk differs from the posterior's, where a mean may lie "
                f"up to {math.sqrt(1.0 / diagnostics.ess - 1.0):.1f} of q's sds from q's, and sds may be too small"
            )
        note = f"q may be a poor approximation of the posterior ({why}): {advice}"
        message += "; " + note
        warnings.warn("blr_fit: " + note, UserWarning, stacklevel=4)
    result = BLRResult(
        posterior=posterior,
        elbo=np.asarray(outcome.elbo),
        num_steps=outcome.num_steps,
        converged=outcome.converged,
        message=message,
        diagnostics=diagnostics,
        diagnostic_time=t3 - t2,
        plan=prepared.plan,
        nat=nat,
        compile_time=t1 - prepared.start_time,
        run_time=t2 - t1,
        graph=bundle.graph,
        state=outcome.state,
        compile_counts=prepared.compile_counts,
    )
    return result
