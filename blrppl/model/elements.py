"""Which element of each latent every element of a program's output reads, from its jaxpr.

The forms (:mod:`blrppl.model.forms`) say *how* an argument depends on the latents (affine,
a power, a product) but carry no axes. The compiler also needs *which elements*: whether each
element of a distribution's argument reads one plate element of a block (``a[group]``, ``x``
broadcast, ``x[1:]``) or mixes several (a sum over a plate, ``X @ w`` over a plated ``w``), and
whether two arguments of one factor read the same element (``loc = x[:-1]`` with value
``x[1:]`` couples neighbours). This module reads both off the same traced program by an
abstract interpretation over **element ids**.

Every latent input is given an integer array of its shape, its *granules*: the id of the unit
each of its scalars belongs to (a plate element, a position of a chain, or each scalar), under
a key (the block that holds it). Each variable of the program then carries, per key, what each
of its elements reads of the key's granules: a :class:`Reads` of three integer arrays of the
variable's shape, ``lo``, ``hi`` and ``count``:

* ``count`` 0 — no granule (``lo = hi =`` :data:`NONE`);
* ``count`` 1 — exactly granule ``lo`` (= ``hi``);
* ``count`` 2 — exactly the two granules ``lo`` < ``hi`` (a transition reads states t − 1 and t);
* ``count`` 3 (:data:`SEVERAL`) — three or more, all within ``[lo, hi]``;
* ``count`` −1 (:data:`AT_MOST_ONE`) — at most one, within ``[lo, hi]``, which one set by a value
  the interpretation does not know (an index an enumerated discrete latent sets: ``mu[z]``).

Layout primitives (reshape, broadcast, transpose, slices, concatenation, padding, ``gather``
and ``dynamic_slice`` at constant indices, ``select_n`` with a constant predicate) are
applied to the id arrays themselves, so indexing by data is followed exactly; elementwise
primitives take the union of their operands' ids element by element; reductions, contractions
and cumulative sums take the union over what they combine; any other primitive is
conservative (every output element reads the union of everything its inputs read). Values
that depend on no latent (data, indices, predicates) are computed when a layout primitive
needs them, op by op on the host. ``pjit`` and custom-derivative calls are followed,
``cond`` with a constant predicate takes its branch (else the union of its branches),
``scan`` is unrolled (each step its own slices of the stacked inputs and outputs) up to
:data:`MAX_UNROLLED` equations, conservatively beyond.

No random draw and no derivative: the reading is exact where the program is followed, and
only ever says "several" where it is not.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import numpy as np
from jax.extend import core as jex_core

from blrppl.model import host_eval
from blrppl.model.deps import sub_jaxpr

#: ``lo``/``hi`` of an element that reads no granule of the key
NONE = -1
#: ``count`` of an element reading three granules or more (within ``[lo, hi]``)
SEVERAL = 3
#: ``count`` of an element reading at most one granule (within ``[lo, hi]``), which one unknown
AT_MOST_ONE = -1
#: the single-id view (:func:`single`): several granules
MANY = -2
#: the single-id view: at most one granule, which one unknown
ONE = -3

#: a scan is unrolled while its length times its body's equations stays within this many
#: (a longer one is read conservatively: each output element reads everything)
MAX_UNROLLED = 200_000

#: primitives that apply one function to each element of their (broadcast) operands
_ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "neg", "exp", "exp2", "log", "log1p", "expm1", "logistic",
    "tanh", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh",
    "pow", "integer_pow", "square", "sqrt", "rsqrt", "cbrt", "abs", "sign", "max", "min", "floor", "ceil",
    "round", "is_finite", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "rem", "clamp",
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "igamma", "igammac", "igamma_grad_a", "random_gamma_grad",
    "polygamma", "zeta", "bessel_i0e", "bessel_i1e", "nextafter", "select_n", "convert_element_type",
    "reduce_precision", "copy", "copy_p", "stop_gradient", "real", "imag", "conj", "regularized_incomplete_beta",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count", "custom_lin",
})
#: reductions over the axes their ``axes`` parameter names
_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin",
    "reduce_logsumexp",
})
#: cumulative reductions along their ``axis``
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
#: linear algebra on the last two axes of their operands, batched over the others (each
#: output's matrix reads the operands' matrices of its batch element)
_MATRIX = frozenset({
    "cholesky", "triangular_solve", "lu", "eigh", "qr", "householder_product", "geqrf", "svd", "schur",
    "lu_pivots_to_permutation", "cholesky_update", "tridiagonal_solve", "eig",
})


class Reads(NamedTuple):
    """What each element of a variable reads of one key's granules (module docstring)."""

    lo: np.ndarray
    hi: np.ndarray
    count: np.ndarray


