"""The plan: stacked factors, data statistics, tied blocks, the factor graph and the order."""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np

from blrppl import families as fam
from blrppl.estimators import bilinear, gram
from blrppl.estimators.enumeration import with_enumeration
from blrppl.estimators.registry import estimator_of
from blrppl.model.functions import factor_arguments
from blrppl.graph import chain_table
from blrppl.runtime.compile import compile_lowered, compiler_options, jit
from blrppl.runtime.program_store import compile_program, jit as store_jit, program_key
from blrppl.graph.plan import FactorRole, Plan
from blrppl.graph.stack import stack_factors
from blrppl.model.trace import program_fingerprint
from blrppl.compiler.stages import CompileOptions, Dependencies, Estimates, SiteInputs
from blrppl.compiler.checks import check_subsampled

#: the arguments that set the spread of a latent's prior rather than its location (a
#: scale, a covariance, a Beta's, Dirichlet's or Gamma's concentration): the latent sites
#: they read are recorded as the factor's ``spread`` (the poor-q advice names them)
SPREAD_ARGS = frozenset(
    {"scale", "scale_tril", "covariance_matrix", "precision_matrix", "concentration", "concentration1", "concentration0"}
)


def finish_plan(inputs: SiteInputs, found: Dependencies, estimates: Estimates, options: CompileOptions) -> tuple:
    """The plan of the estimates: the factors' spreads, their subsampled plates or (in full
    batch) their stacks, data statistics, broadcast enumeration, chain tables and tied
    blocks; the factor graph and the sequential order.

    Returns:
        (plan, model functions, dynamic data leaves, init values dict, networkx graph)
    """
    blocks, fns = dict(estimates.blocks), estimates.fns
    factors = [_with_spread(f, inputs.records, inputs.rules, found.deps) for f in estimates.factors]
    tied = ()
    if options.subsampled:
        factors = check_subsampled(factors, inputs.records, blocks, {p.name for p in options.subsampled})
    else:
        factors, fns, tied = _full_batch(inputs, found, blocks, factors, fns)
    graph = nx.Graph()
    for name, b in blocks.items():
        graph.add_node(("block", name), kind=b.kind, shape=b.value_shape)
    for f in factors:
        graph.add_node(("factor", f.name), dist=f.dist_name, estimator=f.estimator)
        for n in f.neighbours:
            graph.add_edge(("factor", f.name), ("block", n))
    order = _sweep_order(blocks, factors)
    if options.subsampled:
        # the local step (each minibatch element given the global blocks) comes first, then
        # the global blocks see the fresh local statistics (Hoffman et al. 2013)
        order = tuple(n for n in order if blocks[n].local is not None) + tuple(
            n for n in order if blocks[n].local is None
        )
    plan = Plan(
        blocks=tuple(blocks.values()), factors=tuple(factors), order=order, subsampled=options.subsampled, tied=tied,
        barren=tuple(inputs.barren),
    )
    return plan, fns, inputs.data, estimates.init_values, graph


def _full_batch(inputs: SiteInputs, found: Dependencies, blocks: dict, factors: list, fns) -> tuple:
    """``(factors, fns, tied)`` in full batch: sites of one structure (one per step of a
    Python loop) stacked into one factor, the factors that read precomputed data statistics,
    broadcast enumerated labels or chain tables marked, and the tied blocks (made
    :class:`blrppl.families.GaussianTied` in ``blocks``, in place)."""
    data = inputs.data
    factors, stacks, tables = stack_factors(factors, inputs.records, found.forms, blocks, fns, data)
    if stacks:
        fns = fns.with_stacks(stacks, data, tables)
    factors = [_with_statistics(f, blocks, fns, data) for f in factors]
    broadcast = _broadcast_enumerated(factors, blocks, fns, data, np.random.default_rng(0))
    factors = [with_enumeration(f, broadcast=True) if f.name in broadcast else f for f in factors]
    tables = chain_table.tabled(factors, blocks, fns, data, np.random.default_rng(0))
    factors = [with_enumeration(f, table=tables[f.name]) if f.name in tables else f for f in factors]
    tied = tied_blocks(factors, blocks, fns, data)
    for n in {n for n, _, _ in tied}:
        blocks[n] = dataclasses.replace(blocks[n], family=fam.GaussianTied(blocks[n].family.dim))
    return factors, fns, tied


