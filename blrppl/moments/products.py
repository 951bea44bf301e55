"""Second moments of products of two independent Gaussian blocks, by contraction.

A bilinear argument x = f(w_A, w_B) + g(w) (:class:`blrppl.moments.kinds.BilinearGaussian`)
needs, per element, E[f(d_A, d_B)²] with d = w − E[w]. Pushing every pair of square-root
tangents (s_k of A, s'_l of B) through the model gives it as Σ_{k,l} f(s_k, s'_l)²: |S_A|·|S_B|
copies of the argument (100 for ``X @ C.T`` with D = 10). Where the product is a primitive
of the program, the same sum is a contraction of the two factors' covariances:

* ``u * v`` elementwise, u affine in A and v in B:  E[(d_u d_v)²] = Var[u] Var[v];
* a contraction over c (``dot_general``, or ``u * v`` then ``reduce_sum``, as in
  ``X @ C.T``, ``jnp.einsum``, ``(U[i] * V[j]).sum(-1)``):

      E[(Σ_c d_u,c d_v,c)²] = Σ_{c,c'} Cov[u_c, u_c'] Cov[v_c, v_c'],

  an (N, D²) @ (D², M) product for ``X @ C.T`` instead of D² arrays of (N, M).

When x depends on A and B through the product alone, its whole variance (the linear part's
too) comes from the same contraction with the factors' means (:func:`_contract`), and the
caller pushes no tangent of A or B through the model for it.

:func:`product_second_moments` evaluates the program (its jaxpr) once, carrying for each
intermediate its affine parts' tangents along A's and B's tangent sets and, once a product of
the two appears, the second moments of that product through the operations that keep it
elementwise: layout, indexing, scaling by a constant, adding an affine term (uncorrelated
with the bilinear part: its odd moments vanish). Anything else the product passes through (a
sum of two products, a sum over a product already taken, a loop) makes the argument fall
back to the pushes (the caller's job: the function returns None).

The tangent sets are those of :meth:`blrppl.families.base.Family.tangent_sets` over one plate
element, Σ = Σ_s l_s r_sᵀ with l_s unit columns and r_s = Σ l_s (no Cholesky factor, whose
derivative would be in every message): valid over what one plate element of a non-mixing
argument reads, so every covariance taken here (over the positions one output element
combines) is exact.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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
    """What a value carries besides itself: its affine parts' tangents along A's and B's
    tangent sets (``(2k, *shape)``, the k left tangents then the k right ones, or None for
    none) and its bilinear part: None, the second moment
    (``ex``, the value's shape) or, for a product not yet summed, its two factors
    (``prod``: (U, V, m_u, m_v), the tangent stacks and means of u and v, the part
    being the elementwise u·v).

    ``vt``: when the value's dependence on A and B is that product alone (plus terms in
    neither block), its whole variance under q(A) q(B), Var[u·v]; None otherwise."""

    ta: jax.Array | None = None
    tb: jax.Array | None = None
    ex: jax.Array | None = None
    prod: tuple | None = None
    vt: jax.Array | None = None

    @property
    def bilinear(self) -> bool:
        return self.ex is not None or self.prod is not None


#: a value whose bilinear part cannot be followed
_BAD = "bad"


def _halves(t):
    """A stack of tangents [l_1 … l_k, r_1 … r_k] split into its left and right halves."""
    k = t.shape[0] // 2
    return t[:k], t[k:]


def _variance(t):
    """Σ_s l_s r_s: the variance of a value whose tangent stack is ``t``."""
    left, right = _halves(t)
    return jnp.sum(left * right, axis=0)


def _ex_of(tags: _Tags, shape):
    """The second moment of a value's bilinear part (zeros when it has none)."""
    if tags.prod is not None:
        u, v, _, _ = tags.prod
        return jnp.broadcast_to(_variance(u) * _variance(v), shape)
    return tags.ex


def _vt_of(tags: _Tags, shape):
    """Var[u·v] of a value that depends on A and B through that product alone, else None:
    Var[u] Var[v] + Var[u] m_v² + m_u² Var[v] elementwise (no difference of large terms)."""
    if tags.prod is not None:
        u, v, mu, mv = tags.prod
        var_u, var_v = _variance(u), _variance(v)
        return jnp.broadcast_to(var_u * (var_v + jnp.square(mv)) + jnp.square(mu) * var_v, shape)
    return tags.vt


