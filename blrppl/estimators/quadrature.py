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

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.expressions import LINKS, base_values, distribution_leaves, group_moments, shift_leaf
from blrppl.graph.trace import reduce_wrapped
from blrppl.moments import covariance

#: nodes per dimension of the tensor rule, by number of projections
NODES = {1: 20, 2: 12}


def _safe_sqrt(v):
    """√max(v, 0) with a finite derivative at 0 (point blocks have zero variance, and
    Newton steps differentiate through it)."""
    pos = v > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, v, 1.0)), 0.0)


def _standard_nodes(d: int):
    t, w = np.polynomial.hermite_e.hermegauss(NODES[d])
    w = w / w.sum()
    grid = np.array(list(itertools.product(t, repeat=d)))  # (K^d, d)
    weights = np.prod(np.array(list(itertools.product(w, repeat=d))), axis=1)
    return grid, weights


def quadrature_elementwise(fns, factors, blocks, views, discrete_values, data):
    """Per-element E_q[log f | discrete values] of quadrature factors, and their scales."""
    moments = group_moments(fns, factors, blocks, views, discrete_values, data)
    cont = []
    for f in factors:
        cont += [n for n in f.neighbours if n not in f.discrete and n not in cont]
    point = base_values(blocks, views, cont)
    sites = fns.sites(tuple(f.name for f in factors), {**discrete_values, **point}, data)
    els, scales = {}, {}
    for f in factors:
        site = sites[f.name]
        _, leaves, tree = distribution_leaves(site)
        proj = [moments[f.name][name] for name, _, _ in f.links]
        d = len(proj)
        shape = jnp.broadcast_shapes(*[p.shape for p in proj])
        means = [jnp.broadcast_to(p.mean(), shape) for p in proj]
        grid, weights = _standard_nodes(d)
        dtype = means[0].dtype
        grid = jnp.asarray(grid, dtype)
        # the node axis leads; enough unit axes that it never meets a batch axis
        nd = max([len(shape), jnp.ndim(site["value"])] + [jnp.ndim(x) for x in leaves])
        if d == 1:
            sd = _safe_sqrt(jnp.broadcast_to(proj[0].var(), shape))
            etas = [means[0] + sd * grid[:, 0].reshape((-1,) + (1,) * nd)]
        else:
            v0 = jnp.maximum(jnp.broadcast_to(proj[0].var(), shape), 0.0)
            v1 = jnp.maximum(jnp.broadcast_to(proj[1].var(), shape), 0.0)
            c01 = jnp.broadcast_to(covariance(proj[0], proj[1]), shape)
            l00 = _safe_sqrt(v0)
            l10 = jnp.where(l00 > 0, c01 / jnp.where(l00 > 0, l00, 1.0), 0.0)
            l11 = _safe_sqrt(v1 - l10**2)
            z0 = grid[:, 0].reshape((-1,) + (1,) * nd)
            z1 = grid[:, 1].reshape((-1,) + (1,) * nd)
            etas = [means[0] + l00 * z0, means[1] + l10 * z0 + l11 * z1]
        new_leaves = list(leaves)
        value = site["value"]
        for (name, index, link), eta in zip(f.links, etas):
            x = LINKS[link][0](eta)
            if index == "value":
                value = x
            elif isinstance(index, str):  # value − loc of a translation family: loc at 0
                value = x
                loc = shift_leaf(index)
                new_leaves[loc] = jnp.zeros_like(new_leaves[loc])
            else:
                new_leaves[index] = x
        base = tree.unflatten(new_leaves)
        lp = base.log_prob(value)
        w = jnp.asarray(weights, dtype).reshape((-1,) + (1,) * (lp.ndim - 1))
        els[f.name] = reduce_wrapped(site["fn"], jnp.sum(w * lp, axis=0))
        scales[f.name] = site.get("scale")
    return els, scales
