"""Moments of the factors' arguments under q, from one linearisation of the model.

At run time :func:`group_moments` builds the moment objects of :mod:`blrppl.moments.kinds`
from the blocks' ``view`` parameters with one ``jax.linearize`` of the model per group of
factors: means of affine arguments are values at the block means and their covariance
columns are JVPs along the block's covariance columns; gathered Gamma/Beta/Dirichlet
parameters are JVPs of the (linear) indexing map applied to the parameter arrays.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from blrppl.estimators.monte_carlo import tensor_gauss_hermite
from blrppl.graph.plan import Block
from blrppl.model.functions import ModelFunctions, factor_arguments
from blrppl.moments import kinds as mom
from blrppl.moments.products import ProductMoments, product_second_moments


def _base_point(block: Block, view):
    """Where the model is linearised, in the block's site layout (Gaussian blocks at their
    mean, Gamma blocks at log τ = 0 so a power c·τ^a reads c, Beta/Dirichlet blocks at
    their mean: :meth:`blrppl.families.Family.linearisation_point`)."""
    return block.to_site(block.family.linearisation_point(view))


def base_values(blocks: dict, views: dict, names) -> dict:
    """Block values at the base point (see :func:`_base_point`), Gamma blocks as τ = 1."""
    return {n: blocks[n].family.from_linearisation(_base_point(blocks[n], views[n])) for n in names}


def _tangent_sets(block: Block, view, full: bool) -> dict:
    """Stacks of tangents (site layout) to push through the linearised model."""
    return _site_layout(block, block.family.tangent_sets(view, full))


def _site_layout(block: Block, sets: dict) -> dict:
    return {tag: jax.vmap(block.to_site)(stack) for tag, stack in sets.items()}


#: pushed floats (tangent rows × argument elements) above which each block's tangents are
#: pushed on their own (see :func:`_push_tangents`)
SPLIT_PUSH_FLOATS = 1 << 20


def _push_tangents(lin, point: dict, sets: dict, out, row_wise=frozenset()) -> dict:
    """Every block's tangent sets pushed through the linearised model ``lin``.

    Returns ``(block, tag) → pushes``: the arguments' pushes of that set's rows, a pytree
    with the rows as leading axis, or for a block in ``row_wise`` a list of one pytree per
    row.

    Small groups push every block's rows in one batched JVP (the others' tangents zero):
    one copy of the linear model in the program. Once rows × argument elements exceed
    :data:`SPLIT_PUSH_FLOATS`, each block's rows are pushed on their own with the other
    blocks' tangents unbatched zeros, so an argument pays only for the rows of the blocks
    it reads: in a mixture, the D² pushed rows of a precision matrix's Wishart block no
    longer run through the mean's N × D gather, nor the mean's 2D rows through the
    precision's N × D × D one.

    The blocks in ``row_wise`` (Gamma, Beta, Dirichlet, Wishart: a few rows, each read by
    its own moment) push one row at a time, each row an unbatched JVP: a row no argument
    reads is dead code the compiler drops, with its share of the gathers' transposes (a
    Dirichlet read only through E[log π], as a Categorical's probabilities are, pushes one
    row of its three: in a hidden Markov chain's K² enumerated runs of ``trans[prev]`` the
    scatter-add of the gradient was the step's costliest operation).
    """
    zeros = {n: jnp.zeros_like(x) for n, x in point.items()}
    pushed = {}
    for n in row_wise & sets.keys():
        for tag, stack in sets[n].items():
            pushed[(n, tag)] = [lin({**zeros, n: row}) for row in stack]
    sets = {n: tags for n, tags in sets.items() if n not in row_wise}
    if not sets:
        return pushed
    rows, offsets = {}, {}
    for n, tags in sets.items():
        total = 0
        for tag, stack in tags.items():
            rows[(n, tag)] = (total, total + stack.shape[0])
            total += stack.shape[0]
        offsets[n] = total
    count = sum(offsets.values())
    elements = sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(out))
    if len(sets) == 1 or count * elements <= SPLIT_PUSH_FLOATS:
        start, tangents = 0, {}
        for n, tags in sets.items():
            stack = jnp.concatenate(list(tags.values()), axis=0)
            before = jnp.zeros((start,) + point[n].shape, point[n].dtype)
            after = jnp.zeros((count - start - offsets[n],) + point[n].shape, point[n].dtype)
            tangents[n] = jnp.concatenate([before, stack, after], axis=0)
            start += offsets[n]
        joint = jax.vmap(lambda t: lin({**zeros, **t}))(tangents)
        by_block, start = {}, 0
        for n in sets:
            by_block[n] = jax.tree.map(lambda x, lo=start, hi=start + offsets[n]: x[lo:hi], joint)
            start += offsets[n]
    else:
        by_block = {}
        for n, tags in sets.items():
            stack = jnp.concatenate(list(tags.values()), axis=0)
            by_block[n] = jax.vmap(lambda t, n=n: lin({**zeros, n: t}))(stack)
    for (n, tag), (lo, hi) in rows.items():
        pushed[(n, tag)] = jax.tree.map(lambda x, lo=lo, hi=hi: x[lo:hi], by_block[n])
    return pushed


#: Gauss–Hermite nodes per dimension of :func:`support_view`, by scalars per plate element
SUPPORT_NODES = {1: 32, 2: 20, 3: 10}


def support_view(block: Block, view):
    """The Gaussian on u = g⁻¹(φ) whose linearisation gives the site value φ = g(u) its
    exact first two moments under q(u) = N(m, Σ) (a block with :attr:`Block.value_moments`,
    g elementwise), per plate element:

        u* = g⁻¹(E[g(u)]),    Σ* = Cov[g(u)] / (g'(u*) g'(u*)ᵀ)  (elementwise),

    E and Cov by a tensor Gauss–Hermite rule over the element's scalars. The model
    linearised at u* reads φ = E[g(u)]; a tangent t along u moves φ by g'(u*) ⊙ t, so the
    covariance Σ* along u is Cov[g(u)] along φ. An argument affine in φ (or a product of φ
    with an independent Gaussian block) then has its exact mean and variance, and the
    rules' expectations of Normal-type densities, which depend on such an argument through
    those only, are exact. Differentiable in (m, Σ): the messages are the gradients through
    the quadrature (not conjugate).
    """
    family, transform = block.family, block.transform
    mean = family.linearisation_point(view)  # canonical layout
    dense = hasattr(view, "cov")
    d = mean.shape[-1] if dense else 1
    grid, weights = tensor_gauss_hermite(SUPPORT_NODES[d], d)
    grid, weights = jnp.asarray(grid, mean.dtype), jnp.asarray(weights, mean.dtype)
    if dense:
        u = mean + jnp.einsum("...ij,kj->k...i", jnp.linalg.cholesky(view.cov), grid)
    else:
        u = mean + jnp.sqrt(jnp.maximum(view.var, 0.0)) * grid[:, 0].reshape((-1,) + (1,) * mean.ndim)
    g = jax.vmap(block.to_canonical)(transform(jax.vmap(block.to_site)(u)))
    wk = weights.reshape((-1,) + (1,) * mean.ndim)
    g_mean = jnp.sum(wk * g, axis=0)
    centred = g - g_mean
    u_star = transform.inv(block.to_site(g_mean))
    slope = block.to_canonical(jax.jvp(transform, (u_star,), (jnp.ones_like(u_star),))[1])
    u_star = block.to_canonical(u_star)
    if dense:
        g_cov = jnp.einsum("k,k...i,k...j->...ij", weights, centred, centred)
        cov = g_cov / (slope[..., :, None] * slope[..., None, :])
        # (a q far in the tails, where g saturates in floating point: its own mean and covariance)
        ok = jnp.all(jnp.isfinite(u_star) & (slope > 0), -1) & jnp.all(jnp.isfinite(cov), (-2, -1))
        return view._replace(
            mean=jnp.where(ok[..., None], u_star, mean), cov=jnp.where(ok[..., None, None], cov, view.cov)
        )
    var = jnp.sum(wk * jnp.square(centred), axis=0) / jnp.square(slope)
    ok = jnp.isfinite(u_star) & jnp.isfinite(var) & (slope > 0)
    return view._replace(mean=jnp.where(ok, u_star, mean), var=jnp.where(ok, var, view.var))


def group_moments(
    fns: ModelFunctions, factors, blocks: dict, views: dict, discrete_values: dict, data, on_support: bool = False
) -> dict:
    """Moment objects of every argument (and value) of several factors, from one
    linearisation of the model and one batched JVP.

    Args:
        fns: model evaluation functions.
        factors: :class:`blrppl.graph.plan.Factor` objects sharing their discrete neighbours.
        blocks: name → Block.
        views: name → the block's ``view`` (the moments are differentiable in these).
        discrete_values: name → site value of each enumerated discrete neighbour.
        data: dynamic model data.
        on_support: the factors are closed-form (their arguments were classified with
            ``value_moments``): blocks with :attr:`Block.value_moments` are seen through
            :func:`support_view`.

    Returns:
        factor name → {argument → moment object}.
    """
    if on_support:
        views = {
            n: support_view(blocks[n], v) if blocks[n].value_moments and not blocks[n].members else v
            for n, v in views.items()
        }
    cont = []
    for f in factors:
        cont += [n for n in f.neighbours if n not in f.discrete and n not in cont]
    wanted = {f.name: factor_arguments(f) for f in factors}
    point = {n: _base_point(blocks[n], views[n]) for n in cont}
    # log-normal arguments are linearised on log space: their logs, not exp(log) / exp(log)
    logged = {f.name: frozenset(a for a, k in f.kinds.items() if k == mom.ExpGaussian.kind) for f in factors}
    logged = {n: a for n, a in logged.items() if a}

    def model_args(x):
        vals = dict(discrete_values)
        for n in cont:
            vals[n] = blocks[n].family.from_linearisation(x[n])
        return fns.args_of(wanted, vals, data, logged)

    if not cont:  # (constants as the model computes them: nothing is on log space)
        out = fns.args_of(wanted, dict(discrete_values), data)
        return {f.name: {a: mom.Const(v) for a, v in out[f.name].items()} for f in factors}

    out, lin = jax.linearize(model_args, point)
    full = {n for f in factors for n, mode in f.columns if mode == "full"}
    sets = {n: _tangent_sets(blocks[n], views[n], n in full) for n in cont}
    rows_of = _pushed_rows(lin, point, sets, out, factors, blocks, views)
    gauss = [n for n in cont if blocks[n].family.gaussian]
    paired = {n for f in factors for _, ps in f.spec.pairs for pair in ps for n in pair}
    roots = {}
    for n in paired:
        root = blocks[n].family.tangent_roots(views[n], n in full)
        roots[n] = None if root is None else jax.vmap(blocks[n].to_site)(root)
    extra = _bilinear_extra(model_args, point, sets, roots, factors)
    result = {}
    for f in factors:
        arg_blocks = dict(f.arg_blocks)
        fgauss = [n for n in f.neighbours if n in gauss]
        moments = {}
        for arg, _ in f.arg_kinds:
            kind = f.kinds[arg]
            build = _BUILDERS.get(kind)
            if build is None:
                raise ValueError(f"factor '{f.name}': argument '{arg}' is {kind}")
            moments[arg] = build(_Argument(f, arg, out[f.name][arg], arg_blocks[arg], fgauss, rows_of, extra))
        result[f.name] = moments
    return result


def _pushed_rows(lin, point: dict, sets: dict, out, factors, blocks: dict, views: dict) -> Callable:
    """Push the blocks' tangent ``sets`` through the linearised model ``lin``
    (:func:`_push_tangents`); returns ``rows_of(block, tag, factor, argument)``: the pushes
    of one tangent set for one argument (a list of rows for a row-wise block)."""
    # (a chain's factor whose elements each read one of its scalars takes the two rows of
    # its diagonal, pushed on their own; the 2(2b + 1) colour rows are pushed for the
    # others, and are dead code the compiler drops when no factor reads them)
    scalar = {(f.name, n) for f in factors for n, mode in f.columns if mode == "scalar"}
    row_wise = frozenset(n for n in sets if not blocks[n].family.gaussian)
    pushed = _push_tangents(lin, point, sets, out, row_wise)
    zeros = {n: jnp.zeros_like(x) for n, x in point.items()}
    for n in {n for _, n in scalar}:
        for tag, stack in _site_layout(blocks[n], blocks[n].family.scalar_tangent_sets(views[n])).items():
            pushed[(n, "scalar_" + tag)] = jax.vmap(lambda t, n=n: lin({**zeros, n: t}))(stack)

    def rows_of(n, tag, fname, arg):
        rows = pushed[(n, "scalar_" + tag if (fname, n) in scalar else tag)]
        return [r[fname][arg] for r in rows] if isinstance(rows, list) else rows[fname][arg]

    return rows_of


class _Argument(NamedTuple):
    """One argument (or the value) of a factor, as :func:`group_moments` builds its moment
    object: its value at the linearisation point and where to read its pushed rows."""

    factor: Any
    name: str
    value: Any
    used: tuple  # the blocks the argument reads
    gaussian: list  # the factor's Gaussian neighbours
    rows_of: Callable  # see _pushed_rows
    extra: dict  # the bilinear arguments' second moments (_bilinear_extra)

    def rows(self, block: str, tag: str):
        """The pushes of ``block``'s tangent set ``tag`` for this argument."""
        return self.rows_of(block, tag, self.factor.name, self.name)

    def columns(self) -> tuple:
        """(left, right): the covariance columns of every Gaussian neighbour (None for those
        the argument does not read)."""
        left = tuple(self.rows(n, "left") if n in self.used else None for n in self.gaussian)
        right = tuple(self.rows(n, "right") if n in self.used else None for n in self.gaussian)
        return left, right


