"""Chains of discrete latents: which states each factor element reads, found by probing.

A group of discrete blocks (the sites some factors enumerate together) is a sequence of
*positions*: the members' values flattened in C order and concatenated in model order. The
enumeration estimator (:mod:`blrppl.estimators.enumeration`) sets every position of a block
to one value at once, which is exact when each factor element reads its *aligned* position
of each block (the element of the block's value that broadcasting pairs with it: a mixture's
``y[i]`` reads ``z[i]``). A hidden Markov chain breaks that: in ``scan``, ``x[t]``'s
probabilities read ``x[t − 1]``; with ``x[:-1]`` and ``x[1:]`` the pairing shifts.

So the factors are probed. Each factor's element-wise log-density (its masks removed: the
reading is the model's structure, not the data's) is evaluated with the continuous latents
at a random point and the discrete positions at a random base
configuration, then with the positions of a set S moved to other values; an element
*depends on S* when its log-density changes, or its distribution's parameters (a
Categorical's row of probabilities), or (a site of the group) its own value: a known
transition table's ties (equal off-diagonal entries, the rows of a symmetric two-state table
swapped when both states move) leave the log-density at the value unchanged for every move.
With S = {p : bit j of p is 1} and its complement for every bit j, an element reading one
position p learns p; one reading two positions learns the bits they share and those where
they differ; one more set of probes per lowest differing bit j₀ (S = {bit j₀ and bit j set})
tells which position holds which bits.
Every decoded reading is then checked on random sets S: an element that reads more than two
positions (a second-order chain) fails the check. The probes are repeated from several random
base configurations with random moves, so that a dependence one round misses (two states
with equal parameters) still shows; the check's rounds are drawn apart from the probe's.
When the check fails, the group is probed once more, thoroughly (more rounds, positions of a
moved set sometimes staying, the log-density at every value of a small support: a
``numpyro.factor`` over a tied table has nothing else to read).

The group is a *chain* when every element reads at most two positions and every pair is
(p, p + s) for one stride s: position p is state t = p // s of chain c = p mod s (a site of
shape (T, N) written by ``scan`` over T: s = N; one site of shape (N,) per step of a Python
loop: s = N).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.errors import ResourceError, UnsupportedFactorError, is_out_of_memory, out_of_memory_detail
from blrppl.model.probes import random_point
from blrppl.model.program import strip_masks
from blrppl.runtime.compile import compile_lowered, compiler_options, jit
from blrppl.graph.plan import FactorRole, site_values

#: random sets each decoded reading is checked on (per probe round)
_CHECKS = 6
#: positions evaluated at once by the probe (rounds × sets × positions)
_BUDGET = 1 << 22


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


def _positions(members) -> tuple:
    sizes = [int(math.prod(m.value_shape)) for m in members]
    return sizes, int(sum(sizes))


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


#: probe rounds: each with its own random base configuration and its own random move of
#: every position (a dependence a round misses because two states' parameters tie shows in
#: another round)
_ROUNDS = 8
#: supports of at most this many values are read whole by the probe (:func:`_readings`; a
#: larger one, e.g. a vocabulary's emissions, would multiply the probe's memory by its size)
_SUPPORT_READINGS = 16
#: rounds of a probe's second try, when the readings its first decoded fail their check
_THOROUGH_ROUNDS = 48


class Probe:
    """Evaluations of the factors touching a group of discrete blocks (``group``: names of
    single-site blocks in model order) at moved positions (module docstring)."""

    def __init__(
        self, group: tuple, blocks: dict, factors: list, fns, data, rng: np.random.Generator, rounds: int = _ROUNDS,
        thorough: bool = False,
    ):
        self.group, self.rounds, self.thorough = group, rounds, thorough
        self._args = (group, blocks, factors, fns, data, rng)
        self.members = [blocks[n] for n in group]
        sizes, self.size = _positions(self.members)
        # per position: its member's number of values, and the offset of its values in the
        # concatenation of the members' supports (members may have different supports)
        counts = [len(m.support_values) for m in self.members]
        self.k = np.repeat(counts, sizes)
        self.offset = np.repeat(np.cumsum([0] + counts[:-1]), sizes)
        self.support = np.concatenate([np.asarray(m.support_values) for m in self.members])
        self.touching = [f for f in factors if f.role == FactorRole.SITE and set(f.discrete) & set(group)]
        others = {n for f in self.touching for n in f.neighbours if n not in group}
        self.point = {n: np.asarray(random_point(blocks[n], rng)) for n in others}
        self.fns, self.data, self.rng = fns, data, rng
        # sets of positions per compiled evaluation: every stage's sets are evaluated by one
        # compiled program, all rounds of a chunk of sets at once (one pass of a ``scan``
        # model for all of them), the chunk as wide as the memory budget allows
        self.width = int(np.clip(_BUDGET // (rounds * self.size), 1, max(2 * _bits(self.size), _CHECKS)))
        self._compiled = {}
        self._random = None
        self.bases = rng.integers(0, self.k, size=(rounds, self.size))
        # (a thorough probe's moved sets leave some positions put: see :meth:`thorough_probe`)
        low = 0 if thorough else 1
        self.moved = (self.bases + rng.integers(low, np.maximum(self.k, 2), size=(rounds, self.size))) % self.k
        # the random sets' rounds are drawn apart: a reading every probe round missed (its
        # table tied at each of their moves) is checked from other configurations
        self.check_bases = rng.integers(0, self.k, size=(rounds, self.size))
        shift = rng.integers(low, np.maximum(self.k, 2), size=(rounds, self.size))
        self.check_moved = (self.check_bases + shift) % self.k

    def thorough_probe(self) -> "Probe":
        """The same probe with :data:`_THOROUGH_ROUNDS` rounds in which each position of a
        moved set stays put with probability 1/K: a factor whose table is unchanged when
        both states it reads move alike (``log(T)[x[:-1], x[1:]]`` with T symmetric over two
        states) still changes when only one of them moves."""
        return Probe(*self._args, rounds=_THOROUGH_ROUNDS, thorough=True)

    def depends(self, sets: np.ndarray, width: int | None = None, check: bool = False) -> dict:
        """Sets ``(S, P)`` (bool) → factor → ``(S, *batch)`` bool: whether what the element
        reads (:func:`_readings`) changes when the set's positions move, in some round (``width``: sets
        per compiled evaluation, at most :attr:`width`; ``check``: from the check's rounds)."""
        names = tuple(f.name for f in self.touching)
        # (a scan model's steps as a map: values equal to the scan as written, and a probe
        # of a 10⁵-step chain runs ~100 of them: 4.8 -> 1.1 s)
        fns, point, members, support = self.fns.vectorised(), self.point, self.members, jnp.asarray(self.support)
        group, thorough = self.group, self.thorough
        offset = jnp.asarray(self.offset)

        def log_probs(z, data):
            # (masks removed: what an element reads is the model's structure, the same for
            # every mask the data give, e.g. sequences' lengths; a masked element's term is
            # zero in the fit whatever it reads)
            values = {**point, **site_values(members, support[offset + z])}
            sites = fns.sites(names, values, data)
            return [_readings(strip_masks(sites[n]["fn"]), sites[n]["value"], n in group, thorough) for n in names]

        def run(sets, bases, moved, data):
            ref = jax.vmap(lambda z: log_probs(z, data))(bases)
            configs = jnp.where(sets[:, None], moved[None], bases[None]).reshape(-1, self.size)
            out = jax.vmap(lambda z: log_probs(z, data))(configs)
            changed = []
            for now, was in zip(out, ref):  # (readings of one factor: rounds × elements each)
                differs = False
                for x, r in zip(now, was):
                    x = x.reshape((len(sets),) + r.shape)
                    tol = jnp.sqrt(jnp.finfo(r.dtype).eps) * (1.0 + jnp.abs(r))
                    differs = differs | (jnp.abs(x - r) > tol) | (jnp.isfinite(x) != jnp.isfinite(r))
                changed.append(jnp.any(differs, 1))
            return changed

        count = len(sets)
        width = min(width or self.width, self.width)
        pad = (-count) % width
        chunks = np.concatenate([sets, np.zeros((pad, self.size), bool)]).reshape(-1, width, self.size)
        try:
            if width not in self._compiled:
                lowered = jit(run).lower(chunks[0], self.bases, self.moved, self.data)
                self._compiled[width] = compile_lowered(lowered, compiler_options(self.data))
            bases, moved = (self.check_bases, self.check_moved) if check else (self.bases, self.moved)
            outs = [self._compiled[width](c, bases, moved, self.data) for c in chunks]
            # (read inside: an allocation that fails does so when the result is read)
            return {n: np.concatenate([np.asarray(o[j]) for o in outs])[:count] for j, n in enumerate(names)}
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            readers = [n for n in names if n not in self.group] or list(names)
            listed = ", ".join(f"'{n}'" for n in readers)
            raise ResourceError(
                f"evaluating the log density of {listed} at {(width + 1) * self.rounds} values of the discrete latents "
                f"{', '.join(repr(n) for n in self.group)} at once (to find which of them each element reads) "
                f"needs more memory than this machine has ({out_of_memory_detail(exc)}): the distribution "
                "builds large arrays for each element (e.g. a series for its normalising constant); fit fewer "
                "elements, or sum the discrete latent out in the model",
                site=readers[0] if len(readers) == 1 else None,
            ) from None

    def random_sets(self) -> tuple:
        """(random sets of positions ``(S, P)``, :meth:`depends` on them): computed once,
        read by the alignment test and by the check of decoded readings."""
        if self._random is None:
            sets = self.rng.random((_CHECKS, self.size)) < 0.5
            # (a program of their own width: most groups are aligned and probed no further,
            # and evaluating padding sets cost a 2,000-point mixture 2 s of its compile)
            self._random = (sets, self.depends(sets, width=_CHECKS, check=True))
        return self._random


