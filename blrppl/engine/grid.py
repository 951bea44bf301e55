"""Latent scales integrated on a grid: ``blr_fit(..., families={"sigma": "grid"})``.

A scale that the prior of many latents reads (a random walk's step size, a volatility's
shock size, the spread of group effects) and those latents form a funnel: their spread
shrinks with it. No Gaussian q holds that, fitted apart or in one joint block, and the
scale's sd comes out several times too small (docs/limitations.md). With the scales θ held
fixed, though, the rest of the model is what the fit handles well (a linear-Gaussian chain
exactly), and the ELBO of that fit,

    L(θ) = max_q E_q[log p(y, x, θ)] + H[q] ≤ log p(y, θ),

is the log marginal posterior of θ up to a constant wherever q(x | θ) is exact, and its
variational stand-in elsewhere: the integrated nested Laplace approximation's scheme (Rue,
Martino & Chopin 2009, §3), with BLR fits in place of its Laplace approximations. On the
unconstrained scale u = T⁻¹(θ) of the d ≤ :data:`MAX_SCALES` scales,

    log p(u | y) ≈ ℓ(u) = L(T(u)) + log |det T'(u)| + const.

On the grid, L is the importance-weighted bound of the fit's q, log (1/S) Σ_s p(y, x_s, θ) /
q(x_s) over the S draws of the fit's diagnostics (Burda et al. 2016: tighter than the
ELBO, and equal to it where q(x | θ) is exact, so a fit of one conjugate block reads its
ELBO), when those weights are reliable at the mode (PSIS k̂ ≤ 0.7): the ELBO's gap
KL(q ‖ p(x | y, θ)) varies with θ (a stochastic volatility's grows with its shock size,
and biased the shock size's mean down by 0.12 NUTS sd; with the bound 0.02).

ℓ is located by Newton steps on central differences (from the fit with the scales as
latents), then evaluated at the points u_k = u* + V Λ^{1/2} z_k (V Λ Vᵀ = −(∇²ℓ)⁻¹ at the mode
u*) of :mod:`blrppl.engine.design`, with integration weights Δ_k (∫ g(z) dz ≈ Σ_k Δ_k g(z_k)),
and w_k ∝ Δ_k exp ℓ(u_k):

* one or two scales: a product grid, z_k ∈ {−4, …, 4}^d in steps of 0.25 (one scale) or 0.8
  (two: :data:`blrppl.engine.design.GRID_STEP`), widened while the grid's edge carries
  weight (Δ_k all equal);
* three to :data:`MAX_SCALES`, and two when asked (``design=CCD``: the refinement's grid over a
  model's hyperparameters): a central composite design (INLA's past two dimensions: the
  centre, 2d axial points and a fractional factorial's corners; 15 points for d = 3, 45 for
  d = 6), its weights those that integrate a Gaussian's second moments exactly; stretched on
  each side of the mode by ℓ's spread there (read at 2d probes), and w_k tilted to hold the
  scales' marginal means (the design's points miss a heavy side's far tail).

The result reports, in the families of the fit with the scales as latents,

* each scale's block: the moment match of its marginal below (its mean and variance on u:
  what ``result.params`` and ``result.guide`` hold), and ``result.posterior[site]`` (and
  ``result.sample``) that marginal mapped to the site's support. On a product grid, the grid
  itself, Σ_k w_k N(u_k, (spacing/8)²) (a skewed posterior, as eight schools' spread, keeps
  its shape); on a central composite design, whose few points per axis give no shape, a split
  normal on u with its mode at u* and a sd on each side read from the drop of ℓ at probes 3
  Laplace sds out along each principal direction (:func:`blrppl.engine.design.marginal_split`);
* every other block: the moment match of the mixture Σ_k w_k q_k of the fits at the grid
  points (the weighted average of their mean parameters, then λ = ∇A*(μ)); point and param
  blocks, and families without that map, the most probable grid point's fit.

``result.sample`` (and the summaries drawn from it) draws a product grid's mixture jointly
(:mod:`blrppl.posterior.grid_draws`): a grid point for each draw, then the scales near it and
the other latents from its fit, so what depends on both (θ = μ + τ θ̃) is drawn as the mixture
holds it. On a central composite design, and for ``result.guide`` and the PSIS diagnostic,
the scales and the other latents are drawn independently from the blocks above (q is a product
of blocks there); their marginals are the grid's.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions.transforms import biject_to

from blrppl.engine.budget import OverBudget
from blrppl.engine.build import model_data, one_exact_block
from blrppl.engine.design import (
    HALF_WIDTH,
    MAX_SCALES,
    ccd_design,
    grid_points,
    grid_spacing,
    marginal_split,
    probe_points,
    split_normal_moments,
    split_scales,
    stretched,
    tilted,
)
from blrppl.engine.loop import NONFINITE, run_loop
from blrppl.engine.prepare import prepare
from blrppl.engine.run import finish
from blrppl.errors import BLRError, FamilyError
from blrppl.graph.data import DataSpec
from blrppl.runtime.compile import jit as _jit
from blrppl.inputs import host_fold_in
from blrppl.posterior.diagnostics import psis_khat
from blrppl.posterior.export import TransformedPosterior
from blrppl.posterior.grid_draws import GridDraws, GridScale, mixture_log_weights
from blrppl.posterior.split_normal import SplitNormal

#: the family name that asks for a site to be integrated on a grid
GRID = "grid"

#: ``grid_fit``'s ``design`` that integrates two scales on the central composite design too
#: (about 25 fits against the product grid's 120–380): the refinement's grid over a model's
#: hyperparameters, tried within its budget (NumPyro's stochastic volatility example: σ and ν
#: in 15 s, means within 0.08 NUTS sd and sds 0.91–1.00×; on the product grid 0.02 and
#: 0.98–1.00× in about 100 s, past the budget)
CCD = "ccd"

#: how often the product grid (one or two scales) may be widened (× 1.5 each time)
WIDENINGS = 3

#: an edge point of the grid above this fraction of the largest weight widens the grid
EDGE_WEIGHT = 1e-3

#: Newton steps that locate the mode of ℓ
NEWTON_STEPS = 4

#: draws of each grid point's fit behind the moment match of a block whose family differs
#: with the scales fixed (:func:`_drawn_stats`)
MIXTURE_DRAWS = 4000

#: PSIS k̂ of q(x | θ*)'s importance weights at the mode up to which the grid reads ℓ from
#: the importance-weighted bound rather than the ELBO
KHAT_RELIABLE = 0.7


def grid_sites(families: dict) -> list:
    """The sites ``families`` asks to integrate on a grid, in its order."""
    return [site for site, name in (families or {}).items() if name == GRID]



def _check_sites(sites, plan, records) -> list:
    """Each grid site's scalar Gaussian block in the plan with the sites as latents, and its
    bijection to the site's support; a :class:`BLRError` naming the site otherwise (their
    number is checked first, by :func:`_check_count`)."""
    out = []
    for site in sites:
        record = records.get(site)
        if record is None or record.observed or getattr(record, "is_param", False):
            raise BLRError(
                f"families={{'{site}': 'grid'}}: '{site}' is not a latent sample site of the model", site=site
            )
        if record.unconstrained_init is None:
            raise BLRError(
                f"families={{'{site}': 'grid'}}: the support of '{site}' depends on other latents, so no one map "
                "to an unconstrained scale serves the grid",
                site=site,
            )
        block = next((b for b in plan.blocks if site in b.sites), None)
        if block is not None and block.sites != (site,) and block.size > 1 and math.prod(record.value_shape) == 1:
            raise BLRError(
                f"families={{'{site}': 'grid'}}: '{site}' is fitted in one block with {len(block.sites) - 1} other "
                "site(s) (structure='joint'?); a grid integrates a scale fitted apart: drop structure='joint'",
                site=site,
            )
        if block is None or block.sites != (site,) or block.size != 1 or block.discrete or not block.family.gaussian:
            raise BLRError(
                f"families={{'{site}': 'grid'}}: only a continuous scalar latent (a scale, a rate, a "
                f"persistence) can be integrated on a grid; '{site}' has {math.prod(record.value_shape)} "
                "scalar(s)" + (" and is discrete" if block is not None and block.discrete else ""),
                site=site,
            )
        if math.prod(record.value_shape) != 1:
            # (a 2 × 2 LKJ Cholesky factor has one free scalar, and its bijection maps a vector of
            # one, not a scalar, to a matrix: numpyro's transform raised an IndexError)
            raise BLRError(
                f"families={{'{site}': 'grid'}}: a grid integrates a latent whose value is one scalar; '{site}' "
                f"has one free scalar but a value of shape {tuple(record.value_shape)} ({record.support}): write the "
                "scalar as its own site (for a 2 × 2 correlation: r ~ Beta(eta, eta), rho = 2 r - 1, the LKJ(eta) "
                "marginal) and put that on the grid",
                site=site,
            )
        out.append((block, biject_to(record.support)))
    return out


def _check_count(sites) -> None:
    """A :class:`BLRError` for more sites than a grid holds (before anything is compiled)."""
    if len(sites) > MAX_SCALES:
        raise BLRError(
            f"families: {len(sites)} sites asked for 'grid' ({', '.join(sites)}); a grid holds at most "
            f"{MAX_SCALES} scales (its fits grow as the square of their number): integrate the main ones"
        )


def _moment_match(family, weights, means):
    """λ of ``family`` whose mean parameters are Σ_k w_k μ_k (``means``: mean parameters, or
    sufficient statistics T(u_k) of points; None where a grid fit failed or was not read):
    the moment match of the mixture Σ_k w_k q_k, or of the weighted points, over the points
    read (their weights renormalised)."""
    total, used = None, 0.0
    for w, mp in zip(weights, means):
        if w == 0.0 or mp is None:
            continue
        mp = jax.tree.map(lambda x: w * np.asarray(x, np.float64), mp)
        total = mp if total is None else jax.tree.map(np.add, total, mp)
        used += w
    total = jax.tree.map(lambda x: x / used, total)  # (the weights of the points read sum to 1)
    dtype = jax.tree.leaves(next(m for m in means if m is not None))[0].dtype
    return _jit(family.nat_from_mean)(jax.tree.map(lambda x: jnp.asarray(x, dtype), total))


class Integration(NamedTuple):
    """The scales' integration points and what they give (:func:`_product_grid`,
    :func:`_central_composite`).

    Attributes:
        us: (K, d) points on the unconstrained scale.
        weights: (K,) normalised weights w_k ∝ Δ_k exp ℓ(u_k) (on a design, tilted to hold
            the marginals' means).
        values: (ℓ(u_k), the fit's natural parameters or None) per point.
        log_volumes: (K,) log of each point's integration weight on u (log Δ_k + log |det R|).
        moments: each scale's (mean, variance) on u.
        marginals: each scale's marginal on u (a numpyro distribution).
        edge_heavy: a product grid whose edge still carries weight after its widenings.
        kind: how the note names the points ("" for a product grid).
        widths: each scale's kernel width on u in a product grid's marginal (empty on a design).
    """

    us: np.ndarray
    weights: np.ndarray
    values: list
    log_volumes: np.ndarray
    moments: list
    marginals: list
    edge_heavy: bool
    kind: str
    widths: tuple = ()


class _Profile:
    """ℓ(u) by fits of the conditioned model, each from the model's starting state (a fit
    started from another grid point's state, its precision fitted to a scale e⁻⁶, did not
    recover at larger scales in float32)."""

    def __init__(self, prepared, args, kwargs, transforms, num_steps, deadline=None):
        self.prepared, self.args, self.kwargs = prepared, args, kwargs
        self.transforms, self.num_steps = transforms, num_steps
        self.fits, self.deadline = 0, deadline

    def thetas(self, u):
        """The scales θ = T(u), as the conditioned model's ``_blr_grid``."""
        dtype = jnp.result_type(float)
        return jnp.stack([t(jnp.asarray(ui, dtype)) for t, ui in zip(self.transforms, np.asarray(u, float))])

    def log_jacobian(self, u) -> float:
        """log |det T'(u)|."""
        dtype = jnp.result_type(float)
        out = 0.0
        for t, ui in zip(self.transforms, np.asarray(u, float)):
            x = jnp.asarray(ui, dtype)
            out += float(t.log_abs_det_jacobian(x, t(x)))
        return out

    def __call__(self, u, weighted: bool = False):
        """(ℓ(u), the fit's natural parameters); with ``weighted``, ℓ from the importance-
        weighted bound of the fit's q (see :meth:`weighted`) in place of its ELBO."""

        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise OverBudget(f"stopped after {self.fits} fits of the grid: over the refinement's time budget")
        log_jac = self.log_jacobian(u)
        grid = self.thetas(u)
        bundle = self.prepared.bundle
        dyn = DataSpec.split(self.args, {**self.kwargs, "_blr_grid": grid})[1]
        data = bundle.run_data(dyn)
        state = self.prepared.state._replace(elbo=jnp.full_like(self.prepared.state.elbo, jnp.nan))
        outcome = run_loop(
            self.prepared.run_chunk, state, data, self.prepared.rho, self.prepared.tol, self.num_steps,
            self.prepared.chunk_size, False, bundle.window,
        )
        self.fits += 1
        last = float(outcome.elbo[-1]) if len(outcome.elbo) else -math.inf
        if not math.isfinite(last) or not math.isfinite(log_jac):
            return -math.inf, None
        if weighted:
            last = self.weighted(outcome.state.nat, data)[0]
        return last + log_jac, outcome.state.nat

    def weighted(self, nat, data):
        """(log (1/S) Σ_s p(y, x_s, θ)/q(x_s), PSIS k̂ of the weights) over the S draws of the
        fit's diagnostics, the same key at every θ (common random numbers: ℓ stays smooth
        in θ). It bounds log p(y, θ) more tightly than the ELBO (Burda et al. 2016), and
        the ELBO's gap, KL(q ‖ p(x | y, θ)), varies with θ: a stochastic volatility's
        grows with its shock size, which biased the shock size's mean down by 0.12 NUTS sd."""
        bundle = self.prepared.bundle
        log_w = np.asarray(bundle.log_weights(nat, model_data(self.prepared.plan, data), jax.random.key(0)), float)
        log_w = log_w[np.isfinite(log_w)]
        if log_w.size == 0:
            return -math.inf, math.inf
        top = np.max(log_w)
        return float(top + np.log(np.mean(np.exp(log_w - top)))), float(psis_khat(log_w))


class _DensityProfile(_Profile):
    """ℓ(u) of a model every latent of which is on the grid: with the scales fixed nothing is
    left to fit, and ℓ(u) = log p(y, T(u)) + log |det T'(u)| is the model's own log density
    (a Gaussian process's kernel parameters: its latent function is marginalised in its
    ``MultivariateNormal``)."""

    def __init__(self, program, args, kwargs, transforms, deadline=None):
        super().__init__(None, args, kwargs, transforms, 0, deadline)
        self.log_density = program.log_density_fn(args, kwargs, "_blr_grid")

    def __call__(self, u, weighted: bool = False):
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise OverBudget(f"stopped after {self.fits} points of the grid: over the refinement's time budget")
        log_jac = self.log_jacobian(u)
        self.fits += 1
        value = float(self.log_density(self.thetas(u)))
        if not (math.isfinite(value) and math.isfinite(log_jac)):
            return -math.inf, None
        return value + log_jac, {}


def _newton(profile, u, scale):
    """The mode of ℓ and −(∇²ℓ)⁻¹ there, by Newton steps on central differences with steps
    of half the current Laplace sds (``scale`` at first)."""
    d = len(u)
    cov = np.diag(np.asarray(scale, float) ** 2)
    for _ in range(NEWTON_STEPS):
        h = 0.5 * np.sqrt(np.diag(cov))
        f0 = profile(u)[0]
        if not math.isfinite(f0):
            raise BLRError("the fit with the grid's scales at their first guess has no finite ELBO")
        grad, hess = np.zeros(d), np.zeros((d, d))
        plus = [profile(u + h[i] * np.eye(d)[i])[0] for i in range(d)]
        minus = [profile(u - h[i] * np.eye(d)[i])[0] for i in range(d)]
        for i in range(d):
            grad[i] = (plus[i] - minus[i]) / (2 * h[i])
            hess[i, i] = (plus[i] - 2 * f0 + minus[i]) / h[i] ** 2
        for i, j in itertools.combinations(range(d), 2):
            both = profile(u + h[i] * np.eye(d)[i] + h[j] * np.eye(d)[j])[0]
            hess[i, j] = hess[j, i] = (both - plus[i] - plus[j] + f0) / (h[i] * h[j])
        if not np.all(np.isfinite(hess)) or np.any(np.linalg.eigvalsh(hess) >= 0):
            # (not concave here: a diagonal of the curvatures' magnitudes, else the last guess)
            diag = np.abs(np.diag(hess))
            hess = -np.diag(np.where(np.isfinite(diag) & (diag > 0), diag, 1.0 / np.diag(cov)))
        cov = np.linalg.inv(-hess)
        step = cov @ grad
        sds = np.sqrt(np.diag(cov))
        step = np.clip(step, -3 * sds, 3 * sds)
        u = u + step
        if np.all(np.abs(step) < 0.05 * sds):
            break
    return u, cov


def grid_fit(program, args, kwargs, options, key, sites, deadline=None, design=None):
    """``blr_fit`` with ``sites`` integrated on a grid (see the module docstring): the model's
    arguments, its checked :class:`blrppl.inputs.FitOptions` and key, the grid's sites;
    ``deadline`` (a ``time.perf_counter()`` value, for the refinement): :class:`OverBudget` is
    raised at the first grid fit past it; ``design``: :data:`CCD` integrates two scales on the
    central composite design as well (None: a product grid up to two scales).

    (Its warnings are issued here, not in a helper: they point at the line that called
    ``blr_fit``.)"""
    _check_count(sites)
    t1 = time.perf_counter()
    families = {s: f for s, f in options.families if f != GRID}
    base = _prepare_as_latents(program, args, kwargs, options, key, sites, families)
    checked = _check_sites(sites, base.plan, base.records)
    if base.plan.subsampled:
        raise BLRError(
            "families='grid' needs the fit's exact ELBO at every grid point; a model with subsampled plates has "
            "only minibatch estimates of it: fit the full data, or the scales as latents",
            site=sites[0],
        )
    outcome = run_loop(
        base.run_chunk, base.state, base.dyn_data, base.rho, base.tol, options.num_steps, base.chunk_size,
        options.progress_bar, base.bundle.window,
    )
    if outcome.stop == NONFINITE or not (len(outcome.elbo) and np.isfinite(outcome.elbo[-1])):
        # (no finite fit to start the grid from: the fit with the scales as latents is returned,
        # with its stop message and warnings, as blr_fit without the grid returns it)
        result = finish(base, outcome, outcome.state.nat, options.num_steps, t1, time.perf_counter())
        listed = ", ".join(repr(s) for s in sites)
        result.message += f"; {listed} not integrated on a grid: the fit with them as latents reached no finite ELBO"
        return result
    profile, mode, cov, weighted = _locate_mode(
        program, args, kwargs, options, key, sites, families, checked, base, outcome, deadline
    )
    # (ℓ the model's own log density, one compiled call a point: a product grid up to three)
    exact = isinstance(profile, _DensityProfile) and len(sites) <= 3
    integrate = _product_grid if exact or len(sites) <= 2 and design != CCD else _central_composite
    points = integrate(profile, mode, cov, weighted, sites)
    weights = points.weights
    nat = dict(outcome.state.nat)
    _match_scales(nat, checked, points.moments)
    if 1.0 / np.sum(weights**2) < 3.0:
        warnings.warn(
            f"blr_fit: the grid of {', '.join(sites)} puts its weight on fewer than 3 of its points (the posterior "
            "is narrower than the curvature at its mode said): its marginal is coarse; compare with NUTS",
            UserWarning,
            stacklevel=3,
        )
    cond_blocks = {b.name: b for b in profile.prepared.plan.blocks} if profile.prepared is not None else {}
    unmatched, drawn = _match_others(nat, base.plan, cond_blocks, checked, weights, [v[1] for v in points.values], key)
    note = _grid_note(sites, points, profile.fits, weighted, drawn, unmatched)
    if points.edge_heavy:
        warnings.warn(
            f"blr_fit: the grid of {', '.join(sites)} still carries weight at its edge after widening it "
            f"{WIDENINGS} times: the posterior of the scales has heavy tails the grid cuts", UserWarning, stacklevel=3,
        )
    t2 = time.perf_counter()
    mixture = None
    if points.widths and profile.prepared is not None:
        mixture = _mixture_weights(base, points, checked, profile.prepared.plan, nat)
    result = finish(base, outcome, nat, options.num_steps, t1, t2, grid=note, grid_weights=mixture)
    result.diagnostics = result.diagnostics._replace(bound=_grid_bound([v[0] for v in points.values], points.log_volumes))
    for site, (_, transform), marginal in zip(sites, checked, points.marginals):
        # (a TransformedPosterior: its mean and variance from draws, as every posterior on an
        # unconstrained space reports them; numpyro's TransformedDistribution has none)
        result.posterior[site] = TransformedPosterior(marginal, transform)
    if points.widths and profile.prepared is not None:
        result.grid_draws = _joint_draws(points, sites, checked, profile.prepared.plan)
    return result


def _point_weights(points: Integration) -> np.ndarray:
    """The grid points' weights, 0 below 10⁻¹² of the largest and where a fit failed."""
    weights = np.where(points.weights > 1e-12 * np.max(points.weights), points.weights, 0.0)
    return np.where([v[1] is not None for v in points.values], weights, 0.0)


def _mixture_weights(base, points: Integration, checked, cond_plan, nat):
    """``(nat, data, key) -> log-weights`` of the product grid's mixture of fits at its draws
    (:func:`blrppl.posterior.grid_draws.mixture_log_weights`), for its PSIS diagnostic; None
    where the mixture is not one of the fit's own blocks (a scale inside a joint block, a block
    of another family or layout with the scales fixed, a chain), or the plan has no density."""
    density = base.bundle.density
    if density is None:
        return None
    scales = {b.name: i for i, (b, _) in enumerate(checked)}
    cond = {c.name: c for c in cond_plan.blocks}
    weights = _point_weights(points)
    nats = [v[1] if w > 0 else None for v, w in zip(points.values, weights)]
    mode = nats[int(np.argmax(weights))]
    scale_blocks, stacked = {}, {}
    for b in density.drawn:
        if b.name in scales:
            if b.members:
                return None
            scale_blocks[b.name] = (scales[b.name], tuple(jnp.shape(b.family.view(nat[b.name]).mean)))
            continue
        c = cond.get(b.name)
        if c is None or b.chain or c.family != b.family or [m.name for m in c.members] != [m.name for m in b.members]:
            return None
        stacked[b.name] = jax.tree.map(lambda *a: jnp.stack(a), *[(n or mode)[b.name] for n in nats])
    if len(scale_blocks) != len(scales):
        return None
    dtype = jnp.result_type(float)
    with np.errstate(divide="ignore"):
        log_w = jnp.asarray(np.log(weights / weights.sum()), dtype)
    mix = (stacked, log_w, jnp.asarray(points.us, dtype), jnp.asarray(points.widths, dtype))
    fn = _jit(mixture_log_weights(density, scale_blocks))
    return lambda fit_nat, data, key: fn(mix, fit_nat, data, key)


def _joint_draws(points: Integration, sites, checked, cond_plan) -> GridDraws:
    """The mixture of a product grid's fits for ``result.sample``
    (:mod:`blrppl.posterior.grid_draws`): the scales' points and kernel widths, and every block
    the fits with the scales fixed hold as one continuous, non-local posterior, with its natural
    parameters at each point of weight (points below 10⁻¹² of the largest are dropped)."""
    nats = [v[1] for v in points.values]
    weights = _point_weights(points)
    scales = tuple(
        GridScale(site, np.asarray(points.us[:, i], float), float(points.widths[i]), transform)
        for i, (site, (_, transform)) in enumerate(zip(sites, checked))
    )
    blocks = tuple(
        (b, [n[b.name] if n is not None and w > 0 else None for n, w in zip(nats, weights)])
        for b in cond_plan.blocks
        if not (b.discrete or b.point or b.param or b.chain or b.local is not None)
    )
    return GridDraws(weights / weights.sum(), scales, blocks)


def _grid_bound(logp, log_volumes) -> float:
    """log ∫ exp ℓ(u) du ≈ log Σ_k Δ_k exp ℓ(u_k) (``log_volumes``: log Δ_k on u; a product
    grid's point is the centre of a cell of volume spacing^d · |det Λ^{1/2}|): the grid's
    estimate of log p(y), from its fits' bounds (each ≤ log p(y, θ)), comparable with a fit's
    importance-weighted bound."""
    terms = np.asarray(logp, float) + np.asarray(log_volumes, float)
    terms = terms[np.isfinite(terms)]
    top = np.max(terms)
    return float(top + np.log(np.sum(np.exp(terms - top))))


def _prepare_as_latents(program, args, kwargs, options, key, sites, families):
    """The fit of the model with the scales as latents, each in a block of its own: its plan
    and its families are the result's, its fit the grid's first guess."""
    as_latents = {**families, **{s: "gaussian" for s in sites}}
    base_options = dataclasses.replace(options, families=tuple(sorted(as_latents.items())))
    try:
        return prepare(program, args, kwargs, base_options, key)
    except FamilyError as err:
        if err.site in sites and "cannot represent" in str(err):  # (the Gaussian asked for here)
            raise BLRError(
                f"families={{'{err.site}': 'grid'}}: only a continuous scalar latent (a scale, a rate, a "
                f"persistence) can be integrated on a grid; '{err.site}' is not one",
                site=err.site,
            ) from None
        raise


def _locate_mode(program, args, kwargs, options, key, sites, families, checked, base, outcome, deadline=None):
    """``(profile, mode, cov, weighted)``: the profile ℓ of the model with the scales fixed
    (one compiled fit, run at every grid point), its mode and curvature located by Newton
    steps from the fit with the scales as latents (``outcome``), and whether ℓ reads the
    importance-weighted bound."""
    views = [b.family.view(outcome.state.nat[b.name]) for b, _ in checked]
    u0 = np.array([float(np.ravel(v.mean)[0]) for v in views])
    sd0 = np.array([math.sqrt(float(np.ravel(b.family.marginal_variance(v))[0])) for (b, _), v in zip(checked, views)])
    cond_options = dataclasses.replace(options, families=tuple(sorted(families.items())))
    cond_kwargs = {**kwargs, "_blr_grid": np.asarray([t(jnp.asarray(x)) for (_, t), x in zip(checked, u0)])}
    if not any(b.name not in sites and not b.param for b in base.plan.blocks):
        # (every latent on the grid: ℓ is the model's log density, no fit at the points)
        profile = _DensityProfile(program.conditioned(sites), args, kwargs, [t for _, t in checked], deadline)
        mode, cov = _newton(profile, u0, np.maximum(2.0 * sd0, 1e-3))
        return profile, mode, cov, False
    cond = prepare(program.conditioned(sites), args, cond_kwargs, cond_options, key)
    if cond.data_spec.all_static:
        raise BLRError(
            "families='grid' needs a model that reads its data as arrays: this one uses them as concrete "
            "values (np.asarray or Python control flow on them), so each grid point would compile anew",
            site=sites[0],
        )
    profile = _Profile(cond, args, kwargs, [t for _, t in checked], options.num_steps, deadline)
    mode, cov = _newton(profile, u0, np.maximum(2.0 * sd0, 1e-3))
    # the importance-weighted bound where q's weights are reliable at the mode (PSIS k̂ ≤
    # 0.7). Not where q(x | θ) is exact (the fit with the scales fixed has one conjugate
    # block, solved in closed form): its weights are all equal and the bound is the ELBO,
    # drawn for nothing (23 of the 29 s of a 121-point grid of NumPyro's baseball pool)
    weighted = False
    exact = len(cond.plan.blocks) == 1 and one_exact_block(cond.plan) is not None
    if not exact and base.bundle.log_weights_fn is not None and cond.bundle.log_weights_fn is not None:
        at_mode = profile(mode)[1]
        if at_mode is not None:
            dyn = DataSpec.split(args, {**kwargs, "_blr_grid": profile.thetas(mode)})[1]
            weighted = profile.weighted(at_mode, cond.bundle.run_data(dyn))[1] <= KHAT_RELIABLE
    return profile, mode, cov, weighted


def _evaluate_grid(profile, mode, cov, weighted, sites):
    """``(points, weights, profile values, edge mask, half-width)`` of the grid around the
    mode, widened (× 1.5, at most :data:`WIDENINGS` times) while its edge carries weight."""
    evals, vals = np.linalg.eigh(cov)
    root = vals * np.sqrt(np.maximum(evals, 0.0))
    half = HALF_WIDTH
    for widening in range(WIDENINGS + 1):
        zs = grid_points(len(sites), half)
        us = mode + zs @ root.T
        values = [profile(u, weighted) for u in us]
        logp = np.array([v[0] for v in values])
        if not np.any(np.isfinite(logp)):
            raise BLRError(f"no fit on the grid of {', '.join(sites)} has a finite ELBO", site=sites[0])
        weights = np.exp(logp - np.max(logp))
        edge = np.max(np.abs(zs), axis=1) >= np.max(np.abs(zs)) - 1e-9
        if np.max(weights[edge]) <= EDGE_WEIGHT or widening == WIDENINGS:
            break
        half *= 1.5
    return us, weights / weights.sum(), values, edge, half


def _product_grid(profile, mode, cov, weighted, sites) -> Integration:
    """The :class:`Integration` of one or two scales on a product grid (:func:`_evaluate_grid`):
    each scale's marginal Σ_k w_k N(u_k, width²), width an eighth of the grid's spacing."""
    us, weights, values, edge, half = _evaluate_grid(profile, mode, cov, weighted, sites)
    d = len(sites)
    spacing = grid_spacing(d, half)  # (in Laplace sds)
    widths = [spacing * math.sqrt(cov[i, i]) / 8 for i in range(d)]
    moments = []
    for i in range(d):
        mean = float(np.sum(weights * us[:, i]))
        moments.append((mean, float(np.sum(weights * (us[:, i] - mean) ** 2)) + widths[i] ** 2))
    marginals = [_grid_marginal(us[:, i], weights, widths[i]) for i in range(d)]
    log_volume = d * math.log(spacing) + 0.5 * float(np.linalg.slogdet(cov)[1])
    heavy = bool(np.max(weights[edge]) > EDGE_WEIGHT * np.max(weights))
    return Integration(us, weights, values, np.full(len(us), log_volume), moments, marginals, heavy, "", tuple(widths))


def _central_composite(profile, mode, cov, weighted, sites) -> Integration:
    """The :class:`Integration` of three or more scales on a central composite design
    (:func:`blrppl.engine.design.ccd_design`) stretched on each side of the mode by ℓ's
    spreads there (:func:`blrppl.engine.design.stretched`, read at 2d probes first):
    w_k ∝ Δ_k exp ℓ(u_k), and each scale's marginal the split normal of
    :func:`blrppl.engine.design.marginal_split`."""
    d = len(sites)
    evals, vecs = np.linalg.eigh(cov)
    root = vecs * np.sqrt(np.maximum(evals, 0.0))
    centre = profile(mode, weighted)
    if not math.isfinite(centre[0]):
        raise BLRError(f"the fit with {', '.join(sites)} fixed at their mode has no finite ELBO", site=sites[0])
    spreads = split_scales(centre[0], [profile(u, weighted)[0] for u in mode + probe_points(d) @ root.T])
    zs, log_delta = stretched(*ccd_design(d)[:2], spreads)
    us = mode + zs @ root.T
    values = [centre] + [profile(u, weighted) for u in us[1:]]  # (the centre, z = 0, first)
    log_w = np.array([v[0] for v in values]) + log_delta
    weights = np.exp(log_w - np.max(log_w))
    sides = marginal_split(root, spreads)
    moments = [split_normal_moments(float(mode[i]), *sides[i]) for i in range(d)]
    weights = tilted(weights / weights.sum(), us, [m for m, _ in moments])
    dtype = jnp.result_type(float)
    marginals = [SplitNormal(jnp.asarray(mode[i], dtype), jnp.asarray(sides[i, 0], dtype), jnp.asarray(sides[i, 1], dtype))
                 for i in range(d)]
    log_volumes = log_delta + 0.5 * float(np.linalg.slogdet(cov)[1])
    return Integration(us, weights / weights.sum(), values, log_volumes, moments, marginals, False,
                       "a central composite design")


def _match_scales(nat, checked, moments) -> None:
    """Set each scale's block in ``nat`` to the Gaussian of its marginal's mean and variance
    on u (``moments``), as the moment match of the two points mean ± sd."""
    for (block, _), (mean, var) in zip(checked, moments):
        shape = jnp.shape(jax.tree.leaves(nat[block.name])[0])  # (the mean's: η₁ = S m)
        sd = math.sqrt(max(var, 0.0))
        stats = [block.family.sufficient_stats(jnp.full(shape, mean + sign * sd, jnp.result_type(float)))
                 for sign in (-1.0, 1.0)]
        nat[block.name] = _moment_match(block.family, [0.5, 0.5], stats)


def _match_others(nat, plan, cond_blocks, checked, weights, nats, key) -> tuple:
    """Set every other block of ``plan`` in ``nat`` from the grid points' fits ``nats`` (see
    the module docstring); returns ``(unmatched, drawn)``, the blocks that report the fit
    with the scales as latents and those moment-matched from draws."""
    mode_nat = nats[int(np.argmax(weights))]
    unmatched, drawn = [], []
    for b in plan.blocks:
        if any(b is c for c, _ in checked):
            continue
        c = cond_blocks.get(b.name)
        if c is not None and c.family != b.family and _drawable(b) and _drawable(c):
            try:
                nat[b.name] = _moment_match(b.family, weights, _drawn_stats(b, c, weights, nats, key))
                drawn.append(b.name)
                continue
            except NotImplementedError:  # (a family without a map from mean parameters)
                pass
        if c is None or c.family != b.family:
            unmatched.append(b.name)
        elif b.param or b.point:
            nat[b.name] = mode_nat[b.name]  # (a point estimate: the most probable grid point's)
        else:
            try:
                # (compiled once for the grid: run op by op, a banded block's passes compiled
                # their scans anew at each point, 0.1 s a point, 13 s of a 121-point grid)
                mean_params = _jit(b.family.mean_params)
                means = [mean_params(n[b.name]) if n is not None and w > 0 else None for w, n in zip(weights, nats)]
                nat[b.name] = _moment_match(b.family, weights, means)
            except NotImplementedError:  # (a family without a map from mean parameters)
                nat[b.name] = mode_nat[b.name]
    return unmatched, drawn


def _grid_note(sites, points, fits, weighted, drawn, unmatched) -> str:
    """The result message's note of the scales integrated on a grid."""
    d = len(sites)
    spread = ", ".join(f"'{s}' {m:.4g} ± {math.sqrt(max(v, 0.0)):.3g}" for s, (m, v) in zip(sites, points.moments))
    kind = f", {points.kind}," if points.kind else ""
    note = (
        f"{', '.join(repr(s) for s in sites)} integrated on a grid of {len(points.us)} points{kind} ({fits} fits with "
        f"{'it' if d == 1 else 'them'} fixed, read by their {'importance-weighted bounds' if weighted else 'ELBOs'}; "
        f"on the unconstrained scale {spread})"
    )
    if drawn:
        note += (
            f"; the blocks {', '.join(drawn)} take other families with the scales fixed: their mixture over the grid "
            f"is moment-matched in the families of the fit with the scales as latents, from {MIXTURE_DRAWS:,} draws "
            "of each grid fit"
        )
    if unmatched:
        note += (
            f"; the blocks {', '.join(unmatched)} differ with the scales fixed and report the fit with them as latents"
        )
    return note


def _drawable(block) -> bool:
    """A block whose draws map one to one onto its site's values: one site (no joint or
    chain layout), continuous, not a point estimate, not local to a subsampled plate."""
    return not (block.members or block.discrete or block.point or block.local is not None)


def _drawn_stats(b, c, weights, nats, key) -> list:
    """E_{q_k}[T_b(u)] at every grid point k whose weight is above 10⁻⁹ of the largest (None
    elsewhere), for a site fitted in block ``b``'s family with the scales as latents and in
    block ``c``'s, another, with them fixed (a pooled Beta's latents: a Gaussian on their
    logits with the scales as latents, Beta with them fixed, conjugate):
    :data:`MIXTURE_DRAWS` draws of each fit q_k
    (the same key at every point: common random numbers), mapped to the site's values and
    from them to ``b``'s space, where ``b``'s sufficient statistics T_b are averaged."""

    def stats(nat, key):
        x = c.to_site(c.family.sample(nat, key, (MIXTURE_DRAWS,)))
        x = c.transform(x) if c.transform is not None else x
        u = b.transform.inv(x) if b.transform is not None else x
        return jax.tree.map(lambda t: jnp.mean(t, axis=0), b.family.sufficient_stats(b.to_canonical(u)))

    stats = _jit(stats)
    key = host_fold_in(key, 11)
    # (points below 10⁻⁹ of the largest weight move no moment: not drawn)
    keep = weights > 1e-9 * np.max(weights)
    return [stats(n[c.name], key) if n is not None and k else None for k, n in zip(keep, nats)]


def _grid_marginal(u, weights, width: float):
    """A scale's marginal posterior on the unconstrained scale from a product grid:
    Σ_k w_k N(u_k, width²) (an eighth of the grid's spacing as the kernel's sd: u's variance
    grows by 1/64 of a spacing², 0.1 % of a 1-D grid's sd², 1 % of a 2-D one's)."""
    keep = weights > 1e-12 * np.max(weights)
    dtype = jnp.result_type(float)
    return dist.MixtureSameFamily(
        dist.Categorical(probs=jnp.asarray(weights[keep] / weights[keep].sum(), dtype)),
        dist.Normal(jnp.asarray(u[keep], dtype), jnp.asarray(width, dtype)),
    )
