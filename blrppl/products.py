"""Second moments of products of two independent Gaussian blocks, by contraction.

A bilinear argument x = f(w_A, w_B) + g(w) (:class:`blrppl.moments.BilinearGaussian`)
needs, per element, E[f(d_A, d_B)²] with d = w − E[w]. Pushing every pair of square-root
tangents (s_k of A, s'_l of B) through the model gives it as Σ_{k,l} f(s_k, s'_l)²: |S_A|·|S_B|
copies of the argument (100 for ``X @ C.T`` with D = 10). Where the product is a primitive
of the program, the same sum is a contraction of the two factors' covariances:

* ``u * v`` elementwise, u affine in A and v in B:  E[(d_u d_v)²] = Var[u] Var[v];
* a contraction over c (``dot_general``, or ``u * v`` then ``reduce_sum``, as in
  ``X @ C.T``, ``jnp.einsum``, ``(U[i] * V[j]).sum(-1)``):

      E[(Σ_c d_u,c d_v,c)²] = Σ_{c,c'} Cov[u_c, u_c'] Cov[v_c, v_c'],

  an (N, D²) @ (D², M) product for ``X @ C.T`` instead of D² arrays of (N, M).

:func:`product_second_moments` evaluates the program (its jaxpr) once, carrying for each
intermediate the pushed square-root tangents of A and of B (its affine parts) and, once a
product of the two appears, the second moment of its bilinear part through the operations
that keep it elementwise: layout, indexing, scaling by a constant, adding an affine term
(uncorrelated with the bilinear part: its odd moments vanish). Anything else the product
passes through (a sum of two products, a sum over a product already taken, a loop) makes the
argument fall back to the pushes (the caller's job: the function returns None).

The square roots are those of :meth:`blrppl.families.base.Family.tangent_roots`: valid over
what one plate element of a non-mixing argument reads, so every covariance taken here (over
the positions one output element combines) is exact.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

#: primitives that move or select elements without combining them: f(x) applied to the
#: second moment of x is the second moment of f(x); operand 0 is the data, the rest indices
_ELEMENTWISE_LAYOUT = frozenset({
    "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice", "rev", "copy",
    "copy_p", "reduce_precision", "convert_element_type", "gather", "dynamic_slice", "split",
})
#: primitives that place several data operands (positions) into one output without combining
#: elements: {name: positions of the data operands}
_PLACING = {"concatenate": None, "pad": (0, 1), "select_n": "cases", "dynamic_update_slice": (0, 1), "scatter": (0, 2)}
#: primitives linear in their data operands (affine tangents pass through by their JVP)
_LINEAR = _ELEMENTWISE_LAYOUT | frozenset(_PLACING) | frozenset({
    "add", "add_any", "sub", "neg", "reduce_sum", "cumsum", "scatter-add", "scatter_add", "mul", "div", "dot_general",
})
#: call primitives whose inner program is interpreted in place
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint"})
#: a contraction is used when it costs at most this many times the pushes it replaces
_MAX_COST_RATIO = 4.0


class _Unsupported(Exception):
    """The product reaches an operation its second moment cannot follow here."""


class _Tags(NamedTuple):
    """What a value carries besides itself: its affine tangents along A's and B's square
    roots (``(k, *shape)`` or None for none) and its bilinear part: None, the second moment
    (``ex``, the value's shape) or, for a product not yet summed, its two factors'
    tangents (``prod``: (U, V), each ``(k, *shape)``, the part being Σ-free u·v)."""

    ta: jax.Array | None = None
    tb: jax.Array | None = None
    ex: jax.Array | None = None
    prod: tuple | None = None

    @property
    def bilinear(self) -> bool:
        return self.ex is not None or self.prod is not None


#: a value whose bilinear part cannot be followed
_BAD = "bad"


def _variance(t):
    return jnp.sum(jnp.square(t), axis=0)


def _ex_of(tags: _Tags, shape):
    """The second moment of a value's bilinear part (zeros when it has none)."""
    if tags.prod is not None:
        u, v = tags.prod
        return jnp.broadcast_to(_variance(u) * _variance(v), shape)
    return tags.ex


def _contract(u, v, batch_u, batch_v, contract_u, contract_v):
    """Σ_{c,c'} Cov[u_c, u_c'] Cov[v_c, v_c'] for u, v given by tangents (k, *shape) and
    l (l, *shape): ``dot_general``'s output layout (batch, free of u, free of v)."""

    def grouped(t, batch, contract):
        dims = range(1, t.ndim)
        free = [d for d in dims if d - 1 not in batch and d - 1 not in contract]
        order = [0] + [d + 1 for d in batch] + free + [d + 1 for d in contract]
        t = jnp.transpose(t, order)
        b = t.shape[1 : 1 + len(batch)]
        f = t.shape[1 + len(batch) : 1 + len(batch) + len(free)]
        return t.reshape(t.shape[0], math.prod(b), math.prod(f), -1), b, f

    gu, b, fu = grouped(u, batch_u, contract_u)
    gv, _, fv = grouped(v, batch_v, contract_v)
    cov_u = jnp.einsum("kbfc,kbfd->bfcd", gu, gu)
    cov_v = jnp.einsum("kbgc,kbgd->bgcd", gv, gv)
    return jnp.einsum("bfcd,bgcd->bfg", cov_u, cov_v).reshape(*b, *fu, *fv)


def _contraction_worth_it(u, v, batch_u, contract_u) -> bool:
    """Covariances over the contracted dims cost no more than pushing every root pair."""
    size_b = math.prod(u.shape[1 + d] for d in batch_u)
    size_c = math.prod(u.shape[1 + d] for d in contract_u)
    size_f = math.prod(u.shape[1:]) // max(size_b * size_c, 1)
    size_g = math.prod(v.shape[1:]) // max(size_b * size_c, 1)
    k, l = u.shape[0], v.shape[0]
    contraction = size_b * size_c**2 * (k * size_f + l * size_g + size_f * size_g)
    pushes = k * l * size_b * size_f * size_g * size_c
    return contraction <= _MAX_COST_RATIO * pushes


class _Interpreter:
    """Evaluates a jaxpr on values with :class:`_Tags` (None: a constant of the blocks)."""

    def run(self, jaxpr, consts, vals, tags):
        env_val, env_tag = {}, {}

        def read(v):
            if isinstance(v, jex_core.Literal):
                return v.val, None
            return env_val[v], env_tag.get(v)

        for var, c in zip(jaxpr.constvars, consts):
            env_val[var] = c
        for var, x, t in zip(jaxpr.invars, vals, tags):
            env_val[var], env_tag[var] = x, t
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            in_vals = [x for x, _ in ins]
            in_tags = [t for _, t in ins]
            if all(t is None for t in in_tags):
                outs = self.bind(eqn, in_vals)
                out_tags = [None] * len(outs)
            elif any(t is _BAD for t in in_tags):
                outs = self.bind(eqn, in_vals)
                out_tags = [_BAD] * len(outs)
            else:
                outs, out_tags = self.equation(eqn, in_vals, in_tags)
            for var, x, t in zip(eqn.outvars, outs, out_tags):
                env_val[var], env_tag[var] = x, t
        outs = [read(v) for v in jaxpr.outvars]
        return [x for x, _ in outs], [t for _, t in outs]

    @staticmethod
    def bind(eqn, vals):
        out = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
        return list(out) if eqn.primitive.multiple_results else [out]

    def equation(self, eqn, vals, tags):
        name = eqn.primitive.name
        if name in _CALLS:
            sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            inner = getattr(sub, "jaxpr", sub)
            if inner is not None and hasattr(inner, "eqns") and len(inner.invars) == len(vals):
                return self.run(inner, tuple(getattr(sub, "consts", ())), vals, tags)
        outs = self.bind(eqn, vals)
        if name not in _LINEAR or not all(jnp.issubdtype(x.dtype, jnp.inexact) for x in outs):
            return outs, [_BAD] * len(outs)
        try:
            return outs, self.tags_of(eqn, name, vals, tags, outs)
        except _Unsupported:
            return outs, [_BAD] * len(outs)

    def tangents(self, eqn, vals, tags, field):
        """The JVP of the equation along one block's tangents (None when no input has any)."""
        which = [i for i, t in enumerate(tags) if t is not None and getattr(t, field) is not None]
        if not which:
            return None

        def f(*xs):
            full = list(vals)
            for i, x in zip(which, xs):
                full[i] = x
            return self.bind(eqn, full)

        primals = [vals[i] for i in which]

        def push(*ts):
            return jax.jvp(f, primals, list(ts))[1]

        return jax.vmap(push)(*[getattr(tags[i], field) for i in which])

    def tags_of(self, eqn, name, vals, tags, outs):
        tagged = [i for i, t in enumerate(tags) if t is not None]
        if name == "div" and tags[1] is not None:
            raise _Unsupported("a division by a latent")
        products = name in ("mul", "dot_general") and len(tagged) == 2
        if products:
            bil = self.product(eqn, name, vals, tags, outs)
        else:
            bil = self.follow(eqn, name, vals, tags, outs)
        ta = self.tangents(eqn, vals, tags, "ta")
        tb = self.tangents(eqn, vals, tags, "tb")
        return [
            _Tags(
                None if ta is None else ta[j], None if tb is None else tb[j],
                *(bil[j] if bil is not None else (None, None)),
            )
            for j in range(len(outs))
        ]

    def product(self, eqn, name, vals, tags, outs):
        """u ∘ v of an affine value in A and one in B: its bilinear part."""
        tu, tv = tags
        if tu.bilinear or tv.bilinear:
            raise _Unsupported("a product of a product")
        if tu.ta is not None and tu.tb is None and tv.tb is not None and tv.ta is None:
            u, v = tu.ta, tv.tb
        elif tu.tb is not None and tu.ta is None and tv.ta is not None and tv.tb is None:
            u, v = tu.tb, tv.ta
        else:
            raise _Unsupported("a product of one block with itself")
        if name == "mul":
            shape = outs[0].shape
            return [(None, (jnp.broadcast_to(u, u.shape[:1] + shape), jnp.broadcast_to(v, v.shape[:1] + shape)))]
        (contract_u, contract_v), (batch_u, batch_v) = eqn.params["dimension_numbers"]
        if not _contraction_worth_it(u, v, batch_u, contract_u):
            raise _Unsupported("a contraction dearer than the pushes")
        ex = _contract(u, v, batch_u, batch_v, contract_u, contract_v)
        return [(ex.astype(outs[0].dtype), None)]

    def follow(self, eqn, name, vals, tags, outs):
        """The bilinear part of the outputs of an operation on values that may hold one."""
        held = [i for i, t in enumerate(tags) if t is not None and t.bilinear]
        if not held:
            return None
        shape = outs[0].shape
        if name in _ELEMENTWISE_LAYOUT:
            if held != [0]:
                raise _Unsupported("an index that depends on a product")
            t = tags[0]
            if t.prod is not None:
                u, v = t.prod
                return list(zip([None] * len(outs), zip(*[self._map(eqn, vals, x) for x in (u, v)])))
            return [(x, None) for x in self.bind(eqn, [t.ex, *vals[1:]])]
        if name in _PLACING:
            data = _PLACING[name]
            if data is None:
                data = tuple(range(len(vals)))
            elif data == "cases":
                data = tuple(range(1, len(vals)))
            if any(i not in data for i in held):
                raise _Unsupported("an index that depends on a product")
            new = list(vals)
            for i in data:
                t = tags[i]
                new[i] = jnp.zeros_like(vals[i]) if t is None or not t.bilinear else _ex_of(t, jnp.shape(vals[i]))
            return [(x, None) for x in self.bind(eqn, new)]
        if name in ("add", "add_any", "sub"):
            if len(held) > 1:
                raise _Unsupported("a sum of two products")
            t = tags[held[0]]
            if t.prod is not None and jnp.shape(vals[held[0]]) == shape:
                return [(None, t.prod)]
            return [(jnp.broadcast_to(_ex_of(t, jnp.shape(vals[held[0]])), shape), None)]
        if name == "neg":
            return [(tags[0].ex, tags[0].prod)]
        if name in ("mul", "div"):
            if held != [0] and name == "div":
                raise _Unsupported("a division by a product")
            i = held[0]
            c = vals[1 - i]
            t = tags[i]
            if t.prod is not None:
                u, v = t.prod
                u = jnp.broadcast_to(u, u.shape[:1] + shape)
                v = jnp.broadcast_to(v, v.shape[:1] + shape)
                return [(None, (u * c if name == "mul" else u / c, v))]
            c2 = jnp.square(c)
            ex = t.ex * c2 if name == "mul" else t.ex / c2
            return [(jnp.broadcast_to(ex, shape), None)]
        if name == "reduce_sum" and tags[0].prod is not None:
            u, v = tags[0].prod
            axes = tuple(eqn.params["axes"])
            batch = tuple(d for d in range(u.ndim - 1) if d not in axes)
            if not _contraction_worth_it(u, v, batch, axes):
                raise _Unsupported("a contraction dearer than the pushes")
            # a sum over a product u_c v_c is a contraction with the kept dims as batch dims
            ex = _contract(u, v, batch, batch, axes, axes)
            return [(ex.reshape(shape).astype(outs[0].dtype), None)]
        if name == "reduce_sum" and math.prod(jnp.shape(vals[0])) == math.prod(shape):
            return [(x, None) for x in self.bind(eqn, [_ex_of(tags[0], jnp.shape(vals[0]))])]
        raise _Unsupported(f"'{name}' of a product")

    def _map(self, eqn, vals, t):
        """An elementwise-layout equation applied to each tangent of a stack."""
        return jax.vmap(lambda x: tuple(self.bind(eqn, [x, *vals[1:]])))(t)


def product_second_moments(fn, point: dict, a: str, roots_a, b: str, roots_b, wanted) -> dict | None:
    """E[f(d_A, d_B)²] of the arguments ``wanted`` of ``fn`` (the model's arguments as a
    function of the blocks' values), read by contraction (module docstring).

    Args:
        fn: ``values -> {factor: {argument: value}}``.
        point: the blocks' values (their means) where ``fn`` is linearised.
        a, b: the two blocks, with ``roots_a``/``roots_b`` their square-root tangents
            (:meth:`blrppl.families.base.Family.tangent_roots`, in the layout of ``point``
            with a leading axis).
        wanted: (factor, argument) pairs, each bilinear in (A, B).

    Returns:
        {factor: {argument: array}}, or None when some wanted argument's product passes
        through an operation the contraction cannot follow (then pushes are used).
    """
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(point)
    leaves, treedef = jax.tree_util.tree_flatten(point)
    index = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
    tags: list = [None] * len(leaves)
    for name, roots, field in ((a, roots_a, "ta"), (b, roots_b, "tb")):
        for i, r in zip(jax.tree_util.tree_leaves(index[name]), jax.tree_util.tree_leaves(roots)):
            tags[i] = _Tags(**{field: r})
    _, out_tags = _Interpreter().run(closed.jaxpr, closed.consts, leaves, tags)
    out_leaves, out_def = jax.tree_util.tree_flatten(shapes)
    out_index = jax.tree_util.tree_unflatten(out_def, list(range(len(out_leaves))))
    result: dict = {}
    for fname, arg in wanted:
        i = out_index[fname][arg]
        t = out_tags[i]
        if t is _BAD:
            return None
        shape = out_leaves[i].shape
        if t is None or not t.bilinear:
            ex = jnp.zeros(shape, out_leaves[i].dtype)
        else:
            ex = _ex_of(t, shape)
        result.setdefault(fname, {})[arg] = ex
    return result
