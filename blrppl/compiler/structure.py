"""The blocks' structure: joint, banded (chains), arrowhead and plate-coupled dense blocks."""

from __future__ import annotations

import dataclasses

import numpy as np

from blrppl import families as fam
from blrppl import moments as mom
from blrppl.estimators.registry import estimator_of
from blrppl.graph.band import arrowhead_locals, chain_bandwidth
from blrppl.compiler.reads import block_reads
from blrppl.compiler.stages import CompileOptions, Estimates, FamilyChoice, SiteInputs, Structure, StructureLimits
from blrppl.compiler.blocks import (
    banded_block, coupled_discrete_groups, merge_gaussians, time_major,
)

#: by default, the dense Gaussian blocks are merged into one joint dense Gaussian when
#: their total dimension is at most this
JOINT_MAX_DIM = 500
#: ... and, when a Monte Carlo factor reads the joint block, at most this: a dense block's
#: curvature from a few draws per step is too noisy in more dimensions (a logistic
#: regression on a covariate imputed with ``obs_mask``, 157 scalars joint with the product
#: ``b_x * x``: the ELBO fell from −364 to −877 in 60 steps, coefficients of the wrong sign;
#: apart, 100 steps to NUTS's means within 0.1 sd)
MC_JOINT_MAX_DIM = 64
#: Gaussian blocks of at least this many scalars are tested for a chain structure (banded
#: precision, :mod:`blrppl.graph.band`); smaller ones stay dense (exact, and cheap)
BANDED_MIN_DIM = 32


def choose_structure(
    inputs: SiteInputs, choice: FamilyChoice, options: CompileOptions, limits: StructureLimits, program,
) -> Structure:
    """The blocks' structure: which dense Gaussian blocks are merged into one joint block,
    which are chains (banded), which joint block is an arrowhead, which plated blocks are
    dense over their elements, which discrete blocks are one categorical.

    By default (``options.structure`` None) the dense Gaussian blocks without a family
    override are merged when there are several and their total dimension is at most
    :data:`JOINT_MAX_DIM`, except chains (banded) and the scales on log space that a
    would-be chain's factors read (:func:`_scales_of`); ``"joint"`` merges every dense
    Gaussian block (except points), ``"mean-field"`` keeps one block per site. A chain or an
    arrowhead is found from what each factor element reads of the merged block, read off
    the model's ``program`` (:func:`blrppl.compiler.reads.block_reads`; ``limits`` turns
    each off, and the default merge).
    """
    blocks, factors, structure = dict(choice.blocks), choice.factors, options.structure
    # (rows read off a plate-free site's prior, SiteRecord.row_axes: no plate declared them)
    undeclared = {n for n, b in blocks.items() if b.plate_axes and n in inputs.records and not inputs.records[n].plates}
    coupled, densified, dense = _plate_coupling(blocks, factors, options, undeclared)
    apart = _apart(factors, choice.on_support, structure)

    def joinable(n, b):
        # a site the user gave a family keeps its own block, unless structure="joint" asks
        # for every dense Gaussian in one; local blocks of a subsampled plate are never merged
        return (
            b.family.dense_event and not b.point and b.local is None and n not in apart
            and (n not in options.families or structure == "joint")
        )

    def linked(n):
        # (a chain couples its own elements: some block's elements are mixed by a factor, or
        # it is one vector of a distribution with an event dim, as a GaussianRandomWalk)
        return n in coupled or (blocks[n].family.dense_event and not blocks[n].batch_shape)

    members = [n for n, b in {**blocks, **{n: dense[n] for n in densified}}.items() if joinable(n, b)]
    if structure is None and limits.banded:
        # a scale on log space that the factors of a would-be chain read (a walk's step
        # size, an observation noise written one site per step): joined with the chain, each
        # such factor would be a quadrature over a dense block; apart, its closed form holds
        # and the chain is banded, or dense with the affine globals it shares factors with
        # (a level added to every step), as at any length
        scales = {
            m for n in members if blocks[n].size >= BANDED_MIN_DIM and linked(n) for m in _scales_of(n, members, factors)
        }
        apart |= scales
        members = [n for n in members if n not in scales]
    size = sum(blocks[n].size for n in members)
    merge = len(members) > 1 and (
        structure == "joint" or (structure is None and limits.merge_joint and size <= JOINT_MAX_DIM)
    )
    chains = {}
    if structure is None and limits.banded:
        found = _joint_chain(blocks, dense, factors, joinable, linked, program)
        if found is not None:
            blocks, joint, chains[joint] = found
            merge, densified = False, []
    if structure in (None, "mean-field") and limits.banded and not chains:
        candidates = [
            n for n, b in blocks.items()
            if b.family.gaussian and not b.point and not b.members and b.local is None and n not in options.families
            and b.size >= BANDED_MIN_DIM and linked(n) and (structure is None or b.family.dense_event)
        ]
        skip = set(members) if merge else set()
        chains = _separate_chains(blocks, dense, factors, program, [n for n in candidates if n not in skip])
    densified = [n for n in densified if n not in chains]
    if merge:
        members = [n for n in members if n not in chains]
        merge = len(members) > 1
    arrow = ()
    if structure is None and limits.arrowhead and not chains and not merge:
        found = _arrowhead_trial(blocks, dense, factors, joinable, program)
        if found is not None:
            arrow, members = found
            blocks, merge, densified = {**blocks, **dense}, True, []
    for n in densified:
        blocks[n] = dense[n]
    return Structure(blocks, members, merge, arrow, densified, chains, coupled_discrete_groups(blocks, factors))


