"""Gauss–Hermite quadrature for factors that see Gaussian blocks through a few scalars.

A factor whose distribution's parameters (pytree leaves of the numpyro distribution) and
value depend on Gaussian blocks only through d ≤ 2 scalar projections per element,
leaf = g(η) with η affine in the blocks and g a link (identity, exp, sigmoid) — the GLM
likelihoods (Bernoulli/Binomial logits, Poisson with a log link, Student-t/Laplace/Cauchy
location, scales on a log scale, ...) — has

    E_q[log f] = Σ_n E_{η_n ~ N(m_n, C_n)}[log p(y_n | g(η_n))],

with m_n and the d×d covariance C_n of element n's projections computed exactly from the
blocks (as for affine arguments). The inner expectation is a tensor Gauss–Hermite rule
(20 nodes for d = 1, 12² for d = 2): deterministic and nearly exact, the CVI estimator of
Khan & Lin (2017). Its gradient with respect to (m, Σ) gives the message.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.estimators.monte_carlo import tensor_gauss_hermite
from blrppl.estimators.registry import Estimator, EstimatorChoice, register_estimator
from blrppl.families.gaussian import GaussianDense
from blrppl.graph.plan import EstimatorSpec
from blrppl.model.functions import LINKS, distribution_leaves, shift_leaf
from blrppl.moments.linearised import base_values, group_moments
from blrppl.model.records import reduce_wrapped
from blrppl.moments.kinds import AffineGaussian, covariance

@dataclasses.dataclass(frozen=True)
class QuadratureSpec(EstimatorSpec):
    """What the quadrature estimator records of a factor
    (:attr:`blrppl.graph.plan.Factor.spec`).

    Attributes:
        links: ``(name, leaf index or "value" or "shift:<i>", link)`` of each scalar
            projection η = g⁻¹(leaf) the rule integrates over; empty for the grid rule
            (:func:`grid_elementwise`), which integrates over the factor's neighbours'
            scalars instead.
        grid_positions: for a factor on the grid rule that reads some members of a joint
            dense Gaussian block only, ``(block, positions)`` of the scalars it reads (the
            rule integrates over their marginal, not the whole block's); empty otherwise.
    """

    links: tuple = ()
    grid_positions: tuple = ()


#: Gauss–Hermite quadrature over the factor's scalar projections η_n ~ N(m_n, C_n),
#: L = Σ_n Σ_k w_k log p(y_n | g(m_n + chol(C_n) t_k)), or, for a few scalars of a joint
#: block, the tensor rule over their marginal (the grid rule)
QUADRATURE = register_estimator(
    Estimator(
        name="quadrature",
        summary="Gauss–Hermite nodes, L = Σ_n Σ_k w_k log p(y_n | g(m_n + chol(C_n) t_k))",
        reads_moments=True,
        approximates=True,
        grid_rule=True,
        order=1,
        elementwise=lambda fns, fs, blocks, views, dvals, data, wrappers, key, curvature: (
            *quadrature_elementwise(fns, fs, blocks, views, dvals, data), 0.0
        ),
        serves=lambda candidate: _serves(candidate),
        choice_order=20,
    )
)

#: a factor without closed form or projections whose continuous neighbours are Gaussian
#: blocks of at most this many scalars in all (a chain's stationary start reading a level,
#: a scale and a persistence) is integrated over them by a tensor Gauss–Hermite rule
#: (:func:`grid_elementwise`) instead of Monte Carlo
GRID_MAX_DIM = 4
#: ... and when its nodes times its elements (each counted as its event's size squared: a
#: multivariate density costs at least that) are at most this many a step (a plated
#: likelihood of many elements, or a Gaussian process's of many points, stays Monte Carlo:
#: 16 draws)
GRID_MAX_EVALUATIONS = 1 << 21


def _serves(candidate) -> EstimatorChoice | None:
    """A factor whose every scalar projection (a value, a shift, a leaf) is an affine
    Gaussian under one of its inverse links (the rule over the projections), or whose
    continuous neighbours are a few Gaussian scalars (the tensor rule over them)."""
    if not candidate.quadrature:
        return None
    blocks, name = candidate.blocks, candidate.name
    links, kinds, arg_blocks, full = [], [], [], set()
    for k, item in enumerate(candidate.projections):
        index = item if item == "value" or item.startswith("shift:") else int(item.split(":")[1])
        classes = candidate.projection_classes
        found = next(
            (link for link in LINKS if (name, index, link) in classes and classes[(name, index, link)].kind == AffineGaussian.kind),
            None,
        )
        if found is None:
            links = None
            break
        cls = classes[(name, index, found)]
        links.append((f"eta{k}", index, found))
        kinds.append((f"eta{k}", AffineGaussian.kind))
        arg_blocks.append((f"eta{k}", cls.blocks))
        full.update(cls.full)
    if links:
        gauss = [n for n in candidate.neighbours if blocks[n].family.gaussian]
        columns = tuple((n, "full" if n in full else "gather") for n in gauss)
        return EstimatorChoice(
            arg_kinds=tuple(kinds), arg_blocks=tuple(arg_blocks), columns=columns, spec=QuadratureSpec(links=tuple(links))
        )
    cont = [n for n in candidate.neighbours if n not in candidate.discrete]
    positions = grid_positions(blocks, cont, candidate.site_reads)
    if on_grid(blocks, cont, candidate.record, positions):
        # (a few scalars in all: the rule over them is cheap, and deterministic)
        spec = QuadratureSpec(grid_positions=tuple(sorted(positions.items())))
        return EstimatorChoice(arg_kinds=(("log_prob", "quadrature"),), spec=spec)
    return None


def grid_positions(blocks, cont, reads) -> dict:
    """For each joint dense Gaussian block of ``cont`` (unplated) of which the factor reads
    some members only (``reads``: the latent sites it reads), the block positions of the
    scalars of those members: the grid rule integrates over their marginal (a capture-
    recapture model's survival factor reads the survival probabilities of a joint block that
    also holds the recapture probability: 20² nodes, not 10³)."""
    if reads is None:
        return {}
    out = {}
    for n in cont:
        b = blocks[n]
        if not b.members or b.batch_shape or not isinstance(b.family, GaussianDense):
            continue
        read = [pos for m, pos in zip(b.members, b.member_positions()) if m.name in reads]
        if read and len(read) < len(b.members):
            out[n] = tuple(int(i) for i in np.sort(np.concatenate(read)))
    return out


def on_grid(blocks, cont, record, positions=None) -> bool:
    """Whether a factor's continuous neighbours ``cont`` are Gaussian blocks of at most
    :data:`GRID_MAX_DIM` scalars in all (neither points nor minibatch-local; of a joint block,
    the scalars the factor reads, ``positions``), and the cost of the rule's evaluations at
    most :data:`GRID_MAX_EVALUATIONS`."""
    if not cont or not all(blocks[n].family.gaussian and not blocks[n].point and blocks[n].local is None for n in cont):
        return False
    positions = positions or {}
    d = sum(len(positions[n]) if n in positions else blocks[n].size for n in cont)
    if d > GRID_MAX_DIM:
        return False
    shape = tuple(record.value_shape)
    split = len(shape) - record.event_ndim
    cost = math.prod(shape[:split]) * math.prod(shape[split:]) ** 2
    return GRID_NODES[d] ** d * cost <= GRID_MAX_EVALUATIONS

#: nodes per dimension of the tensor rule, by number of projections
NODES = {1: 20, 2: 12}


def _safe_sqrt(v):
    """√max(v, 0) with a finite derivative at 0 (point blocks have zero variance, and
    Newton steps differentiate through it)."""
    pos = v > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, v, 1.0)), 0.0)


def quadrature_elementwise(fns, factors, blocks, views, discrete_values, data):
    """Per-element E_q[log f | discrete values] of quadrature factors, and their scales.

    Factors of the same structure (distribution, projections and shapes: one site per time
    step written in a Python loop) are evaluated together, as one batched rule, so that the
    compiled program does not grow with their number. Factors without projections are
    integrated over their neighbours' scalars (:func:`grid_elementwise`)."""
    grid = [f for f in factors if not f.spec.links]
    factors = [f for f in factors if f.spec.links]
    els, scales = {}, {}
    for f in grid:
        e, sc = grid_elementwise(fns, f, blocks, views, discrete_values, data)
        els.update(e)
        scales.update(sc)
    if not factors:
        return els, scales
    moments = group_moments(fns, factors, blocks, views, discrete_values, data)
    cont = []
    for f in factors:
        cont += [n for n in f.neighbours if n not in f.discrete and n not in cont]
    point = base_values(blocks, views, cont)
    sites = fns.sites(tuple(f.name for f in factors), {**discrete_values, **point}, data)
    groups: dict = {}
    for f in factors:
        site = sites[f.name]
        _, leaves, tree = distribution_leaves(site)
        proj = [moments[f.name][name] for name, _, _ in f.spec.links]
        inputs = (list(leaves), jnp.asarray(site["value"]), proj)
        shapes = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), inputs)
        groups.setdefault((f.spec.links, tree, str(shapes)), []).append((f, inputs))
    for (links, tree, _), members in groups.items():
        rule = functools.partial(_expected_log_prob, links, tree)
        if len(members) == 1:
            ((f, inputs),) = members
            per_factor = [rule(*inputs)]
        else:
            stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[inputs for _, inputs in members])
            batched = jax.vmap(rule)(*stacked)
            per_factor = [batched[k] for k in range(len(members))]
        for (f, _), lp in zip(members, per_factor):
            site = sites[f.name]
            els[f.name] = reduce_wrapped(site["fn"], lp)
            scales[f.name] = site.get("scale")
    return els, scales