def _const(a: _Argument):
    return mom.Const(a.value)


def _affine_gaussian(a: _Argument):
    return mom.AffineGaussian(a.value, *a.columns())


def _bilinear_gaussian(a: _Argument):
    left, right = a.columns()
    pairs = dict(a.factor.spec.pairs)[a.name]
    found = [a.extra[pair][a.factor.name][a.name] for pair in pairs]
    whole = _whole_product_variance(a.factor, a.name, pairs, found)
    if whole is None:
        return mom.BilinearGaussian(mom.AffineGaussian(a.value, left, right), sum(m.extra for m in found))
    # the product's variance in full: the linear part's rows of its two blocks are not
    # read (nor computed: XLA drops unused pushes)
    drop = set(pairs[0])
    left = tuple(None if n in drop else r for n, r in zip(a.gaussian, left))
    right = tuple(None if n in drop else r for n, r in zip(a.gaussian, right))
    return mom.BilinearGaussian(mom.AffineGaussian(a.value, left, right), whole)


def _exp_gaussian(a: _Argument):
    # x = exp(a) with a affine: a and its rows were pushed (``logged`` in group_moments)
    return mom.ExpGaussian(mom.AffineGaussian(a.value, *a.columns()))


def _power_gamma(a: _Argument):
    # each row pushed through x = c τ^a at τ = 1 is multiplied by the slope c a
    slope, shape_t, rate_t, *mean_t = a.rows(a.used[0], "gamma")
    mean_params = [m / slope for m in mean_t] if mean_t else [None, None]
    # the exponent a is the argument form's, known at trace time
    power = dict(a.factor.spec.powers).get(a.name)
    power = slope / a.value if power is None else float(power)
    return mom.PowerGamma(a.value, power, shape_t / slope, rate_t / slope, *mean_params)