def single(reads: Reads) -> np.ndarray:
    """The granule each element reads when it reads one, :data:`NONE` when none, :data:`MANY`
    when several, :data:`ONE` when at most one that the program does not say."""
    return np.select([reads.count == 0, reads.count == 1, reads.count == AT_MOST_ONE], [NONE, reads.lo, ONE], MANY)


def channels(reads: Reads) -> np.ndarray:
    """The ``(…, 3)`` array (lo, hi, count) of a :class:`Reads`, as :func:`union` and
    :func:`reduce_union` take it."""
    return _channels(reads)


def from_channels(ids: np.ndarray) -> Reads:
    """The :class:`Reads` of a ``(…, 3)`` array (lo, hi, count)."""
    return Reads(ids[..., 0], ids[..., 1], ids[..., 2])


def _none(shape) -> np.ndarray:
    """The channels ``(…, 3)`` (lo, hi, count) of elements reading nothing."""
    out = np.empty(tuple(shape) + (3,), dtype=np.int64)
    out[..., :2], out[..., 2] = NONE, 0
    return out


def union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The channels of elements reading both ``a``'s and ``b``'s (broadcast), exact while each
    reads at most two granules. Computed on the operands' distinct elements only (the axes
    they are broadcast along, e.g. a linear predictor's reads of its coefficients, are
    taken once) and returned broadcast to the full shape (read-only)."""
    shape = np.broadcast_shapes(a.shape, b.shape)
    a, b = _compact(a), _compact(b)
    if a.size * 2 < math.prod(shape) or b.size * 2 < math.prod(shape):
        return np.broadcast_to(_union(a, b), shape)
    return _union(a, b)


def _compact(ids: np.ndarray) -> np.ndarray:
    """``ids`` without the repeats along the axes it is broadcast along (stride 0): size 1
    there, the same channels after broadcasting back."""
    if not any(st == 0 and n > 1 for st, n in zip(ids.strides[:-1], ids.shape[:-1])):
        return ids
    return ids[tuple(slice(0, 1) if st == 0 else slice(None) for st in ids.strides[:-1])]


def _union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """:func:`union`, elementwise over the broadcast operands."""
    a, b = np.broadcast_arrays(a, b)
    lo1, hi1, n1 = a[..., 0], a[..., 1], a[..., 2]
    lo2, hi2, n2 = b[..., 0], b[..., 1], b[..., 2]
    distinct = 1 + (hi1 != lo1) + ((lo2 != lo1) & (lo2 != hi1)) + ((hi2 != lo1) & (hi2 != hi1) & (hi2 != lo2))
    count = np.where((n1 == AT_MOST_ONE) | (n2 == AT_MOST_ONE) | (n1 >= SEVERAL) | (n2 >= SEVERAL), SEVERAL,
                     np.minimum(distinct, SEVERAL))
    both = np.stack([np.minimum(lo1, lo2), np.maximum(hi1, hi2), count], -1)
    return np.where((n1 == 0)[..., None], b, np.where((n2 == 0)[..., None], a, both))


def reduce_union(ids: np.ndarray, axes: Sequence[int]) -> np.ndarray:
    """The union of channels ``ids`` (``(…, 3)``) over the value ``axes`` (those removed)."""
    ndim = ids.ndim - 1
    axes = tuple(sorted(a % ndim for a in axes)) if ndim else ()
    if not axes:
        return ids
    keep = [i for i in range(ndim) if i not in axes]
    flat = np.transpose(ids, keep + list(axes) + [ndim]).reshape([ids.shape[i] for i in keep] + [-1, 3])
    lo, hi, n = flat[..., 0], flat[..., 1], flat[..., 2]
    some = n != 0
    big = np.iinfo(np.int64).max
    out_lo = np.min(np.where(some, lo, big), axis=-1)
    out_hi = np.max(np.where(some, hi, NONE), axis=-1)
    # the distinct granules of the elements reading one or two (exact), sorted
    exact = (n == 1) | (n == 2)
    values = np.concatenate([np.where(exact, lo, big), np.where(exact & (n == 2), hi, big)], axis=-1)
    values = np.sort(values, axis=-1)
    fresh = (values != big) & np.concatenate([np.ones(values.shape[:-1] + (1,), bool),
                                               values[..., 1:] != values[..., :-1]], axis=-1)
    distinct = np.sum(fresh, axis=-1)
    members = np.sum(some, axis=-1)
    vague = np.any((n >= SEVERAL) | (n == AT_MOST_ONE), axis=-1)
    count = np.where(vague, np.where((members == 1) & np.any(n == AT_MOST_ONE, axis=-1), AT_MOST_ONE, SEVERAL),
                     np.minimum(distinct, SEVERAL))
    count = np.where(members == 0, 0, count)
    out_lo = np.where(members == 0, NONE, out_lo)
    return np.stack([out_lo, out_hi, count], -1).astype(np.int64)


def _everything(ids: np.ndarray) -> np.ndarray:
    """The channels ``(3,)`` of everything the elements of ``ids`` read together."""
    return reduce_union(ids.reshape(-1, 3), (0,)) if ids.size else _none(())


class _Value:
    """An abstract variable: its element ids per key, and (when it reads no latent) a way to
    compute its value on the host."""

    __slots__ = ("shape", "ids", "_compute", "_value")

    def __init__(self, shape, ids: dict | None = None, compute: Callable | None = None, value=None):
        self.shape = tuple(shape)
        self.ids = ids or {}
        self._compute = compute
        self._value = value

    @property
    def known(self) -> bool:
        return not self.ids and (self._value is not None or self._compute is not None)

    def value(self):
        """The concrete value (only when :attr:`known`)."""
        if self._value is None:
            if self._compute is None:
                raise _Unknown
            self._value = np.asarray(self._compute())
            self._compute = None
        return self._value

    def of(self, key) -> np.ndarray:
        """The channels ``(*shape, 3)`` of ``key`` (reading none where it reads none)."""
        ids = self.ids.get(key)
        return _none(self.shape) if ids is None else ids


class _Unknown(Exception):
    """A value the interpretation does not know (it depends on a latent, or was not kept)."""


def _shape(var) -> tuple:
    return tuple(getattr(getattr(var, "aval", None), "shape", ()))


def _count(jaxpr) -> int:
    """Equations of a jaxpr, its sub-programs included."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _count(inner)
    return total


