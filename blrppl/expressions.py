"""Distribution arguments as functions of the blocks: classification and moments.

For each factor, every argument the rule reads (and the value) is a function of the
neighbouring blocks, obtained by re-running the model with substituted latent values.
At compile time :func:`classify_argument` probes that function by autodiff at random
points:

* ``const``           — depends on no continuous block;
* ``affine_gaussian`` — affine in Gaussian blocks (second directional derivative exactly
  zero, as forward-over-forward autodiff gives for linear maps such as ``X @ w + b`` or
  ``a[group]``);
* ``power_gamma``     — c·τ^a in one Gamma block τ (``log`` of it is affine in ``log τ``),
  e.g. ``1 / jnp.sqrt(tau)``;
* ``beta`` / ``dirichlet`` — the block itself, possibly indexed;
* ``opaque``          — anything else.

Arguments that touch a plated block must use one plate element per output element
("gather" structure) for the elementwise moments to be exact. This is tested with random
sign patterns over plate elements: the squared directional derivative is the same for
every pattern exactly when a single element contributes. Dense Gaussian blocks whose
elements mix (e.g. a sum over a plate) use one column per scalar of the block instead.

At run time :func:`argument_moments` builds the moment objects of :mod:`blrppl.moments`
from the blocks' ``view`` parameters with one ``jax.linearize`` of the model per factor:
means of affine arguments are values at the block means and their covariance columns are
JVPs along the block's covariance columns; gathered Gamma/Beta/Dirichlet parameters are
JVPs of the (linear) indexing map applied to the parameter arrays.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers

from blrppl import moments as mom
from blrppl.graph.plan import Block
from blrppl.graph.trace import unwrap

#: dense Gaussian blocks whose elements mix in an argument get one column per scalar,
#: up to this many scalars; beyond it the argument is opaque
MAX_FULL_COLUMNS = 2048
_NUM_SIGN_PATTERNS = 16
_NUM_PROBES = 2


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Splits model arguments into array leaves (passed to jit) and static leaves."""

    treedef: Any
    static: tuple  # (index, value) of non-array leaves

    @staticmethod
    def split(args, kwargs):
        leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)), is_leaf=lambda x: x is None)
        dynamic, static = [], []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, (jax.Array, np.ndarray)) and not isinstance(leaf, np.generic):
                dynamic.append(jnp.asarray(leaf))
            else:
                static.append((i, leaf))
        return DataSpec(treedef, tuple(static)), tuple(dynamic)

    def merge(self, dynamic):
        n = len(dynamic) + len(self.static)
        leaves = [None] * n
        static = dict(self.static)
        it = iter(dynamic)
        for i in range(n):
            leaves[i] = static[i] if i in static else next(it)
        args, kwargs = jax.tree.unflatten(self.treedef, leaves)
        return args, kwargs


class ModelFunctions:
    """Evaluates a factor's arguments as a function of the latent values.

    Args:
        model: the numpyro model.
        data_spec: how to rebuild the model's arguments from the dynamic data leaves.
        fill_values: a valid value for every latent site (used for sites a factor does not
            depend on; their values never reach the factor's arguments).
    """

    def __init__(self, model, data_spec: DataSpec, fill_values: dict):
        self.model = model
        self.data_spec = data_spec
        self.fill_values = fill_values

    def site(self, name: str, values: dict, data):
        """Run the model with ``values`` substituted and return the site's trace entry."""
        args, kwargs = self.data_spec.merge(data)
        full = dict(self.fill_values)
        full.update(values)
        model = handlers.substitute(handlers.seed(self.model, 0), data=full)
        tr = handlers.trace(model).get_trace(*args, **kwargs)
        return tr[name]

    def factor_args(self, name: str, arg_names, values: dict, data) -> dict:
        """The rule arguments and value of site ``name`` (unwrapped distribution)."""
        site = self.site(name, values, data)
        base, _, _ = unwrap(site["fn"])
        out = {a: jnp.asarray(getattr(base, a)) for a in arg_names}
        out["value"] = jnp.asarray(site["value"])
        return out

    def factor_weight(self, name: str, data):
        """Mask and scale of site ``name`` (do not depend on latent values)."""
        site = self.site(name, {}, data)
        _, _, mask = unwrap(site["fn"])
        return mask, site.get("scale")


# -- probing -----------------------------------------------------------------------------


