"""Which elements of a program's outputs are the same function of the same inputs: value
numbers, read off the jaxpr.

Some of the compiler's optimisations hold when elements of a factor's arguments are equal
as *functions* of the latents, not only as values at one point: a mixture's ``mu[z]`` computed
once per label and broadcast over the elements (the labels passed with size-1 plate dims), a
hidden Markov chain's transition factor read as one K × K table (every element reading the
pair (i, j) has the arguments of every other). This module decides such equalities exactly by
an abstract interpretation over **value numbers** (Alpern, Wegman & Zadeck 1988): every
element of every variable gets an integer naming the expression it holds, and two elements
get one number exactly when they are the same primitive applied to elements of equal numbers.

The inputs are numbered by the caller: each scalar of a continuous latent its own symbol, a
discrete latent whose every element holds one value one symbol for all. Values that depend on
no symbol (data, indices, the states of an enumeration) are computed on the host, as by
:mod:`blrppl.model.elements`, and numbered by their dtype and bits where they meet a symbol.
Then

* elementwise primitives number each element by the primitive, its parameters and the
  operands' numbers there;
* layout primitives (reshape, broadcast, transpose, slices, ``rev``, concatenation, padding,
  ``gather`` / ``dynamic_slice`` / ``dynamic_update_slice`` at known indices, ``select_n``
  with a known predicate) move the numbers;
* reductions number each output element by the sequence of numbers it reduces, contractions
  by the pair of rows they contract, cumulative reductions by the chain of their prefixes;
* a ``gather`` at indices a symbol sets (``mu[z]``) numbers each element by its candidates
  along the indexed axes and its index's number;
* ``pjit`` and custom-derivative calls are followed, ``cond`` with a known predicate takes its
  branch, ``scan`` is unrolled (up to :data:`MAX_UNROLLED` equations);
* anything else numbers each output element by its position and everything its inputs hold:
  never equal to another element, never wrong.

Equal numbers therefore mean equal values at every value of the symbols: an exact reading,
with no random point. Unequal numbers may still hold equal values (``x + x`` and ``2 * x``):
the optimisations are then left off, which costs time, never accuracy.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.extend import core as jex_core

from blrppl.model import host_eval, scan_map
from blrppl.model.deps import sub_jaxpr

#: a scan is unrolled while its length times its body's equations stays within this many
MAX_UNROLLED = 200_000

#: primitives that apply one function to each element of their (broadcast) operands
ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "neg", "exp", "exp2", "log", "log1p", "expm1", "logistic",
    "tanh", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh",
    "pow", "integer_pow", "square", "sqrt", "rsqrt", "cbrt", "abs", "sign", "max", "min", "floor", "ceil",
    "round", "is_finite", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "rem", "clamp",
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "igamma", "igammac", "igamma_grad_a", "random_gamma_grad",
    "polygamma", "zeta", "bessel_i0e", "bessel_i1e", "nextafter", "select_n", "convert_element_type",
    "reduce_precision", "copy", "copy_p", "real", "imag", "conj", "regularized_incomplete_beta",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count",
})
#: primitives that pass their operand through unchanged (the value, not the derivative, matters)
_IDENTITY = frozenset({"stop_gradient", "optimization_barrier", "copy", "copy_p"})
_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin",
})
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
#: linear algebra on the last two axes of their operands, batched over the others
_MATRIX = frozenset({
    "cholesky", "triangular_solve", "lu", "eigh", "qr", "householder_product", "geqrf", "svd", "schur",
    "lu_pivots_to_permutation", "cholesky_update", "tridiagonal_solve", "eig",
})


class Numbering:
    """The table of value numbers: one number per distinct expression (a tuple)."""

    def __init__(self):
        self._table: dict = {}

    def of(self, key) -> int:
        """The number of the expression ``key`` (a hashable tuple)."""
        found = self._table.get(key)
        if found is None:
            found = self._table[key] = len(self._table)
        return found

    def fresh(self) -> int:
        """A number no expression has (an unknown value: equal to nothing else)."""
        return self.of(("fresh", len(self._table)))

    def rows(self, tag, rows: np.ndarray) -> np.ndarray:
        """The number of ``(tag, row)`` for each row of the 2-d integer array ``rows``."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.shape[0] == 0:
            return np.zeros(0, np.int64)
        unique, inverse = np.unique(rows, axis=0, return_inverse=True)
        numbers = np.fromiter((self.of((tag, tuple(r))) for r in unique.tolist()), np.int64, len(unique))
        return numbers[np.ravel(inverse)]

    def elementwise(self, tag, arrays: list, shape) -> np.ndarray:
        """Per element of ``shape``: the number of ``(tag, the arrays' numbers there)``.
        Along an axis where every array is constant (a broadcast: a label the same for every
        element, a table read alike) the numbers are found once and broadcast."""
        shape = tuple(shape)
        full = [np.broadcast_to(a, shape) for a in arrays]
        index = tuple(
            slice(0, 1) if n > 1 and all(_constant_along(a, axis) for a in full) else slice(None)
            for axis, n in enumerate(shape)
        )
        small = [a[index] for a in full]
        reduced = small[0].shape if small else tuple(1 if i == slice(0, 1) else n for i, n in zip(index, shape))
        cols = [a.reshape(-1) for a in small]
        rows = np.stack(cols, -1) if cols else np.zeros((math.prod(reduced), 0), np.int64)
        return np.broadcast_to(self.rows(tag, rows).reshape(reduced), shape)

    def constants(self, value) -> np.ndarray:
        """The numbers of a known array's elements: by dtype and bits."""
        value = np.asarray(value)
        dtype = value.dtype.str
        flat = np.ascontiguousarray(value).reshape(-1)
        if value.itemsize in (1, 2, 4, 8):  # (the bits as one unsigned integer each)
            bits = flat.view(np.dtype(f"u{value.itemsize}"))
            unique, inverse = np.unique(bits, return_inverse=True)
            numbers = np.fromiter((self.of(("const", dtype, int(b))) for b in unique.tolist()), np.int64, len(unique))
            return numbers[np.ravel(inverse)].reshape(value.shape)
        bits = flat.view(np.uint8).reshape(flat.size, -1) if flat.size else np.zeros((0, value.itemsize), np.uint8)
        return self.rows(("const", dtype), bits.astype(np.int64)).reshape(value.shape)