def _with_statistics(factor, blocks, fns, data):
    """The factor with the data statistics its expectation comes from in its spec
    (:attr:`blrppl.estimators.exact.ExactSpec.statistics`): those of one large Gaussian
    block (:mod:`blrppl.estimators.gram`) or, failing them, of a product of two blocks' rows
    (:mod:`blrppl.estimators.bilinear`), when it is eligible for them."""
    block = gram.eligible(factor, blocks, fns, data)
    if block:
        source = gram.GramSource(block)
    else:
        found = bilinear.eligible(factor, blocks, fns, data)
        if found is None:
            return factor
        source = bilinear.BilinearSource(pair=found[:2], scale_rows=found[2])
    return dataclasses.replace(factor, spec=dataclasses.replace(factor.spec, statistics=source))


def tied_blocks(factors, blocks: dict, fns, data) -> tuple:
    """The plated dense Gaussian blocks whose rows every factor gives the same precision, on
    this data: ``(block, factor, side)`` for each factor on each such block (the facts a fit
    on other data checks again, see :func:`rows_share_precision`).

    A block qualifies when every factor on it reads precomputed data statistics (its own
    prior, :mod:`blrppl.estimators.gram`; a product of two blocks' rows,
    :mod:`blrppl.estimators.bilinear`) and each gives all its rows one precision: the
    prior's per-element precisions κ are equal from row to row; the product's weights
    W2 are equal along the block's rows (no mask, no row-dependent scale). Its fixed point
    in the dense family then has one covariance for all rows, and :class:`GaussianTied`
    holds one (a factor model's rows: one D × D Cholesky per step instead of one per row).
    """
    candidates = {}
    for n, b in blocks.items():
        if type(b.family) is not fam.GaussianDense or b.family.dim < 2 or math.prod(b.batch_shape) < 2:
            continue
        if b.point or b.members or b.local is not None or b.transform is not None:
            continue
        on = [f for f in factors if n in f.neighbours]
        sources = [f.spec.statistics for f in on]
        # (rows whose factor weights them by a precision of their own, τ_j, are not tied)
        if on and all(
            s is not None and n in s.blocks and f.name not in fns.stacks and s.scale_rows != n
            for f, s in zip(on, sources)
        ):
            candidates[n] = [(n, f.name, s.blocks.index(n)) for f, s in zip(on, sources)]
    if not candidates:
        return ()
    by_name = {f.name: f for f in factors}

    def shared(data):
        # (one program for every block's facts: the statistics run the model a few times)
        out = {}
        for n, facts in candidates.items():
            stats = {}
            for _, name, _ in facts:
                f = by_name[name]
                stats[name] = f.spec.statistics.compute(fns, f, blocks, data)
            out[n] = rows_share_precision(facts, stats)
        return out

    options = compiler_options(data, 0)
    try:
        holds = compile_lowered(jit(shared).lower(data), options)(data)
    except Exception:  # (a model the statistics cannot evaluate keeps its rows' own covariances)
        return ()
    return tuple(fact for n, facts in candidates.items() if bool(holds[n]) for fact in facts)


def rows_share_precision(facts, stats: dict):
    """Whether the statistics ``stats`` (factor → statistics) give every row of the blocks
    in ``facts`` (:func:`tied_blocks`) one precision (a bool array); facts of factors not in
    ``stats`` are not checked."""
    holds = jnp.array(True)
    for _, name, side in facts:
        if name not in stats:
            continue
        s = stats[name]
        if isinstance(s, gram.ElementStatistics):
            kappa = jnp.reshape(s.kappa, (-1, jnp.shape(s.kappa)[-1]))
            holds = holds & jnp.all(kappa == kappa[:1])
        else:
            holds = holds & jnp.all(s.quad == (s.quad[:1] if side == 0 else s.quad[:, :1]))
    return holds


#: enumerated states whose labels a broadcast check tries per factor: all of them up to
#: this many, else this many at random
BROADCAST_CHECK_STATES = 64