class _Interpreter:
    def run(self, jaxpr, ins: Sequence[_Value], consts: Sequence = ()) -> list:
        env: dict = {}
        for var, v in zip(jaxpr.invars, ins):
            env[var] = v
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = _Value(np.shape(c), value=np.asarray(c))

        def read(v):
            if isinstance(v, jex_core.Literal):
                return _Value(np.shape(v.val), value=np.asarray(v.val))
            return env[v] if v in env else _Value(_shape(v))

        for eqn in jaxpr.eqns:
            outs = self.equation(eqn, [read(v) for v in eqn.invars])
            for var, v in zip(eqn.outvars, outs):
                env[var] = v
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn, ins: list) -> list:
        shapes = [_shape(v) for v in eqn.outvars]
        if all(not v.ids for v in ins):
            return self._known(eqn, ins, shapes)
        name = eqn.primitive.name
        if name == "scan":
            return self.scan(eqn, ins, shapes)
        if name == "cond":
            return self.cond(eqn, ins, shapes)
        if name in _MATRIX:
            return self.matrix(eqn, ins, shapes)
        sub = sub_jaxpr(eqn) if name != "while" else None
        if sub is not None and len(sub[0].invars) == len(ins):
            return self.run(sub[0], ins, sub[1])
        try:
            ids = _primitive_ids(eqn, name, ins, shapes[0]) if len(shapes) == 1 else None
        except _Unknown:
            ids = None
        if ids is None:
            return [_Value(s, _conservative(ins, s)) for s in shapes]
        return [_Value(shapes[0], ids)]

    def _known(self, eqn, ins, shapes) -> list:
        """Outputs that read no latent: computed on demand (all outputs of the equation at once)."""
        cache: dict = {}

        def compute(i):
            def get():
                if "out" not in cache:
                    try:
                        values = [v.value() for v in ins]
                        cache["out"] = host_eval.evaluate(eqn, values) or host_eval.bind(eqn, values)
                    except _Unknown:
                        raise
                    except Exception as e:  # noqa: BLE001 - an input the host cannot evaluate
                        raise _Unknown from e
                return cache["out"][i]

            return get

        return [_Value(s, compute=compute(i) if all(v.known for v in ins) else None) for i, s in enumerate(shapes)]

    def scan(self, eqn, ins, shapes) -> list:
        body, consts = sub_jaxpr(eqn)
        p = eqn.params
        length, nc, nk = p["length"], p["num_consts"], p["num_carry"]
        if length * max(_count(body), 1) > MAX_UNROLLED:
            return [_Value(s, _conservative(ins, s)) for s in shapes]
        head, carry, xs = ins[:nc], list(ins[nc : nc + nk]), ins[nc + nk :]
        steps = range(length - 1, -1, -1) if p.get("reverse", False) else range(length)
        ys: dict = {}
        for t in steps:
            outs = self.run(body, head + carry + [_slice(x, t) for x in xs], consts)
            carry, ys[t] = outs[:nk], outs[nk:]
        stacked = [_stack([ys[t][i] for t in range(length)], shapes[nk + i]) for i in range(len(shapes) - nk)]
        return carry + stacked

    def matrix(self, eqn, ins, shapes) -> list:
        """A batched linear-algebra primitive (:data:`_MATRIX`): the batch axes are the first
        output's but its last two (the others' too); each output element reads what its batch
        element's operand matrices read."""
        batch = max(len(shapes[0]) - 2, 0)
        per: dict = {}
        for v in ins:
            for k, ids in v.ids.items():
                lead = ids.shape[:-1]
                r = reduce_union(ids, tuple(range(min(batch, len(lead)), len(lead))))
                r = r.reshape((1,) * (batch - (r.ndim - 1)) + r.shape) if r.ndim - 1 < batch else r
                per[k] = union(per[k], r) if k in per else r
        outs = []
        for s in shapes:
            ids = {}
            for k, r in per.items():
                expanded = r.reshape(r.shape[:-1] + (1,) * (len(s) - batch) + (3,))
                ids[k] = np.broadcast_to(expanded, tuple(s) + (3,)).copy()
            outs.append(_Value(s, ids))
        return outs

    def cond(self, eqn, ins, shapes) -> list:
        branches = eqn.params["branches"]
        pred, ops = ins[0], ins[1:]
        if pred.known:
            try:
                index = int(np.clip(pred.value(), 0, len(branches) - 1))
                return self.run(branches[index].jaxpr, ops, branches[index].consts)
            except _Unknown:
                pass
        outs = None
        for branch in branches:
            res = self.run(branch.jaxpr, ops, branch.consts)
            outs = res if outs is None else [_union_values(a, b, s) for a, b, s in zip(outs, res, shapes)]
        if pred.ids:
            outs = [_union_values(o, _Value((), {k: np.asarray(_everything(i)) for k, i in pred.ids.items()}), s)
                    for o, s in zip(outs, shapes)]
        return outs


