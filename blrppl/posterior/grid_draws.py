"""Joint draws of a fit whose scales were integrated on a product grid.

``blr_fit(..., families={"tau": "grid"})`` (:mod:`blrppl.engine.grid`) approximates the
posterior by the mixture of its grid points' fits,

    p(u, x | y) ≈ Σ_k w_k N(u; u_k, diag(h²)) q_k(x),

u the scales on their unconstrained scale, u_k the grid's points with weights w_k, h the
kernel width of each scale's marginal (an eighth of the grid's spacing) and q_k the fit of the
other latents with the scales fixed at u_k. Each block's exported posterior is the moment match
of its marginal, and drawing those blocks independently loses the dependence the mixture holds:
in the non-centred eight schools, θ = μ + τ θ̃ computed from independent draws of τ and θ̃ came
out 0.13 NUTS sd off, against 0.05 for the fit without a grid.

:func:`draw` samples the mixture itself: a grid point k ~ w for every draw, then the scales
u_k + h ε and every block of the fits at the points from its q_k (in the family it has with
the scales fixed). Blocks the grid's fits do not hold alike (point estimates, a block whose
layout differs with the scales fixed) are drawn by the caller from the result's posterior.

:func:`mixture_log_weights` gives the PSIS diagnostic a density of the same construction: with
kernels of width h it is a comb of peaks at the points, which is no density of the posterior's
shape, so the diagnostic widens them to H = :data:`SMOOTHING` h (half the grid's spacing: a smooth
sum) and takes the other latents from the fit at the nearest point j(u),

    q_grid(u, x) = Σ_j w_j N(u; u_j, diag(H²)) · q_{j(u)}(x),

and reads the importance weights p(y, u, x) / q_grid(u, x) at draws of it, where every block the
fit with the scales as latents draws is a scale's own block or a block of the same family and
layout in the fits at the points (otherwise k̂ stays that of the blocks drawn independently).
Centred eight schools: k̂ 0.94 for its blocks drawn independently.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp
from jax.scipy.stats import norm

from blrppl.inputs import host_fold_in, host_split

#: the diagnostic's kernels are this many times the draws' (h, an eighth of the grid's spacing)
SMOOTHING = 4.0


class GridScale(NamedTuple):
    """One scale on the grid: its site, the points' values u_k on its unconstrained scale
    (K,), the kernel width h, and the bijection to its support (None: real-valued)."""

    site: str
    points: np.ndarray
    width: float
    transform: Any


class GridDraws(NamedTuple):
    """The mixture of a product grid's fits (module docstring).

    Attributes:
        weights: (K,) the grid points' normalised weights w_k.
        scales: a :class:`GridScale` per scale.
        blocks: ``(block, nats)`` for every block drawn from the grid's fits: the block as the
            fits with the scales fixed hold it, and its natural parameters at each point (None
            at points of no weight).
    """

    weights: np.ndarray
    scales: tuple
    blocks: tuple

    def sites(self) -> set:
        """The sites :func:`draw` gives."""
        out = {s.site for s in self.scales}
        for b, _ in self.blocks:
            out |= {m.name for m in b.members} if b.members else {b.name}
        return out


def draw(grid: GridDraws, key, num_samples: int) -> dict:
    """``num_samples`` joint draws of the grid's mixture: site → array with a leading
    ``num_samples`` axis, on the sites' supports."""
    seed = np.asarray(jax.random.key_data(host_fold_in(key, 0))).astype(np.uint64)
    rng = np.random.default_rng(seed.tolist())
    picks = rng.choice(len(grid.weights), size=num_samples, p=grid.weights / grid.weights.sum())
    out = {}
    for s in grid.scales:
        u = s.points[picks] + s.width * rng.standard_normal(num_samples)
        out[s.site] = np.asarray(s.transform(u)) if s.transform is not None else u
    used = np.unique(picks)
    count = int(np.max(np.bincount(picks)))
    for i, (block, nats) in enumerate(grid.blocks):
        parts: dict = {}
        keys = host_split(host_fold_in(key, i + 1), len(nats))
        for k in used:
            rows = np.flatnonzero(picks == k)
            # (one sample shape for every point, the largest count: one compiled draw a block)
            x = block.family.sample(nats[k], keys[k], (count,))
            for name, values in _site_values(block, x).items():
                if name not in parts:
                    parts[name] = np.empty((num_samples,) + values.shape[1:], values.dtype)
                parts[name][rows] = values[: rows.size]
        out.update(parts)
    return out


def _site_values(block, x) -> dict:
    """Site → constrained values of a block's draws ``x`` (a leading sample axis)."""
    if block.members:
        split = block.split(x)
        return {
            m.name: np.asarray(m.transform(split[m.name]) if m.transform is not None else split[m.name])
            for m in block.members
        }
    u = block.to_site(x)
    return {block.name: np.asarray(block.transform(u) if block.transform is not None else u)}


def mixture_log_weights(density, scale_blocks: dict):
    """``f(mix, nat, data, key) -> (density.num,)`` importance log-weights of the grid's
    mixture with its kernels widened (q_grid of the module docstring) at draws of it.

    Args:
        density: the model's density as the diagnostics read it
            (:class:`blrppl.posterior.diagnostics.Density`) of the plan with the scales as
            latents.
        scale_blocks: block name → (index of its scale, the block's value shape), for the
            scales' own blocks.

    ``mix`` is ``(stacked, log_w, us, widths)``: every other drawn block's natural parameters
    at the K points (a leading axis of K), the points' log weights (−∞: none), their values of
    the scales (K, d) and the kernel widths (d,); ``nat`` the fit's, for its point blocks.
    """
    drawn, num, at_once = density.drawn, density.num, density.at_once

    def one_draw(mix, fixed_values, data, key):
        stacked, log_w, us, widths = mix
        key_k, key_u, *keys = jax.random.split(key, len(drawn) + 2)
        smooth = SMOOTHING * widths
        u = us[jax.random.categorical(key_k, log_w)] + smooth * jax.random.normal(key_u, us.shape[1:], us.dtype)
        # (the other latents from the fit at the nearest point of weight)
        k = jnp.argmin(jnp.sum(((u - us) / smooth) ** 2, axis=1) + jnp.where(jnp.isfinite(log_w), 0.0, jnp.inf))
        log_q = logsumexp(log_w + jnp.sum(norm.logpdf(u, us, smooth), axis=1))
        values, log_det = dict(fixed_values), 0.0
        for key_b, b in zip(keys, drawn):
            if b.name in scale_blocks:
                i, shape = scale_blocks[b.name]
                x = jnp.reshape(u[i], shape)
            else:
                nat_k = jax.tree.map(lambda a: a[k], stacked[b.name])
                x = b.family.sample(nat_k, key_b)
                log_q = log_q + jnp.sum(b.family.log_prob(nat_k, x))
            vals, ld = density.site_values(b, x)
            values.update(vals)
            log_det = log_det + ld
        return density.log_joint(values, data) + log_det - log_q

    def log_weights(mix, nat, data, key):
        fixed_values = density.point_values(nat)
        keys = jax.random.split(key, num)
        draw = jax.vmap(lambda k: one_draw(mix, fixed_values, data, k))
        if at_once == num:
            return draw(keys)
        out = jax.lax.map(draw, keys.reshape((num // at_once, at_once)))
        return out.reshape((num,))

    return log_weights