def random_point(block: Block, key) -> jax.Array:
    """A random value of a block's site, inside its support."""
    shape = block.value_shape
    if block.discrete:
        vals = jnp.asarray(block.support_values)
        return vals[jax.random.randint(key, shape, 0, len(vals))]
    if block.kind in ("gaussian", "gaussian-diag"):
        return jax.random.normal(key, shape)
    if block.kind == "gamma":
        return jnp.exp(0.5 * jax.random.normal(key, shape))
    if block.kind == "beta":
        return jax.random.uniform(key, shape, minval=0.2, maxval=0.8)
    if block.kind == "dirichlet":
        return jax.random.dirichlet(key, jnp.ones(shape[-1]), shape[:-1])
    raise ValueError(block.kind)


def _second_derivative(fn, point, tangent):
    def first(s):
        shifted = jax.tree.map(lambda p, t: p + s * t, point, tangent)
        return fn(shifted)

    def d1(s):
        return jax.jvp(first, (s,), (jnp.ones_like(s),))[1]

    s0 = jnp.zeros(())
    return jax.jvp(d1, (s0,), (jnp.ones_like(s0),))[1]


def _is_gather(fn, point, name, block: Block, key, elementwise: bool) -> bool:
    """Whether each output element of ``fn`` uses one plate element (or, if ``elementwise``,
    one scalar) of ``block``."""
    if elementwise:
        shape = block.value_shape
        if math.prod(shape) <= 1:
            return True
    else:
        if math.prod(block.batch_shape) <= 1:
            return True
    k1, k2 = jax.random.split(key)
    if elementwise:
        signs = jax.random.rademacher(k1, (_NUM_SIGN_PATTERNS,) + block.value_shape).astype(float)
        scales = jnp.exp(0.3 * jax.random.normal(k2, block.value_shape))
        tangents = signs * scales
    else:
        bshape = block.batch_shape
        dim = math.prod(block.value_shape) // max(math.prod(bshape), 1)
        signs = jax.random.rademacher(k1, (_NUM_SIGN_PATTERNS,) + bshape + (1,)).astype(float)
        direction = jax.random.normal(k2, (dim,))
        tangents = jax.vmap(block.to_site)(signs * direction)

    def jvp_of(t):
        return jax.jvp(lambda x: fn({**point, name: x}), (point[name],), (t,))[1]

    outs = jax.vmap(jvp_of)(tangents)
    sq = jnp.square(outs)
    ref = sq[0]
    tol = 1e-5 if sq.dtype == jnp.float64 else 1e-3
    return bool(jnp.all(jnp.abs(sq - ref) <= tol * (jnp.abs(ref) + 1e-12)))


@dataclasses.dataclass(frozen=True)
class ArgumentClass:
    """Result of classifying one argument.

    Attributes:
        kind: one of :data:`blrppl.moments.KINDS` or ``"opaque"``.
        blocks: continuous blocks it depends on.
        full: Gaussian blocks whose plate elements mix in this argument.
        reason: why the argument is opaque (empty otherwise).
    """

    kind: str
    blocks: tuple
    full: tuple = ()
    reason: str = ""