def _slice(x: _Value, t: int) -> _Value:
    ids = {k: v[t] for k, v in x.ids.items()}
    if ids or not x.known:
        return _Value(x.shape[1:], ids)
    return _Value(x.shape[1:], compute=lambda: x.value()[t])


def _stack(values: list, shape) -> _Value:
    keys = set().union(*(v.ids for v in values)) if values else set()
    if keys:
        return _Value(shape, {k: np.stack([v.of(k) for v in values]) for k in keys})
    if all(v.known for v in values):
        return _Value(shape, compute=lambda: np.stack([v.value() for v in values]))
    return _Value(shape)


def _union_values(a: _Value, b: _Value, shape) -> _Value:
    keys = set(a.ids) | set(b.ids)
    return _Value(shape, {k: np.broadcast_to(union(a.of(k), b.of(k)), tuple(shape) + (3,)).copy() for k in keys})


def _conservative(ins: list, shape) -> dict:
    """Every element reads everything any input reads."""
    out: dict = {}
    for v in ins:
        for k, ids in v.ids.items():
            g = _everything(ids)
            out[k] = g if k not in out else union(out[k], g)
    return {k: np.broadcast_to(g, tuple(shape) + (3,)).copy() for k, g in out.items()}


def _each_key(ins: list, fn) -> dict:
    """``fn(ids of each input at key)`` for every key any input reads."""
    keys = set().union(*(v.ids for v in ins))
    return {k: np.asarray(fn([v.of(k) for v in ins]), dtype=np.int64) for k in keys}


