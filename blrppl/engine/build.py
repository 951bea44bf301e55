"""The compiled fit: a model's plan, its jitted chunk of steps, its diagnostics' and export
programs (:class:`CompiledFit`), built by :func:`compile_fit` once per (model program, data
layout, options).

XLA compilations run on worker threads (:data:`_COMPILER`): XLA releases the GIL, so a
fit's programs compile while its setup runs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro

from blrppl import families as fam
from blrppl.engine.cache import stored_fit_key
from blrppl.engine.loop import history_size, make_chunk
from blrppl.engine.state import initial_state, start_nat
from blrppl.engine.step import make_step
from blrppl.engine.subsample import svi_rate
from blrppl.estimators import gram
from blrppl.estimators.registry import estimator_of
from blrppl.model.functions import table_key
from blrppl.compiler.pipeline import compile_model
from blrppl.compiler.online import online_blocks
from blrppl.compiler.finish import rows_share_precision
from blrppl.graph.data import RunData, split_run_data
from blrppl.runtime.compile import SMALL_DATA, compiler_options as _compiler_options, jit as _jit
from blrppl.model.deps import output_dependencies
from blrppl.runtime.program_store import compile_program, fit_program_key, jit as store_jit
from blrppl.graph.stack import stack_table
from blrppl.model.trace import subsampled_plates
from blrppl.posterior.diagnostics import log_weights_of, model_density
from blrppl.posterior.narrow import make_narrow_check, site_reader
from blrppl.posterior.export import posterior_builder


#: default initial ρ of blocks with Monte Carlo messages (then decaying); other blocks start
#: at ρ = 1 (exact coordinate steps for conjugate blocks, Newton-like natural-gradient
#: steps for the others), backtracking on the exact ELBO when a step does not improve it
MONTE_CARLO_RHO = 0.5


#: window of the windowed-mean convergence test when the ELBO is a Monte Carlo estimate
MC_WINDOW = 25
#: ... when it is IVON's one-draw estimate (blocks of a large network,
#: :class:`blrppl.families.GaussianIVON`): its noise is many times larger, and windows of 25
#: or 100 steps stopped a two-layer network's fit (1,153 weights) after 100–500 steps with its
#: ELBO at −1,300 to −620, still rising (−360 at 3,000 steps): the test runs after 1,000 steps
IVON_WINDOW = 250


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
    #: the step ``(state, data, rho) -> (state, info)`` the chunk runs (:mod:`blrppl.engine.kernel`)
    step_fn: Callable | None = None
    carry_fn: Callable | None = None  # (state, data) → the state a run's loop carries (make_step)
    elbo_fn: Callable | None = None  # jitted ELBO(nat, data, key)
    #: online fits: the blocks whose prior is the previous posterior (run-time data)
    online: tuple = ()
    #: for models with subsampled plates: the tracer of the model at full plate sizes
    full_tracer: Any = None
    #: the latents' support parameters the bijections were compiled with
    supports: tuple = ()
    #: data → the precomputed statistics of the plan's factors that read data statistics
    #: (their spec's ``statistics``; None: none)
    statistics_fn: Callable | None = None
    _statistics_compiled: Any = None
    _last_statistics: Any = None  # (data, its statistics): the last data set's
    #: data → the tables of the plan's stacked factors (:mod:`blrppl.graph.stack`; None: none)
    tables_fn: Callable | None = None

    #: (nat, model data, key) → importance log-weights of q (None: not computed for this plan)
    log_weights_fn: Callable | None = None
    _log_weights_compiled: Any = None
    #: (nat, model data, key) → (log-weights, the drawn latents' values): the corrected
    #: summaries' draws (:mod:`blrppl.posterior.importance`), compiled on first use
    weighted_draws_fn: Callable | None = None
    _weighted_draws_compiled: Any = None
    #: (nat, model data, key) → the narrow-q check's draws (:mod:`blrppl.posterior.narrow`;
    #: None: no scalar site to check), and the sites it reads
    narrow_fn: Callable | None = None
    narrow_sites: tuple = ()
    _narrow_compiled: Any = None
    #: the model's density at draws of q (:class:`blrppl.posterior.diagnostics.Density`; None:
    #: subsampled or online plans), which the mixture fit steps on (:mod:`blrppl.engine.mixture`)
    #: and a grid's mixture weights read (:func:`blrppl.posterior.grid_draws.mixture_log_weights`)
    density: Any = None
    #: :func:`_dense_work` of the plan (the diagnostics' program compiles optimised from the
    #: same measure as the chunk)
    dense_work: int = 0
    #: the fit's key in the program store (None: its programs are not stored), see
    #: :func:`stored_fit_key`
    stored_key: str | None = None
    #: the XLA options the chunk is compiled with (its programs over a mesh take them too)
    chunk_options: dict | None = None
    #: mesh → the chunk run over it (:func:`blrppl.engine.sharding.sharded_chunk`)
    sharded: dict = dataclasses.field(default_factory=dict)

    def _stored(self, name: str, options) -> str | None:
        return fit_program_key(self.stored_key, name, options)

    def compile_log_weights(self, nat, dyn, key) -> None:
        """Start compiling :meth:`log_weights` for arguments of these shapes (on a worker
        thread: the fit runs meanwhile), or load it from the program store. (The narrow-q
        check's program compiles when a fit first needs it: most fits' weights show it is not
        needed, :func:`blrppl.engine.run._diagnose`.)"""
        self._log_weights_compiled = self._compile_diagnostic("log_weights", self.log_weights_fn, (nat, dyn, key))

    def _compile_diagnostic(self, name: str, fn, args):
        options = _compiler_options(args[1], None, self.dense_work, once=True)
        with numpyro.validation_enabled(False):
            return compile_program(
                self._stored(name, options), store_jit(fn, name).lower, args, options, _COMPILER.submit, background=True
            )

    def log_weights(self, nat, dyn, key):
        """The importance log-weights of q (:mod:`blrppl.posterior.diagnostics`): one compiled call."""
        return self.log_weights_read(nat, dyn, key)[0]

    def log_weights_read(self, nat, dyn, key) -> tuple:
        """``(log_weights, at_draws, sd)``: the importance log-weights of q and, from the same
        compiled call, the narrow-q check's sites read at their draws and q's sds of them
        (:func:`blrppl.posterior.narrow.site_reader`; None and None when the plan has no
        such site)."""
        if self._log_weights_compiled is None:
            self.compile_log_weights(nat, dyn, key)
        out = self._log_weights_compiled.result()(nat, dyn, key)
        return out if self.narrow_sites else (out, None, None)

    def weighted_draws(self, nat, dyn, key):
        """q's draws and their importance log-weights: one call, compiled the first time a
        result asks for importance-corrected summaries or draws."""
        if self._weighted_draws_compiled is None:
            self._weighted_draws_compiled = _jit(self.weighted_draws_fn)
        with numpyro.validation_enabled(False):
            return self._weighted_draws_compiled(nat, dyn, key)

    def narrow(self, nat, dyn, key):
        """The narrow-q check's draws (:func:`blrppl.posterior.narrow.make_narrow_check`):
        one compiled call; None when the plan has no scalar site to check."""
        if self.narrow_fn is None:
            return None
        if self._narrow_compiled is None:
            self._narrow_compiled = self._compile_diagnostic("narrow", self.narrow_fn, (nat, dyn, key))
        return self._narrow_compiled.result()(nat, dyn, key)

    def statistics(self, dyn) -> dict:
        """The data statistics of the plan's factors that read them: one compiled call (XLA's
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


