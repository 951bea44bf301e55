"""The final blocks and their factors' estimators."""

from __future__ import annotations

import dataclasses


from blrppl.estimators.enumeration import with_enumeration
from blrppl.estimators.monte_carlo import MONTE_CARLO, elementwise_bijection
from blrppl.estimators.quadrature import QUADRATURE, QuadratureSpec
from blrppl.estimators.registry import estimator_of
from blrppl.graph.plan import Block, EstimatorSpec, Factor, FactorRole
from blrppl.compiler.stages import CompileOptions, Dependencies, Estimates, FamilyChoice, SiteInputs, Structure
from blrppl.compiler.blocks import (
    arrowhead_block, block_init_values, merge_discrete, merge_gaussians, site_fill, is_transformed, site_transforms,
)
from blrppl.compiler.classify import classify_factors


def estimate(
    inputs: SiteInputs, found: Dependencies, choice: FamilyChoice, structure: Structure, options: CompileOptions
) -> Estimates:
    """The final blocks (merged as ``structure`` says) and every factor's estimator on them,
    with the log|det J| terms of the blocks on an unconstrained space."""
    blocks, fns, init_values, factors = structure.blocks, choice.fns, choice.init_values, choice.factors
    if (
        not structure.merge and not structure.coupled_discrete and not structure.densified and not structure.chains
        and not choice.chain_reads
    ):
        factors = classify_factors(
            inputs.records, inputs.rules, found.deps, blocks, cache=choice.cache, elementwise=found.elementwise,
            forms=found.forms, program=found.program,
        )
    else:
        blocks, fns, init_values, factors = _merged(inputs, found, choice, structure, options)
    factors = [
        with_enumeration(f, chain_reads=choice.chain_reads[f.name]) if f.name in choice.chain_reads else f
        for f in factors
    ]
    factors = [_scalar_columns(f, structure.chains) for f in factors]
    factors += [
        _jacobian_factor(b)
        for b in blocks.values()
        if is_transformed(b) and not b.param and not (b.point and options.point_space == "constrained")
    ]
    return Estimates(blocks, factors, fns, init_values, structure.chains)


def _merged(inputs: SiteInputs, found: Dependencies, choice: FamilyChoice, structure: Structure, options) -> tuple:
    """``(blocks, fns, init_values, factors)`` with the blocks ``structure`` merges merged and
    the factors classified on them."""
    blocks = structure.blocks
    for group in structure.coupled_discrete:
        blocks = merge_discrete(blocks, group)
    if structure.merge:
        blocks = merge_gaussians(blocks, structure.members)
    if structure.arrow:
        joint = next(n for n, b in blocks.items() if b.members and not b.discrete)
        blocks[joint] = arrowhead_block(blocks[joint], structure.arrow)
    init_values = block_init_values(blocks, inputs.site_init, inputs.unconstrained)
    joints = {n: b for n, b in blocks.items() if b.members and not b.discrete}
    fns = inputs.functions(site_fill(blocks, inputs.site_init, inputs.unconstrained), site_transforms(blocks), joints)
    site_block = {s: n for n, b in blocks.items() for s in b.sites}
    site_reads = {name: frozenset().union(*args.values()) for name, args in found.deps.items()}
    deps = {
        name: {arg: frozenset(site_block[x] for x in d) for arg, d in args.items()}
        for name, args in found.deps.items()
    }
    factors = classify_factors(
        inputs.records, inputs.rules, deps, blocks, elementwise=found.elementwise, forms=found.forms,
        program=found.program, site_reads=site_reads,
    )
    return blocks, fns, init_values, factors


def _scalar_columns(f: Factor, chains: dict) -> Factor:
    """The factor with ``"scalar"`` columns for each chain it reads one scalar of per
    element (:class:`blrppl.graph.band.Chain`), when its messages come from its arguments'
    moments (closed form or quadrature): their covariances are then the diagonal of the
    chain's Σ (:meth:`blrppl.families.GaussianBanded.scalar_tangent_sets`)."""
    if not estimator_of(f).reads_moments:
        return f
    columns = tuple((n, "scalar" if n in chains and f.name in chains[n].scalar_reads else mode) for n, mode in f.columns)
    return f if columns == f.columns else dataclasses.replace(f, columns=columns)


def _jacobian_factor(block: Block) -> Factor:
    """The log|det J| term of a Gaussian block on an unconstrained space."""
    transforms = [m.transform for m in (block.members or (block,)) if m.transform is not None]
    elementwise = all(elementwise_bijection(t) is not None for t in transforms)
    return Factor(
        name=f"{block.name}:jacobian",
        dist_name="log|det J| (" + ", ".join(sorted({type(t).__name__ for t in transforms})) + ")",
        observed=False,
        neighbours=(block.name,),
        discrete=(),
        estimator=(QUADRATURE if elementwise else MONTE_CARLO).name,
        rule=None,
        arg_kinds=(),
        arg_blocks=(),
        columns=(),
        reinterpreted_ndim=0,
        role=FactorRole.JACOBIAN,
        spec=QuadratureSpec() if elementwise else EstimatorSpec(),
    )