def _contract(u, v, mu, mv, batch_u, batch_v, contract_u, contract_v):
    """For u, v given by tangents (k, *shape) and (l, *shape) and means, contracted over
    c: E[f(d_u, d_v)²] = Σ_{c,c'} Cov[u_c, u_c'] Cov[v_c, v_c'] and the whole variance

        Var[Σ_c u_c v_c] = Σ_{c,c'} Cov[u]_{cc'} (Cov[v] + m_v m_vᵀ)_{cc'} + (m_u m_uᵀ)_{cc'} Cov[v]_{cc'},

    both in ``dot_general``'s output layout (batch, free of u, free of v)."""

    def grouped(t, batch, contract, lead):
        dims = range(lead, t.ndim)
        free = [d for d in dims if d - lead not in batch and d - lead not in contract]
        order = list(range(lead)) + [d + lead for d in batch] + free + [d + lead for d in contract]
        t = jnp.transpose(t, order)
        b = t.shape[lead : lead + len(batch)]
        f = t.shape[lead + len(batch) : lead + len(batch) + len(free)]
        return t.reshape(*t.shape[:lead], math.prod(b), math.prod(f), -1), b, f

    gu, b, fu = grouped(u, batch_u, contract_u, 1)
    gv, _, fv = grouped(v, batch_v, contract_v, 1)
    mu, _, _ = grouped(mu, batch_u, contract_u, 0)
    mv, _, _ = grouped(mv, batch_v, contract_v, 0)
    # the symmetric matrices over (c, c') packed to c ≤ c', off-diagonal terms counted twice
    # on u's side: half the multiply-adds of the contraction
    rows, cols = np.triu_indices(gu.shape[-1])
    twice = jnp.asarray(np.where(rows == cols, 1.0, 2.0), gu.dtype)

    def packed_cov(g):
        return jnp.einsum("kbfc,kbfd->bfcd", *_halves(g))[..., rows, cols]

    cov_u, cov_v = packed_cov(gu) * twice, packed_cov(gv)
    outer_u, outer_v = mu[..., rows] * mu[..., cols] * twice, mv[..., rows] * mv[..., cols]
    extra = jnp.einsum("bfp,bgp->bfg", cov_u, cov_v)
    whole = jnp.einsum("bfp,bgp->bfg", cov_u, cov_v + outer_v) + jnp.einsum("bfp,bgp->bfg", outer_u, cov_v)
    shape = (*b, *fu, *fv)
    return extra.reshape(shape), whole.reshape(shape)