def _beta_identity(a: _Argument):
    alpha, beta, *mean_params = a.rows(a.used[0], "beta")
    return mom.BetaIdentity(alpha, beta, *mean_params)


def _dirichlet_identity(a: _Argument):
    conc, tot, *mean_params = a.rows(a.used[0], "dirichlet")
    return mom.DirichletIdentity(conc, tot, *mean_params)


def _wishart_identity(a: _Argument):
    # whole matrices in place, each times a constant c (checked at compile time):
    # rows E[Λ], E[log|Λ|] and 1 come back as c E[Λ], c E[log|Λ|] and c, and
    # log|cΛ| = D log c + log|Λ|
    # (packed in one row for D > 1, see Wishart.tangent_sets)
    pushed_rows = a.rows(a.used[0], "wishart")
    mean = pushed_rows[0]
    if mean.shape[-1] == 1:
        c, c_logdet = pushed_rows[2][..., 0, 0], pushed_rows[1][..., 0, 0]
    else:
        c, c_logdet = pushed_rows[1][..., 0, 1], pushed_rows[1][..., 0, 0]
    return mom.WishartIdentity(mean, c_logdet / c + mean.shape[-1] * jnp.log(c))


#: the builder of each kind of moment object from an argument's linearisation
_BUILDERS = {
    mom.Const.kind: _const,
    mom.AffineGaussian.kind: _affine_gaussian,
    mom.BilinearGaussian.kind: _bilinear_gaussian,
    mom.ExpGaussian.kind: _exp_gaussian,
    mom.PowerGamma.kind: _power_gamma,
    mom.BetaIdentity.kind: _beta_identity,
    mom.DirichletIdentity.kind: _dirichlet_identity,
    mom.WishartIdentity.kind: _wishart_identity,
}


