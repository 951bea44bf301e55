"""Host-side NumPy evaluation of the primitives that compute indices and move elements.

The element reads (:mod:`blrppl.model.elements`) need the values of what a program computes
from data alone (indices, masks, predicates) and apply the layout primitives (``gather``,
``dynamic_slice``) to integer id arrays. Evaluated by JAX, each such operation is a program
of its own, compiled once per shape: a dozen XLA compilations per model, several seconds of
a first fit. These NumPy versions follow XLA's semantics for the cases models produce; for
anything else :func:`evaluate` returns None and the caller binds the primitive.
:func:`run` evaluates a whole jaxpr so (a stacked factor's table over its members,
:mod:`blrppl.graph.stack`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.extend import core as jex_core

_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
    "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor,
}
_UNARY = {"neg": np.negative, "abs": np.abs, "sign": np.sign, "floor": np.floor, "ceil": np.ceil}


def _integer_pow(x, y: int):
    """``x ** y`` by the products XLA's lowering of ``integer_pow`` takes (binary
    exponentiation), so the same roundings."""
    acc, base, n = None, x, abs(y)
    while n:
        if n & 1:
            acc = base if acc is None else acc * base
        n >>= 1
        if n:
            base = base * base
    acc = np.ones_like(x) if acc is None else acc
    return 1 / acc if y < 0 else acc


def _short_sum(values, p):
    """``reduce_sum`` over at most two elements per output, or of integers, as XLA sums them:
    one element is itself (a reduction over a dimension of size one is a reshape), two are
    added to the zero the reduction starts from (which makes −0.0 + −0.0 zero), in the one
    order addition of two numbers has."""
    x = values[0]
    axes = tuple(p["axes"])
    if not np.issubdtype(x.dtype, np.inexact):
        return np.sum(x, axis=axes, dtype=x.dtype)
    kept = [d for d in range(x.ndim) if d not in axes]
    flat = np.transpose(x, kept + list(axes)).reshape([x.shape[d] for d in kept] + [-1])
    if flat.shape[-1] > 2:
        return None
    if flat.shape[-1] == 0:
        return np.zeros(flat.shape[:-1], x.dtype)
    return flat[..., 0] if flat.shape[-1] == 1 else (np.zeros((), x.dtype) + flat[..., 0]) + flat[..., 1]


#: primitives whose NumPy version rounds as XLA's does (IEEE operations, exact results)
_EXACT = {
    "div": lambda v, p: np.true_divide(*v),
    "sqrt": lambda v, p: np.sqrt(v[0]),
    "square": lambda v, p: v[0] * v[0],
    "integer_pow": lambda v, p: _integer_pow(v[0], p["y"]) if p["y"] >= 0 or np.issubdtype(v[0].dtype, np.inexact) else None,
    "is_finite": lambda v, p: np.isfinite(v[0]),
    "reduce_and": lambda v, p: np.all(v[0], axis=tuple(p["axes"])),
    "reduce_or": lambda v, p: np.any(v[0], axis=tuple(p["axes"])),
    "reduce_sum": _short_sum,
}


def _logical(name, a, b):
    if a.dtype == bool and b.dtype == bool:
        return {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}[name](a, b)
    return {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[name](a, b)


def evaluate(eqn, values: list):
    """The outputs of ``eqn`` at the NumPy ``values`` of its inputs, or None when the
    primitive (or this use of it) has no NumPy version here."""
    if any(_is_key(v) for v in values):  # (random keys: no NumPy dtype holds them)
        return None
    with np.errstate(all="ignore"):  # (XLA's infinities and NaNs, without NumPy's warnings)
        return _evaluate(eqn, values)


def _evaluate(eqn, values: list):
    name, p = eqn.primitive.name, eqn.params
    out_aval = eqn.outvars[0].aval if eqn.outvars else None
    dtype = getattr(out_aval, "dtype", None)
    shape = tuple(getattr(out_aval, "shape", ()))
    try:
        if name in ("and", "or", "xor"):
            out = _logical(name, *values)
        elif name in _BINARY:
            out = _BINARY[name](*values)
        elif name in _UNARY:
            out = _UNARY[name](values[0])
        elif name == "not":
            out = np.logical_not(values[0]) if values[0].dtype == bool else np.invert(values[0])
        elif name == "div" and np.issubdtype(dtype, np.integer):
            a, b = values
            out = np.trunc(np.true_divide(a, b))  # (XLA's integer division rounds toward zero)
        elif name == "rem" and np.issubdtype(dtype, np.integer):
            out = np.fmod(*values)
        elif name in _EXACT:
            out = _EXACT[name](values, p)
        elif name == "select_n":
            which = values[0].astype(int)
            out = np.choose(which, [np.broadcast_to(c, shape) for c in values[1:]])
        elif name == "convert_element_type":
            out = values[0]
        elif name == "iota":
            out = np.broadcast_to(
                np.arange(shape[p["dimension"]]).reshape([-1 if i == p["dimension"] else 1 for i in range(len(shape))]),
                shape,
            )
        elif name == "broadcast_in_dim":
            x = values[0]
            x = np.expand_dims(x, [i for i in range(len(shape)) if i not in p["broadcast_dimensions"]])
            out = np.broadcast_to(x, shape)
        elif name in ("reshape", "squeeze", "expand_dims"):
            out = np.reshape(values[0], shape)
        elif name == "transpose":
            out = np.transpose(values[0], p["permutation"])
        elif name == "slice":
            strides = p.get("strides") or (1,) * values[0].ndim
            out = values[0][tuple(slice(s, e, k) for s, e, k in zip(p["start_indices"], p["limit_indices"], strides))]
        elif name == "concatenate":
            out = np.concatenate(values, axis=p["dimension"])
        elif name == "stack":
            out = np.stack(values, axis=p["axis"])
        elif name == "clamp":
            lo, x, hi = values
            out = np.clip(x, lo, hi)
        elif name == "gather":
            out = gather(values[0], values[1], eqn)
        elif name == "dynamic_slice":
            out = dynamic_slice(values[0], values[1:], p["slice_sizes"])
        else:
            return None
    except (TypeError, ValueError, IndexError, KeyError):
        return None
    if out is None:
        return None
    out = np.asarray(out)
    if dtype is not None:
        out = out.astype(dtype)
    return [np.broadcast_to(out, shape) if out.shape != shape else out]


def dynamic_slice(operand: np.ndarray, starts, sizes) -> np.ndarray:
    """XLA's ``dynamic_slice``: starts clamped so that the slice stays inside the operand."""
    index = []
    for s, n, dim in zip(starts, sizes, operand.shape):
        s = int(np.clip(int(np.asarray(s)), 0, dim - n))
        index.append(slice(s, s + n))
    return operand[tuple(index)]


