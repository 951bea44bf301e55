"""The plan: stacked factors, data statistics, tied blocks, the factor graph and the order."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np

from blrppl import families as fam
from blrppl.estimators import bilinear, gram
from blrppl.estimators.enumeration import with_enumeration
from blrppl.estimators.registry import estimator_of
from blrppl.model import values
from blrppl.model.functions import factor_arguments
from blrppl.graph import chain_table
from blrppl.runtime.compile import compile_lowered, compiler_options, jit
from blrppl.graph.plan import FactorRole, Plan
from blrppl.graph.stack import stack_factors
from blrppl.compiler.stages import CompileOptions, Dependencies, Estimates, SiteInputs
from blrppl.compiler.checks import check_subsampled
from blrppl.compiler.reads import ElementReads

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
        event_ndims=tuple((n, int(r.event_ndim)) for n, r in inputs.records.items() if not r.observed),
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
    reads = ElementReads(found.program, blocks)
    factors = [_with_statistics(f, blocks, fns, data, reads) for f in factors]
    broadcast = _broadcast_enumerated(factors, blocks, fns, data)
    factors = [with_enumeration(f, broadcast=True) if f.name in broadcast else f for f in factors]
    tables = chain_table.tabled(factors, blocks, fns, data)
    factors = [with_enumeration(f, table=tables[f.name]) if f.name in tables else f for f in factors]
    tied = tied_blocks(factors, blocks, fns, data)
    for n in {n for n, _, _ in tied}:
        blocks[n] = dataclasses.replace(blocks[n], family=fam.GaussianTied(blocks[n].family.dim))
    return factors, fns, tied


def _with_statistics(factor, blocks, fns, data, reads):
    """The factor with the data statistics its expectation comes from in its spec
    (:attr:`blrppl.estimators.exact.ExactSpec.statistics`): those of one large Gaussian
    block (:mod:`blrppl.estimators.gram`) or, failing them, of a product of two blocks' rows
    (:mod:`blrppl.estimators.bilinear`), when it is eligible for them (``reads``: the
    program's :class:`blrppl.compiler.reads.ElementReads` on the final blocks, read only for
    the bilinear candidates)."""
    block = gram.eligible(factor, blocks, fns, data)
    if block:
        source = gram.GramSource(block)
    else:
        if bilinear.candidate(factor, blocks) is None:
            return factor
        items = {item: _reads_of(reads, factor.name, item) for item in ("loc", "scale")}
        found = bilinear.eligible(factor, blocks, fns, data, items)
        if found is None:
            return factor
        source = bilinear.BilinearSource(pair=found[:2], scale_rows=found[2])
    return dataclasses.replace(factor, spec=dataclasses.replace(factor.spec, statistics=source))


def _reads_of(reads, site, item) -> dict:
    """key → the element reads of one item of a site ({} when the program has no such item)."""
    try:
        return reads.of(site, item)
    except KeyError:
        return {}


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


def _broadcast_enumerated(factors, blocks: dict, fns, data) -> set:
    """The enumerated factors whose arguments, with their discrete blocks' values of shape 1
    along every dim (every element at one value), equal their arguments with the full values
    broadcast (:attr:`blrppl.estimators.enumeration.Enumeration.broadcast`), read off the factor's
    program by value numbers (:mod:`blrppl.model.values`): traced with the full labels and
    with labels of size-1 dims, each discrete block's state one symbol (what the enumeration
    holds every element at), each scalar of a continuous neighbour one of its own, the data
    at their values. The arguments agree where their numbers do, for every state and every
    value of the continuous neighbours at once. A model that reads a label's shape
    (``z.shape[0]``, a reshape to N, a ``scan`` over it) traces to other numbers, or cannot
    be traced with the small labels, and keeps full values."""
    candidates = [
        f for f in factors
        if f.discrete and estimator_of(f).closed_form and f.role == FactorRole.SITE and f.name not in fns.stacks
        and not any(blocks[d].chain or blocks[d].local is not None for d in f.discrete)
    ]
    return {f.name for f in candidates if _broadcasts(f, blocks, fns, data)}


def _broadcasts(f, blocks: dict, fns, data) -> bool:
    """Whether factor ``f``'s arguments agree with its labels broadcast (see
    :func:`_broadcast_enumerated`)."""
    numbering = values.Numbering()
    dtype = jnp.result_type(float)
    avals, inputs = {}, {}
    for n in f.neighbours:
        if n not in f.discrete:
            shape = tuple(blocks[n].value_shape)
            avals[("block", n)] = jax.ShapeDtypeStruct(shape, dtype)
            inputs[("block", n)] = values.scalar_symbols(numbering, n, shape)
    for d in f.discrete:
        avals[("state", d)] = jax.ShapeDtypeStruct((), np.int32)
        inputs[("state", d)] = values.Symbols(np.asarray(numbering.of(("state", d))))

    def arguments(small):
        def fn(vals, data):
            site = {key[1]: x for key, x in vals.items() if key[0] == "block"}
            for d in f.discrete:
                site.update(blocks[d].discrete_site_values(vals[("state", d)], broadcast=small))
            return fns.args_of({f.name: factor_arguments(f)}, site, data)[f.name]

        traced = values.trace(fn, avals, data)
        return None if traced is None else traced.numbers(inputs, numbering)

    full, small = arguments(False), arguments(True)
    if full is None or small is None or set(full) != set(small):
        return False
    return all(values.same(full[arg], small[arg]) for arg in full)


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