def _plate_coupling(blocks: dict, factors: list, options: CompileOptions, undeclared=frozenset()) -> tuple:
    """``(coupled, densified, dense)``: the Gaussian blocks whose plate elements a factor
    mixes, those of them made dense, and the dense block of each.

    A factor that mixes the plate elements of a Gaussian block (a difference of neighbours,
    a sum over the plate) couples them: the block is dense over all its scalars, exact,
    unless the user asked for its family or for mean-field, it is too large for the
    default, or it is a local block of a subsampled plate (then its elements are fitted
    mean-field, iterated: see :func:`blrppl.compiler.conjugacy.conjugate_blocks`). A block
    whose rows no plate declared (``undeclared``: read off its prior) is made dense at any
    size unless mean-field is asked for: the model wrote one site, and its rows are apart
    only where no factor mixes them.
    """
    coupled = [n for n in _plate_coupled(blocks, factors) if n not in options.families and blocks[n].local is None]
    densified = [
        n for n in coupled
        if options.structure == "joint"
        or (options.structure is None and (blocks[n].size <= JOINT_MAX_DIM or n in undeclared))
    ]
    dense = {n: dataclasses.replace(blocks[n], family=fam.GaussianDense(blocks[n].size), plate_axes=()) for n in coupled}
    return coupled, densified, dense


def _apart(factors: list, on_support: set, structure: str | None) -> set:
    """The blocks that stay out of a joint block (none under ``structure="joint"``).

    A scale on log space that a factor with event dims reads (a random walk's step size):
    joined with the walk it would leave that factor Monte Carlo only (there is no quadrature
    over an event); apart, the factor's closed form holds. The blocks a product multiplies
    (``w * x``) stay apart: joined, the product would be quadratic in one block (no closed
    form); apart, each is a conjugate coordinate step (variational message passing). So does
    a scale on log space beside a product (a factor model's HalfCauchy noise scale): joined
    with the product's offset (a per-column mean) it would leave the likelihood Monte Carlo;
    apart, the Normal's closed form holds.
    """
    if structure == "joint":
        return set()
    apart = {
        n for f in factors if f.rule is not None and f.rule.event_ndim
        for a, k in f.arg_kinds if k == mom.ExpGaussian.kind for n in dict(f.arg_blocks)[a]
    }
    apart |= {n for f in factors for _, pairs in f.spec.pairs for pair in pairs for n in pair}
    apart |= on_support  # (seen through their moments, on their own only)
    apart |= {
        n for f in factors if f.spec.pairs
        for a, k in f.arg_kinds if k == mom.ExpGaussian.kind for n in dict(f.arg_blocks)[a]
    }
    return apart


