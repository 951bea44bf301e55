"""How good is q? Pareto-smoothed importance sampling k̂ on every fit.

After a fit, :data:`NUM_DRAWS` draws x_s ~ q (fewer for data of more than 10⁵ elements:
at most 10⁸ model-element evaluations, at least 100 draws) of every non-point continuous block give the
importance log-weights

    log w_s = log p(x_s, y) − log q(x_s),

where log p is the model's own log density (its ``log_prob`` at every site, masks and
scales applied, on each block's own space: the log|det J| of blocks fitted on an
unconstrained space included), with the enumerated discrete latents summed out exactly
(per connected group of discrete latents, per plate element: log Σ_k p), and the point
blocks (params, ``point`` latents) held at their estimates. The shape parameter k̂ of a
generalised Pareto distribution fitted to the largest weights (Vehtari, Simpson, Gelman,
Yao & Gabry 2024, "Pareto smoothed importance sampling"; the fit of Zhang & Stephens 2009
with its weakly informative prior) says how far q's tails are from the posterior's
(Yao, Vehtari, Simpson & Gelman 2018): k̂ ≤ 0.5 q is close (importance sampling from it has
finite variance), 0.5 < k̂ ≤ 0.7 usable, k̂ > 0.7 q is a poor approximation of the posterior
(a funnel, several modes, heavy tails q cannot hold); the fit warns then, unless the weights
hardly vary (relative effective sample size at least :data:`ESS_CLOSE`), and also when the
weights' relative effective sample size is below :data:`ESS_POOR` (q's bulk is off). Weights that are all equal (q is the
exact posterior, as for a conjugate model) give k̂ = −∞; so does a converged fit whose only
latent block is conjugate (its closed-form step is the exact posterior), without any draws.

The log-weights are one compiled call (draws in batches of :data:`BATCH`), evaluated once
per fit.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp

#: draws of q for k̂ (the tail fit uses the largest min(0.2 S, 3 √S) = 95 of them); fewer, down
#: to MIN_DRAWS, when the data (times the enumerated values of discrete latents) are large (see
#: :func:`num_draws`)
NUM_DRAWS = 1000
#: the fewest draws (large data)
MIN_DRAWS = 100
#: the most draw × data-element model evaluations the diagnostic spends (an element evaluated at
#: each of K enumerated values counts K times)
EVALUATIONS = 100_000_000
#: the most draws evaluated at once when the data are large (memory: BATCH model evaluations)
BATCH = 50
#: the most draw × data-element evaluations held at once: below it every draw is evaluated at
#: once, above it draws go in batches of at most BATCH (at least one) and enumerated values one
#: at a time
VMAP_ALL = 5_000_000
#: the most draw × scalar values of q's draws made ahead of the batches of model evaluations
#: (:func:`log_weights_of`: small blocks, as a regression's coefficients; a factor model's
#: rows, 900 draws of 5,210 scalars, ran no faster so)
HOISTED_DRAWS = 200_000
#: above this k̂, q is a poor approximation (a UserWarning says so, unless the importance
#: weights' relative effective sample size is at least ESS_CLOSE)
KHAT_WARN = 0.7
#: a relative effective sample size of the importance weights at which q's bulk is close to
#: the posterior whatever k̂ says about the tails: with w = p/q normalised, 1/ESS − 1 estimates
#: χ²(p‖q) = E_q[(w − 1)²], and by Cauchy–Schwarz |E_p f − E_q f| = |E_q[(w − 1) f]| ≤
#: √χ² · sd_q(f), 0.23 sd_q of any quantity at 0.95 (near-exact fits reach 0.98–0.99, where the
#: k̂ fit to a tail of nearly equal weights is noise; fits with too small sds 0.04–0.25)
ESS_CLOSE = 0.95
#: a relative effective sample size below which q is a poor approximation whatever k̂ says:
#: 1/ESS − 1 > 1.86, so a mean may lie more than 1.36 of q's sds from q's (the bound above).
#: k̂ fits the largest weights only; a q too narrow in its bulk (a centred hierarchical scale
#: fitted mean-field: eight schools' τ with 0.34× NUTS' sd at k̂ 0.58, ESS 0.25; a mixture
#: missing a mode, ESS 0.30) keeps k̂ below 0.7. Fits close to NUTS measured 0.42–1.0 (an
#: item-response model of 501 latents 0.53)
ESS_POOR = 0.35


class Diagnostics(NamedTuple):
    """How a fit ended and how good its q is.

    Attributes:
        khat: PSIS k̂ of q against the model (NaN when not computed, −∞ when the importance
            weights are all equal).
        num_draws: draws of q behind k̂ (0 when none were needed or k̂ was not computed).
        elbo_rel_change: the last step's relative ELBO change.
        rejected_steps: steps undone by backtracking (the ELBO fell or went non-finite).
        elbo_noise: for Monte Carlo ELBOs, the standard deviation of the last window of
            ELBOs (0 for exact ELBOs).
        note: why k̂ was not computed, if it was not.
        ess: relative effective sample size of the importance weights, (Σ w)² / (S Σ w²) over
            the S draws (1 when they are all equal; NaN when not computed or not finite).
        bound: the importance-weighted bound log (1/S) Σ_s w_s of those draws (Burda, Grosse &
            Salakhutdinov 2016), an estimate from below of log p(y) that is tighter than the
            ELBO; for scales integrated on a grid, the grid's quadrature of its fits' bounds,
            log ∫ exp ℓ(u) du (:mod:`blrppl.engine.grid`). What refinement compares fits by
            (NaN when not computed).
        widths: the narrow-q check of every scalar site it read
            (:class:`blrppl.posterior.narrow.Width`: the posterior's sd over q's, on the
            site's unconstrained space; from q's own draws and weights where those decide,
            :func:`blrppl.posterior.narrow.screen`), empty when it read none (and when the
            weights' relative ESS is at least :data:`ESS_CLOSE`).
        narrow: the entries of ``widths`` where the posterior is wider than q beyond the
            check's error (:meth:`blrppl.posterior.narrow.Width.narrow`), widest first.
        bulk: where the relative ESS is below :data:`ESS_POOR` with reliable weights, each
            coordinate's importance-corrected mean and sd against q's
            (:class:`blrppl.posterior.bulk.Bulk`: how many were checked, which are off); None
            when not checked. A low ESS with no coordinate off is not a poor q.
    """

    khat: float
    num_draws: int
    elbo_rel_change: float
    rejected_steps: int
    elbo_noise: float
    note: str = ""
    ess: float = math.nan
    bound: float = math.nan
    widths: tuple = ()
    narrow: tuple = ()
    bulk: Any = None

    def poor(self) -> bool:
        """Whether q is a poor approximation by these diagnostics (what the fit warns of and
        refines): k̂ above :data:`KHAT_WARN` unless the weights hardly vary (relative ESS at
        least :data:`ESS_CLOSE`), a relative ESS below :data:`ESS_POOR` unless the bulk check
        found every coordinate's mean and sd close to q's (``bulk``), or a scalar site along
        which the posterior is wider than q (``narrow``)."""
        return bool((self.khat > KHAT_WARN and not self.ess >= ESS_CLOSE) or self.low_ess() or self.narrow)

    def low_ess(self) -> bool:
        """Whether the relative ESS alone makes q poor: below :data:`ESS_POOR`, and not
        cleared by the bulk check (:mod:`blrppl.posterior.bulk`)."""
        return bool(self.ess < ESS_POOR and (self.bulk is None or self.bulk.off))

    def narrow_note(self) -> str:
        """The narrow-q check's finding in words ('' when it flagged no site)."""
        if not self.narrow:
            return ""
        listed = ", ".join(f"'{w.site}' {w.ratio:.2g}× (± {w.se:.1g})" for w in self.narrow)
        return (
            f"the posterior is wider than q along {listed} (its sd over q's on the unconstrained scale, "
            "by importance sampling from q widened along each scalar site)"
        )

    def bulk_note(self) -> str:
        """The bulk check's finding in words ('' when it did not run)."""
        if self.bulk is None:
            return ""
        if not self.bulk.off:
            return (
                f"every one of the {self.bulk.coordinates} coordinates has its importance-corrected mean and sd close "
                "to q's (the low ESS comes from many small differences)"
            )
        shown = "; ".join(c.describe() for c in self.bulk.off[:3])
        more = f" and {len(self.bulk.off) - 3} more" if len(self.bulk.off) > 3 else ""
        return f"importance-corrected moments off q's: {shown}{more}"

    def describe(self) -> str:
        k = "not computed" if math.isnan(self.khat) else ("-inf (q is exact)" if self.khat == -math.inf else f"{self.khat:.3g}")
        lines = [
            f"PSIS k-hat: {k}" + (f" ({self.note})" if self.note else f" ({self.num_draws} draws of q)"),
            *([f"importance sampling relative ESS: {self.ess:.3g}"] if not math.isnan(self.ess) else []),
            *([f"importance-weighted bound: {self.bound:.6g}"] if not math.isnan(self.bound) else []),
            *(
                ["posterior sd over q's: " + ", ".join(f"{w.site} {w.ratio:.3g}" for w in self.widths)]
                if self.widths else []
            ),
            *([f"narrow q: {self.narrow_note()}"] if self.narrow else []),
            *([self.bulk_note()] if self.bulk is not None else []),
            f"last relative ELBO change: {self.elbo_rel_change:.3g}",
            f"rejected steps: {self.rejected_steps}",
        ]
        if self.elbo_noise:
            lines.append(f"Monte Carlo ELBO noise (sd, last window): {self.elbo_noise:.3g}")
        return "\n".join(lines)


# -- the generalised Pareto fit --------------------------------------------------------------


def _gpd_fit(x: np.ndarray) -> float:
    """Shape k of a generalised Pareto fitted to sorted positive exceedances ``x`` by the
    empirical-Bayes estimate of Zhang & Stephens (2009), with the weakly informative prior
    of Vehtari et al. (shrinking k towards 0.5 as if by 10 more observations)."""
    return gpd_fit(x)[0]


def gpd_fit(x: np.ndarray) -> tuple:
    """``(k, σ)`` of the generalised Pareto of :func:`_gpd_fit` (k with the prior, σ = −k₀/b
    from the estimate k₀ before it)."""
    n = x.size
    m = 30 + int(math.sqrt(n))
    prior = 3.0
    j = np.arange(1, m + 1, dtype=float)
    theta = 1.0 / x[-1] + (1.0 - np.sqrt(m / (j - 0.5))) / (prior * x[int(n / 4 + 0.5) - 1])
    k = np.mean(np.log1p(-theta[:, None] * x), axis=1)  # (negative of the usual) shape per θ
    log_lik = n * (np.log(-theta / k) - k - 1.0)
    weights = 1.0 / np.sum(np.exp(log_lik[None, :] - log_lik[:, None]), axis=1)
    keep = weights >= 10.0 * np.finfo(float).eps
    weights, theta = weights[keep], theta[keep]
    weights = weights / weights.sum()
    b = np.sum(theta * weights)
    khat = np.mean(np.log1p(-b * x))
    return float((n * khat + 10.0 * 0.5) / (n + 10.0)), float(-khat / b)


def psis_khat(log_weights) -> float:
    """k̂ of the importance log-weights (−∞ when they are all equal, +∞ when they are not
    finite)."""
    lw = np.asarray(log_weights, dtype=float).ravel()
    if lw.size < 10 or not np.all(np.isfinite(lw)):
        return math.inf if lw.size else math.nan
    lw = lw - lw.max()
    if lw.min() > -1e-6:
        return -math.inf
    n = lw.size
    tail = int(math.ceil(min(0.2 * n, 3.0 * math.sqrt(n))))
    order = np.sort(lw)
    cutoff = max(order[-tail - 1], np.log(np.finfo(float).tiny))
    x = np.exp(order[order > cutoff]) - np.exp(cutoff)
    if x.size <= 4:
        return math.inf
    return _gpd_fit(np.sort(x))


def relative_ess(log_weights) -> float:
    """(Σ w)² / (S Σ w²) of the S importance weights w = exp(log w): 1 when they are all
    equal, 1/S when one dominates; NaN when any is not finite or there are none."""
    lw = np.asarray(log_weights, dtype=float).ravel()
    if not lw.size or not np.all(np.isfinite(lw)):
        return math.nan
    w = np.exp(lw - lw.max())
    return float(w.sum() ** 2 / (lw.size * np.sum(w**2)))


def importance_bound(log_weights) -> float:
    """log (1/S) Σ_s exp(log w_s) over the S draws: the importance-weighted bound (NaN when
    there are none; −∞ when none is finite, the non-finite ones dropped)."""
    lw = np.asarray(log_weights, dtype=float).ravel()
    if not lw.size:
        return math.nan
    finite = lw[np.isfinite(lw)]
    if not finite.size or np.any(lw == math.inf):
        return math.inf if np.any(lw == math.inf) else -math.inf
    top = finite.max()
    return float(top + np.log(np.sum(np.exp(finite - top)) / lw.size))


# -- the log weights ---------------------------------------------------------------------------


def _components(plan) -> list:
    """Connected groups of discrete blocks (two are connected when a factor enumerates both)."""
    parent = {b.name: b.name for b in plan.blocks if b.discrete and not b.chain}

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for f in plan.factors:
        names = [d for d in f.discrete if d in parent]
        for a, b in zip(names, names[1:]):
            parent[find(a)] = find(b)
    groups: dict = {}
    for n in parent:
        groups.setdefault(find(n), []).append(n)
    return [tuple(g) for g in groups.values()]


def _reduce_to(x, shape):
    """Sum a site's log-density terms down to a discrete group's element shape."""
    x = jnp.asarray(x)
    while x.ndim > len(shape):
        x = x.sum(0)
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and x.shape[i] != 1)
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return jnp.broadcast_to(x, shape)