#: worker threads for XLA compilations (which release the GIL): a fit's programs compile
#: while the next one is traced, or while the fit runs
_COMPILER = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="blrppl-compile")


def _statistics_fns(plan, fns, data) -> tuple:
    """``(statistics, constant)``: data → the statistics of the plan's factors whose
    expectation comes from data statistics (their spec's ``statistics``) that read the data (computed once per data set, see
    :meth:`CompiledFit.statistics`), and → those of the factors that read none (a Gaussian
    prior's: constants); None for none."""
    gram_factors = [f for f in plan.factors if f.spec.from_statistics]
    if not gram_factors:
        return None, None
    blocks = {b.name: b for b in plan.blocks}

    def of(factors):
        def statistics(data, rows=False):
            return {f.name: f.spec.statistics.compute(fns, f, blocks, data, rows=rows) for f in factors}

        return statistics

    reads = output_dependencies(lambda d: of(gram_factors)(d["data"]), {"data": data})
    constant = [f for f in gram_factors if not any(jax.tree.leaves(reads[f.name], is_leaf=lambda x: isinstance(x, frozenset)))]
    varying = [f for f in gram_factors if f not in constant]
    return (of(varying) if varying else None), (of(constant) if constant else None)


def _with_statistics(fn, constant):
    """``fn(x, data, *rest)`` reading, besides ``data``'s statistics, those ``constant``
    computes from it."""

    def with_statistics(x, data, *rest):
        model_data, previous, statistics = split_run_data(data)
        return fn(x, RunData(model_data, previous, {**statistics, **constant(data)}), *rest)

    return with_statistics


