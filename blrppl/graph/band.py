"""Chains: the bandwidth of a Gaussian block's coupling, read off the factors' element reads.

A Gaussian block of n scalars (a site's value flattened in C order) is a *chain* of
half-bandwidth b when every element of every factor touching it reads, through all its
arguments, scalars within b + 1 consecutive positions (a random walk: b = 1; an AR(p) or a
p-lag ``scan``: b = p; a state-space model with a d-dimensional state stored time-major:
b ≤ 2d − 1). Its posterior precision is then banded with half-bandwidth b and
:class:`blrppl.families.GaussianBanded` holds it exactly.

Which positions each element reads comes from the model's program
(:func:`blrppl.compiler.reads.block_reads`: the positions as granules of the element reads
of :mod:`blrppl.model.elements`): the lowest and highest it reads bound its span, exactly. The
same reading tells, per factor, whether each of its elements reads one scalar (b = 0), as a
chain's observations ``y[t] ~ Poisson(exp(x[t]))`` do: their moments then need the two rows
(:meth:`blrppl.families.GaussianBanded.scalar_tangent_sets`), not the 2(2b + 1).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from blrppl.estimators.registry import estimator_of
from blrppl.graph.plan import FactorRole
from blrppl.model import elements as el

#: the half-bandwidths a chain may have
CANDIDATES = (1, 2, 3, 4, 6, 8)


def _qualifies(factor, provisional: bool) -> bool:
    """Whether a factor's estimator lets a block it touches be a chain or an arrowhead: it
    reads the block through its arguments' moments (closed form, quadrature), or, while
    the compiler's family policy iterates (``provisional``), it is a provisional choice
    that the final classification may replace (a logistic or
    Student-t observation of a chain gets quadrature)."""
    estimator = estimator_of(factor)
    return estimator.reads_moments or (provisional and estimator.provisional)


class Chain(NamedTuple):
    """What the reading found of a chain: its half-bandwidth, and the factors each of whose
    elements reads one scalar of it (through all its arguments)."""

    bandwidth: int
    scalar_reads: frozenset


def _touching(name: str, factors, site_block: dict | None, provisional: bool):
    """The factors of the block ``name`` (site factors), or None when one of them does not
    qualify (:func:`_qualifies`) or there is none."""
    site_block = site_block or {}
    touching = [
        f for f in factors
        if name in {site_block.get(m, m) for m in f.neighbours} and f.role == FactorRole.SITE
    ]
    if not touching or not all(_qualifies(f, provisional) for f in touching):
        return None
    return touching


def chain_bandwidth(
    name: str, blocks: dict, factors, reads_of, site_block: dict | None = None, provisional: bool = False,
) -> Chain | None:
    """The smallest half-bandwidth b in :data:`CANDIDATES` such that the block ``name`` is a
    chain of bandwidth b (see the module docstring), with the factors that read one scalar
    per element; or None.

    Only blocks whose factors' estimators read them through the moments of their arguments
    qualify (closed form and quadrature; with ``provisional``, the compiler's provisional
    Monte Carlo ones too: it checks the final classes). ``site_block`` maps
    the sites the factors name as neighbours to the block holding them, when ``blocks``
    merges some.

    Args:
        reads_of: ``factors → {factor: Reads}``, what each element of each factor reads of
            the block's positions (:func:`blrppl.compiler.reads.block_reads`), asked for
            only when the block may be a chain.
    """
    n = blocks[name].size
    touching = _touching(name, factors, site_block, provisional)
    candidates = [b for b in CANDIDATES if 2 * b + 1 < n]
    if n < 3 or touching is None or not candidates:
        return None
    found = reads_of(touching)
    width, scalar = 0, set()
    for f in touching:
        r = found.get(f.name, _NO_READS)
        if r is None:
            return None
        count = np.asarray(r.count)
        if np.any(count == el.AT_MOST_ONE):
            return None  # (a position an index the program does not know chooses)
        some = count != 0
        if np.any(some):
            width = max(width, int(np.max(np.where(some, r.hi - r.lo, 0))))
        if np.all(count <= 1):
            scalar.add(f.name)
    fitting = [b for b in candidates if b >= width]
    return Chain(fitting[0], frozenset(scalar)) if fitting else None


#: the reads of a factor that reads nothing of the block
_NO_READS = el.Reads(np.full((), el.NONE), np.full((), el.NONE), np.zeros((), int))


def arrowhead_locals(name: str, blocks: dict, factors, reads_of, spans: dict, site_block: dict | None = None) -> tuple:
    """The largest set of the candidate parts ``spans`` (part → (start, stop) positions in the
    block ``name``) such that every element of every factor touching the block reads at most
    one scalar of their union, through all its arguments: the block's posterior precision is
    then an arrowhead (diagonal over those *local* scalars, dense over the rest and between
    the two: :class:`blrppl.families.GaussianArrowhead`). Empty when none is.

    The factors' estimators are those of the blocks before the merge (a gather of a
    per-site block can leave a factor Monte Carlo that the merged block gives quadrature):
    only the arguments' structure is read here, and the compiler checks the final ones.

    Args:
        reads_of: ``(factors, parts) → {factor: {part: Reads}}``, what each element of each
            factor reads of each part's positions (:func:`blrppl.compiler.reads.block_reads`).
    """
    touching = _touching(name, factors, site_block, provisional=True)
    parts = [p for p in spans if spans[p][1] - spans[p][0] >= 2]
    if touching is None or not parts:
        return ()
    found = reads_of(touching, {p: spans[p] for p in parts})
    # per factor and part: how many scalars of the part each element reads (at most one
    # unknown counts as one; several as two: more than a local part allows)
    counts = []
    for f in touching:
        r = found.get(f.name, {})
        if r is None:
            return ()
        counts.append({p: np.clip(np.abs(np.asarray(r[p].count)), 0, 2) for p in r})
    best = ()
    for size in range(1, len(parts) + 1):
        for chosen in itertools.combinations(parts, size):
            fits = all(
                np.all(sum((c[p] for p in chosen if p in c), np.zeros((), int)) <= 1) for c in counts
            )
            total = sum(spans[p][1] - spans[p][0] for p in chosen)
            if fits and total > sum(spans[p][1] - spans[p][0] for p in best):
                best = chosen
    return best