def _broadcast_enumerated(factors, blocks: dict, fns, data, rng: np.random.Generator) -> set:
    """The enumerated factors whose arguments, with their discrete blocks' values of shape 1
    along every dim (every element at one value), equal their arguments with the full values
    broadcast (:attr:`blrppl.estimators.enumeration.Enumeration.broadcast`): checked at a random
    point of their continuous blocks for every enumerated state (or
    :data:`BROADCAST_CHECK_STATES` at random), in one compiled program. A model that reads a
    label's shape (``z.shape[0]``, a reshape to N, a ``scan`` over it) fails the check, or
    raises, and keeps full values."""
    candidates = [
        f for f in factors
        if f.discrete and estimator_of(f).closed_form and f.role == FactorRole.SITE and f.name not in fns.stacks
        and not any(blocks[d].chain or blocks[d].local is not None for d in f.discrete)
    ]
    if not candidates:
        return set()
    point = {
        n: blocks[n].generic_value(rng) for f in candidates for n in f.neighbours if n not in f.discrete
    }
    combos = {}
    for f in candidates:
        sizes = [len(blocks[d].support_values) for d in f.discrete]
        if math.prod(sizes) <= BROADCAST_CHECK_STATES:
            combos[f.name] = np.array(list(itertools.product(*[range(k) for k in sizes])), np.int32)
        else:
            combos[f.name] = np.stack([rng.integers(k, size=BROADCAST_CHECK_STATES) for k in sizes], axis=1).astype(np.int32)

    def agrees(f, combo, data, point):
        full, small = dict(point), dict(point)
        for j, d in enumerate(f.discrete):
            full.update(blocks[d].discrete_site_values(combo[j]))
            small.update(blocks[d].discrete_site_values(combo[j], broadcast=True))
        want = fns.args_of({f.name: factor_arguments(f)}, full, data)[f.name]
        got = fns.args_of({f.name: factor_arguments(f)}, small, data)[f.name]
        ok = jnp.array(True)
        for arg, a in want.items():
            b = got[arg]
            if jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b)) != jnp.shape(a):
                raise ValueError("not broadcast")
            b = jnp.broadcast_to(b, jnp.shape(a))
            if jnp.issubdtype(jnp.result_type(a), jnp.inexact):
                tol = 64 * jnp.finfo(jnp.result_type(a)).eps * (1.0 + jnp.abs(a))
                close = (jnp.abs(a - b) <= tol) | (jnp.isnan(a) & jnp.isnan(b)) | (a == b)
            else:
                close = a == b
            ok = ok & jnp.all(close)
        return ok

    static_false = set()

    # (the point and the states are arguments, not constants: XLA would fold the whole check,
    # K × N × D × D comparisons for a mixture's precisions, at compile time: 17 s for K = 40)
    def check(data, point, combos):
        out = {}
        for f in candidates:
            try:
                out[f.name] = jnp.all(jax.vmap(lambda c, f=f: agrees(f, c, data, point))(combos[f.name]))
            except Exception:  # (a model that cannot run with them, or other shapes: full values)
                static_false.add(f.name)
        return out

    try:
        args = (data, point, combos)
        traced = store_jit(check, "broadcast").trace(*args)
        if not jax.tree.leaves(traced.out_info):
            return set()
        options = compiler_options(data)
        key = program_key("broadcast", program_fingerprint(traced.jaxpr), jax.tree.structure(traced.out_info), options)
        result = compile_program(key, lambda *_: traced.lower(), args, options)(*args)
    except Exception:  # (the check itself failed: full values everywhere)
        return set()
    return {name for name, ok in result.items() if name not in static_false and bool(ok)}


def _sweep_order(blocks: dict, factors) -> tuple:
    """The order of the sequential schedule.

    Continuous blocks in model order, then discrete blocks, except that a discrete block
    whose continuous neighbours (through its factors) are all point blocks comes first:
    its update is then the E-step from the points' initial values, so that a model whose
    continuous quantities are params (or ``point`` latents) is classical EM from the user's
    initial values (E-step, then M-steps in model order) rather than starting from the
    random responsibilities discrete blocks are initialised with (right for variational
    Bayes, where the continuous blocks' broad initial posteriors carry no information).
    Param blocks no factor depends on are left out: they keep their initial value.
    """
    neighbours = {n: set() for n in blocks}
    for f in factors:
        for n in f.neighbours:
            neighbours[n].update(f.neighbours)
    first, cont, last = [], [], []
    for n, b in blocks.items():
        if b.param and len(neighbours[n]) == 0:
            continue
        if not b.discrete:
            cont.append(n)
            continue
        others = [blocks[m] for m in neighbours[n] if m != n and not blocks[m].discrete]
        (first if others and all(m.point for m in others) else last).append(n)
    return tuple(first + cont + last)


def _with_spread(f, records, rules, site_deps):
    """``f`` with its ``spread``: for a latent's prior, ``(argument, sites)`` of each of its
    :data:`SPREAD_ARGS` that reads other latent sites (``site_deps``: per site and argument,
    the latent sites it depends on)."""
    rule = rules.get(f.name)
    if f.role != FactorRole.SITE or f.observed or rule is None:
        return f
    spread = tuple(
        (arg, tuple(n for n in records if n in site_deps[f.name].get(arg, ()) and n != f.name))
        for arg in rule.arg_names if arg in SPREAD_ARGS
    )
    return dataclasses.replace(f, spread=tuple((arg, sites) for arg, sites in spread if sites))