def _per_element(x, elements: tuple) -> list:
    """``[r]``, r of shape ``elements``: ``x`` broadcast to the elements (as numpy broadcasts a
    distribution's parameter to its batch shape when it has no more axes than they do; else
    its leading axes) and its trailing axes folded by a fixed generic projection (two
    different rows of a table fold to different numbers); [] for a leaf of another layout."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.result_type(float))
    lead = x.shape if x.ndim <= len(elements) else x.shape[: len(elements)]
    try:
        if jnp.broadcast_shapes(lead, elements) != elements:
            return []
    except ValueError:
        return []
    if x.ndim <= len(elements):
        return [jnp.broadcast_to(x, elements)]
    rows = x.reshape(lead + (-1,))
    weights = jnp.asarray(np.cos(np.arange(rows.shape[-1]) * 2.399963 + 0.5), x.dtype)  # (golden-angle cosines)
    return [jnp.broadcast_to(jnp.sum(rows * weights, -1), elements)]  # (a reduction XLA fuses with the gather)


def _readings(fn, value, member: bool, thorough: bool) -> list:
    """What an element's log-density reads, as arrays of the elements' shape: its
    log-density at the value; the distribution's parameters (its pytree leaves, e.g. a
    Categorical's row of probabilities); for a site of the group, its own value (read by its
    log-density whatever the ties of its table); in a :meth:`Probe.thorough_probe` probe, its
    log-density at every value of a small enumerable support too (a ``numpyro.factor`` has
    no parameter but its value). A tie at the value (a transition table's equal off-diagonal
    entries, a symmetric table's rows swapped) leaves the others changed."""
    lp = fn.log_prob(value)
    out = [lp]
    elements = jnp.shape(lp)
    for leaf in jax.tree.leaves(fn):
        out += _per_element(leaf, elements)
    if member:
        out += _per_element(value, elements)
    if thorough and getattr(fn, "has_enumerate_support", False):
        try:
            support = fn.enumerate_support(expand=False)
            at_support = fn.log_prob(support) if support.shape[0] <= _SUPPORT_READINGS else None
        except Exception:  # (e.g. a support that needs concrete parameters: an optional reading)
            at_support = None
        if at_support is not None and at_support.shape[1:] == elements:
            out += _per_element(jnp.moveaxis(at_support, 0, -1), elements)
    return out


def _bits(size: int) -> int:
    """Bits of the largest position index."""
    return max(1, int(math.ceil(math.log2(max(size, 2)))))


def is_aligned(probe: Probe) -> bool:
    """Whether every factor element reads exactly its aligned positions (the enumeration's
    assumption), on random sets of positions."""
    sets, observed = probe.random_sets()
    for f in probe.touching:
        lp = observed[f.name]
        index = aligned_reads(probe.members, f, lp.shape[1:])
        if index is None:
            return False
        predicted = np.zeros(lp.shape, bool)
        for i in index:
            predicted = predicted | sets[:, i]
        # (an element whose log-density does not change reads nothing: a masked element)
        if np.any(observed[f.name] & ~predicted):
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


def probe_reads(probe: Probe) -> dict:
    """Factor name → :class:`Reads` in the group's positions, by the bit probes of the
    module docstring; when the readings fail their check, once more by a
    :meth:`Probe.thorough_probe` probe (a table's ties can hide a reading from every round).

    Raises:
        UnsupportedFactorError: an element reads more than two positions, or its reading is
            not consistent (a factor no first-order chain holds).
    """
    try:
        return _decoded_reads(probe)
    except UnsupportedFactorError:
        if probe.thorough:
            raise
    return _decoded_reads(probe.thorough_probe())


def _decoded_reads(probe: Probe) -> dict:
    """:func:`probe_reads` from one probe."""
    size, group = probe.size, probe.group
    bits = _bits(size)
    index = np.arange(size)
    bit_sets = np.stack([(index >> j) & 1 == 1 for j in range(bits)] + [(index >> j) & 1 == 0 for j in range(bits)])
    first = probe.depends(bit_sets)
    decoded, j0s = {}, set()
    for f in probe.touching:
        d = first[f.name]
        ones, zeros = d[:bits], d[bits:]  # (bits, *batch)
        weights = (1 << np.arange(bits)).reshape((-1,) + (1,) * (d.ndim - 1))
        both = ones & zeros  # bits where the two positions read differ
        none = ~ones.any(0) & ~zeros.any(0)
        common = np.sum(np.where(ones & ~zeros, weights, 0), 0)
        pair = both.any(0)
        j0 = np.where(pair, np.argmax(both, 0), -1)
        decoded[f.name] = (none, common, both, pair, j0, weights)
        j0s |= set(np.unique(j0[pair]).tolist())
    conditional = {}
    if j0s:
        j0s = sorted(j0s)
        sets = np.stack([((index >> a) & 1 == 1) & ((index >> j) & 1 == 1) for a in j0s for j in range(bits)])
        out = probe.depends(sets)
        conditional = {n: {a: d[i * bits : (i + 1) * bits] for i, a in enumerate(j0s)} for n, d in out.items()}
    result = {}
    for f in probe.touching:
        none, common, both, pair, j0, weights = decoded[f.name]
        lo = np.where(none, -1, common).astype(np.int64)
        hi = np.full(lo.shape, -1, np.int64)
        if pair.any():
            differ = np.sum(np.where(both, weights, 0), 0)
            upper = common
            for a, d in conditional[f.name].items():
                # the position with bit j0 set has bit j set where the probe of (j0, j) moved it
                upper = np.where(pair & (j0 == a), np.sum(np.where(d, weights, 0), 0), upper)
            lower = upper ^ differ
            lo = np.where(pair, np.minimum(lower, upper), lo)
            hi = np.where(pair, np.maximum(lower, upper), hi)
        if np.any(lo >= size) or np.any(hi >= size):
            raise unsupported(f, group, probe.touching)
        result[f.name] = Reads(lo, hi)
    sets, observed = probe.random_sets()
    for f in probe.touching:
        r = result[f.name]
        predicted = np.where(r.lo >= 0, sets[:, np.clip(r.lo, 0, None)], False)
        predicted = predicted | np.where(r.hi >= 0, sets[:, np.clip(r.hi, 0, None)], False)
        if np.any(predicted != observed[f.name]):
            raise unsupported(f, group, probe.touching)
    return result


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