#: nodes per dimension of :func:`grid_elementwise`'s tensor rule, by number of scalars (a
#: Normal observed at tanh(a) + b, q's sds 0.76 and 0.55: means within 5e-3 of a 40-node
#: rule's with 12 nodes, 2e-5 with 20)
GRID_NODES = {1: 32, 2: 20, 3: 10, 4: 7}


def grid_elementwise(fns, factor, blocks, views, discrete_values, data):
    """Per-element E_q[log f | discrete values] of a factor whose continuous neighbours are
    Gaussian blocks of a few scalars in all (d ≤ 4), and its scale: the tensor
    Gauss–Hermite rule over them,

        E_q[log f] ≈ Σ_k w_k log f(m + L z_k),    Σ = L Lᵀ per block,

    with GRID_NODES[d]^d nodes z_k (32 for one scalar, 7⁴ for four); of a joint block whose
    members it reads only some of (``factor.spec.grid_positions``), over their marginal. Deterministic: its
    gradient with respect to (m, Σ) gives the message as for the projections' rule (a
    stationary start ``Normal(mu, sigma / jnp.sqrt(1 - phi**2))``, a prior with no closed
    form on its unconstrained space)."""
    cont = [n for n in factor.neighbours if n not in factor.discrete]
    read = dict(factor.spec.grid_positions)
    sizes = [len(read[n]) if n in read else blocks[n].size for n in cont]
    d = sum(sizes)
    grid, weights = tensor_gauss_hermite(GRID_NODES[d], d)
    nodes, start = {}, 0
    for n, size in zip(cont, sizes):
        block, view = blocks[n], views[n]
        if n in read:
            # (the members the factor reads, over their marginal; the others at their mean,
            # which the factor does not read)
            pos = np.asarray(read[n])
            z = jnp.asarray(grid[:, start : start + size], view.mean.dtype)
            start += size
            sub = view.mean[pos] + z @ jnp.linalg.cholesky(view.cov[pos[:, None], pos[None, :]]).T
            x = jnp.broadcast_to(view.mean, (z.shape[0],) + view.mean.shape).at[:, pos].set(sub)
            nodes[n] = jax.vmap(block.to_site)(x)
            continue
        z = jnp.asarray(grid[:, start : start + size], view.mean.dtype).reshape((-1,) + view.mean.shape)
        start += size
        if block.family.dense_event:
            x = view.mean + jnp.einsum("...ij,k...j->k...i", jnp.linalg.cholesky(view.cov), z)
            nodes[n] = jax.vmap(block.to_site)(x)
        else:
            nodes[n] = view.mean + _safe_sqrt(view.var) * z
    names = (factor.name,)

    def one(x):
        ((lp, _),) = fns.log_probs(names, {**discrete_values, **x}, data).values()
        return lp

    per_node = jax.vmap(one)(nodes)
    ((_, scale),) = fns.log_probs(names, {**discrete_values, **{n: x[0] for n, x in nodes.items()}}, data).values()
    lp = jnp.tensordot(jnp.asarray(weights, per_node.dtype), per_node, axes=1)
    return {factor.name: lp}, {factor.name: scale}


