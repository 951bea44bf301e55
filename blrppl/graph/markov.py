"""Chains of discrete latents: which states each factor element reads.

A group of discrete blocks (the sites some factors enumerate together) is a sequence of
*positions*: the members' values flattened in C order and concatenated in model order. The
enumeration estimator (:mod:`blrppl.estimators.enumeration`) sets every position of a block
to one value at once, which is exact when each factor element reads its *aligned* position
of each block (the element of the block's value that broadcasting pairs with it: a mixture's
``y[i]`` reads ``z[i]``). A hidden Markov chain breaks that: in ``scan``, ``x[t]``'s
probabilities read ``x[t − 1]``; with ``x[:-1]`` and ``x[1:]`` the pairing shifts.

Which positions each element of a factor's log-density reads is read off the model's
program (:func:`blrppl.compiler.reads.group_positions`: the positions as granules of the
element reads of :mod:`blrppl.model.elements`), exactly: one position, a pair, or more
(a factor no first-order chain holds). :func:`position_reads` turns them into
:class:`Reads`, :func:`is_aligned` tells the enumeration's own case.

The group is a *chain* when every element reads at most two positions and every pair is
(p, p + s) for one stride s: position p is state t = p // s of chain c = p mod s (a site of
shape (T, N) written by ``scan`` over T: s = N; one site of shape (N,) per step of a Python
loop: s = N).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from blrppl.errors import UnsupportedFactorError
from blrppl.graph.plan import FactorRole
from blrppl.model import elements as el

class Reads:
    """Per element of a factor (its wrapped distribution's batch shape), the group positions
    it reads: ``lo`` and ``hi`` (−1 for none; ``hi`` is −1 for an element reading one
    position, else ``hi = lo + stride``). Static arrays, compared by identity."""

    def __init__(self, lo: np.ndarray, hi: np.ndarray):
        self.lo, self.hi = lo, hi

    def __repr__(self):
        return f"Reads(shape={self.lo.shape})"


class ChainLayout(NamedTuple):
    """Positions p = t·width + c: ``width`` independent chains of ``length`` states."""

    length: int
    width: int


def aligned_reads(members, factor, batch_shape) -> tuple | None:
    """The positions each element of ``factor`` reads if it reads its aligned element of
    each member it touches (broadcasting), as a tuple of arrays of ``batch_shape``
    (one per touched member), or None when a member does not broadcast to the factor."""
    out, offset = [], 0
    for m in members:
        size = int(math.prod(m.value_shape))
        if m.name in factor.discrete:
            index = np.arange(size).reshape(m.value_shape) + offset
            try:
                if np.broadcast_shapes(index.shape, batch_shape) != tuple(batch_shape):
                    return None
            except ValueError:
                return None
            out.append(np.broadcast_to(index, batch_shape))
        offset += size
    return tuple(out)


def position_reads(found) -> "Reads | None":
    """The :class:`Reads` of a factor's elements from what the program says they read of the
    group's positions (:class:`blrppl.model.elements.Reads`), or None when an element reads
    more than two positions or one an index the program does not know chooses."""
    count = np.asarray(found.count)
    if np.any((count >= el.SEVERAL) | (count == el.AT_MOST_ONE)):
        return None
    lo = np.where(count >= 1, found.lo, -1).astype(np.int64)
    hi = np.where(count == 2, found.hi, -1).astype(np.int64)
    return Reads(lo, hi)


def is_aligned(members, factor, reads: Reads) -> bool:
    """Whether every element of ``factor`` reads only its aligned positions (the
    enumeration's assumption)."""
    index = aligned_reads(members, factor, reads.lo.shape)
    if index is None:
        return False
    for r in (reads.lo, reads.hi):
        ok = r < 0
        for i in index:
            ok = ok | (r == i)
        if not np.all(ok):
            return False
    return True


def aligned_chain_reads(members, factors, batch_shape_of) -> dict | None:
    """Factor → :class:`Reads` when every factor touching several sites (one per step of a
    loop) reads its aligned element of at most two of them, else None (``batch_shape_of``:
    factor → its element-wise batch shape)."""
    names = {m.name for m in members}
    reads = {}
    for f in factors:
        if f.role != FactorRole.SITE or not set(f.discrete) & names:
            continue
        index = aligned_reads(members, f, batch_shape_of(f))
        if index is None or len(index) > 2:
            return None
        lo, hi = (index[0], np.full(index[0].shape, -1)) if len(index) == 1 else (np.minimum(*index), np.maximum(*index))
        reads[f.name] = Reads(lo.astype(np.int64), hi.astype(np.int64))
    return reads


def unsupported(f, group, touching=()) -> UnsupportedFactorError:
    """The error for factor ``f``, whose reading of the discrete blocks ``group`` no chain
    holds (``touching``: the factors reading the group, to say why its blocks are one)."""
    together = [g.name for g in touching if len(set(g.discrete) & set(group)) > 1]
    if len(group) > 1 and together:
        # (several latents read together by some factor are one chain of their states in
        # turn; the factor at fault may read only one of them, e.g. a factorial HMM's w)
        listed = ", ".join(f"'{n}'" for n in together)
        why = (
            f"the discrete latents {', '.join(group)} form one chain together (read at once by {listed}), and "
            f"factor '{f.name}' reads that chain in a pattern no first-order chain holds (states more than one "
            "place apart in it: a factorial or second-order hidden Markov model); write them as one latent over "
            "the product of their values, or sum the chain out yourself (a forward algorithm in numpyro.factor)"
        )
    else:
        why = (
            f"factor '{f.name}' reads the discrete latents {', '.join(group)} in a pattern no first-order chain "
            "holds (an element reads more than two of them: a sum over them, or a second-order hidden Markov "
            "model); write the extra lag into the state (one latent over pairs of states), or sum the chain out "
            "yourself (a forward algorithm in numpyro.factor)"
        )
    return UnsupportedFactorError(why, site=f.name)


def chain_layout(reads: dict, size: int) -> ChainLayout | None:
    """The chain layout the readings fit (every pair (p, p + s) for one stride s, s dividing
    the number of positions), or None when no element reads two positions or they do not."""
    strides = set()
    for r in reads.values():
        pair = r.hi >= 0
        if pair.any():
            strides |= set(np.unique(r.hi[pair] - r.lo[pair]).tolist())
    if len(strides) != 1:
        return None
    (s,) = strides
    if s <= 0 or size % s:
        return None
    return ChainLayout(size // s, s)