def _whole_product_variance(f, arg: str, pairs, found):
    """Var[x] under q(A) q(B) of an argument x that depends on the blocks A and B of its
    one pair only through their product, when the contraction gave it and no other argument
    of the factor reads A or B (no covariance with them is needed); else None."""
    if len(pairs) != 1 or found[0].variance is None:
        return None
    blocks = set(pairs[0])
    if any(set(used) & blocks for other, used in f.arg_blocks if other != arg):
        return None
    return found[0].variance


def _bilinear_extra(model_args, point: dict, sets: dict, roots: dict, factors) -> dict:
    """The second moments of every bilinear argument, per pair of blocks (A, B) it
    multiplies (:class:`blrppl.moments.kinds.BilinearGaussian`):
    {(A, B): {factor: {argument: ProductMoments}}} (:class:`blrppl.moments.products.ProductMoments`:
    E[f(d_A, d_B)²], and the whole variance where the contraction gives it).

    E[(d_Aᵀ J d_B)²] = tr(Jᵀ Σ_A J Σ_B), each f(a, b) below the mixed second derivative of
    the arguments along a (in A) and b (in B). With square roots Σ_A = Σ_k s_k s_kᵀ and
    Σ_B = Σ_l s'_l s'_lᵀ (``roots``: the Cholesky columns of each plate element) it is
    Σ_{k,l} f(s_k, s'_l)²: |S|·|T| pushes. Otherwise, with Σ_A = Σ_s l_s r_sᵀ and
    Σ_B = Σ_t l'_t r'_tᵀ the blocks' tangent sets (``left`` and ``right``, as for affine
    arguments), it is Σ_{s,t} f(r_s, l'_t) f(l_s, r'_t): 2·|S|·|T| pushes.

    With square roots on both sides, a product the program takes as a primitive (``X @ C.T``,
    ``w * x``, ``(U[i] * V[j]).sum(-1)``) is read instead as a contraction of the two factors'
    covariances (:func:`blrppl.moments.products.product_second_moments`): for ``X @ C.T``, one
    (N, D²) @ (D², M) product in place of D² pushes of (N, M).
    """
    pairs = sorted({pair for f in factors for _, ps in f.spec.pairs for pair in ps})
    zeros = {n: jnp.zeros_like(x) for n, x in point.items()}

    def tile(x, k):
        return jnp.tile(x, (k,) + (1,) * (x.ndim - 1))

    out = {}
    for a, b in pairs:
        rooted = roots.get(a) is not None and roots.get(b) is not None
        wanted = [(f.name, arg) for f in factors for arg, ps in f.spec.pairs if (a, b) in ps]
        if rooted:
            # a product the program takes as a primitive: one contraction of covariances
            contracted = product_second_moments(model_args, point, a, sets[a], b, sets[b], wanted)
            if contracted is not None:
                out[(a, b)] = contracted
                continue
        if rooted:
            ka, kb = roots[a].shape[0], roots[b].shape[0]
            ta, tb = jnp.repeat(roots[a], kb, axis=0), tile(roots[b], ka)
        else:
            la, ra = sets[a]["left"], sets[a]["right"]
            lb, rb = sets[b]["left"], sets[b]["right"]
            ka, kb = la.shape[0], lb.shape[0]
            ta = jnp.concatenate([jnp.repeat(ra, kb, axis=0), jnp.repeat(la, kb, axis=0)])
            tb = jnp.concatenate([tile(lb, ka), tile(rb, ka)])

        def mixed(u, v, a=a, b=b):
            def along_a(x):
                return jax.jvp(model_args, (x,), ({**zeros, a: u},))[1]

            return jax.jvp(along_a, (point,), ({**zeros, b: v},))[1]

        pushed = jax.vmap(mixed)(ta, tb)
        half = ka * kb

        def square(x, rooted=rooted, half=half):
            return jnp.sum(jnp.square(x), axis=0) if rooted else jnp.sum(x[:half] * x[half:], axis=0)

        out[(a, b)] = {
            f.name: {arg: ProductMoments(square(pushed[f.name][arg]), None) for arg, ps in f.spec.pairs if (a, b) in ps}
            for f in factors
        }
    return out