def _projection_factors(proj) -> list:
    """Means and the lower Cholesky factor of the projections' covariance, per element:
    [m] and [l] for one projection, [m0, m1] and [l00, l10, l11] for two."""
    shape = jnp.broadcast_shapes(*[p.shape for p in proj])
    means = [jnp.broadcast_to(p.mean(), shape) for p in proj]
    if len(proj) == 1:
        return means + [_safe_sqrt(jnp.broadcast_to(proj[0].var(), shape))]
    v0 = jnp.maximum(jnp.broadcast_to(proj[0].var(), shape), 0.0)
    v1 = jnp.maximum(jnp.broadcast_to(proj[1].var(), shape), 0.0)
    c01 = jnp.broadcast_to(covariance(proj[0], proj[1]), shape)
    l00 = _safe_sqrt(v0)
    l10 = jnp.where(l00 > 0, c01 / jnp.where(l00 > 0, l00, 1.0), 0.0)
    return means + [l00, l10, _safe_sqrt(v1 - l10**2)]


def _expected_log_prob(links, tree, leaves, value, proj):
    """Σ_k w_k log p(value | leaves at the nodes η_k), per element: the tensor rule over the
    Gaussian of the projections (moment objects ``proj``)."""
    factors = _projection_factors(proj)
    d = len(links)
    grid, weights = tensor_gauss_hermite(NODES[d], d)
    dtype = factors[0].dtype
    grid = jnp.asarray(grid, dtype)
    # the node axis leads; enough unit axes that it never meets a batch axis
    nd = max([jnp.ndim(factors[0]), jnp.ndim(value)] + [jnp.ndim(x) for x in leaves])
    z = [grid[:, j].reshape((-1,) + (1,) * nd) for j in range(d)]
    if d == 1:
        mean, sd = factors
        etas = [mean + sd * z[0]]
    else:
        m0, m1, l00, l10, l11 = factors
        etas = [m0 + l00 * z[0], m1 + l10 * z[0] + l11 * z[1]]
    new_leaves = list(leaves)
    for (_, index, link), eta in zip(links, etas):
        x = LINKS[link][0](eta)
        if index == "value":
            value = x
        elif isinstance(index, str):  # value − loc of a translation family: loc at 0
            value = x
            loc = shift_leaf(index)
            new_leaves[loc] = jnp.zeros_like(new_leaves[loc])
        else:
            new_leaves[index] = x
    lp = tree.unflatten(new_leaves).log_prob(value)
    w = jnp.asarray(weights, dtype).reshape((-1,) + (1,) * (lp.ndim - 1))
    return jnp.sum(w * lp, axis=0)
