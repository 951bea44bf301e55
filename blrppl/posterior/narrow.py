"""Is the posterior wider than q along a scalar site? A check PSIS k̂ cannot make.

PSIS k̂ and the importance ESS (:mod:`blrppl.posterior.diagnostics`) read the weights
p(x, y)/q(x) at draws of q. Where the posterior is much wider than q along some direction
(a kernel's variance or length scale, a hierarchical scale), q's draws never reach the
posterior's bulk there, and the weights at them need not vary much: the fit looks good
(Yao, Vehtari, Simpson & Gelman 2018 note that k̂ is blind to what q does not reach). This
check draws from a proposal wider than q along one scalar at a time, and estimates the
posterior's variance of that scalar by importance sampling.

For every scalar site u_j (a latent of one scalar, on its block's unconstrained space: the
hyperparameters) of a Gaussian block q = N(m, Σ) with the column Σ_{·j} (dense blocks, a
scalar's own block, an arrowhead's globals), the proposal r_j keeps q's conditional of the
block given u_j and replaces q's marginal of u_j by the defensive mixture (Hesterberg 1995)

    g_j(d) = ½ N(d; 0, σ_j²) + ½ Cauchy(d; 0, :data:`WIDEN` σ_j),    d = u_j − m_j,

whose Cauchy half (truncated at |d| ≤ :data:`TRUNCATE` σ_j) reaches posteriors many times
wider than q and whose Gaussian half keeps the weights near 1 where q is right. A draw of r_j is a draw x of q moved along q's
regression on u_j: x' = x + (d' − d) Σ_{·j} / σ_j² with d' ~ g_j (so x'_j = m_j + d', and
the rest of the block, given it, is as under q); the other blocks are q's draws. Its log
weight is

    log w = log p(x', y) − log q(x') + log N(d'; 0, σ_j²) − log g_j(d'),

and the self-normalised estimates of the posterior's mean and variance of u_j give the
ratio ρ_j = sd_p(u_j) / σ_j, with its Monte Carlo standard error by the delta method
(Var v̂ ≈ Σ_s w̄_s² ((d_s − μ̂)² − v̂)², w̄ the normalised weights). A site is *narrow*
when ρ_j less :data:`NARROW_Z` standard errors exceeds :data:`NARROW_RATIO`: the
posterior of u_j is wider than q's by more than q's own error allows.

Cost: :func:`draws_per_site` draws per site (k̂'s draws, fewer when there are many sites or
large data, at most :data:`MAX_SITES` sites), one compiled call next to k̂'s, compiled when a
fit first needs it. Measured (first fits, ``refine=False``): NumPyro's GP example 0.1 → 0.3 s
of diagnostics in a fit of 5-10 s; a logistic regression, random intercepts, a Student-t
regression 0.02 → 0.15-0.5 s (its compilation, on fits of 1-4 s: random intercepts' first
fit 19 % slower). Most fits do not need it: where q's own importance weights are reliable
(k̂ ≤ :data:`KHAT_SCREEN`) and q is otherwise good, the same estimate from q's own draws, read
in k̂'s program (:func:`site_reader`, :func:`screen`), decides when it puts every site clearly
below the threshold, and the check's program is neither compiled nor run.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.posterior.diagnostics import BATCH, KHAT_WARN, MIN_DRAWS, draws_at_once

#: the Cauchy half of the proposal has this many of q's sds as its scale
WIDEN = 3.0
#: the Cauchy half is truncated at this many of q's sds: the model is never evaluated further
#: out, where its own computation may not end (an ODE solved by odeint at a decay rate e⁵⁰
#: times q's: its adaptive steps never finished); a posterior 10× wider than q keeps 99.9 %
#: of its variance within 4 of its sds
TRUNCATE = 40.0
#: the Cauchy's mass within ±TRUNCATE / WIDEN of its scales
_CAUCHY_MASS = 2.0 / math.pi * math.atan(TRUNCATE / WIDEN)
#: a site is narrow when its posterior sd, less NARROW_Z of the estimate's standard errors, is
#: more than this many times q's (see :func:`flagged`)
NARROW_RATIO = 1.2
#: standard errors of the estimated ratio subtracted before comparing it with NARROW_RATIO
NARROW_Z = 2.0
#: k̂ of q's importance weights up to which :func:`screen` reads the sites' widths off q's own
#: draws, without the check's widened draws: PSIS's bound of reliable importance estimates
#: (Vehtari et al. 2024), and the poor-q warning's. Simulated (a posterior Gaussian along one
#: site and r× wider than q, 1,000 draws of q, the weights perturbed by 20 other dimensions: k̂
#: 0.57 at the median, as random intercepts' 0.40–0.60): the screen decides in 79 % of the
#: draws at r = 1 (in 26 % if it required k̂ ≤ 0.5), in 4 % at r = 1.3 and never from r = 1.5
KHAT_SCREEN = KHAT_WARN
#: the scalar sites checked (the first in the plan's order)
MAX_SITES = 16
#: the draws of all sites together are at most this many times k̂'s
DRAW_FACTOR = 4
#: and they evaluate at most this many data elements (a tenth of k̂'s budget,
#: :data:`blrppl.posterior.diagnostics.EVALUATIONS`): 300 draws for an item-response model
#: of 30,000 answers, whose 1,000 took 4 s against k̂'s 1.9 s (the draws moved along a site's
#: column compile into a slower program at XLA's level 0), the fit 6 s
EVALUATIONS = 10_000_000


class Width(NamedTuple):
    """How much wider than q the posterior is along one scalar site.

    Attributes:
        site: the site (one scalar, on its block's unconstrained space).
        ratio: the posterior's sd of it over q's (importance sampling estimate).
        se: the Monte Carlo standard error of ``ratio``.
        ess: relative effective sample size of the check's weights for this site.
    """

    site: str
    ratio: float
    se: float
    ess: float

    def narrow(self) -> bool:
        """Whether q is narrower than the posterior here beyond the estimate's error."""
        return bool(self.ratio - NARROW_Z * self.se > NARROW_RATIO)


class ScalarSite(NamedTuple):
    """A scalar site the check reads: its block (position in ``drawn``) and flat index."""

    site: str
    block: int
    index: int


def scalar_sites(drawn) -> list:
    """The :class:`ScalarSite` of every scalar latent in a global Gaussian block of ``drawn``
    whose family holds its covariance column, at most :data:`MAX_SITES`."""
    out = []
    for i, b in enumerate(drawn):
        if b.discrete or b.point or not b.family.gaussian or b.local is not None:
            continue
        members = b.members or (b,)
        positions = b.member_positions() if b.members else [np.arange(b.size)]
        shape = tuple(b.family.canonical_batch_shape(tuple(b.value_shape), tuple(b.plate_axes))) + tuple(
            b.family.event_shape
        )
        view = jax.eval_shape(lambda x, b=b: b.family.view(b.family.initial_nat(x)), jax.ShapeDtypeStruct(shape, float))
        for m, pos in zip(members, positions):
            if math.prod(m.value_shape) != 1:
                continue
            index = int(pos[0])
            column = jax.eval_shape(lambda v, b=b, index=index: b.family.covariance_column(v, index), view)
            if column is not None:
                out.append(ScalarSite(m.name, i, index))
    return out[:MAX_SITES]


def draws_per_site(num: int, sites: int, elements: int = 1) -> int:
    """Draws for each of ``sites`` scalar sites: k̂'s ``num``, fewer when the sites are more
    than :data:`DRAW_FACTOR` (the total at most DRAW_FACTOR · num) or when the draws would
    evaluate more than :data:`EVALUATIONS` data elements (``elements`` per draw), at least
    :data:`MIN_DRAWS`; a multiple of :data:`BATCH`."""
    sites = max(sites, 1)
    each = min(num, DRAW_FACTOR * num // sites, EVALUATIONS // (max(elements, 1) * sites))
    return max(MIN_DRAWS, each // BATCH * BATCH)


def make_narrow_check(density, batch: int = BATCH):
    """``(sites, check)`` with ``check(nat, data, key) -> (log_w, d, sd)``: for each of the
    scalar sites (:func:`scalar_sites`), the log weights and deviations d' of its draws
    ``(sites, S)`` and q's sd of it ``(sites,)`` (module docstring); ``(sites, None)`` when
    there is no site to check.

    Args:
        density: the model's density at q's draws
            (:func:`blrppl.posterior.diagnostics.model_density`).
    """
    drawn = density.drawn
    sites = scalar_sites(drawn)
    if not sites:
        return sites, None
    per_site = draws_per_site(density.num, len(sites), max(density.data_size, 1) * density.enumerated)
    total = per_site * len(sites)
    at_once = draws_at_once(max(density.data_size, 1) * density.enumerated, total)
    if at_once < total:
        at_once = max(d for d in range(1, min(batch, at_once) + 1) if total % d == 0)

    def columns(nat):
        return _columns(sites, drawn, nat)

    def one_draw(nat, data, key, fixed_values, cols, which):
        """One draw of r_j for site ``which`` (traced index): (log w, d')."""
        key_mix, key_d, key_q = jax.random.split(key, 3)
        var = jnp.stack([c[3] for c in cols])[which]
        sd = jnp.sqrt(var)
        wide = jax.random.bernoulli(key_mix, 0.5)
        # (the Cauchy half truncated at TRUNCATE of q's sds, by its inverse CDF)
        half = jax.random.uniform(key_d, dtype=var.dtype, minval=-0.5, maxval=0.5)
        cauchy = WIDEN * jnp.tan(jnp.pi * half * _CAUCHY_MASS)
        d_new = sd * jnp.where(wide, cauchy, jax.random.normal(key_d, dtype=var.dtype))
        keys = jax.random.split(key_q, max(len(drawn), 1))
        values, log_q, log_det = dict(fixed_values), 0.0, 0.0
        for i, (k, b) in enumerate(zip(keys, drawn)):
            x = b.family.sample(nat[b.name], k)
            mine = [j for j, s in enumerate(sites) if s.block == i]
            if mine:  # (moved along q's regression on the site, when the site is in this block)
                flat = jnp.ravel(x)
                here = jnp.stack([jnp.asarray(j) == which for j in mine])
                cols_b = jnp.stack([cols[j][1] for j in mine])
                idx = jnp.asarray([sites[j].index for j in mine])
                pick = jnp.argmax(here)
                d_old = flat[idx[pick]] - cols[mine[0]][0][idx[pick]]
                shift = jnp.where(jnp.any(here), (d_new - d_old) / var, 0.0)
                x = jnp.reshape(flat + shift * cols_b[pick], jnp.shape(x))
            log_q = log_q + jnp.sum(b.family.log_prob(nat[b.name], x))
            vals, ld = density.site_values(b, x)
            values.update(vals)
            log_det = log_det + ld
        log_g = jnp.logaddexp(
            jax.scipy.stats.norm.logpdf(d_new, scale=sd),
            jax.scipy.stats.cauchy.logpdf(d_new, scale=WIDEN * sd) - math.log(_CAUCHY_MASS),
        ) + jnp.log(0.5)
        log_w = density.log_joint(values, data) + log_det - log_q + jax.scipy.stats.norm.logpdf(d_new, scale=sd) - log_g
        return log_w, d_new

    def check(nat, data, key):
        fixed_values = density.point_values(nat)
        cols = columns(nat)
        keys = jax.random.split(key, total)
        which = jnp.repeat(jnp.arange(len(sites)), per_site)
        draw = jax.vmap(lambda k, j: one_draw(nat, data, k, fixed_values, cols, j))
        if at_once == total:
            log_w, d = draw(keys, which)
        else:  # (large data: a few draws at a time)
            shape = (total // at_once, at_once)
            log_w, d = jax.lax.map(lambda kw: draw(*kw), (keys.reshape(shape), which.reshape(shape)))
        sd = jnp.sqrt(jnp.stack([c[3] for c in cols]))
        return log_w.reshape(len(sites), per_site), d.reshape(len(sites), per_site), sd

    return sites, check


def _columns(sites, drawn, nat) -> list:
    """Per site: its block's mean (flat), Σ_{·j}, m_j and σ_j²."""
    out = []
    for s in sites:
        b = drawn[s.block]
        view = b.family.view(nat[b.name])
        col = b.family.covariance_column(view, s.index)
        mean = jnp.ravel(view.mean)
        out.append((mean, col, mean[s.index], col[s.index]))
    return out


def site_reader(sites, drawn) -> tuple:
    """``(at_draw, of_q)`` for :func:`blrppl.posterior.diagnostics.log_weights_of`:
    ``at_draw(nat, xs)``, the deviation u_j − m_j of each site at one draw of q (``xs``: the
    draw of each block of ``drawn``), ``(sites,)``; ``of_q(nat)``, q's sd of each site. With
    k̂'s weights they give :func:`screen`'s estimates, in k̂'s own program (no model evaluation
    of their own)."""

    def at_draw(nat, xs):
        means = {}
        out = []
        for s in sites:
            b = drawn[s.block]
            if s.block not in means:
                means[s.block] = jnp.ravel(b.family.view(nat[b.name]).mean)
            out.append(jnp.ravel(xs[s.block])[s.index] - means[s.block][s.index])
        return jnp.stack(out)

    def of_q(nat):
        return jnp.sqrt(jnp.stack([c[3] for c in _columns(sites, drawn, nat)]))

    return at_draw, of_q


def screen(sites, log_w, at_draws, sd) -> tuple | None:
    """The :class:`Width` of each site estimated from q's own draws and importance weights
    (k̂'s: ``log_w`` ``(S,)``, ``at_draws`` ``(S, sites)`` from :func:`site_reader`), or None
    when they leave room for a narrow site, so that the check's own draws must decide.

    Where the posterior is Gaussian along u_j and r times wider than q, the weights at q's
    draws grow as exp(c d²) with c = (1 − 1/r²) / 2σ_j²: Pareto-tailed with k = 1 − 1/r², of
    finite variance (k ≤ ½) for r ≤ √2, and so are the weighted moments of d; a posterior
    wider along a site than the check flags leaves a heavier tail, and an estimate from q's
    draws that, biased low, still comes near the threshold. The caller reads these estimates
    only where k̂ ≤ :data:`KHAT_SCREEN` and q is otherwise good; they decide when every
    site's ratio plus :data:`NARROW_Z` standard errors is at most :data:`NARROW_RATIO`. The
    widened draws are needed only where q's cannot see: heavy tails, or a ratio near or
    above the threshold."""
    # (on the host: a jax array's transpose would compile a program of its own, 0.1 s)
    at_draws = np.asarray(at_draws, float).T
    found = widths(sites, np.broadcast_to(np.asarray(log_w, float), at_draws.shape), at_draws, np.asarray(sd, float))
    if all(w.ratio + NARROW_Z * w.se <= NARROW_RATIO for w in found):  # (NaN: not decided)
        return found
    return None


def widths(sites, log_w, d, sd) -> tuple:
    """The :class:`Width` of each site from the check's draws (see the module docstring and
    :func:`width_of`)."""
    out = []
    for s, lw, dev, scale in zip(sites, np.asarray(log_w, float), np.asarray(d, float), np.asarray(sd, float)):
        out.append(Width(s.site, *width_of(lw, dev, scale)))
    return tuple(out)


def width_of(log_w, d, sd) -> tuple:
    """``(ratio, se, ess)``: the self-normalised importance estimate of sd_p(u) / ``sd`` from
    draws ``d`` = u − m with log weights ``log_w``, its delta-method standard error and the
    weights' relative ESS. A draw where the model's density is −∞ or NaN weighs nothing (the
    Cauchy half of the proposal reaches far out, where a kernel of variance e⁵⁰ overflows: the
    posterior has no mass there); NaN when a weight is +∞, none is finite or ``sd`` is not
    positive."""
    log_w, d = np.asarray(log_w, float), np.asarray(d, float)
    log_w = np.where(np.isnan(log_w) | ~np.isfinite(d), -np.inf, log_w)
    if not log_w.size or np.any(log_w == np.inf) or not np.any(np.isfinite(log_w)) or not sd > 0:
        return math.nan, math.nan, math.nan
    keep = np.isfinite(log_w)
    log_w, d = log_w[keep], d[keep]
    w = np.exp(log_w - log_w.max())
    w = w / w.sum()
    mean = np.sum(w * d)
    sq = (d - mean) ** 2
    var = np.sum(w * sq)
    if not var > 0:
        return 0.0, 0.0, float(1.0 / (w.size * np.sum(w**2)))
    se_var = math.sqrt(np.sum(w**2 * (sq - var) ** 2))
    ratio = math.sqrt(var) / sd
    return float(ratio), float(ratio * se_var / (2.0 * var)), float(1.0 / (w.size * np.sum(w**2)))


def flagged(found) -> tuple:
    """The narrow :class:`Width` entries of ``found``, widest first."""
    return tuple(sorted((w for w in found if w.narrow()), key=lambda w: -w.ratio))