def gather(operand: np.ndarray, indices: np.ndarray, eqn, fill=None) -> np.ndarray | None:
    """XLA's ``gather`` (the index vectors on the last axis of ``indices``), or None for a
    mode this does not follow. Out-of-bounds windows: clamped (``clip`` and promised in
    bounds), or filled with ``fill`` (``fill``, default the operand's zero)."""
    p = eqn.params
    dn = p["dimension_numbers"]
    mode = str(p.get("mode", "")).lower()
    offset_dims, collapsed = tuple(dn.offset_dims), tuple(dn.collapsed_slice_dims)
    start_map = tuple(dn.start_index_map)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    sizes = tuple(p["slice_sizes"])
    out_shape = tuple(eqn.outvars[0].aval.shape)
    grid = np.indices(out_shape, sparse=False) if out_shape else np.zeros((0,), int)
    batch_out = [d for d in range(len(out_shape)) if d not in offset_dims]
    batch_index = tuple(grid[d] for d in batch_out)
    vectors = indices[batch_index] if batch_out else np.broadcast_to(indices, out_shape + indices.shape[-1:])
    window = [d for d in range(operand.ndim) if d not in collapsed and d not in op_batch]
    position, inside = [], np.ones(out_shape, bool)
    for d in range(operand.ndim):
        pos = np.zeros(out_shape, np.int64)
        if d in start_map:
            start = vectors[..., start_map.index(d)].astype(np.int64)
            if "fill" in mode:
                inside &= (start >= 0) & (start <= operand.shape[d] - sizes[d])
            start = np.clip(start, 0, operand.shape[d] - sizes[d])
            pos = pos + start
        if d in op_batch:
            pos = pos + grid[batch_out[idx_batch[op_batch.index(d)]]]
        if d in window:
            pos = pos + grid[offset_dims[window.index(d)]]
        position.append(pos)
    out = operand[tuple(position)] if operand.ndim else np.broadcast_to(operand, out_shape)
    if "fill" in mode:
        out = np.where(inside, out, np.zeros((), operand.dtype) if fill is None else fill)
    return out


def bind(eqn, values: list) -> list:
    """The outputs of ``eqn`` at ``values``, by the primitive itself (evaluated eagerly, at
    compile time: each call compiles a small program, so :func:`evaluate` is tried first)."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    # (older JAX returns the sub-functions beside the parameters)
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    with jax.ensure_compile_time_eval():
        out = eqn.primitive.bind(*subfuns, *values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _is_key(x) -> bool:
    """Whether ``x`` is an array of random keys (never a NumPy array: checked first, cheaply)."""
    return not isinstance(x, np.ndarray) and jax.dtypes.issubdtype(getattr(x, "dtype", np.float64), jax.dtypes.prng_key)


def _host(x):
    """``x`` as a NumPy array; a random key (no NumPy dtype holds it) as it is."""
    return x if _is_key(x) else np.asarray(x)


#: call-like primitives whose body :func:`run` evaluates in place
_CALLS = ("pjit", "jit", "closed_call", "core_call")


def run(jaxpr, consts, args) -> list:
    """The outputs of ``jaxpr`` at ``args``, evaluated on the host: by NumPy where
    :func:`evaluate` has the primitive, by the primitive itself (:func:`bind`) otherwise, the
    bodies of calls (``pjit``) in place. A program of many small operations (a table over
    the members of a stacked factor) then costs NumPy's per-operation time, not an eager
    dispatch of each operation."""
    env = {}

    def read(v):
        if isinstance(v, jex_core.Literal):
            return np.asarray(v.val, dtype=v.aval.dtype)
        return env[v]

    for var, x in zip(jaxpr.constvars, consts):
        env[var] = _host(x)
    for var, x in zip(jaxpr.invars, args):
        env[var] = _host(x)
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        inner = eqn.params.get("jaxpr") if eqn.primitive.name in _CALLS else None
        if inner is not None:
            outs = run(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()), ins)
        else:
            outs = evaluate(eqn, ins) or [_host(o) for o in bind(eqn, ins)]
        for var, x in zip(eqn.outvars, outs):
            env[var] = x
    return [read(v) for v in jaxpr.outvars]