def _elementwise_work(plan, records) -> int:
    """The number of factor elements a step evaluates one by one (factors with precomputed
    statistics excluded): the measure of the data a compiled step works through."""
    return sum(
        int(np.prod(records[n].value_shape)) if n in records else 0
        for f in plan.factors
        if not f.spec.from_statistics
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
        # (a product read from statistics still counts: its rows' second moments are D² per
        # row and pair of rows, and optimised code runs them 2-4x faster)
        if f.spec.from_statistics and not f.spec.statistics.dense_work:
            continue
        states = 1
        for d in f.discrete:
            values = blocks[d].support_values if d in blocks else None
            states = min(states * max(len(values or ()), 1), _MAX_COUNTED_STATES)
        pairs = sum(blocks[a].element_size * blocks[b].element_size for _, ps in f.spec.pairs for a, b in ps)
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


def plan_model(program, records, data_spec, dyn_data, options, prior_spec, k_probe):
    """The plan of a traced model (blocks, factors, estimators, the online prior, conjugacy),
    what :func:`compile_model` builds with it, and the blocks whose prior is a previous fit's
    posterior."""
    plan, fns, dyn_data, init_values, graph = compile_model(
        program,
        records,
        data_spec,
        dyn_data,
        families=options.families_dict,
        rng_key=k_probe,
        structure=options.structure,
        point=options.point,
        point_space=options.point_space,
        subsampled=subsampled_plates(records),
        prior_spec=prior_spec,
    )
    return plan, fns, dyn_data, init_values, graph, online_blocks(plan)


def compile_fit(program, records, data_spec, dyn_data, tracer, options, prior_spec, k_probe, supports=()):
    """Compile a model (its :class:`blrppl.model.program.ModelProgram`): plan, initialisation, the jitted chunk of steps, posterior export."""
    rate_fn, chunk_size, curvature = options.rate_fn, CHUNK_SIZE, options.mc_curvature
    default_rate = options.learning_rate is None
    plan, fns, dyn_data, init_values, graph, online = plan_model(
        program, records, data_spec, dyn_data, options, prior_spec, k_probe
    )
    # (the latents integrated out have no block, no factor, no term of log p in the diagnostics)
    records = {n: r for n, r in records.items() if n not in plan.barren}
    blocks = {b.name: b.full for b in plan.blocks}
    # the programs run at every step evaluate the model's scans as maps (the plan is made)
    fns = fns.vectorised()

    # on the host for concrete values (numpy, then placed on the device): no XLA program
    # before the first step but the trace run's and the chunk's
    init_fn = functools.partial(start_nat, plan)

    sampled = [f for f in plan.factors if estimator_of(f).decaying_steps]
    decay = {n for f in sampled for n in f.neighbours} if default_rate else set()
    window = (IVON_WINDOW if any(b.family.mc_draws is not None for b in plan.blocks) else MC_WINDOW) if sampled else 0
    epoch = 0
    if plan.subsampled:
        # windows of whole epochs (the longest plate's), at least MC_WINDOW steps
        epoch = max(p.steps_per_epoch for p in plan.subsampled)
        window = epoch * -(-MC_WINDOW // epoch)
    step, elbo_fn, _, carry = make_step(
        plan,
        fns,
        options.schedule or default_schedule(plan),
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
        carry = carry if carry is None else _with_statistics(carry, constant)
    exact_block = one_exact_block(plan)
    chunk = make_chunk(
        step, chunk_size, window, epoch, rate_fn, () if plan.subsampled else tuple(plan.order),
        elbo_fn=None if plan.subsampled else elbo_fn, exact_block=exact_block,
        views_fn=carry,
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
    fit_key = stored_fit_key(tracer, dyn_data, options, prior_spec, supports, plan)
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
    # (the diagnostics: PSIS k̂ and the narrow-q check read the model's density at draws of q)
    density = None if plan.subsampled or online else model_density(plan, fns, records, dyn_data)
    narrow_sites, narrow_fn = ((), None) if density is None else make_narrow_check(density)
    # (k̂'s program also reads the narrow-q check's sites at its draws: their widths from q's
    # own weights, which spare most fits the check's program, blrppl.posterior.narrow.screen)
    reader = site_reader(narrow_sites, density.drawn) if narrow_sites else None
    log_weights_fn = None if density is None else log_weights_of(density, reader=reader)
    weighted_draws_fn = None if density is None else log_weights_of(density, with_values=True)
    posterior_fn = posterior_builder(plan, records, _COMPILER.submit)
    bundle = CompiledFit(
        tracer, plan, graph, init_fn, None, posterior_fn, window,
        chunk_fn=chunk, step_fn=step, carry_fn=carry, elbo_fn=_jit(elbo_fn), online=online, statistics_fn=statistics_fn,
        density=density, log_weights_fn=log_weights_fn, weighted_draws_fn=weighted_draws_fn, tables_fn=tables_fn,
        stored_key=fit_key,
        dense_work=dense_work, narrow_fn=narrow_fn, narrow_sites=tuple(narrow_sites), chunk_options=chunk_options,
    )
    if log_weights_fn is not None and not (len(plan.blocks) == 1 and exact_block is not None):
        # (a lone conjugate block needs no draws, see _diagnose)
        bundle.compile_log_weights(state.nat, model_data(plan, run_data), state.rng_key)
    if not plan.subsampled:  # (subsampled plans export their local blocks at full size)
        posterior_fn.prepare(state.nat, fit_key)
    # (the fit's setup, e.g. its data statistics, runs while the chunk compiles)
    bundle.chunk = Compiling(chunk_future)
    return bundle


class Compiling:
    """A compiled function still compiling on a worker thread: calls wait for it."""

    def __init__(self, future):
        self.future = future

    def wait(self):
        """The compiled function (once its compilation has finished)."""
        return self.future.result()

    def __call__(self, *args):
        return self.future.result()(*args)


def default_schedule(plan) -> str:
    """The schedule of a fit that did not ask for one: ``"parallel"`` when the plan has IVON
    blocks (a network's weights, :class:`blrppl.families.GaussianIVON`: every weight
    updated from one draw and one backward pass of the network, as IVON does; the
    sequential schedule would run the network once per block and step), else
    ``"sequential"``."""
    return "parallel" if any(b.family.reparam_curvature for b in plan.blocks) else "sequential"


def _first_search(plan, window: int, default_rate: bool) -> bool:
    """Whether the first step is a line search over ρ (:mod:`blrppl.engine.loop`): exact
    ELBOs, the default step sizes, and a block whose messages depend on its own q (a
    conjugate block's step at ρ = 1 is its exact update given the others)."""
    conjugate = dict(plan.conjugate)
    return (
        default_rate and not window and not plan.subsampled
        and any(not conjugate.get(b.name, False) and not b.point for b in plan.blocks)
    )


def one_exact_block(plan) -> str | None:
    """The plan's only updated block when it is conjugate and not a point block (one step at
    ρ = 1 is then its exact posterior), else None."""
    if plan.subsampled or len(plan.order) != 1:
        return None
    (name,) = plan.order
    return name if dict(plan.conjugate).get(name) and not plan.block(name).point else None


def model_data(plan, run_data):
    """What the model functions read of a fit's run-time data: the model's data, and the
    tables of the plan's stacked factors when it has some."""
    data, _, statistics = split_run_data(run_data)
    stacked = {table_key(f.name): statistics[table_key(f.name)] for f in plan.factors if f.members}
    return RunData(data, {}, stacked) if stacked else data