def _primitive_ids(eqn, name, ins, shape) -> dict | None:
    """The ids of a one-output primitive's result, or None for the conservative reading."""
    p = eqn.params
    if name == "select_n" and ins[0].known:
        which = np.broadcast_to(ins[0].value(), shape).astype(int)[..., None]
        full = tuple(shape) + (3,)
        return _each_key(ins[1:], lambda cases: np.choose(np.broadcast_to(which, full),
                                                          [np.broadcast_to(c, full) for c in cases]))
    if name in _ELEMENTWISE:
        out = {}
        for k in set().union(*(v.ids for v in ins)):
            # (only the operands reading the key: most operations have one)
            present = [v.ids[k] for v in ins if k in v.ids]
            ids = present[0]
            for other in present[1:]:
                ids = union(ids, other)
            out[k] = np.broadcast_to(ids, tuple(shape) + (3,))
        return out
    if name in _REDUCTIONS:
        return _each_key(ins[:1], lambda ids: reduce_union(ids[0], p["axes"]))
    if name in _CUMULATIVE:
        return _each_key(ins[:1], lambda ids: _cumulative(ids[0], p["axis"], p.get("reverse", False)))
    if name == "dot_general":
        return _dot_general(ins, p, shape)
    layout = _LAYOUT_RULES.get(name)
    if layout is not None:
        return layout(eqn, ins, shape)
    return None


def _cumulative(ids, axis, reverse) -> np.ndarray:
    ids = np.moveaxis(ids, axis, 0)
    order = range(ids.shape[0] - 1, -1, -1) if reverse else range(ids.shape[0])
    out, acc = np.empty_like(ids), _none(ids.shape[1:-1])
    for i in order:
        acc = union(acc, ids[i])
        out[i] = acc
    return np.moveaxis(out, 0, axis)


