"""Monte Carlo and quadrature estimators for factors without a closed form.

For a factor f whose neighbours are Gaussian blocks (the family policy moves every other
continuous latent of such a factor to a Gaussian on its unconstrained space, unless the
user asked for its native family: then Gamma, Beta and Dirichlet draws use implicit
reparameterisation gradients and the family's Fisher solve),

    L = E_q[log f] ≈ (1/S) Σ_s log f(x_s),     x_s = m + chol(Σ) ε_s,

with fresh ε_s at every step. The gradient of this average with respect to (m, Σ)
(reparameterisation through the Cholesky factor) is an unbiased estimate of
(E[∇ log f], ½ E[∇² log f]) (Bonnet's and Price's theorems), which the Gaussian family turns
into the natural-parameter message λ̃ = (g − H m, ½ H). ``numpyro.factor`` terms and any
other density are handled this way.

The log|det J| term of a block on an unconstrained space is a sum of per-element functions
of u for elementwise bijections (exp, sigmoid, affine): its expectation is computed by
Gauss–Hermite quadrature over each element's marginal N(m_i, v_i), deterministic and nearly
exact; other bijections (stick-breaking, ordered, Cholesky) use the samples.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.estimators.registry import Estimator, EstimatorChoice, register_estimator
from blrppl.families.gaussian_ivon import reparam_curvature
from blrppl.graph.derivatives import grad_and_hvps

#: draws from q, L ≈ (1/S) Σ_s log f(x_s) with x_s = m + chol(Σ) ε_s and fresh ε_s per step
MONTE_CARLO = register_estimator(
    Estimator(
        name="monte_carlo",
        summary="draws from q, L ≈ (1/S) Σ_s log f(m + chol(Σ) ε_s)",
        deterministic=False,
        draws=True,
        decaying_steps=True,
        samples_jointly=True,
        approximates=True,
        provisional=True,
        order=3,
        elementwise=lambda fns, fs, blocks, views, dvals, data, wrappers, key, curvature: monte_carlo_elementwise(
            fns, fs, blocks, views, dvals, data, key, curvature=curvature
        ),
        # (any factor: the estimator of last resort)
        serves=lambda candidate: EstimatorChoice(arg_kinds=(("log_prob", "monte_carlo"),)),
        choice_order=100,
    )
)

#: default number of Monte Carlo samples per factor group and step
NUM_SAMPLES = 16
#: Gauss–Hermite nodes for one-dimensional expectations
NUM_NODES = 20


def gauss_hermite(num_nodes: int = NUM_NODES):
    """Nodes t and weights w with E_{N(0,1)}[h(z)] ≈ Σ_k w_k h(t_k)."""
    t, w = np.polynomial.hermite_e.hermegauss(num_nodes)
    return t, w / w.sum()


def tensor_gauss_hermite(num_nodes: int, d: int):
    """Nodes z (K^d, d) and weights w (K^d,) with E_{N(0, I_d)}[h(z)] ≈ Σ_k w_k h(z_k): the
    product of ``num_nodes``-point rules (:func:`gauss_hermite`) in each dimension."""
    t, w = gauss_hermite(num_nodes)
    grid = np.array(list(itertools.product(t, repeat=d)))
    weights = np.prod(np.array(list(itertools.product(w, repeat=d))), axis=1)
    return grid, weights


def sample_block(block, view, key, num_samples: int, eps=None):
    """Reparameterised draws of a Gaussian block in its site layout (block space); a point
    (delta-method) block is its mean. ``eps``: the block's standard normal draws, shape
    ``(num_samples, *view.mean.shape)`` (None: drawn here from ``key``)."""
    if block.point:
        mean = block.to_site(view.mean)
        return jnp.broadcast_to(mean, (num_samples,) + mean.shape)
    if not block.family.gaussian:
        # Gamma, Beta, Dirichlet: implicit reparameterisation (jax.random.gamma is
        # differentiable in its shape); the family's Fisher solve turns ∇_view into ∇_μ
        return block.family.sample(block.family.nat_from_view(view), key, (num_samples,))
    if eps is None:
        eps = jax.random.normal(key, (num_samples,) + view.mean.shape, view.mean.dtype)
    if not block.family.dense_event:
        return view.mean + jnp.sqrt(view.var) * eps
    chol = jnp.linalg.cholesky(view.cov)
    x = view.mean + jnp.einsum("...ij,s...j->s...i", chol, eps)
    return jax.vmap(block.to_site)(x)


def standard_normals(keys, shapes, dtype) -> list:
    """``[jax.random.normal(k, shape, dtype) for k, shape in zip(keys, shapes)]`` from one
    draw mapped over the keys (each key's first ``prod(shape)`` numbers of a flat draw of the
    largest size): one random-number program in the step instead of one per block, each of
    which (a threefry hash and an inverse error function) is a few hundred operations for
    XLA to compile. Under JAX's default threefry (``jax_threefry_partitionable``) each
    number depends only on its key and its position, so these are the numbers the separate
    draws give; otherwise they are other, equally independent, standard normal draws.
    Shapes of very different sizes are drawn apart (the mapped draw would make each key
    draw as many as the largest)."""
    sizes = [math.prod(shape) for shape in shapes]
    if len(shapes) < 2 or max(sizes) * len(sizes) > 2 * sum(sizes):
        return [jax.random.normal(k, shape, dtype) for k, shape in zip(keys, shapes)]
    flat = jax.vmap(lambda k: jax.random.normal(k, (max(sizes),), dtype))(jnp.stack(list(keys)))
    return [jnp.reshape(flat[i, :size], shape) for i, (size, shape) in enumerate(zip(sizes, shapes))]


def draw_blocks(names, blocks, views, keys, num_samples: int) -> dict:
    """:func:`sample_block` of each block of ``names`` (its key from ``keys``), the standard
    normals of the Gaussian blocks among them drawn at once (:func:`standard_normals`)."""
    normal = [
        n for n in names
        if blocks[n].family.gaussian and not blocks[n].point and views[n].mean.dtype == views[names[0]].mean.dtype
    ]
    key_of = dict(zip(names, keys))
    eps = dict(zip(normal, standard_normals(
        [key_of[n] for n in normal], [(num_samples,) + views[n].mean.shape for n in normal],
        views[normal[0]].mean.dtype if normal else None,
    ))) if normal else {}
    return {n: sample_block(blocks[n], views[n], key_of[n], num_samples, eps.get(n)) for n in names}


def marginal_moments(block, view):
    """Per-element mean and variance of a Gaussian block in its site layout."""
    return block.to_site(view.mean), block.to_site(block.family.marginal_variance(view))


#: curvature estimators of Monte Carlo messages to Gaussian blocks
CURVATURES = ("auto", "reparam", "hessian", "diagonal", "gauss-newton", "stein")


class Curvature(NamedTuple):
    """A curvature estimator (one of :data:`CURVATURES`), the blocks whose messages are
    wanted and whether the objective's value is: a step's message program for one block
    builds the surrogate of that block only (the other blocks' surrogates would have no
    gradient there, yet their gradients and Hessians at every draw would be traced into
    each block's program), and without ``values`` not the factor's sample mean either (with
    explicit curvature it carries no gradient: the program would trace the model's density
    at the draws twice more, for XLA to remove)."""

    estimator: str
    targets: frozenset
    values: bool = True


def curvature_for(curvature, targets, values: bool = True):
    """``curvature`` (an estimator's name, or None: values only) restricted to the blocks
    ``targets`` (None: every Gaussian neighbour, and the values), as the Monte Carlo
    estimator reads it."""
    if curvature is None or targets is None:
        return curvature
    return Curvature(curvature, frozenset(targets), values)
#: ``"auto"``: dense Gaussian blocks of at most this many scalars per plate element get the
#: exact Hessian at each draw; larger ones the Stein estimate
AUTO_HESSIAN_DIM = 64


def auto_curvature(block) -> str:
    """The curvature estimator ``"auto"`` chooses for a Gaussian block: the exact Hessian
    (``"hessian"``; for a diagonal block its Hutchinson diagonal) when the block has at most
    :data:`AUTO_HESSIAN_DIM` scalars per plate element (D Hessian-vector products a draw,
    cheap there), else Stein's Σ⁻¹(x − m)∇ log fᵀ (no second derivatives)."""
    if not block.family.dense_event:
        return "diagonal"
    dim = block.size // max(math.prod(block.batch_shape), 1)
    return "hessian" if dim <= AUTO_HESSIAN_DIM else "stein"


def monte_carlo_elementwise(
    fns, factors, blocks, views, discrete_values, data, key, num_samples=NUM_SAMPLES, curvature="auto"
):
    """Per-factor sample means of log f (batch shape of each site), their scales, and a
    scalar correction term (zero for the reparameterisation estimator).

    With ``curvature`` None, the values alone (no surrogate: the ELBO's). With ``curvature``
    other than ``"reparam"`` and no discrete neighbours, the messages to
    Gaussian blocks come from explicit estimates of g = E[∇F] and H = E[∇²F] of the scaled
    sum F of the group's log-densities (Bonnet's and Price's theorems), through the
    surrogate ĝ·(m − m̄) + ½ tr(Ĥ (Σ − Σ̄)) whose value is zero and whose gradient is
    (ĝ, ½Ĥ):

    * ``"hessian"``: the exact Hessian of F at each draw (per plate element; small blocks);
    * ``"diagonal"``: its diagonal by Hutchinson's estimator E_z[z ⊙ ∇²F z] (large blocks);
    * ``"gauss-newton"``: −Σ_i ∇ log f_i ∇ log f_iᵀ over the elements i of the factors
      (empirical Fisher, negative semi-definite by construction, biased);
    * ``"stein"``: Σ⁻¹(x − m)∇Fᵀ symmetrised (no second derivatives).

    ``curvature`` may also be a :class:`Curvature`: the surrogate is then built for its
    ``targets`` only (the draws, and so the estimates, are the same as for all blocks), and
    without its ``values`` the sample means are zeros (their gradient is zero).
    """
    targets, values = None, True
    if isinstance(curvature, Curvature):
        curvature, targets, values = curvature
    cont = []
    for f in factors:
        cont += [n for n in f.neighbours if n not in f.discrete and n not in cont]
    keys = jax.random.split(key, max(len(cont), 1) + 1)
    gauss = [n for n in cont if blocks[n].family.gaussian and not blocks[n].point]
    num_samples = group_draws([blocks[n] for n in cont], num_samples)
    explicit = curvature not in (None, "reparam") and not discrete_values and len(gauss) == len(cont)
    live = views
    if explicit:  # draws and estimates carry no gradient: the surrogate below does
        views = {**views, **{n: jax.lax.stop_gradient(views[n]) for n in gauss}}
    draws = draw_blocks(cont, blocks, views, keys, num_samples)
    names = tuple(f.name for f in factors)
    if explicit and gauss and not values:
        # (the objective is only differentiated: its value, a sum of these, is not read)
        zero = {n: 0.0 for n in names}
        els, scales = zero, dict.fromkeys(names)
    else:
        els, scales = _sample_means(fns, names, discrete_values, draws, data)
    if not explicit or not gauss:
        return els, scales, 0.0
    els = {n: jax.lax.stop_gradient(v) for n, v in els.items()}

    def elements(x):
        out = fns.log_probs(names, {**discrete_values, **x}, data)
        return jnp.concatenate([jnp.ravel(lp if sc is None else sc * lp) for lp, sc in out.values()])

    def total(x):
        return jnp.sum(elements(x))

    wanted = [n for n in gauss if targets is None or n in targets]
    reparam = [n for n in wanted if blocks[n].family.reparam_curvature]
    correction = _reparam_surrogate(reparam, blocks, views, live, draws, total) if reparam else 0.0
    probe_key = keys[-1]
    for n in wanted:
        if n in reparam:
            continue
        block, view = blocks[n], views[n]
        xs = draws[n]
        others = {m: d for m, d in draws.items() if m != n}

        def f_n(xn, rest):
            return total({**rest, n: xn})

        def per_element(xn, rest):
            return elements({**rest, n: xn})

        estimator = auto_curvature(block) if curvature == "auto" else curvature
        if estimator == "gauss-newton":
            grads = jax.vmap(jax.grad(f_n))(xs, others)
            h = _gauss_newton(block, per_element, xs, others)
        else:
            grads, h = _curvature(estimator, block, view, f_n, xs, others, probe_key)
        g = jnp.mean(jax.vmap(block.to_canonical)(grads), 0)
        # control variate: E[x − m] = 0, so subtracting Ĥ·mean(x − m) removes the part of
        # the gradient's noise that is linear in the draws (exact for quadratic log f)
        dx = jnp.mean(jax.vmap(block.to_canonical)(xs), 0) - view.mean
        g = g - block.family.precision_times(h, dx)
        correction = correction + _surrogate(block, live[n], view, g, h)
    return els, scales, correction


def _sample_means(fns, names, discrete_values, draws, data):
    """``(els, scales)``: each site's log-density averaged over the draws (batch shape of
    the site), and its scale (the sites' scales do not depend on the draws: the first's,
    from the same mapped run of the model)."""

    def one(x):
        return fns.log_probs(names, {**discrete_values, **x}, data)

    per_sample = jax.vmap(one)(draws)
    els = {n: lp.mean(0) for n, (lp, _) in per_sample.items()}
    return els, {n: None if sc is None else sc[0] for n, (_, sc) in per_sample.items()}


def _reparam_surrogate(names, blocks, views, live, draws, total):
    """The surrogate of the blocks ``names`` (families with ``reparam_curvature``: IVON's),
    whatever ``mc_curvature`` says: one gradient of the group's log-density ``total`` at each
    draw with respect to all of them at once (a network's backward pass), ĝ its mean and
    ĥ = ĝ (x − m)/v (:func:`blrppl.families.gaussian_ivon.reparam_curvature`), without the
    control variate (with one draw it would take ĝ ε² from ĝ: a biased gradient)."""
    others = {m: d for m, d in draws.items() if m not in names}
    grads = jax.vmap(jax.grad(lambda xs, rest: total({**rest, **xs})))({n: draws[n] for n in names}, others)
    correction = 0.0
    for n in names:
        block, view = blocks[n], views[n]
        canon = jax.vmap(block.to_canonical)
        g = jnp.mean(canon(grads[n]), 0)
        h = jnp.mean(reparam_curvature(canon(grads[n]), canon(draws[n]) - view.mean, view.var), 0)
        correction = correction + _surrogate(block, live[n], view, g, h)
    return correction


def _surrogate(block, live, view, g, h):
    """ĝ·(m − m̄) + ½ tr(Ĥ (Σ − Σ̄)): zero at the block's view, with gradient (ĝ, ½Ĥ)."""
    spread = block.family.view_covariance(live) - block.family.view_covariance(view)
    return jnp.sum(g * (live.mean - view.mean)) + 0.5 * jnp.sum(h * spread)


def group_draws(blocks, default: int = NUM_SAMPLES) -> int:
    """The draws per step of a Monte Carlo factor group reading ``blocks``: the most that their
    families ask for (:attr:`blrppl.families.Family.mc_draws`; IVON's blocks one), else
    ``default``."""
    asked = [b.family.mc_draws for b in blocks if b.family.mc_draws is not None]
    return max(asked) if asked else default


def _gauss_newton(block, per_element, xs, others):
    """−mean over draws of Σ_i J_i J_iᵀ, J_i the gradient of element i (canonical layout)."""
    jac = jax.vmap(jax.jacrev(per_element))(xs, others)  # (S, elements, *site shape)
    if block.family.dense_event:
        jc = jax.vmap(jax.vmap(block.to_canonical))(jac)  # (S, elements, *B, D)
        return -jnp.einsum("se...i,se...j->...ij", jc, jc) / xs.shape[0]
    return -jnp.mean(jnp.sum(jnp.square(jac), axis=1), 0)


def _curvature(estimator, block, view, f_n, xs, others, key):
    """``(gradient of F at each draw, mean over draws of the curvature estimate of F)`` in
    block ``block`` (canonical layout: (*B, D, D) for dense blocks, the value shape for
    diagonal ones). The Hessian-vector products of the exact and Hutchinson estimates come
    with the gradient from one linearisation of it per draw
    (:func:`blrppl.graph.derivatives.grad_and_hvps`: the model's density is traced once for
    both, not once for the gradient and again for the products)."""
    if estimator == "stein":
        grads = jax.vmap(jax.grad(f_n))(xs, others)
        if not block.family.dense_event:
            return grads, jnp.mean(grads * (xs - view.mean) / view.var, 0)
        dx = jax.vmap(block.to_canonical)(xs) - view.mean
        prec_dx = jnp.linalg.solve(view.cov, dx[..., None])[..., 0]
        gc = jax.vmap(block.to_canonical)(grads)
        h = jnp.einsum("s...i,s...j->...ij", prec_dx, gc) / xs.shape[0]
        return grads, 0.5 * (h + jnp.swapaxes(h, -1, -2))
    if block.family.dense_event and estimator != "diagonal":
        dim = view.mean.shape[-1]
        bshape = view.mean.shape[:-1]
        eye = jnp.eye(dim, dtype=view.mean.dtype)
        basis = jnp.broadcast_to(eye.reshape((dim,) + (1,) * len(bshape) + (dim,)), (dim,) + bshape + (dim,))
        basis = jax.vmap(block.to_site)(basis)

        def grad_and_cols(x, r):
            g, cols = grad_and_hvps(lambda y: f_n(y, r), x, basis)
            return g, jax.vmap(block.to_canonical)(cols)  # (D, *B, D): column j of each plate's H

        grads, cols = jax.vmap(grad_and_cols)(xs, others)
        return grads, jnp.moveaxis(jnp.mean(cols, 0), 0, -1)
    # Hutchinson's diagonal: E_z[z ⊙ ∇²F z]
    z = jax.random.rademacher(key, xs.shape, dtype=xs.dtype)

    def grad_and_hz(x, r, t):
        g, hz = grad_and_hvps(lambda y: f_n(y, r), x, t[None])
        return g, hz[0]

    grads, hz = jax.vmap(grad_and_hz)(xs, others, z)
    if not block.family.dense_event:
        return grads, jnp.mean(z * hz, 0)
    diag = jnp.mean(jax.vmap(block.to_canonical)(z * hz), 0)
    return grads, diag[..., None] * jnp.eye(view.mean.shape[-1], dtype=diag.dtype)


def elementwise_bijection(transform):
    """The elementwise bijection ``transform`` applies (unwrapping ``IndependentTransform``,
    which only declares event dims: its log|det J| sums the elements'), or None."""
    while type(transform).__name__ == "IndependentTransform":
        transform = transform.base_transform
    return transform if transform.domain.event_dim == 0 else None


def expected_log_jacobian(block, view, key, num_samples=NUM_SAMPLES):
    """E_q[log|det J|] of a block's bijection(s), summed over elements (and members of a
    joint block, each from its marginal)."""
    if block.members:
        keys = jax.random.split(key, len(block.members))
        return sum(
            expected_log_jacobian(m, v, k, num_samples)
            for (m, v), k in zip(block.member_views(view), keys)
            if m.transform is not None
        )
    t = elementwise_bijection(block.transform)
    if t is not None:
        mean, var = marginal_moments(block, view)
        nodes, weights = gauss_hermite()
        # (the nodes on a leading axis: a bijection's parameters have the site's shape, the
        # bounds of a Uniform drawn at each step of a scan)
        nodes = jnp.asarray(nodes, mean.dtype).reshape((-1,) + (1,) * mean.ndim)
        u = mean + jnp.sqrt(var) * nodes
        ladj = t.log_abs_det_jacobian(u, t(u))
        return jnp.sum(jnp.tensordot(jnp.asarray(weights, mean.dtype), ladj, axes=1))
    t = block.transform
    u = sample_block(block, view, key, num_samples)
    ladj = jax.vmap(lambda x: jnp.sum(t.log_abs_det_jacobian(x, t(x))))(u)
    return ladj.mean()
