"""Refinement by default: a fit whose own diagnostics say q is poor tries the remedies its
advice names and keeps the best candidate (``blr_fit(..., refine=True)``, the default).

The remedies are those :func:`blrppl.engine.advice.poor_q_advice` names for the plan
(:func:`blrppl.engine.advice.named_remedies`): a grid where it names a funnel (a funnel's advice
says no structure holds it), a grid over the scalar sites the narrow-q check flags
(:mod:`blrppl.posterior.narrow`: the widest, as many as :data:`blrppl.engine.grid.MAX_SCALES`)
with another structure and more starts, another structure and more starts where its advice is
the generic one, and nothing where it says to compare with NUTS (a product of blocks, as in a factor model,
whose symmetries no start or structure removes: the other structure cost a factor model's online
update 40 s against its first fit's 0.9 s; a Monte Carlo factor's spread; closed-form factors).

When the first fit converged and its PSIS k̂, importance ESS or narrow-q check says q is poor (:meth:`Diagnostics.poor
<blrppl.posterior.diagnostics.Diagnostics.poor>`, the test behind the "q may be a poor
approximation" warning), :func:`refine` fits candidates that each change one thing, in this
order:

* all the model's constrained scalar latents (its hyperparameters, :func:`hyperparameters`) on
  one grid, a central composite design, where they are more than the grid below names and a
  grid holds them;
* the funnel scales and the narrow sites the advice names integrated on a grid
  (``families={"tau": "grid"}``, :mod:`blrppl.engine.grid`): INLA's scheme, which turns
  centred eight schools exact;
* the other structure: ``structure="joint"`` when the plan fits several dense Gaussian
  blocks apart (a joint block is not split: mean-field is a restriction of it, its optimum no
  closer to the posterior);
* an over-dispersed start: the fit started from a draw of the first fit's q with its spread
  widened :data:`OVERDISPERSION` times on the unconstrained scale (a start far from the
  first fit's mode, where another mode may lie that PSIS cannot see from q's draws);
* more starts: the starts ``num_starts=4`` would add (another key; for enumerated latents,
  k-means++ seeds);
* a mixture of :data:`MIXTURE_COMPONENTS` Gaussians (:mod:`blrppl.engine.mixture`) over the
  sites the diagnostics point at (:func:`mixture_candidates`): where the advice names more
  starts, the posterior may have several modes, which one Gaussian misses whichever start it
  takes; the mixture's fit computes its own k̂ and bound, by which it is ranked like the rest.

A start that finds the first fit's optimum again (:func:`same_optimum`) while no start has
found another ends the starts, and the mixture too unless the first fit points at mass q
misses (k̂ ≥ 1, or sites the narrow-q check flags); a converged candidate whose own
diagnostics are no longer poor ends the refinement (the question that started it is
answered): :func:`skip_reason`; those are listed with a ``"not run: ..."`` note.

A remedy that would override an option the user gave is not tried (``structure=`` given, a
scale already in ``families=``, ``num_starts`` > 1, ``prior=``, scales already on a grid, or a
mixture asked).

A candidate that did not converge ranks below every one that did (the first fit did). Each
candidate is then ranked by its importance-weighted bound (``Diagnostics.bound``, an estimate
of log p(y) from below; for a grid, the quadrature of its fits' bounds), less two of its Monte
Carlo standard errors (√((1/ESS − 1)/S) for S draws of relative ESS, the delta method's error
of a log-mean), and candidates whose bound is reliable come first: k̂ ≤ 0.7 (where the
weights' variance is finite: Vehtari et al. 2024), or a grid, whose bound is a quadrature
of fits with the scales fixed rather than draws of its product q. The first fit is kept
unless a candidate ranks above it.

The refinement is bounded by ``refine_budget`` (default 5: :data:`blrppl.inputs.REFINE_BUDGET`,
which says why) times the first fit's time T, T counted as at least :data:`MIN_UNIT` (6 s: a fit
from the cache skips the compilation its remedies pay): a candidate is started only while the
time the refinement has spent plus its expected cost (:func:`expected_cost`: a start reruns the
first fit's steps, a mixture :data:`MIXTURE_COMPONENTS` times them, anything else costs T) is at
most that budget (one past it is passed over, and a cheaper one after it may start), and a
grid, whose fits are many, stops at the budget's end (the random walk reference's two scales
took 590 s against a first fit of 6 s), and so does a single fit (another structure or start),
after its compilation, at its loop's chunk boundaries and before its diagnostics
(:mod:`blrppl.engine.budget`): a candidate cut so is reported with its note, not ranked. No
candidate run (no remedy applies, or a budget below 1): the first fit, with no refinements.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.engine.advice import named_remedies
from blrppl.engine.budget import OverBudget
from blrppl.engine.grid import CCD, MAX_SCALES
from blrppl.inputs import host_fold_in
from blrppl.posterior.diagnostics import KHAT_WARN

#: the over-dispersed start is a draw of q with its spread widened this many times (on the
#: unconstrained scale of every Gaussian block)
OVERDISPERSION = 3.0

#: the starts tried beyond the first (``num_starts=4``'s)
EXTRA_STARTS = 3

#: the components of the mixture the refinement tries: a bimodal scalar's two modes held with
#: components to spare for the mass between them, which the importance weights' k̂ reads
#: (y ~ N(θ², 1) at y = 4, float64, two keys: k̂ 1.44 and 1.53 with K = 4, 0.36 and 0.70 with
#: K = 8, both under 1.3 times K = 4's time; at y = 2, 2.3 and 2.4 against −0.98 and 0.00)
MIXTURE_COMPONENTS = 8

#: the most scalars the refinement's mixture covers (its steps draw K × 16 of the model's
#: gradients over them, and its diagonal components, without ``structure="joint"``, hold none
#: of their correlations)
MIXTURE_MAX_DIM = 100

#: the remedies a :class:`Candidate` tries
GRID, STRUCTURE, START, MIXTURE = "grid", "structure", "start", "mixture"

#: what a start found (:func:`refine`): the first fit's optimum (:func:`same_optimum`), or another;
#: and that a candidate passed the diagnostics that started the refinement
SAME, OTHER, PASSED = "same optimum", "other optimum", "passed"

#: two optima are one where their q's means differ by less than this many of the first fit's
#: sds along every coordinate of its Gaussian blocks: an even mixture of two Gaussians of one
#: sd is unimodal while their means are at most two sds apart
SAME_OPTIMUM_SDS = 2.0

#: seconds a first fit counts for at least in the budget: a first fit whose programs came from
#: the cache skips its compilation, and its remedies' fits compile theirs (NumPyro's logit
#: baseball model: a first fit of 3.9 s compiling and 0.9–1.6 s from the cache, its grid 15.7 s
#: either way, kept on a cold cache and cut on a warm one before this floor)
MIN_UNIT = 6.0


class Refinement(NamedTuple):
    """One fit the refinement compared (``result.refinements``).

    Attributes:
        change: what it changed from the fit as asked (``"as asked"`` for the first fit).
        khat: its PSIS k̂.
        bound: its importance-weighted bound (``Diagnostics.bound``).
        time: seconds it took.
        kept: whether it is the result returned.
        note: why it has no result (an error), or empty.
    """

    change: str
    khat: float
    bound: float
    time: float
    kept: bool = False
    note: str = ""


class Candidate(NamedTuple):
    """A fit to try: what it changes, its options, key, starting values and start number."""

    change: str
    options: object
    key: object
    init_values: dict | None = None
    start: int = 0
    #: a grid's design (:func:`blrppl.engine.grid.grid_fit`; None: its default)
    design: str | None = None
    #: the sites a grid candidate integrates (a grid over a subset of a fitted grid's is not tried)
    grid_sites: tuple = ()
    #: the remedy it tries (:data:`GRID`, :data:`STRUCTURE`, :data:`START`, :data:`MIXTURE`): the
    #: refinement stops a remedy once it is answered, and reads its expected cost by it
    remedy: str = ""


def candidates(first, options, key, grid_asked: bool) -> list:
    """The :class:`Candidate` fits of the remedies the first fit's advice names (see the module
    docstring), in the order they are tried."""
    plan, out = first.plan, []
    families = options.families_dict
    scales, generic = named_remedies(plan, first.diagnostics.narrow)
    # (the scales the user gave a family keep it; a grid holds at most MAX_SCALES, the widest
    # narrow sites first)
    scales = tuple(s for s in scales if s not in families)[:MAX_SCALES]
    hyper = hyperparameters(plan)
    grids = [scales] if scales else []
    if len(hyper) > 1 and set(hyper) > set(scales) and len(hyper) <= MAX_SCALES and (scales or generic):
        # (first: on its design it costs fewer fits than the funnel's product grid, and holds
        # the funnel's scales too)
        grids.insert(0, hyper)
    for sites in grids:
        if grid_asked or set(sites) & set(families):
            continue
        grid = {**families, **{s: "grid" for s in sites}}
        change = "families={" + ", ".join(f"'{s}': 'grid'" for s in sites) + "}"
        # (the hyperparameters' grid on the central composite design: a product grid of two
        # costs 5–15 times as many fits, past the budget)
        design = CCD if sites is hyper else None
        fit_options = dataclasses.replace(options, families=tuple(sorted(grid.items())), num_starts=1)
        out.append(
            Candidate(change + (" (the hyperparameters)" if design else ""), fit_options, key, design=design,
                      grid_sites=tuple(sites), remedy=GRID)
        )
    if options.structure is None and generic and not grid_asked:
        # (only the joint block, which holds what blocks apart drop; a joint block is not split:
        # mean-field is a restriction of it, so its optimum is no closer to the posterior.
        # NumPyro's semi-supervised HMM, one joint block: mean-field k̂ 1.46 against 0.77; the
        # LKJ varying slopes: k̂ 1.01 and means 0.48 NUTS sd off against 0.94 and 0.08)
        dense = [b for b in plan.blocks if b.family.dense_event and not b.point]
        if len(dense) > 1:
            out.append(Candidate("structure='joint'", dataclasses.replace(options, structure="joint"), key,
                                 remedy=STRUCTURE))
    if options.num_starts == 1 and generic and not grid_asked:
        try:
            values = overdispersed_values(first.plan, first.nat, host_fold_in(key, 101))
        except Exception:  # (a family that cannot be drawn so: that start is not offered)
            values = {}
        if values:
            out.append(Candidate(f"an over-dispersed start (q's spread × {OVERDISPERSION:g})", options, key, values,
                                 remedy=START))
        out.extend(
            Candidate(f"start {k} of num_starts={EXTRA_STARTS + 1}", options, host_fold_in(key, k), None, k,
                      remedy=START)
            for k in range(1, EXTRA_STARTS + 1)
        )
        out.extend(mixture_candidates(first, options, key))
    return out


def mixture_candidates(first, options, key) -> list:
    """The Gaussian mixture of :data:`MIXTURE_COMPONENTS` components (:mod:`blrppl.engine.mixture`)
    over the sites the diagnostics point at, as one :class:`Candidate` (or none).

    :func:`candidates` asks it only where the advice names more starts (a Gaussian q finds one
    mode), not where a grid is its only remedy (a funnel) nor where it says to compare with NUTS
    (a product of blocks, whose modes are symmetric copies with the same predictions; a network's
    IVON blocks). The sites: those the narrow-q check flags (the posterior wider than q along
    them: what a second mode beside q's gives, as for θ with y ~ N(θ², 1)), else, q being poor
    with no scalar flagged (the check reads scalar sites only), every site of the plan's global
    Gaussian blocks, while they hold at most :data:`MIXTURE_MAX_DIM` scalars in all. Sites the
    user gave a family keep it."""
    plan, families = first.plan, options.families_dict
    eligible = mixture_sites(plan, families)
    narrow = [w.site for w in (first.diagnostics.narrow or ()) if w.site in eligible]
    sites = tuple(dict.fromkeys(narrow)) or tuple(eligible)
    size = sum(b.size for b in {id(eligible[s]): eligible[s] for s in sites}.values())
    if not sites or size > MIXTURE_MAX_DIM or options.mixtures:
        return []
    # (by default each site keeps the first fit's block, which the mixture then contains,
    # blrppl.engine.mixture; with structure= the structure's Gaussian)
    family = {None: None, "joint": "gaussian"}.get(options.structure, "gaussian-diag")
    asked = {s: family for s in sites} if family is not None else {}
    fit_options = dataclasses.replace(
        options,
        families=tuple(sorted({**families, **asked}.items())),
        mixtures=tuple(sorted((s, MIXTURE_COMPONENTS) for s in sites)),
    )
    change = "families={" + ", ".join(f"'{s}': ('gaussian-mixture', {MIXTURE_COMPONENTS})" for s in sites) + "}"
    return [Candidate(change, fit_options, key, remedy=MIXTURE)]


def mixture_sites(plan, families=()) -> dict:
    """Site → its block, for every site of the plan's global Gaussian blocks a mixture can
    start from (unstructured, drawn, not a point, a chain's or IVON's), those the user gave a
    family (``families``) left out."""
    return {
        s: b for b in plan.blocks
        if b.family.gaussian and not (b.discrete or b.point or b.param or b.chain or b.family.reparam_curvature)
        and b.local is None and not b.family.banded and not b.family.arrowhead
        for s in (b.sites or (b.name,)) if s not in families
    }


def hyperparameters(plan) -> tuple:
    """The scalar latents with a constrained support (alone or in a joint block, not a chain's
    steps), in plan order: a model's scales, rates, degrees of freedom, persistences, what INLA
    integrates on a grid (its θ; Rue, Martino & Chopin 2009), and not its real-valued latents,
    which with the θ fixed are part of the Gaussian field q holds well (eight schools' μ: with it
    on the grid beside τ, the coarser 2-D grid put τ's mean 0.15 NUTS sd off, against 0.02). A
    grid over all of them (where a grid holds that many, ``grid.MAX_SCALES``) is tried after
    the funnel's scales: NumPyro's stochastic volatility example has its shocks' scale σ, a
    funnel's, and the returns' degrees of freedom ν, whose sd stayed 0.44× NUTS's with σ alone
    on a grid, and 1.0× with both."""
    return tuple(
        m.name for b in plan.blocks
        if not (b.discrete or b.point or b.param or b.chain) and b.local is None and b.family.gaussian
        for m in (b.members or (b,))
        # (a value of one scalar: a 2 × 2 LKJ Cholesky factor has one free scalar but a matrix value)
        if m.size == 1 and m.transform is not None
        and math.prod(m.value_shape if m.site_shape is None else m.site_shape) == 1
    )


def overdispersed_values(plan, nat, key) -> dict:
    """Site → a starting value (constrained) for every latent in a Gaussian block: a draw x of
    q moved to m + :data:`OVERDISPERSION` · (x − m) (m: q's mean) on the block's unconstrained
    space; sites whose value is not finite there are left to the model's start."""
    blocks = [
        (i, b) for i, b in enumerate(plan.blocks)
        if not (b.discrete or b.point or not b.family.gaussian or b.local is not None or b.name not in nat)
    ]

    def values(block_nat, key):
        out = {}
        for i, b in blocks:
            x = b.family.sample(block_nat[b.name], jax.random.fold_in(key, i))
            m = b.family.view(block_nat[b.name]).mean
            u = m + OVERDISPERSION * (x - m)
            parts = b.split(u) if b.members else {b.name: b.to_site(u)}
            for member in b.members or (b,):
                value = parts[member.name]
                out[member.name] = member.transform(value) if member.transform is not None else value
        return out

    # (one compiled program: op by op, the draw, the split and the transforms of the semi-supervised
    # HMM's 33 scalars took 1–2.7 s of dispatch and compilation, a third of a step's run)
    drawn = jax.jit(values)({b.name: nat[b.name] for _, b in blocks}, key)
    out = {}
    for name, value in drawn.items():
        value = np.asarray(value, dtype=float)
        if np.all(np.isfinite(value)):
            out[name] = value
    return out


#: PSIS k̂ at and above which the importance ratios have no finite mean (Vehtari et al. 2024):
#: the importance-weighted bound of such a candidate is no estimate at all
KHAT_NO_MEAN = 1.0


def _rank(entry: Refinement, grid: bool) -> tuple:
    """Sort key of a fitted candidate: (its bound is reliable, its bound has a finite mean,
    its bound less two standard errors); larger is better. (NumPyro's semi-supervised HMM:
    the mean-field candidate, k̂ 1.46, showed a bound 1.4 nats above the first fit's, k̂ 0.77,
    and was kept: its means 0.31 NUTS sd off and sds 0.65–0.89× against 0.12 sd and
    0.89–1.34×.)"""
    reliable = grid or entry.khat <= KHAT_WARN
    bound = entry.bound if not math.isnan(entry.bound) else -math.inf
    return (reliable, grid or entry.khat < KHAT_NO_MEAN, bound)


def bound_se(d) -> float:
    """The Monte Carlo standard error of the importance-weighted bound of diagnostics ``d``:
    √((1/ESS − 1)/S) for S draws of relative ESS (0 where it cannot be read)."""
    if d.num_draws and not math.isnan(d.ess) and d.ess > 0:
        return math.sqrt(max(1.0 / d.ess - 1.0, 0.0) / d.num_draws)
    return 0.0


def _lower_bound(result, grid: bool = False) -> float:
    """The candidate's bound less two of its Monte Carlo standard errors (none for a grid's
    quadrature, whose ``ess`` is its product q's draws', nor for weights that are all equal)."""
    d = result.diagnostics
    if math.isnan(d.bound) or grid:
        return d.bound
    return d.bound - 2.0 * bound_se(d)


#: the note of a candidate the refinement did not run (:func:`skip_reason`)
NOT_RUN = "not run: "


def skip_reason(cand: Candidate, answered: set, first) -> str:
    """Why ``cand`` is not run, given what the candidates fitted so far found (``answered``:
    :data:`SAME`, :data:`OTHER`, :data:`PASSED`), or ''.

    A start found the first fit's optimum again (:func:`same_optimum`; the over-dispersed
    start, begun :data:`OVERDISPERSION` times q's spread away, is tried first) and none found
    another: the other starts are not run, nor the mixture, whose components would sit at that
    one optimum, unless the first fit points at mass q misses (its k̂ at least :data:`KHAT_NO_MEAN`, or
    sites the narrow-q check flags). NumPyro's semi-supervised HMM: its three more starts cost
    2.1× its first fit and the mixture 2.5× before the budget cut it, the starts' k̂ 0.75–0.86
    and bounds within 0.5 nats of its 0.77; the four-mode θ² model's first fit has k̂
    1.02, and its mixture is kept.

    A candidate already fitted passed the diagnostics (:data:`PASSED`: converged, and its k̂,
    importance ESS and narrow-q check no longer poor; a start back at the first fit's optimum
    does not count, its k̂ being the first fit's on other draws): no other candidate is run. Eight schools
    with ``LocScaleReparam``: the grid over τ took its k̂ from 0.62 to 0.06, and the mixture
    tried after it ran 20 s to the budget's end, against the grid's 11 s and NUTS's 7 s."""
    if PASSED in answered:
        return "a fit before it passed the diagnostics (k-hat, importance ESS, narrow-q check)"
    if answered != {SAME} or cand.remedy not in (START, MIXTURE):
        return ""
    if cand.remedy == START:
        return "a start found the first fit's optimum again"
    d = first.diagnostics
    if d.khat >= KHAT_NO_MEAN or d.narrow:
        return ""
    return "the starts found one optimum, and the first fit's k-hat (< 1) and narrow-q check point at no mass q misses"


def expected_cost(cand: Candidate, first, first_time: float) -> float:
    """The seconds ``cand`` is expected to take, by what it reruns of the first fit (its
    ``compile_time`` and ``run_time``; ``first_time`` its whole time): a start reuses the
    compiled fit and reruns its steps; a mixture compiles its own steps and takes at least
    :data:`MIXTURE_COMPONENTS` times the first fit's steps' time (its steps draw K × 16 of the
    model's gradients: the LKJ varying slopes' took 11.5 times, the semi-supervised HMM's more
    than 3 times, cut by the budget); any other candidate a first fit's time."""
    compile_time, run_time = getattr(first, "compile_time", None), getattr(first, "run_time", None)
    if not isinstance(run_time, float) or not isinstance(compile_time, float):
        return first_time
    run = max(first_time - compile_time, run_time)  # (the diagnostics and export included)
    if cand.remedy == START:
        return run
    if cand.remedy == MIXTURE:
        return compile_time + MIXTURE_COMPONENTS * run
    return first_time


def same_optimum(first, other) -> bool:
    """Whether ``other`` (a fit of the first fit's plan from another start) found the first
    fit's optimum: the means of every global Gaussian block within :data:`SAME_OPTIMUM_SDS` of
    either fit's marginal sds along every coordinate (on the unconstrained scale; a wide q
    between two modes and a narrow one at either are two optima), and their
    importance-weighted bounds within two standard errors of their difference (a start that
    settled at a worse optimum shows there are several: the θ² model with two modes per
    coordinate, started 3 q sds out, settled 1.6–1.7 nats below the first fit with means within
    its sds). False where no block can be compared so."""
    names = [
        b.name for b in first.plan.blocks
        if b.family.gaussian and not (b.discrete or b.point) and b.local is None and b.name in first.nat
    ]
    again = getattr(other, "nat", {})
    if not names or any(n not in again for n in names):
        return False
    gap = abs(other.diagnostics.bound - first.diagnostics.bound)
    if not gap <= 2.0 * math.hypot(bound_se(first.diagnostics), bound_se(other.diagnostics)):
        return False

    def gaps(nat, nat_again):
        out = {}
        for n in names:
            family = first.plan.block(n).family
            view, moved = family.view(nat[n]), family.view(nat_again[n])
            sd = jnp.sqrt(jnp.minimum(family.marginal_variance(view), family.marginal_variance(moved)))
            out[n] = jnp.max(jnp.abs(moved.mean - view.mean) / sd)
        return out

    try:
        # (one compiled program: op by op, a 33-scalar dense block's moments took 1–2 s)
        found = jax.jit(gaps)({n: first.nat[n] for n in names}, {n: again[n] for n in names})
    except Exception:  # (a family without marginal variances, or another layout: not compared)
        return False
    return all(bool(np.isfinite(g) and g < SAME_OPTIMUM_SDS) for g in map(float, found.values()))


def refine(fit: Callable, first, held: list, options, key, first_time: float, budget: float, grid_asked: bool):
    """Try the remedies of a poor first fit and keep the best candidate (module docstring).

    Args:
        fit: ``fit(options, key, init_values, start) -> (result, held warnings)``: one fit as
            ``blr_fit`` runs it, its warnings held.
        first: the first fit's :class:`BLRResult`, ``held`` its warnings.
        options: its checked :class:`blrppl.inputs.FitOptions`; ``key`` its key.
        first_time: the first fit's seconds; ``budget``: the refinement's limit in multiples of
            it.
        grid_asked: the first fit integrated scales on a grid.

    Returns:
        ``(result, held warnings, refinements)``: the kept fit, its warnings, and the
        :class:`Refinement` of every fit compared (the first included; empty when the first
        fit's diagnostics were good and nothing was tried).
    """
    if first.diagnostics is None or not first.diagnostics.poor() or not first.converged:
        # (a fit stopped before converging, by num_steps= or a non-finite ELBO, is not yet its
        # q's answer: its message says so, and more steps, not another fit, is what it needs)
        return first, held, []
    fitted = [(Refinement("as asked", first.diagnostics.khat, first.diagnostics.bound, first_time), first, held, False)]
    spent, limit = 0.0, budget * max(first_time, MIN_UNIT)
    gridded: set = set()  # (the sites of the grids fitted so far)
    answered: set = set()  # (what the starts found: SAME, the first fit's optimum, OTHER, another; PASSED)
    for cand in candidates(first, options, key, grid_asked):
        if cand.grid_sites and set(cand.grid_sites) <= gridded:
            continue
        reason = skip_reason(cand, answered, first)
        if reason:
            fitted.append((Refinement(cand.change, math.nan, math.nan, 0.0, note=NOT_RUN + reason), None, [], False))
            continue
        if spent + expected_cost(cand, first, first_time) > limit:
            continue
        t0 = time.perf_counter()
        try:
            # (a candidate stops at the budget's end: blrppl.engine.budget)
            result, caught = fit(cand.options, cand.key, cand.init_values, cand.start, t0 + limit - spent, cand.design)
        except Exception as exc:  # (a remedy that does not apply to this model: reported, not raised)
            seconds = time.perf_counter() - t0
            spent += seconds
            if isinstance(exc, OverBudget):
                note = str(exc)
            else:
                note = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            fitted.append((Refinement(cand.change, math.nan, math.nan, seconds, note=note), None, [], False))
            continue
        seconds = time.perf_counter() - t0
        spent += seconds
        d = result.diagnostics
        grid = "'grid'" in cand.change
        gridded |= set(cand.grid_sites)
        same = None
        if cand.remedy == START and getattr(result, "converged", True):
            # (one start at another optimum shows there are several: the rest run)
            same = same_optimum(first, result)
            answered.add(SAME if same else OTHER)
        if getattr(result, "converged", True) and d is not None and not d.poor() and not same:
            # (a start back at the first fit's optimum passing on other draws answers nothing new)
            answered.add(PASSED)
        fitted.append((Refinement(cand.change, d.khat, d.bound, seconds), result, caught, grid))
    # (a candidate that did not converge ranks below every one that did: the first fit did, and a
    # mixture stopped by num_steps before its ELBO settled would turn a converged fit into one
    # that is not, as a float32 Poisson fit's was)
    scored = [
        ((bool(getattr(result, "converged", True)),) + _rank(entry._replace(bound=_lower_bound(result, grid)), grid), -i, i)
        for i, (entry, result, _, grid) in enumerate(fitted) if result is not None
    ]
    if all(entry.note.startswith(NOT_RUN) for entry, *_rest in fitted[1:]):
        return first, held, []  # (no remedy applies, or the budget allowed none)
    best = max(scored)[2]  # (ties: the earlier fit, the first fit before any candidate)
    refinements = [entry._replace(kept=i == best) for i, (entry, *_rest) in enumerate(fitted)]
    _, result, caught, _ = fitted[best]
    return result, caught, refinements


def summary(refinements: list) -> str:
    """The result message's note of what the refinement tried and which fit it kept."""

    def shown(r):
        what = r.note or f"k-hat {r.khat:.2f}, bound {r.bound:.4g}, {r.time:.1f} s"
        return f"{r.change} ({what})" + (" [kept]" if r.kept else "")

    first = refinements[0]
    tried = [r for r in refinements[1:] if not r.note.startswith(NOT_RUN)]
    skipped = [r for r in refinements[1:] if r.note.startswith(NOT_RUN)]
    return (
        f"q was poor, so the fit tried {len(tried)} remed{'y' if len(tried) == 1 else 'ies'} and kept the one with the "
        "best importance-weighted bound (fits whose weights are reliable, k-hat ≤ 0.7 or a grid, first, then k-hat < 1): "
        "the fit as asked "
        f"({shown(first).split(' (', 1)[1]}; " + "; ".join(shown(r) for r in tried)
        + "".join(f"; {r.change} ({r.note})" for r in skipped)
    )