def _joint_chain(blocks: dict, dense: dict, factors: list, joinable, linked, program) -> tuple | None:
    """``(blocks, joint, chain)`` when every joinable dense Gaussian together is a chain (a
    random walk, an AR(p), a state-space model with its initial state), with a banded
    precision; else None.

    Tried when they are several and long (a long vector site, or more scalar sites than a
    dense block holds: one per step of a Python loop): in model order (each site's scalars in
    turn), else with the sites of one length step by step (a state written as one site per
    component: level and slope).
    """
    every = [n for n, b in {**blocks, **dense}.items() if joinable(n, b)]
    total = sum(blocks[n].size for n in every)
    if not (len(every) > 1 and total >= BANDED_MIN_DIM and (
        any(blocks[n].size >= BANDED_MIN_DIM // 2 for n in every if linked(n)) or total > JOINT_MAX_DIM
    )):
        return None
    for order, interleaved in ((every, 0), time_major({**blocks, **dense}, every)):
        if order is None:
            break
        trial = merge_gaussians({**blocks, **dense}, order, interleaved)
        joint = next(n for n, b in trial.items() if b.members and not b.discrete)
        site_block = {m: joint for m in trial[joint].sites}
        chain = chain_bandwidth(
            joint, trial, factors, lambda fs, trial=trial, joint=joint: block_reads(program, trial, joint, fs),
            site_block, provisional=True,
        )
        if chain is not None and 3 * (2 * chain.bandwidth + 1) <= trial[joint].size:
            return {**trial, joint: banded_block(trial[joint], chain.bandwidth)}, joint, chain
    return None


def _separate_chains(blocks: dict, dense: dict, factors: list, program, candidates: list) -> dict:
    """Block → chain for each of ``candidates`` that is a chain on its own (under
    "mean-field" too, for a site whose block is dense: a scan's stacked steps; its posterior
    precision has the chain's band, so the banded block is the same q, fitted in O(n)); each
    such block of ``blocks`` is made banded in place."""
    chains = {}
    for n in candidates:
        trial = {**blocks, n: dense.get(n, blocks[n])}
        chain = chain_bandwidth(
            n, trial, factors, lambda fs, trial=trial, n=n: block_reads(program, trial, n, fs), provisional=True
        )
        if chain is not None and 3 * (2 * chain.bandwidth + 1) <= blocks[n].size:
            chains[n] = chain
            blocks[n] = banded_block(blocks[n], chain.bandwidth)
    return chains


def _arrowhead_trial(blocks: dict, dense: dict, factors: list, joinable, program) -> tuple | None:
    """``(dense spans, members)`` of an arrowhead joint block, or None.

    Beyond the dense limit, an arrowhead: members of which each factor element reads at most
    one scalar (per-student effects) get a diagonal precision, the others (per-question
    effects, a global mean) a dense one and the coupling between the two (item-response and
    hierarchical models). Locals are plate elements: a member without a plate is read whole,
    e.g. a regression's coefficient vector.
    """
    every = [n for n, b in {**blocks, **dense}.items() if joinable(n, b)]
    total = sum(blocks[n].size for n in every)
    if not (len(every) > 1 and total > JOINT_MAX_DIM and any(blocks[n].batch_shape for n in every)):
        return None
    trial = merge_gaussians({**blocks, **dense}, every)
    joint = next(n for n, b in trial.items() if b.members and not b.discrete)
    offsets = np.cumsum([0] + [m.size for m in trial[joint].members])
    spans = {m.name: (int(lo), int(hi)) for m, lo, hi in zip(trial[joint].members, offsets[:-1], offsets[1:])}
    site_block = {m: joint for m in trial[joint].sites}
    plated = {m: span for m, span in spans.items() if blocks[m].batch_shape}
    local = arrowhead_locals(
        joint, trial, factors, lambda fs, parts: block_reads(program, trial, joint, fs, parts), plated, site_block
    )
    if local and total - sum(spans[m][1] - spans[m][0] for m in local) <= JOINT_MAX_DIM:
        return tuple(spans[m] for m in every if m not in local), every
    return None


def fallback(estimates: Estimates, options: CompileOptions, limits: StructureLimits) -> StructureLimits | None:
    """The limits of the structure pass to run again with, or None when the estimates stand.

    A chain or an arrowhead is chosen on the factors' structure, before their final classes:
    a factor without closed form or quadrature would need draws of the whole block, which
    its view cannot give; its members are then fitted as without it. A large joint block
    that a Monte Carlo factor reads has its members fitted apart (see :data:`MC_JOINT_MAX_DIM`).
    """
    blocks, factors, chains = estimates.blocks, estimates.factors, estimates.chains
    for n in [*chains, *(b.name for b in blocks.values() if b.family.arrowhead)]:
        if any(n in f.neighbours and not estimator_of(f).reads_moments for f in factors):
            return limits._replace(arrowhead=limits.arrowhead and n in chains, banded=limits.banded and n not in chains)
    for n, b in blocks.items():
        joint = b.members and not b.discrete and not b.family.banded and not b.family.arrowhead
        if options.structure is None and joint:
            if b.size > MC_JOINT_MAX_DIM and any(n in f.neighbours and estimator_of(f).samples_jointly for f in factors):
                return limits._replace(merge_joint=False)
    return None


def _scales_of(n: str, members: list, factors: list) -> set:
    """The blocks of ``members`` other than ``n`` that a factor reads as a scale on log space
    (an argument ``exp(z)``: a walk's step size, an observation noise) beside another
    argument that reads block ``n`` (not ``exp(mu + x)``'s level ``mu``: one argument)."""
    out = set()
    for f in factors:
        reads = dict(f.arg_blocks)
        for a, k in f.arg_kinds:
            if k == mom.ExpGaussian.kind and any(n in reads[b] for b, _ in f.arg_kinds if b != a):
                out |= {m for m in reads[a] if m != n and m in members}
    return out


def _plate_coupled(blocks: dict, factors: list) -> list:
    """The Gaussian blocks with independent elements (plate elements, or a diagonal
    family's scalars) that some closed-form factor mixes (its arguments use them through
    ``"full"`` columns, see :class:`blrppl.graph.plan.Factor`)."""
    out = []
    for f in factors:
        for n, columns in f.columns:
            b = blocks[n]
            if columns == "full" and b.family.gaussian and b.batch_shape and n not in out:
                out.append(n)
    return out