def _constant_along(a: np.ndarray, axis: int) -> bool:
    """Whether ``a`` holds one value along ``axis`` (a broadcast view, or equal entries)."""
    if a.shape[axis] <= 1 or a.strides[axis] == 0:
        return True
    first = np.take(a, [0], axis=axis)
    return bool(np.all(a == first))


class _Value:
    """A variable: its numbers (when it depends on a symbol), or a way to compute its value
    and a way to number it by its expression (without computing it)."""

    __slots__ = ("shape", "numbers", "_compute", "_value", "expression")

    def __init__(self, shape, numbers=None, compute=None, value=None):
        self.shape = tuple(shape)
        self.numbers = numbers
        self._compute, self._value = compute, value
        self.expression = None

    @property
    def symbolic(self) -> bool:
        return self.numbers is not None

    @property
    def known(self) -> bool:
        return self.numbers is None and (self._value is not None or self._compute is not None)

    def value(self):
        if self._value is None:
            if self._compute is None:
                raise _Unknown
            self._value = np.asarray(self._compute())
            self._compute = None
        return self._value


class _Unknown(Exception):
    """A value the interpretation cannot compute."""


def _shape(var) -> tuple:
    return tuple(getattr(getattr(var, "aval", None), "shape", ()))


def _count(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _count(inner)
    return total


def _signature(eqn) -> tuple:
    """The primitive and its parameters, as part of a number's expression."""
    params = tuple(sorted((k, repr(v)) for k, v in eqn.params.items()))
    return (eqn.primitive.name, params)


class _Interpreter:
    def __init__(self, numbering: Numbering):
        self.numbering = numbering

    def numbers(self, v: _Value) -> np.ndarray:
        """A variable's numbers: a known leaf's (data, a constant) from its bits, a value
        computed from known ones from its expression (never evaluated for it)."""
        if v.symbolic:
            return v.numbers
        if v._value is None and v.expression is not None:
            try:
                return v.expression()
            except _Unknown:
                pass
        return self.numbering.constants(v.value())

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
        if not any(v.symbolic for v in ins):
            return self.known(eqn, ins, shapes)
        return self.symbolic(eqn, ins, shapes)

    def known(self, eqn, ins, shapes) -> list:
        """Outputs that depend on no symbol: their values computed on demand on the host
        (indices, masks), their numbers by their expression."""
        outs = _known(eqn, ins, shapes)
        cache: dict = {}

        def expression(i):
            def get():
                if "numbers" not in cache:
                    cache["numbers"] = [self.numbers(v) for v in self.symbolic(eqn, ins, shapes)]
                return cache["numbers"][i]

            return get

        for i, out in enumerate(outs):
            out.expression = expression(i)
        return outs

    def symbolic(self, eqn, ins, shapes) -> list:
        """The outputs' numbers from the inputs' (:meth:`numbers`)."""
        name = eqn.primitive.name
        try:
            if name == "scan":
                return self.scan(eqn, ins, shapes)
            if name == "cond":
                return self.cond(eqn, ins, shapes)
            if name in _MATRIX:
                return self.matrix(eqn, ins, shapes)
            sub = sub_jaxpr(eqn) if name != "while" else None
            if sub is not None and len(sub[0].invars) == len(ins):
                return self.run(sub[0], ins, sub[1])
            if len(shapes) == 1:
                out = self.primitive(eqn, name, ins, shapes[0])
                if out is not None:
                    return [_Value(shapes[0], np.asarray(out, np.int64).reshape(shapes[0]))]
        except _Unknown:
            pass
        return self.opaque(eqn, ins, shapes)

    def opaque(self, eqn, ins, shapes) -> list:
        """Each output element numbered by its position and everything the inputs hold."""
        parts = []
        for v in ins:
            try:
                parts.append(self.numbering.of(("all", v.shape, tuple(np.ravel(self.numbers(v)).tolist()))))
            except _Unknown:  # (a value the host could not compute: a number of its own)
                parts.append(self.numbering.fresh())
        whole = self.numbering.of(("inputs", tuple(parts)))
        out = []
        for i, s in enumerate(shapes):
            positions = np.arange(math.prod(s), dtype=np.int64).reshape(s)
            out.append(_Value(s, self.numbering.elementwise(("opaque", _signature(eqn), i, whole), [positions], s)))
        return out

    def primitive(self, eqn, name, ins, shape):
        p = eqn.params
        if name in _IDENTITY:
            return self.numbers(ins[0])
        if name == "select_n" and ins[0].known:
            which = np.broadcast_to(ins[0].value(), shape).astype(int)
            return np.choose(which, [np.broadcast_to(self.numbers(c), shape) for c in ins[1:]])
        if name in ELEMENTWISE:
            return self.numbering.elementwise(_signature(eqn), [self.numbers(v) for v in ins], shape)
        if name in _REDUCTIONS:
            return self.reduce(_signature(eqn), self.numbers(ins[0]), p["axes"], shape)
        if name in _CUMULATIVE:
            return self.cumulative(_signature(eqn), self.numbers(ins[0]), p["axis"], p.get("reverse", False))
        if name == "dot_general":
            return self.dot_general(eqn, ins, shape)
        if name in ("gather", "dynamic_slice") and any(not v.known for v in ins[1:]):
            return self.selection(eqn, ins, shape)
        if name in _LAYOUT:
            return _LAYOUT[name](self, eqn, ins, shape)
        return None

    def reduce(self, tag, numbers, axes, shape) -> np.ndarray:
        axes = tuple(sorted(a % numbers.ndim for a in axes)) if numbers.ndim else ()
        keep = [i for i in range(numbers.ndim) if i not in axes]
        rows = np.transpose(numbers, keep + list(axes)).reshape(math.prod(shape), -1)
        return self.numbering.rows(tag, rows).reshape(shape)

    def cumulative(self, tag, numbers, axis, reverse) -> np.ndarray:
        moved = np.moveaxis(numbers, axis, 0)
        out = np.empty_like(moved)
        order = range(moved.shape[0] - 1, -1, -1) if reverse else range(moved.shape[0])
        previous = None
        for i in order:
            parts = [moved[i]] if previous is None else [previous, moved[i]]
            out[i] = self.numbering.elementwise((tag, len(parts)), parts, moved.shape[1:])
            previous = out[i]
        return np.moveaxis(out, 0, axis)

    def dot_general(self, eqn, ins, shape) -> np.ndarray:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = self.numbers(ins[0]), self.numbers(ins[1])
        lfree = [i for i in range(lhs.ndim) if i not in lc and i not in lb]
        rfree = [i for i in range(rhs.ndim) if i not in rc and i not in rb]

        def rows(numbers, batch, free, contract):
            moved = np.transpose(numbers, list(batch) + list(free) + list(contract))
            lead = moved.shape[: len(batch) + len(free)]
            flat = moved.reshape(math.prod(lead), -1)
            return self.numbering.rows("row", flat).reshape(lead)

        left, right = rows(lhs, lb, lfree, lc), rows(rhs, rb, rfree, rc)
        nb = len(lb)
        left = left.reshape(left.shape + (1,) * len(rfree))
        right = right.reshape(right.shape[:nb] + (1,) * len(lfree) + right.shape[nb:])
        return self.numbering.elementwise(_signature(eqn), [left, right], shape)

    def selection(self, eqn, ins, shape) -> np.ndarray:
        """A gather or dynamic slice at indices that depend on a symbol: each element numbered
        by its candidates along the indexed axes and its index's number."""
        name = eqn.primitive.name
        operand = self.numbers(ins[0])
        if name == "gather":
            numbers = eqn.params["dimension_numbers"]
            axes = tuple(numbers.start_index_map)
            zeros = [np.zeros(ins[1].shape, dtype=np.int32)]
            if getattr(numbers, "operand_batching_dims", ()):
                raise _Unknown
        else:
            axes = tuple(i for i, v in enumerate(ins[1:]) if not v.known)
            zeros = [np.zeros((), dtype=np.int32) if not v.known else v.value() for v in ins[1:]]
        # the candidates of each element: the operand's numbers along the indexed axes, as one
        candidates = self.reduce("candidates", operand, axes, tuple(d for i, d in enumerate(operand.shape) if i not in axes))
        candidates = np.broadcast_to(np.expand_dims(candidates, axes), operand.shape)
        chosen = _moved(eqn, candidates, zeros)
        if name == "gather":
            index = self.numbers(ins[1])
            per = self.reduce("index", index, (index.ndim - 1,), index.shape[:-1])
            window = tuple(eqn.params["dimension_numbers"].offset_dims)
            per = np.broadcast_to(np.expand_dims(per, window), shape)
        else:
            starts = [self.numbers(v) for v in ins[1:]]
            per = np.broadcast_to(self.numbering.elementwise("starts", starts, ()), shape)
            window = tuple(range(len(shape)))
        # (an element's place in its window: operand[index + w] differs from operand[index])
        grid = np.indices(shape, dtype=np.int64) if shape else np.zeros((0,), np.int64)
        places = [grid[d] for d in window]
        return self.numbering.elementwise(("select", _signature(eqn)), [chosen, per] + places, shape)

    def matrix(self, eqn, ins, shapes) -> list:
        """A batched linear-algebra primitive (:data:`_MATRIX`): the batch axes are the first
        output's but its last two; each output element is numbered by its batch element's
        operand matrices (their numbers, as one) and its place in its output."""
        batch_shape = shapes[0][: max(len(shapes[0]) - 2, 0)]
        nb = len(batch_shape)
        contents = []
        for v in ins:
            nums = self.numbers(v)
            if nums.ndim < nb:
                raise _Unknown
            try:
                lead = np.broadcast_shapes(nums.shape[:nb], batch_shape)
            except ValueError:
                raise _Unknown from None
            if lead != batch_shape:
                raise _Unknown
            core = nums.shape[nb:]
            flat = np.broadcast_to(nums, batch_shape + core).reshape(math.prod(batch_shape), -1)
            contents.append(self.numbering.rows(("matrix", core), flat).reshape(batch_shape))
        out = []
        for i, s in enumerate(shapes):
            if tuple(s[:nb]) != batch_shape:
                raise _Unknown
            core = tuple(s[nb:])
            expand = (slice(None),) * nb + (None,) * len(core)
            parts = [c[expand] for c in contents]
            grid = np.indices(core, dtype=np.int64) if core else np.zeros((0,), np.int64)
            places = [np.broadcast_to(g, s) for g in grid] if core else []
            out.append(_Value(s, self.numbering.elementwise((_signature(eqn), i), parts + places, s)))
        return out

    def scan(self, eqn, ins, shapes) -> list:
        body, consts = sub_jaxpr(eqn)
        p = eqn.params
        length, nc, nk = p["length"], p["num_consts"], p["num_carry"]
        if length * max(_count(body), 1) > MAX_UNROLLED:
            raise _Unknown
        head, carry, xs = ins[:nc], list(ins[nc : nc + nk]), ins[nc + nk :]
        steps = range(length - 1, -1, -1) if p.get("reverse", False) else range(length)
        ys: dict = {}
        for t in steps:
            outs = self.run(body, head + carry + [_slice(x, t) for x in xs], consts)
            carry, ys[t] = outs[:nk], outs[nk:]
        stacked = []
        for i in range(len(shapes) - nk):
            parts = [ys[t][i] for t in range(length)]
            if any(v.symbolic for v in parts):
                stacked.append(_Value(shapes[nk + i], np.stack([self.numbers(v) for v in parts])))
            else:
                stacked.append(_Value(shapes[nk + i], compute=lambda parts=parts: np.stack([v.value() for v in parts])))
        return carry + stacked

    def cond(self, eqn, ins, shapes) -> list:
        branches = eqn.params["branches"]
        pred, ops = ins[0], ins[1:]
        if pred.known:
            index = int(np.clip(pred.value(), 0, len(branches) - 1))
            return self.run(branches[index].jaxpr, ops, branches[index].consts)
        results = [self.run(b.jaxpr, ops, b.consts) for b in branches]
        which = self.numbers(pred)
        return [
            _Value(s, self.numbering.elementwise(("cond", i), [which] + [self.numbers(r[i]) for r in results], s))
            for i, s in enumerate(shapes)
        ]


def _known(eqn, ins, shapes) -> list:
    """Outputs that depend on no symbol: computed on demand on the host."""
    cache: dict = {}

    def compute(i):
        def get():
            if "out" not in cache:
                values = [v.value() for v in ins]
                try:
                    cache["out"] = host_eval.evaluate(eqn, values) or host_eval.bind(eqn, values)
                except _Unknown:
                    raise
                except Exception as e:  # noqa: BLE001 - an input the host cannot evaluate
                    raise _Unknown from e
            return cache["out"][i]

        return get

    return [_Value(s, compute=compute(i) if all(v.known for v in ins) else None) for i, s in enumerate(shapes)]


def _slice(x: _Value, t: int) -> _Value:
    if x.symbolic:
        return _Value(x.shape[1:], x.numbers[t])
    if x.known:
        return _Value(x.shape[1:], compute=lambda: x.value()[t])
    return _Value(x.shape[1:])


def _moved(eqn, numbers: np.ndarray, rest: list, fill: int = -1) -> np.ndarray:
    """A gather or dynamic slice of the number array at known indices."""
    name = eqn.primitive.name
    if name == "gather":
        return np.asarray(host_eval.gather(numbers, np.asarray(rest[0]), eqn, fill=fill), np.int64)
    if name == "dynamic_slice":
        return np.asarray(host_eval.dynamic_slice(numbers, rest, eqn.params["slice_sizes"]), np.int64)
    raise _Unknown


def _layout(fn):
    """A layout rule moving the first operand's numbers by a numpy function."""

    def rule(interp, eqn, ins, shape):
        return np.asarray(fn(interp.numbers(ins[0]), eqn.params)).reshape(shape)

    return rule


def _pad(interp, eqn, ins, shape):
    config = eqn.params["padding_config"]
    if any(lo < 0 or hi < 0 for lo, hi, _ in config):
        raise _Unknown
    numbers = interp.numbers(ins[0])
    fill = interp.numbers(ins[1])
    out = np.broadcast_to(fill, shape).copy()
    index = tuple(slice(lo, lo + (n - 1) * (interior + 1) + 1 if n else lo, interior + 1)
                  for n, (lo, _, interior) in zip(numbers.shape, config))
    out[index] = numbers
    return out


def _concatenate(interp, eqn, ins, shape):
    return np.concatenate([interp.numbers(v) for v in ins], axis=eqn.params["dimension"])


def _bound(operands: int):
    """gather / dynamic_slice / dynamic_update_slice at known indices."""

    def rule(interp, eqn, ins, shape):
        if any(not v.known for v in ins[operands:]):
            raise _Unknown
        name = eqn.primitive.name
        if name in ("gather", "dynamic_slice"):
            fill = -1
            if name == "gather" and "fill" in str(eqn.params.get("mode", "")).lower():
                # (a window outside the operand reads the fill value: JAX's default for the dtype)
                fill = int(interp.numbering.constants(_fill_value(eqn)))
            return _moved(eqn, interp.numbers(ins[0]), [v.value() for v in ins[1:]], fill)
        if name == "dynamic_update_slice":
            target, update = np.array(interp.numbers(ins[0])), interp.numbers(ins[1])
            rest = [int(np.asarray(v.value())) for v in ins[2:]]
            starts = [int(np.clip(s, 0, d - n)) for s, d, n in zip(rest, target.shape, update.shape)]
            target[tuple(slice(s, s + n) for s, n in zip(starts, update.shape))] = update
            return target
        raise _Unknown

    return rule


def _fill_value(eqn) -> np.ndarray:
    """A filling gather's value for windows outside its operand."""
    dtype = np.dtype(eqn.outvars[0].aval.dtype)
    value = eqn.params.get("fill_value")
    if value is None:
        if np.issubdtype(dtype, np.inexact):
            value = np.nan
        elif dtype == bool:
            value = True
        else:
            info = np.iinfo(dtype)
            value = info.min if np.issubdtype(dtype, np.signedinteger) else info.max
    return np.asarray(value, dtype)


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


_LAYOUT: dict = {
    "reshape": _layout(lambda ids, p: ids),
    "broadcast_in_dim": _layout(_broadcast_in_dim),
    "squeeze": _layout(_squeeze),
    "expand_dims": _layout(lambda ids, p: np.expand_dims(ids, p["dimensions"])),
    "transpose": _layout(lambda ids, p: np.transpose(ids, p["permutation"])),
    "slice": _layout(_slice_rule),
    "rev": _layout(lambda ids, p: np.flip(ids, axis=tuple(p["dimensions"]))),
    "concatenate": _concatenate,
    "pad": _pad,
    "gather": _bound(1),
    "dynamic_slice": _bound(1),
    "dynamic_update_slice": _bound(2),
}


def value_numbers(jaxpr, consts: Sequence, inputs: Sequence, numbering: Numbering | None = None) -> list:
    """The value numbers of a jaxpr's outputs.

    Args:
        jaxpr: the program (a ``Jaxpr``; its ``constvars`` take ``consts``).
        consts: the values of its constants.
        inputs: per input, either its value (data, or a latent held at known values) or a
            :class:`Symbols` of its scalars' numbers.
        numbering: the table to number in (pass one table to compare two programs' outputs).

    Returns:
        per output, its numbers (a :class:`Symbols`; an output that depends on no symbol is
        numbered by its expression over the data's and constants' bits, never evaluated),
        or None where it cannot be numbered.
    """
    numbering = numbering or Numbering()
    ins = []
    for var, x in zip(jaxpr.invars, inputs):
        if isinstance(x, Symbols):
            ins.append(_Value(_shape(var), np.broadcast_to(np.asarray(x.numbers, np.int64), _shape(var)).copy()))
        else:
            ins.append(_Value(_shape(var), value=None if x is None else np.asarray(x)))
    out = []
    interp = _Interpreter(numbering)
    for v in interp.run(jaxpr, ins, consts):
        try:
            out.append(Symbols(interp.numbers(v)))
        except _Unknown:
            out.append(None)
    return out


class Symbols:
    """An input held symbolically: the numbers of its scalars (``numbers``: an integer
    array of the input's shape, broadcastable), made by :meth:`Numbering.of` from a tag the
    caller chooses (one per scalar of a continuous latent; one for all the elements of a
    discrete latent that holds one value everywhere)."""

    def __init__(self, numbers):
        self.numbers = numbers


class Traced:
    """A function ``fn(values, data)`` traced once (:func:`trace`), to be numbered at several
    inputs (:meth:`numbers`)."""

    def __init__(self, closed, out_tree, keys, data_leaves):
        self.closed, self.out_tree, self.keys, self.data_leaves = closed, out_tree, keys, data_leaves

    def numbers(self, inputs: dict, numbering: Numbering):
        """The outputs' numbers (:class:`Symbols`; None where one cannot be numbered) with
        ``inputs`` (key → :class:`Symbols` or a value: every key traced), in the output's
        structure."""
        leaves = [inputs[k] for k in self.keys] + self.data_leaves
        outs = value_numbers(self.closed.jaxpr, self.closed.consts, leaves, numbering)
        return jax.tree.unflatten(self.out_tree, outs)


def trace(fn, avals: dict, data) -> Traced | None:
    """``fn(values, data)`` traced with ``values`` of the shapes and dtypes ``avals`` (key →
    ``jax.ShapeDtypeStruct``; keys sortable) and ``data`` abstracted (its values kept for the
    numbering); None when the function cannot be traced with them (a model that refuses
    these shapes). A trace, not an evaluation: nothing is computed at a point."""
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(avals, data)
    except Exception:  # noqa: BLE001 - a model that cannot run with these shapes
        return None
    keys = sorted(avals)
    # (scans whose carries are known ahead read as maps over their steps: the same values,
    # without a loop of T steps to follow one by one)
    jaxpr, consts = scan_map.vectorise(closed.jaxpr, closed.consts)
    closed = jex_core.ClosedJaxpr(jaxpr, consts)
    return Traced(closed, jax.tree.structure(out_shape), keys, [np.asarray(x) for x in jax.tree.leaves(data)])


def scalar_symbols(numbering: Numbering, tag, shape) -> Symbols:
    """One symbol per scalar of a value of ``shape`` (a continuous latent)."""
    size = math.prod(shape)
    return Symbols(numbering.rows(("scalar", tag), np.arange(size, dtype=np.int64)[:, None]).reshape(shape))


def same(a, b, shape=None) -> bool:
    """Whether two outputs of :meth:`Traced.numbers` are equal everywhere: both numbers
    (:class:`Symbols`, compared exactly) or both values (to 64 ulps, NaN equal to NaN), after
    broadcasting ``b`` to ``a``'s shape (``b`` must broadcast to it)."""
    if a is None or b is None or isinstance(a, Symbols) != isinstance(b, Symbols):
        return False
    x, y = (a.numbers, b.numbers) if isinstance(a, Symbols) else (np.asarray(a), np.asarray(b))
    try:
        if np.broadcast_shapes(x.shape, y.shape) != x.shape:
            return False
    except ValueError:
        return False
    y = np.broadcast_to(y, x.shape)
    if isinstance(a, Symbols) or not np.issubdtype(x.dtype, np.inexact):
        return bool(np.array_equal(x, y))
    tol = 64 * np.finfo(x.dtype).eps * (1.0 + np.abs(x))
    return bool(np.all((np.abs(x - y) <= tol) | (x == y) | (np.isnan(x) & np.isnan(y))))