def _contraction_worth_it(u, v, batch_u, contract_u) -> bool:
    """Covariances over the contracted dims cost no more than pushing every root pair
    (u, v: tangent stacks of 2k and 2l rows, for k and l square roots)."""
    size_b = math.prod(u.shape[1 + d] for d in batch_u)
    size_c = math.prod(u.shape[1 + d] for d in contract_u)
    size_f = math.prod(u.shape[1:]) // max(size_b * size_c, 1)
    size_g = math.prod(v.shape[1:]) // max(size_b * size_c, 1)
    k, l = u.shape[0] // 2, v.shape[0] // 2
    contraction = size_b * size_c**2 * (2 * k * size_f + 2 * l * size_g + size_f * size_g)
    # (each pushed pair at least forms u and v and their product)
    pushes = k * l * size_b * size_c * (size_f * size_g + size_f + size_g)
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
                *(bil[j] if bil is not None else (None, None, None)),
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
        mu, mv = vals
        dtype = outs[0].dtype
        if name == "mul":
            shape = outs[0].shape
            # (rows, *operand shape) → (rows, *shape): the operand's axes align right, as
            # numpy broadcasts them (a scalar coefficient times a vector: `a * z_prev`)
            aligned = [x.reshape(x.shape[:1] + (1,) * (len(shape) - x.ndim + 1) + x.shape[1:]) for x in (u, v)]
            lifted = [jnp.broadcast_to(x, x.shape[:1] + shape) for x in aligned]
            return [(None, (*lifted, jnp.broadcast_to(mu, shape), jnp.broadcast_to(mv, shape)), None)]
        (contract_u, contract_v), (batch_u, batch_v) = eqn.params["dimension_numbers"]
        if not _contraction_worth_it(u, v, batch_u, contract_u):
            raise _Unsupported("a contraction dearer than the pushes")
        ex, vt = _contract(u, v, mu, mv, batch_u, batch_v, contract_u, contract_v)
        return [(ex.astype(dtype), None, vt.astype(dtype))]

    def follow(self, eqn, name, vals, tags, outs):
        """The bilinear part (ex, prod, vt) of the outputs of an operation on values that
        may hold one (None when none does)."""
        held = [i for i, t in enumerate(tags) if t is not None and t.bilinear]
        if not held:
            return None
        shape = outs[0].shape
        # the other operands' dependence on A and B: none keeps a pure product pure
        others_free = all(t is None for i, t in enumerate(tags) if i not in held)
        if name in _ELEMENTWISE_LAYOUT:
            if held != [0]:
                raise _Unsupported("an index that depends on a product")
            t = tags[0]
            if t.prod is not None:
                mapped = zip(*[self._map(eqn, vals, x, lead) for x, lead in zip(t.prod, (1, 1, 0, 0))])
                return [(None, p, None) for p in mapped]
            exs = self.bind(eqn, [t.ex, *vals[1:]])
            vts = self.bind(eqn, [t.vt, *vals[1:]]) if t.vt is not None and others_free else [None] * len(exs)
            return list(zip(exs, [None] * len(exs), vts))
        if name in _PLACING:
            data = _PLACING[name]
            if data is None:
                data = tuple(range(len(vals)))
            elif data == "cases":
                data = tuple(range(1, len(vals)))
            if any(i not in data for i in held):
                raise _Unsupported("an index that depends on a product")
            ex_in, vt_in = list(vals), list(vals)
            pure = all(tags[i] is None for i in range(len(vals)) if i not in data)
            for i in data:
                t, x_shape = tags[i], jnp.shape(vals[i])
                zeros = jnp.zeros_like(vals[i])
                ex_in[i] = zeros if t is None or not t.bilinear else _ex_of(t, x_shape)
                vt = zeros if t is None else (_vt_of(t, x_shape) if t.bilinear else None)
                pure = pure and vt is not None
                vt_in[i] = vt
            (ex,) = self.bind(eqn, ex_in)
            vt = self.bind(eqn, vt_in)[0] if pure else None
            return [(ex, None, vt)]
        if name in ("add", "add_any", "sub"):
            if len(held) > 1:
                raise _Unsupported("a sum of two products")
            i = held[0]
            t, x_shape = tags[i], jnp.shape(vals[i])
            if t.prod is not None and x_shape == shape and others_free:
                return [(None, t.prod, None)]
            vt = _vt_of(t, x_shape)
            vt = jnp.broadcast_to(vt, shape) if vt is not None and others_free else None
            return [(jnp.broadcast_to(_ex_of(t, x_shape), shape), None, vt)]
        if name == "neg":  # (a sign leaves every second moment as it is)
            t = tags[0]
            return [(t.ex, t.prod, t.vt)]
        if name in ("mul", "div"):
            if held != [0] and name == "div":
                raise _Unsupported("a division by a product")
            i = held[0]
            c = vals[1 - i]
            t = tags[i]
            if t.prod is not None:
                u, v, mu, mv = (jnp.broadcast_to(x, x.shape[: x.ndim - len(jnp.shape(vals[i]))] + shape) for x in t.prod)
                scale = c if name == "mul" else 1.0 / c
                return [(None, (u * scale, v, mu * scale, mv), None)]
            c2 = jnp.square(c) if name == "mul" else 1.0 / jnp.square(c)
            vt = None if t.vt is None else jnp.broadcast_to(t.vt * c2, shape)
            return [(jnp.broadcast_to(t.ex * c2, shape), None, vt)]
        if name == "reduce_sum" and tags[0].prod is not None:
            u, v, mu, mv = tags[0].prod
            axes = tuple(eqn.params["axes"])
            batch = tuple(d for d in range(u.ndim - 1) if d not in axes)
            if not _contraction_worth_it(u, v, batch, axes):
                raise _Unsupported("a contraction dearer than the pushes")
            # a sum over a product u_c v_c is a contraction with the kept dims as batch dims
            ex, vt = _contract(u, v, mu, mv, batch, batch, axes, axes)
            dtype = outs[0].dtype
            return [(ex.reshape(shape).astype(dtype), None, vt.reshape(shape).astype(dtype))]
        if name == "reduce_sum" and math.prod(jnp.shape(vals[0])) == math.prod(shape):
            t = tags[0]
            (ex,) = self.bind(eqn, [_ex_of(t, jnp.shape(vals[0]))])
            vt = _vt_of(t, jnp.shape(vals[0]))
            return [(ex, None, None if vt is None else self.bind(eqn, [vt])[0])]
        raise _Unsupported(f"'{name}' of a product")

    def _map(self, eqn, vals, t, lead):
        """An elementwise-layout equation applied to a value (``lead`` 0) or to each
        tangent of a stack (``lead`` 1)."""
        if lead == 0:
            return tuple(self.bind(eqn, [t, *vals[1:]]))
        return jax.vmap(lambda x: tuple(self.bind(eqn, [x, *vals[1:]])))(t)