def num_draws(data_shapes, enumerated: int = 1, work: int = 1) -> int:
    """:data:`NUM_DRAWS`, or fewer (a multiple of :data:`BATCH`, at least :data:`MIN_DRAWS`)
    when the data, each element evaluated ``enumerated`` times (the values of its discrete
    latents summed out) at ``work`` times the cost of one density term (1 + D for an element of
    ``X @ C.T`` with D latent dimensions), have more than :data:`EVALUATIONS` / NUM_DRAWS
    elements. (A 2,000 × 100 factor model with D = 40 spent 1.7 s of its first fit on 500
    draws; 100 take 0.4 s.)"""
    size = max(sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(data_shapes)), 1) * max(enumerated, 1)
    size *= max(work, 1)
    affordable = (EVALUATIONS // size) // BATCH * BATCH
    return int(min(NUM_DRAWS, max(MIN_DRAWS, affordable)))


def draws_at_once(work_per_draw: int, num: int) -> int:
    """How many of ``num`` draws to evaluate at once (a divisor of ``num``): all of them when
    ``num · work_per_draw`` ≤ :data:`VMAP_ALL`, else the most, at most :data:`BATCH`, whose
    work fits in VMAP_ALL (at least one)."""
    if num * work_per_draw <= VMAP_ALL:
        return num
    batch = max(1, min(BATCH, VMAP_ALL // max(work_per_draw, 1)))
    while num % batch:
        batch -= 1
    return batch


class Density(NamedTuple):
    """The model's density at draws of q, as the diagnostics evaluate it (:func:`model_density`).

    Attributes:
        drawn: the blocks drawn from q (continuous non-point blocks and chains).
        point_values: ``nat`` → {site: value} of the point blocks at their estimates.
        site_values: ``(block, draw)`` → ({site: value in block space}, log|det J|).
        log_joint: ``(values, data)`` → log p(values, y), enumerated latents summed out.
        num: draws of q for k̂ (:func:`num_draws`).
        at_once: how many of them are evaluated at once (a divisor of ``num``).
        data_size: the data's elements, each evaluated ``enumerated`` times.
        enumerated: the enumerated values an element is evaluated at (1 without).
    """

    drawn: list
    point_values: Callable
    site_values: Callable
    log_joint: Callable
    num: int
    at_once: int
    data_size: int
    enumerated: int


def model_density(plan, fns, records, data_shapes, batch: int = BATCH) -> Density:
    """The model's log density and q's blocks as the importance weights read them (see the
    module docstring and :func:`make_log_weights`)."""
    blocks = {b.name: b for b in plan.blocks}
    # (chains of discrete latents are drawn, with their exact log q, not summed out)
    drawn = [b for b in plan.blocks if (b.chain or not b.discrete) and not b.point]
    fixed = [b for b in plan.blocks if not b.discrete and b.point]
    groups = _components(plan)
    sites = tuple(n for n, r in records.items() if r.observed or not r.is_param)
    # a stacked factor's sites are evaluated as the one stacked site (blrppl.graph.stack)
    stacked = {m: f.name for f in plan.factors for m in f.members}
    sites = tuple(dict.fromkeys(stacked.get(n, n) for n in sites))
    site_discrete = {f.name: {d for d in f.discrete if not blocks[d].chain} for f in plan.factors if f.name in records}
    broadcastable = {f.name: f.enumeration is not None and f.enumeration.broadcast for f in plan.factors}
    for f in plan.factors:
        for d in f.discrete:
            if blocks[d].chain:
                continue
            for s in blocks[d].sites:  # a discrete latent's own prior is enumerated with it
                site_discrete.setdefault(s, set()).add(d)

    def point_values(nat):
        out = {}
        for b in fixed:
            mean = b.family.view(nat[b.name]).mean
            out.update(_site_values(b, mean)[0])
        return out

    def log_joint(values, data):
        """log p(values, y) with every group of discrete latents summed out."""
        lp = fns.log_probs(sites, values, data) if not groups else None
        if lp is not None:
            return sum(_scaled_sum(v, s) for v, s in lp.values())
        # sites with no discrete latent: once; the others per group, enumerated
        plain = [n for n in sites if not site_discrete.get(n)]
        total = 0.0
        if plain:
            lp = fns.log_probs(plain, values, data)
            total = sum(_scaled_sum(v, s) for v, s in lp.values())
        for group in groups:
            names = [n for n in sites if site_discrete.get(n, set()) & set(group)]
            shape = jnp.broadcast_shapes(*[blocks[d].full.value_shape for d in group])
            sizes = [len(blocks[d].support_values) for d in group]
            combos = np.array(list(itertools.product(*[range(k) for k in sizes])))
            # labels of shape 1 along their plates when the fit's factors take them so (a
            # mixture's component densities are then built once per component, not per point)
            broadcast = all(broadcastable.get(n, False) for n in names)

            def one(combo, group=group, names=names, shape=shape, broadcast=broadcast):
                vals = dict(values)
                for j, d in enumerate(group):
                    vals.update(blocks[d].full.discrete_site_values(combo[j], broadcast))
                lp = fns.log_probs(names, vals, data)
                return sum(_reduce_to(_scaled(v, s), shape) for v, s in lp.values())

            if len(combos) * data_size > VMAP_ALL:  # memory: one enumerated value at a time
                per_combo = jax.lax.map(one, jnp.asarray(combos))
            else:
                per_combo = jax.vmap(one)(jnp.asarray(combos))
            total = total + jnp.sum(logsumexp(per_combo, axis=0))
        return total

    data_size = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(data_shapes))
    # (each data element is evaluated at every enumerated value of its group's discrete latents)
    enumerated = sum(math.prod(len(blocks[d].support_values) for d in group) for group in groups) or 1
    # (an element of a product of Gaussian blocks, ``X @ C.T``, is a sum of D products)
    product = max((blocks[a].element_size for f in plan.factors for _, ps in f.spec.pairs for a, _ in ps), default=0)
    num = num_draws(data_shapes, enumerated, 1 + product)
    at_once = draws_at_once(max(data_size, 1) * enumerated, num)
    if at_once < num:
        at_once = max(d for d in range(1, min(batch, at_once) + 1) if num % d == 0)
    return Density(drawn, point_values, _site_values, log_joint, num, at_once, data_size, enumerated)


def _site_values(b, x):
    """Block draw (canonical layout) → {site: value in block space} (the model functions
    apply each site's bijection), and log|det J| of those bijections."""
    if b.chain:
        return b.chain_site_values(b.family.flat(x)), 0.0
    parts = b.split(x) if b.members else {b.name: b.to_site(x)}
    log_det = 0.0
    for m in b.members or (b,):
        if m.transform is not None:
            u = parts[m.name]
            log_det = log_det + jnp.sum(m.transform.log_abs_det_jacobian(u, m.transform(u)))
    return parts, log_det


def make_log_weights(plan, fns, records, data_shapes, batch: int = BATCH):
    """``log_weights(nat, data, key) -> (num_draws,)`` (see the module docstring).

    Args:
        plan: the compiled plan (no subsampled plates).
        fns: the model functions of the plan.
        records: site name → :class:`blrppl.model.records.SiteRecord`.
        data_shapes: the model's data (or their shapes): large data are evaluated
            :data:`BATCH` draws at a time, small data all draws at once.
    """
    return log_weights_of(model_density(plan, fns, records, data_shapes, batch))


def log_weights_of(density: Density, with_values: bool = False, reader=None):
    """:func:`make_log_weights` from the model's :class:`Density`; with ``with_values``,
    ``(log_weights, draws)``, ``draws`` the drawn latent sites' values (site → ``(num_draws,
    *shape)``, on their constrained space): what the importance-corrected summaries weigh
    (:mod:`blrppl.posterior.importance`).

    Args:
        reader: a pair ``(at_draw, of_q)`` of functions read in the same program: then
            ``(log_weights, at_draws, of_q(nat))``, ``at_draws`` the stacked
            ``at_draw(nat, xs)`` of every draw, ``xs`` the draw of each block of
            ``density.drawn`` (the narrow-q check's screen,
            :func:`blrppl.posterior.narrow.site_reader`, reads its sites there).
    """
    drawn, num, at_once = density.drawn, density.num, density.at_once
    # (q's draws for every draw at once, ahead of the batches of model evaluations, when
    # they are small: drawn inside the batches' loop, a dense block's triangular solve
    # against a batch's columns ran 20× slower than against all draws at once, 160 of a
    # 569 × 31 logistic regression's 190 ms of diagnostics)
    hoisted = at_once < num and num * sum(b.size for b in drawn) <= HOISTED_DRAWS

    def draw_blocks(nat, key):
        keys = jax.random.split(key, max(len(drawn), 1))
        xs, log_q = [], 0.0
        for k, b in zip(keys, drawn):
            x = b.family.sample(nat[b.name], k)
            xs.append(x)
            log_q = log_q + jnp.sum(b.family.log_prob(nat[b.name], x))
        return xs, log_q

    def weigh(nat, data, xs, log_q, fixed_values):
        values, log_det, constrained = dict(fixed_values), 0.0, {}
        for b, x in zip(drawn, xs):
            vals, ld = _site_values(b, x)
            values.update(vals)
            log_det = log_det + ld
            if with_values:
                constrained.update(vals if b.chain else _constrained(b, vals))
        log_w = density.log_joint(values, data) + log_det - log_q
        if reader is not None:
            return log_w, reader[0](nat, xs)
        return (log_w, constrained) if with_values else log_w

    def one_draw(nat, data, key, fixed_values):
        return weigh(nat, data, *draw_blocks(nat, key), fixed_values)

    def log_weights(nat, data, key):
        fixed_values = density.point_values(nat)
        keys = jax.random.split(key, num)
        if at_once == num:
            out = jax.vmap(lambda k: one_draw(nat, data, k, fixed_values))(keys)
        elif hoisted:
            xs, log_q = jax.vmap(lambda k: draw_blocks(nat, k))(keys)
            batches = jax.tree.map(lambda x: x.reshape((num // at_once, at_once) + x.shape[1:]), (xs, log_q))
            weigh_batch = jax.vmap(lambda x, lq: weigh(nat, data, x, lq, fixed_values))
            out = jax.lax.map(lambda batch: weigh_batch(*batch), batches)
            out = jax.tree.map(lambda x: x.reshape((num,) + x.shape[2:]), out)
        else:  # large data: a few draws at a time (memory: that many model evaluations)
            draw = jax.vmap(lambda k: one_draw(nat, data, k, fixed_values))
            out = jax.lax.map(draw, keys.reshape((num // at_once, at_once)))
            out = jax.tree.map(lambda x: x.reshape((num,) + x.shape[2:]), out)
        return out if reader is None else (*out, reader[1](nat))

    return log_weights


def _constrained(block, values: dict) -> dict:
    """A non-chain block's site values on their constrained space (its members' bijections
    applied to the values ``_site_values`` gives on the block's space)."""
    out = dict(values)
    for m in block.members or (block,):
        if m.transform is not None and m.name in out:
            out[m.name] = m.transform(out[m.name])
    return out


def _scaled(log_prob, scale):
    return log_prob if scale is None else scale * log_prob


def _scaled_sum(log_prob, scale):
    return jnp.sum(_scaled(log_prob, scale))