def _dot_general(ins, p, shape) -> dict:
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    lhs, rhs = ins[0].shape, ins[1].shape
    lfree = [i for i in range(len(lhs)) if i not in lc and i not in lb]
    rfree = [i for i in range(len(rhs)) if i not in rc and i not in rb]

    def side(ids, contract, batch, free, before):
        reduced = reduce_union(ids, contract)  # remaining axes: batch and free, in order
        kept = [i for i in range(ids.ndim - 1) if i not in contract]
        reduced = np.transpose(reduced, [kept.index(i) for i in list(batch) + list(free)] + [len(kept)])
        # output layout: batch, lhs free, rhs free (then the channels)
        nb, lead = len(batch), reduced.shape[:-1]
        if before:
            return reduced.reshape(lead + (1,) * len(rfree) + (3,))
        return reduced.reshape(lead[:nb] + (1,) * len(lfree) + lead[nb:] + (3,))

    out = {}
    for k in set(ins[0].ids) | set(ins[1].ids):
        # (only the operands reading the key: a design matrix of data reads none)
        sides = []
        if k in ins[0].ids:
            sides.append(side(ins[0].ids[k], lc, lb, lfree, True))
        if k in ins[1].ids:
            sides.append(side(ins[1].ids[k], rc, rb, rfree, False))
        ids = sides[0] if len(sides) == 1 else union(*sides)
        out[k] = np.broadcast_to(ids, tuple(shape) + (3,))
    return out


def _numpy_layout(fn):
    """A layout rule from a numpy function of the ids (and the equation's parameters)."""

    def rule(eqn, ins, shape):
        return _each_key(ins[:1], lambda ids: _per_channel(lambda c: np.asarray(fn(c, eqn.params)).reshape(shape),
                                                           ids[0]))

    return rule


def _per_channel(fn, *arrays) -> np.ndarray:
    """``fn`` applied to each channel (lo, hi, count) of ``arrays``, restacked."""
    return np.stack([np.asarray(fn(*(a[..., c] for a in arrays))) for c in range(3)], -1)


def _bound_layout(operands: int):
    """A layout rule applying the primitive itself to the ids of its first ``operands``
    inputs, the other inputs (indices, starts, padding) at their values."""

    def rule(eqn, ins, shape):
        if operands == 1 and any(not v.known for v in ins[1:]):
            return _unknown_selection(eqn, ins, shape)
        rest = [v.value() for v in ins[operands:]] if operands < len(ins) else []

        def channel(c, ids):
            return _moved(eqn, [i[..., c] for i in ids], rest, NONE if c < 2 else 0)

        return _each_key(ins[:operands], lambda ids: np.stack([channel(c, ids) for c in range(3)], -1))

    return rule


def _unknown_selection(eqn, ins, shape) -> dict | None:
    """A ``gather`` or ``dynamic_slice`` at indices not known here (set by an enumerated
    latent, or read from one: ``trans[z[t - 1]]``, ``mu[z]``).

    Along the operand's axes the unknown indices choose on, an element may read any of the
    candidates: their union, at most one of them when each reads at most one granule (so a
    row of a table whose entries all read state t − 1 reads it exactly). The operand's reads
    are first made constant along those axes, then selected at zero indices (the layout of
    the selection is the primitive's own); each element also reads what its index reads.
    """
    name = eqn.primitive.name
    numbers = eqn.params.get("dimension_numbers")
    if name == "gather":  # (batching axes are positional: zero index vectors keep them)
        axes = tuple(numbers.start_index_map)
        zeros = [np.zeros(ins[1].shape, dtype=np.int32)]
    else:
        axes = tuple(i for i, v in enumerate(ins[1:]) if not v.known)
        zeros = [np.zeros((), dtype=np.int32) if not v.known else v.value() for v in ins[1:]]
    out = {}
    for k, ids in ins[0].ids.items():
        spread = reduce_union(ids, axes)
        vague = (spread[..., 2] >= 2) & ~_any_several(ids, axes)
        spread[..., 2] = np.where(vague, AT_MOST_ONE, spread[..., 2])
        spread = np.broadcast_to(np.expand_dims(spread, axes), ids.shape)
        out[k] = _select_channels(eqn, spread, zeros)
    if name == "gather" and ins[1].ids:
        for k, ids in ins[1].ids.items():
            # (the last axis of the indices holds each index vector; the output's axes other
            # than its offset axes are the indices' batch axes, in order)
            per = reduce_union(ids, (ids.ndim - 2,))
            placed = np.broadcast_to(np.expand_dims(per, tuple(numbers.offset_dims)), tuple(shape) + (3,))
            out[k] = union(out[k], placed) if k in out else placed.copy()
    elif any(v.ids for v in ins[1:]):
        return None
    return out