class ProductMoments(NamedTuple):
    """The second moments of an argument's product of blocks A and B.

    Attributes:
        extra: E[f(d_A, d_B)²] (:class:`blrppl.moments.kinds.BilinearGaussian`'s ``extra``).
        variance: when the argument depends on A and B through the product alone (plus
            terms in neither), its whole variance under q(A) q(B), Var[f(w_A, w_B)]: the
            linear part's too, with no pushed tangents; else None.
    """

    extra: jax.Array
    variance: jax.Array | None


def product_second_moments(fn, point: dict, a: str, sets_a: dict, b: str, sets_b: dict, wanted) -> dict | None:
    """The second moments of the arguments ``wanted`` of ``fn`` (the model's arguments as a
    function of the blocks' values) that multiply blocks A and B, read by contraction
    (module docstring).

    Args:
        fn: ``values -> {factor: {argument: value}}``.
        point: the blocks' values (their means) where ``fn`` is linearised.
        a, b: the two blocks, with ``sets_a``/``sets_b`` their tangent sets ``left`` and
            ``right`` (:meth:`blrppl.families.base.Family.tangent_sets`, not ``full``: over
            one plate element; in the layout of ``point`` with a leading axis).
        wanted: (factor, argument) pairs, each bilinear in (A, B).

    Returns:
        {factor: {argument: :class:`ProductMoments`}}, or None when some wanted argument's
        product passes through an operation the contraction cannot follow (then pushes are
        used).
    """
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(point)
    leaves, treedef = jax.tree_util.tree_flatten(point)
    index = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
    tags: list = [None] * len(leaves)
    for name, sets, field in ((a, sets_a, "ta"), (b, sets_b, "tb")):
        pieces = zip(
            jax.tree_util.tree_leaves(index[name]),
            jax.tree_util.tree_leaves(sets["left"]),
            jax.tree_util.tree_leaves(sets["right"]),
        )
        for i, left, right in pieces:
            tags[i] = _Tags(**{field: jnp.concatenate([left, right])})
    _, out_tags = _Interpreter().run(closed.jaxpr, closed.consts, leaves, tags)
    out_leaves, out_def = jax.tree_util.tree_flatten(shapes)
    out_index = jax.tree_util.tree_unflatten(out_def, list(range(len(out_leaves))))
    result: dict = {}
    for fname, arg in wanted:
        i = out_index[fname][arg]
        t = out_tags[i]
        if t is _BAD:
            return None
        shape, dtype = out_leaves[i].shape, out_leaves[i].dtype
        if t is None or not t.bilinear:
            zeros = jnp.zeros(shape, dtype)
            moments = ProductMoments(zeros, zeros if t is None else None)
        else:
            vt = _vt_of(t, shape)
            moments = ProductMoments(_ex_of(t, shape), None if vt is None else jnp.broadcast_to(vt, shape))
        result.setdefault(fname, {})[arg] = moments
    return result
