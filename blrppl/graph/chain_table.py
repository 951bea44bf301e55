"""Transition factors of a hidden Markov chain read as one K × K table.

A factor of a chain block whose elements read two consecutive states (a hidden Markov
model's ``Categorical(trans[prev])`` in ``scan``) is enumerated over the K² pairs of values
(:mod:`blrppl.estimators.enumeration`): K² runs of the model over every element. When its
arguments and value at an element are the same function of the two states it reads at every
element (nothing else of the element enters: no covariate, no observation), its expected
log-density is one table G(i, j) shared by all of them, and

    Σ_t E_q[log f_t] = Σ_t Σ_{i,j} q(z_t = i, z_{t+1} = j) G(i, j)
                       (+ Σ_t Σ_i q(z_t = i) H_t(i) for elements reading one state),

where the pair sums are the chain's expected transition counts (Baum–Welch's statistics,
Rabiner 1989; Beal 2003, ch. 3). G and H come from K runs of the model with the chain's
states laid out along a de Bruijn sequence (every pair of values at consecutive steps),
shifted by r = 0 … K − 1 (every state's every value at an element reading one state).
Masks and scales stay per element (applied after the table is read).

Whether a factor is read this way is read off its program when compiling, on the data of
the fit (:func:`tabled`, by value numbers: :mod:`blrppl.model.values`): its arguments at
every element reading a pair, in every run, are those of the element chosen for that pair,
as functions of its continuous neighbours.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.estimators.registry import estimator_of
from blrppl.model import values
from blrppl.graph.plan import FactorRole


def de_bruijn(k: int) -> np.ndarray:
    """A cyclic sequence of length k² over 0 … k − 1 whose k² pairs of cyclically
    consecutive entries are every pair of values once (a de Bruijn sequence of order 2,
    from the Lyndon words of length ≤ 2 in lexicographic order)."""
    seq = []
    for i in range(k):
        seq.append(i)  # the Lyndon word (i)
        seq.extend(x for j in range(i + 1, k) for x in (i, j))  # the words (i, j), i < j
    return np.asarray(seq, np.int32)


class ChainTable:
    """The static layout of a tabled factor (compared by identity, as
    :class:`blrppl.graph.markov.Reads`).

    Attributes:
        states: ``(K, positions)`` the chain's states in each of the K runs.
        kind: per flat element, 2 if it reads a pair of states, 1 one state, 0 none.
        codes: ``(K, elements)`` i·K + j of the pair (i, j) each element reads in each run
            (0 for elements reading fewer than two states).
        pair_run, pair_element: ``(K²,)`` for the pair (i, j) at ``i·K + j``, a run and an
            element reading (i, j) in it.
        single_run: ``(elements, K)`` for an element reading one state and each value v of
            it, the run in which the element reads v (0 for other elements).
        pair_row, single_row: per flat element, its row of the chain's flattened pair
            marginals ``(C·(L − 1), K, K)`` and marginals ``(C·L, K)`` (for an element
            reading fewer states, some row).
    """

    def __init__(self, states, kind, codes, pair_run, pair_element, single_run, pair_row, single_row):
        self.states, self.kind, self.codes = states, kind, codes
        self.pair_run, self.pair_element, self.single_run = pair_run, pair_element, single_run
        self.pair_row, self.single_row = pair_row, single_row

    def __repr__(self):
        return f"ChainTable(runs={self.states.shape[0]}, elements={self.kind.size})"

    @classmethod
    def build(cls, reads, k: int, length: int, width: int) -> "ChainTable | None":
        """The layout for a factor with these chain reads, or None when the runs do not show
        every pair of values at some element (a chain shorter than about K² steps)."""
        lo, hi = np.ravel(reads.lo), np.ravel(reads.hi)
        kind = np.where(hi >= 0, 2, np.where(lo >= 0, 1, 0)).astype(np.int8)
        if not np.any(kind == 2) or np.any((kind == 2) & (hi != lo + width)):
            return None
        sequence = de_bruijn(k)
        steps = np.arange(length * width) // width
        states = (sequence[steps % sequence.size][None, :] + np.arange(k)[:, None]) % k
        pair_run = np.full(k * k, -1, np.int32)
        pair_element = np.full(k * k, -1, np.int32)
        pairs = np.flatnonzero(kind == 2)
        safe, safe_hi = np.clip(lo, 0, None), np.clip(hi, 0, None)
        codes = np.where(kind == 2, states[:, safe] * k + states[:, safe_hi], 0).astype(np.int32)
        for r in range(k):
            seen, first = np.unique(codes[r, pairs], return_index=True)
            fresh = pair_run[seen] < 0
            pair_run[seen[fresh]] = r
            pair_element[seen[fresh]] = pairs[first[fresh]]
        if np.any(pair_run < 0):
            return None
        # the run in which position lo holds value v: (v − sequence value at lo) mod K
        single_run = (np.arange(k)[None, :] - states[0, safe][:, None]) % k
        single_run = np.where((kind == 1)[:, None], single_run, 0).astype(np.int32)
        step, chain = safe // width, safe % width
        # (an element reading fewer states reads some row, its term replaced: spread over the
        # rows, each read by few elements, as the gradient of the rows' gather wants)
        spread = np.arange(kind.size) % max(width * (length - 1), 1)
        pair_row = np.where(kind == 2, chain * max(length - 1, 1) + np.minimum(step, max(length - 2, 0)), spread)
        single_row = np.where(kind == 1, chain * length + step, 0)
        pair_row, single_row = pair_row.astype(np.int32), single_row.astype(np.int32)
        return cls(states.astype(np.int32), kind, codes, pair_run, pair_element, single_run, pair_row, single_row)


def candidates(factors, blocks, fns) -> dict:
    """{factor name: (factor, layout)} of the factors a table could hold: closed-form site
    factors of one chain block, whose elements are the chain reads' elements, reading pairs."""
    out = {}
    for f in factors:
        if f.enumeration is None or not f.enumeration.chain_reads:
            continue
        if not (estimator_of(f).closed_form and f.role == FactorRole.SITE and f.rule is not None):
            continue
        if len(f.discrete) != 1 or not blocks[f.discrete[0]].chain or f.name in fns.stacks:
            continue
        if f.reinterpreted_ndim or f.spec.from_statistics:
            continue
        block = blocks[f.discrete[0]]
        k, length = len(block.support_values), block.family.length
        table = ChainTable.build(dict(f.enumeration.chain_reads)[block.name], k, length, block.size // length)
        if table is not None:
            out[f.name] = (f, table)
    return out


def arguments_agree(table: ChainTable, runs: dict, batch_shape: tuple) -> bool:
    """Whether, in every run (``runs``: argument → its value numbers or values in each of the
    K runs, :meth:`blrppl.model.values.Traced.numbers`), every element reading a pair has the
    arguments of the element chosen for its pair. False when an argument does not carry the
    factor's elements along its leading dims, or is numbers in one run and a value in another."""
    n, nb = math.prod(batch_shape), len(batch_shape)
    pairs = table.kind == 2
    for per_run in runs.values():
        if any(r is None for r in per_run) or len({isinstance(r, values.Symbols) for r in per_run}) != 1:
            return False
        symbolic = isinstance(per_run[0], values.Symbols)
        a = np.stack([np.asarray(r.numbers if symbolic else r) for r in per_run])
        k, shape = a.shape[0], a.shape[1:]
        shape = (1,) * max(nb - len(shape), 0) + shape
        try:
            if np.broadcast_shapes(shape[:nb], tuple(batch_shape)) != tuple(batch_shape):
                return False
        except ValueError:
            return False
        a = np.broadcast_to(np.reshape(a, (k,) + shape), (k,) + tuple(batch_shape) + shape[nb:])
        a = np.reshape(a, (k, n, -1))
        ref = a[table.pair_run, table.pair_element][table.codes]  # (K, n, event)
        if symbolic or not np.issubdtype(a.dtype, np.inexact):
            close = a == ref
        else:
            tol = 64 * np.finfo(a.dtype).eps * (1.0 + np.abs(ref))
            close = (np.abs(a - ref) <= tol) | (a == ref) | (np.isnan(a) & np.isnan(ref))
        if not np.all(close | ~pairs[None, :, None]):
            return False
    return True


def tabled(factors, blocks, fns, data) -> dict:
    """{factor name: :class:`ChainTable`} of the factors read as a table (module
    docstring): their arguments in the K runs read off the factor's program by value
    numbers (:mod:`blrppl.model.values`: each scalar of a continuous neighbour one symbol,
    the runs' states and the data at their values), equal at every element reading a pair
    to those of the element chosen for it, for every value of the continuous neighbours at
    once. A model that cannot be traced with the runs' states, or whose arguments do not
    carry the elements, keeps the K² runs."""
    from blrppl.model.functions import factor_arguments

    out = {}
    for name, (f, table) in candidates(factors, blocks, fns).items():
        block = blocks[f.discrete[0]]
        numbering = values.Numbering()
        dtype = jnp.result_type(float)
        avals, inputs = {("states",): jax.ShapeDtypeStruct(table.states.shape[1:], np.int32)}, {}
        for n in f.neighbours:
            if n not in f.discrete:
                shape = tuple(blocks[n].value_shape)
                avals[("block", n)] = jax.ShapeDtypeStruct(shape, dtype)
                inputs[("block", n)] = values.scalar_symbols(numbering, n, shape)

        def fn(vals, data, f=f, block=block):
            site = {key[1]: x for key, x in vals.items() if key[0] == "block"}
            site.update(block.chain_site_values(vals[("states",)]))
            return fns.args_of({f.name: factor_arguments(f)}, site, data)[f.name]

        traced = values.trace(fn, avals, data)
        if traced is None:
            continue
        runs = [traced.numbers({**inputs, ("states",): states}, numbering) for states in table.states]
        per_arg = {arg: [r[arg] for r in runs] for arg in runs[0]}
        if arguments_agree(table, per_arg, dict(f.enumeration.chain_reads)[block.name].lo.shape):
            out[name] = table
    return out


def expected_log_terms(table: ChainTable, base_runs: jax.Array, view) -> jax.Array:
    """Per flat element, Σ over the states it reads of their chain marginal times its
    expected log-density there (module docstring), from ``base_runs`` ``(K, elements)``:
    the factor's unwrapped expected log-density in each run of ``table``'s layout."""

    k = base_runs.shape[0]
    g = base_runs[table.pair_run, table.pair_element]  # (K²,): G(i, j) at i·K + j
    pair_probs = jnp.reshape(view.pair_probs, (-1, k * k))
    terms = static_rows(pair_probs, table.pair_row) @ g  # (elements reading fewer: set below)
    single = np.flatnonzero(table.kind == 1)
    if single.size:
        probs = jnp.reshape(view.probs, (-1, k))[table.single_row[single]]
        h = base_runs[table.single_run[single], single[:, None]]  # (singles, K): H_t(v)
        terms = terms.at[single].set(jnp.sum(probs * h, -1))
    none = np.flatnonzero(table.kind == 0)
    if none.size:
        terms = terms.at[none].set(base_runs[0, none])
    return terms


def static_rows(table: jax.Array, index: np.ndarray) -> jax.Array:
    """``table[index]`` (rows of ``table`` by a static integer array): when no row is read
    more than :data:`MAX_READERS` times, its gradient is a sum of that many gathers (each
    row's cotangents from the elements that read it, zero for unread rows) instead of a
    scatter-add, which XLA's CPU backend runs as a serial loop over the elements (10⁵
    iterations per step for a hidden Markov chain of 10⁵ steps)."""
    flat = np.asarray(index).reshape(-1)
    rows = table.shape[0]
    counts = np.bincount(flat, minlength=rows)
    if not flat.size or counts.max() > MAX_READERS:
        return table[index]
    # readers[j, r]: the j-th element reading row r (the sentinel flat.size: a zero row)
    order = np.argsort(flat, kind="stable")
    rank = np.arange(flat.size) - np.repeat(np.cumsum(counts) - counts, counts)
    readers = np.full((int(counts.max()), rows), flat.size, np.int32)
    readers[rank, flat[order]] = order

    @jax.custom_vjp
    def take(t):
        return t[index]

    def fwd(t):
        return t[index], None

    def bwd(_, g):
        g = jnp.reshape(g, (flat.size,) + g.shape[np.ndim(index):])
        padded = jnp.concatenate([g, jnp.zeros((1,) + g.shape[1:], g.dtype)])
        return (sum(padded[r] for r in readers),)

    take.defvjp(fwd, bwd)
    return take(table)


#: rows read more often than this by :func:`static_rows` keep the scatter-add gradient
MAX_READERS = 4