def _any_several(ids: np.ndarray, axes) -> np.ndarray:
    """Whether some candidate along ``axes`` reads several granules (or an unknown one)."""
    several = (ids[..., 2] >= 2) | (ids[..., 2] == AT_MOST_ONE)
    return np.any(several, axis=axes) if axes else several


def _select_channels(eqn, ids: np.ndarray, indices: list) -> np.ndarray:
    """The primitive ``eqn`` (a gather or a dynamic slice) applied to each channel of ``ids``
    at the given index values."""
    return np.stack([_moved(eqn, [ids[..., c]], list(indices), NONE if c < 2 else 0) for c in range(3)], -1)


def _moved(eqn, operands: list, rest: list, fill: int) -> np.ndarray:
    """A gather, dynamic slice or dynamic update of the id arrays ``operands`` at the index
    values ``rest`` (``fill`` where a window falls outside): on the host where
    :mod:`blrppl.model.host_eval` follows the primitive, else by the primitive itself."""
    name = eqn.primitive.name
    out = None
    if name == "gather":
        out = host_eval.gather(operands[0], np.asarray(rest[0]), eqn, fill=fill)
    elif name == "dynamic_slice":
        out = host_eval.dynamic_slice(operands[0], rest, eqn.params["slice_sizes"])
    elif name == "dynamic_update_slice":
        target, update = np.array(operands[0]), operands[1]
        starts = [int(np.clip(int(np.asarray(s)), 0, d - n)) for s, d, n in zip(rest, target.shape, update.shape)]
        target[tuple(slice(s, s + n) for s, n in zip(starts, update.shape))] = update
        out = target
    if out is not None:
        return np.asarray(out, dtype=np.int64)
    params = dict(eqn.params)
    if "fill_value" in params:
        params["fill_value"] = fill
    sub = eqn.replace(params=params) if hasattr(eqn, "replace") else eqn
    return np.asarray(host_eval.bind(sub, [np.asarray(i, dtype=np.int32) for i in operands] + list(rest))[0], np.int64)


def _pad(eqn, ins, shape):
    config = eqn.params["padding_config"]

    def apply(ids):
        out = _none(shape)
        index = tuple(slice(lo, lo + (n - 1) * (interior + 1) + 1 if n else lo, interior + 1)
                      for n, (lo, _, interior) in zip(ids[0].shape, config))
        if any(lo < 0 or hi < 0 for lo, hi, _ in config):
            raise _Unknown  # negative padding: cropping and padding at once
        out[index] = ids[0]
        return out

    return _each_key(ins[:1], apply)


def _concatenate(eqn, ins, shape):
    return _each_key(ins, lambda ids: np.concatenate(ids, axis=eqn.params["dimension"]))


def _stack_rule(eqn, ins, shape):
    return _each_key(ins, lambda ids: np.stack(ids, axis=eqn.params["axis"]))


def _squeeze(ids, p):
    return np.squeeze(ids, axis=tuple(p["dimensions"])) if p["dimensions"] else ids


def _broadcast_in_dim(ids, p):
    shape = p["shape"]
    expanded = np.expand_dims(ids, [i for i in range(len(shape)) if i not in p["broadcast_dimensions"]]) \
        if len(shape) > ids.ndim else ids
    return np.broadcast_to(expanded, shape)


def _slice_rule(ids, p):
    strides = p.get("strides") or (1,) * ids.ndim
    return ids[tuple(slice(s, e, k) for s, e, k in zip(p["start_indices"], p["limit_indices"], strides))]


