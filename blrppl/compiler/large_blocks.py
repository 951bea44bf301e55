"""Large continuous blocks without closed forms (a network's weights): IVON's family.

A Monte Carlo factor that reads many Gaussian scalars at once, the likelihood of a neural
network written as a NumPyro model (its weights ``sample`` sites, or a
``random_flax_module``), cannot be served by the dense or Hessian-based messages of smaller
blocks: a dense block of d scalars holds d × d matrices and factorises them at every step,
the exact Hessian takes d Hessian-vector products a draw, Hutchinson's diagonal one a draw
at each of 16 draws, and Stein's estimate of a d × d curvature from 16 draws has rank 16.
Such blocks get IVON's elementwise Gaussian instead
(:class:`blrppl.families.GaussianIVON`: one draw and one gradient per step, O(d) memory),
the choice of the pass :func:`ivon_blocks` after the structure pass.
"""

from __future__ import annotations

import dataclasses

from blrppl import families as fam
from blrppl.compiler.stages import CompileOptions, Structure
from blrppl.estimators.registry import estimator_of

#: a Monte Carlo factor whose free Gaussian neighbours hold at least this many scalars in all
#: gets them as IVON blocks. At 1024 scalars a dense block's matrices take 8 MB each in
#: float64 and a factorisation ~0.4 GFLOP, several per step, against a few MFLOP for a
#: gradient of a small network: beyond it the step costs orders of magnitude more than
#: IVON's; and its curvature from a few draws per step is far too noisy already at a tenth
#: of it (:data:`blrppl.compiler.structure.MC_JOINT_MAX_DIM`). No model of the golden plans
#: (tests/plans) comes near it: their largest such groups are chains, which keep their
#: banded structure.
IVON_MIN_DIM = 1024


def ivon_blocks(structure: Structure, factors, options: CompileOptions) -> Structure:
    """``structure`` with the blocks of large Monte Carlo groups made IVON blocks.

    For every factor whose provisional estimator draws from q (no closed form), its free
    Gaussian neighbours are summed: when they hold at least :data:`IVON_MIN_DIM` scalars,
    each of them becomes a :class:`blrppl.families.GaussianIVON` block of its own value
    shape. A free neighbour is a continuous Gaussian block that is not a point, not local
    to a subsampled plate, not a chain, not merged into the joint block, and whose family
    the user did not choose (``families=`` keeps its word).

    Args:
        structure: the structure pass's result.
        factors: the factors with their provisional estimators (the family pass's).
        options: the checked options.

    Returns:
        The structure, with those blocks replaced (and no longer made dense over their
        plate elements).
    """
    blocks = structure.blocks
    held = set(structure.chains) | (set(structure.members) if structure.merge else set())

    def free(n):
        b = blocks.get(n)
        return (
            b is not None and b.family.gaussian and not b.point and b.local is None and not b.members
            and not b.family.reparam_curvature and n not in held and n not in options.families
        )

    chosen = set()
    for f in factors:
        estimator = estimator_of(f)
        if estimator.closed_form or not estimator.draws:
            continue
        group = [n for n in f.neighbours if free(n)]
        if sum(blocks[n].size for n in group) >= IVON_MIN_DIM:
            chosen.update(group)
    if not chosen:
        return structure
    new = dict(blocks)
    for n in chosen:
        new[n] = _ivon_block(blocks[n])
    return structure._replace(blocks=new, densified=[n for n in structure.densified if n not in chosen])


def _ivon_block(block):
    """The block as an IVON block: elementwise over its value shape (no plate axes)."""
    family = fam.GaussianIVON.for_value(block.value_shape)
    return dataclasses.replace(block, family=family, kind=family.name, plate_axes=())