def classify_argument(
    fn: Callable[[dict], jax.Array],
    deps: frozenset,
    blocks: dict,
    key,
) -> ArgumentClass:
    """Classify ``fn`` (a function of site values) by probing it at random points.

    Args:
        fn: maps a dict of latent site values (those in ``deps``) to the argument.
        deps: names of the blocks the argument depends on (structurally).
        blocks: name → :class:`Block` for every latent site.
        key: PRNG key for the probes.
    """
    cont = tuple(n for n in deps if not blocks[n].discrete)
    disc = tuple(n for n in deps if blocks[n].discrete)
    if not cont:
        return ArgumentClass("const", ())
    kinds = {blocks[n].kind for n in cont}
    keys = jax.random.split(key, _NUM_PROBES * 4)

    def probe_point(k):
        ks = jax.random.split(k, len(deps))
        return {n: random_point(blocks[n], kk) for n, kk in zip(cont + disc, ks)}

    if kinds <= {"gaussian", "gaussian-diag"}:
        full = set()
        for p in range(_NUM_PROBES):
            point = probe_point(keys[4 * p])
            tks = jax.random.split(keys[4 * p + 1], len(cont))
            tangent = {n: jax.random.normal(k, blocks[n].value_shape) for n, k in zip(cont, tks)}

            def restricted(x, point=point):
                return fn({**point, **x})

            d2 = _second_derivative(restricted, {n: point[n] for n in cont}, tangent)
            if not bool(jnp.all(d2 == 0)):
                return ArgumentClass("opaque", cont, reason="not affine in its Gaussian blocks")
            for n in cont:
                if not _is_gather(fn, point, n, blocks[n], keys[4 * p + 2], blocks[n].kind != "gaussian"):
                    full.add(n)
        for n in full:
            if blocks[n].size > MAX_FULL_COLUMNS:
                return ArgumentClass(
                    "opaque", cont, reason=f"mixes the elements of the large block '{n}'"
                )
        return ArgumentClass("affine_gaussian", cont, tuple(sorted(full)))

    if len(cont) != 1:
        return ArgumentClass("opaque", cont, reason="depends on several non-Gaussian blocks")
    (name,) = cont
    block = blocks[name]
    if block.kind == "gamma":
        for p in range(_NUM_PROBES):
            point = probe_point(keys[4 * p])

            def log_fn(u, point=point):
                return jnp.log(fn({**point, name: jnp.exp(u[name])}))

            u0 = {name: jnp.log(point[name])}
            val = fn(point)
            if not bool(jnp.all(val > 0)):
                return ArgumentClass("opaque", cont, reason="not positive")
            tangent = {name: jax.random.normal(keys[4 * p + 1], block.value_shape)}
            d2 = _second_derivative(log_fn, u0, tangent)
            if not bool(jnp.all(jnp.abs(d2) <= 1e-6 * (1 + jnp.abs(val)))):
                return ArgumentClass("opaque", cont, reason="not a power of its Gamma block")
            log_point = {**point, name: u0[name]}
            if not _is_gather(lambda v: log_fn({name: v[name]}), log_point, name, block, keys[4 * p + 2], True):
                return ArgumentClass("opaque", cont, reason="mixes elements of its Gamma block")
        return ArgumentClass("power_gamma", cont)

    if block.kind in ("beta", "dirichlet"):
        for p in range(_NUM_PROBES):
            point = probe_point(keys[4 * p])
            x = point[name]

            def lin_fn(v, point=point):
                return fn({**point, name: v})

            val, slope_x = jax.jvp(lin_fn, (x,), (x,))
            _, slope_1 = jax.jvp(lin_fn, (x,), (jnp.ones_like(x),))
            ok = bool(jnp.allclose(val, slope_x, rtol=1e-6, atol=1e-9)) and bool(
                jnp.allclose(slope_1, 1.0, rtol=1e-6)
            )
            if not ok:
                return ArgumentClass("opaque", cont, reason=f"not the {block.kind} block itself")
            if not _is_gather(fn, point, name, block, keys[4 * p + 2], True):
                return ArgumentClass("opaque", cont, reason=f"mixes elements of its {block.kind} block")
        return ArgumentClass(block.kind, cont)

    return ArgumentClass("opaque", cont, reason=f"depends on a {block.kind} block")


# -- moments at run time ------------------------------------------------------------------


def gaussian_columns(block: Block, view, full: bool):
    """Tangents (site layout) of the unit columns and of the covariance columns of a
    Gaussian block: ``left`` and ``right`` inputs of :class:`blrppl.moments.AffineGaussian`."""
    if block.kind == "gaussian-diag":
        var = view.var
        if not full:
            return jnp.ones((1,) + var.shape, var.dtype), var[None]
        n = var.size
        eye = jnp.eye(n, dtype=var.dtype)
        return eye.reshape((n,) + var.shape), (eye * var.reshape(-1)).reshape((n,) + var.shape)
    cov = view.cov  # (*B, D, D)
    bshape = cov.shape[:-2]
    dim = cov.shape[-1]
    if not full:
        eye = jnp.eye(dim, dtype=cov.dtype)
        basis = eye.reshape((dim,) + (1,) * len(bshape) + (dim,))
        basis = jnp.broadcast_to(basis, (dim,) + bshape + (dim,))
        cols = jnp.moveaxis(cov, -1, 0)  # (D, *B, D): column j of each Σ_p
        return jax.vmap(block.to_site)(basis), jax.vmap(block.to_site)(cols)
    nb = math.prod(bshape)
    n = nb * dim
    eye = jnp.eye(n, dtype=cov.dtype).reshape((n,) + bshape + (dim,))
    cov_flat = cov.reshape((nb, dim, dim))
    # column (p, j): Σ_p[:, j] at plate element p, zero elsewhere
    sel = jnp.eye(nb, dtype=cov.dtype)  # (nb, nb)
    right = jnp.einsum("pq,qdj->pjqd", sel, cov_flat).reshape((n,) + bshape + (dim,))
    return jax.vmap(block.to_site)(eye), jax.vmap(block.to_site)(right)