_LAYOUT_RULES: dict = {
    "reshape": _numpy_layout(lambda ids, p: ids),
    "broadcast_in_dim": _numpy_layout(_broadcast_in_dim),
    "squeeze": _numpy_layout(_squeeze),
    "expand_dims": _numpy_layout(lambda ids, p: np.expand_dims(ids, p["dimensions"])),
    "transpose": _numpy_layout(lambda ids, p: np.transpose(ids, p["permutation"])),
    "slice": _numpy_layout(_slice_rule),
    "rev": _numpy_layout(lambda ids, p: np.flip(ids, axis=tuple(p["dimensions"]))),
    "optimization_barrier": _numpy_layout(lambda ids, p: ids),
    "concatenate": _concatenate,
    "stack": _stack_rule,
    "pad": _pad,
    "gather": _bound_layout(1),
    "dynamic_slice": _bound_layout(1),
    "dynamic_update_slice": _bound_layout(2),
    "scatter": None,  # (filled below: operand and updates are ids, indices a value)
}


def _scatter(eqn, ins, shape):
    indices = ins[1].value()
    params = dict(eqn.params)

    def channel(operand, updates):
        out = host_eval.bind(eqn.replace(params=params) if hasattr(eqn, "replace") else eqn,
                    [np.asarray(operand, np.int32), indices, np.asarray(updates, np.int32)])
        return np.asarray(out[0], dtype=np.int64)

    def apply(ids):
        return _per_channel(channel, ids[0], ids[2])

    return _each_key([ins[0], _Value(ins[1].shape), ins[2]], apply)


_LAYOUT_RULES["scatter"] = _scatter


def element_reads(jaxpr, consts: Sequence, in_ids: Sequence[dict], in_values: Sequence) -> list[dict]:
    """The element ids of every output of a jaxpr.

    Args:
        jaxpr: the program (a ``Jaxpr``; its ``constvars`` take ``consts``).
        consts: the values of its constants.
        in_ids: per input, key → the granule id of each of its scalars (an integer array of
            the input's shape, NONE for a scalar of no granule), or the :class:`Reads` of
            its scalars; empty for inputs that read no latent.
        in_values: per input, its value when it reads no latent (data), else None.

    Returns:
        per output, key → the :class:`Reads` of its elements (:func:`single` views them as
        one granule per element, or :data:`NONE`, :data:`MANY`, :data:`ONE`).
    """
    ins = []
    for var, ids, value in zip(jaxpr.invars, in_ids, in_values):
        shape = _shape(var)
        if ids:
            ins.append(_Value(shape, {k: np.broadcast_to(_channels(i), tuple(shape) + (3,)).copy()
                                      for k, i in ids.items()}))
        else:
            ins.append(_Value(shape, value=None if value is None else np.asarray(value)))
    return [{k: from_channels(i) for k, i in v.ids.items()} for v in _Interpreter().run(jaxpr, ins, consts)]


def _channels(ids) -> np.ndarray:
    """The channels of an input whose scalars read the granules ``ids`` (NONE: none), or
    what a :class:`Reads` says they read."""
    if isinstance(ids, Reads):
        return np.stack([np.asarray(a, dtype=np.int64) for a in ids], -1)
    ids = np.asarray(ids, dtype=np.int64)
    return np.stack([ids, ids, (ids >= 0).astype(np.int64)], -1)


def granules(shape: Sequence[int], plate_dims: int) -> np.ndarray:
    """Granule ids of a value of ``shape`` whose leading ``plate_dims`` axes are plate
    elements (each plate element one granule; ``plate_dims = len(shape)``: each scalar)."""
    shape = tuple(shape)
    lead = math.prod(shape[:plate_dims])
    ids = np.arange(lead, dtype=np.int64).reshape(shape[:plate_dims] + (1,) * (len(shape) - plate_dims))
    return np.broadcast_to(ids, shape)