def argument_moments(
    fns: ModelFunctions,
    factor,
    blocks: dict,
    views: dict,
    discrete_values: dict,
    data,
) -> dict:
    """Moment objects of every argument (and the value) of ``factor``.

    Args:
        fns: model evaluation functions.
        factor: the :class:`blrppl.graph.plan.Factor`.
        blocks: name → Block.
        views: name → the block's ``view`` (parameters the moments are differentiable in).
        discrete_values: name → site value of each enumerated discrete neighbour.
        data: dynamic model data.
    """
    cont = [n for n in factor.neighbours if n not in factor.discrete]
    point = {}
    for n in cont:
        b, v = blocks[n], views[n]
        if b.kind == "gaussian":
            point[n] = b.to_site(v.mean)
        elif b.kind == "gaussian-diag":
            point[n] = v.mean
        elif b.kind == "gamma":
            point[n] = jnp.zeros(b.value_shape, v.shape.dtype)  # u = log τ = 0
        elif b.kind == "beta":
            point[n] = v.alpha / (v.alpha + v.beta)
        elif b.kind == "dirichlet":
            point[n] = v.concentration / v.concentration.sum(-1, keepdims=True)

    gamma_names = [n for n in cont if blocks[n].kind == "gamma"]
    arg_names = factor.rule.arg_names

    def f(x):
        vals = dict(discrete_values)
        for n in cont:
            vals[n] = jnp.exp(x[n]) if n in gamma_names else x[n]
        return fns.factor_args(factor.name, arg_names, vals, data)

    out, lin = jax.linearize(f, point)
    zeros = {n: jnp.zeros_like(p) for n, p in point.items()}

    def lin_block(n, t):
        return lin({**zeros, n: t})

    kinds = factor.kinds
    arg_blocks = dict(factor.arg_blocks)
    gauss = [n for n in cont if blocks[n].kind in ("gaussian", "gaussian-diag")]
    full = {n for n, mode in factor.columns if mode == "full"}
    columns = {}
    for n in gauss:
        left_t, right_t = gaussian_columns(blocks[n], views[n], n in full)
        columns[n] = (
            jax.vmap(lambda t, n=n: lin_block(n, t))(left_t),
            jax.vmap(lambda t, n=n: lin_block(n, t))(right_t),
        )
    result = {}
    for arg in ("value",) + tuple(arg_names):
        kind = kinds[arg]
        value = out[arg]
        if kind == "const":
            result[arg] = mom.Const(value)
        elif kind == "affine_gaussian":
            used = arg_blocks[arg]
            left = tuple(columns[n][0][arg] if n in used else None for n in gauss)
            right = tuple(columns[n][1][arg] if n in used else None for n in gauss)
            result[arg] = mom.AffineGaussian(value, left, right)
        elif kind == "power_gamma":
            (n,) = arg_blocks[arg]
            v = views[n]
            slope = lin_block(n, jnp.ones(blocks[n].value_shape, value.dtype))[arg]
            result[arg] = mom.PowerGamma(
                coef=value,
                power=slope / value,
                shape_param=lin_block(n, v.shape)[arg] / slope,
                rate=lin_block(n, v.rate)[arg] / slope,
            )
        elif kind == "beta":
            (n,) = arg_blocks[arg]
            v = views[n]
            result[arg] = mom.BetaIdentity(lin_block(n, v.alpha)[arg], lin_block(n, v.beta)[arg])
        elif kind == "dirichlet":
            (n,) = arg_blocks[arg]
            a = views[n].concentration
            total = jnp.broadcast_to(a.sum(-1, keepdims=True), a.shape)
            result[arg] = mom.DirichletIdentity(lin_block(n, a)[arg], lin_block(n, total)[arg])
        else:
            raise ValueError(f"factor '{factor.name}': argument '{arg}' is {kind}")
    return result
