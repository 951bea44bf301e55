"""What a fit's result says of how it ended: why it stopped (:func:`stop_message`), an
improper posterior, a diverged ELBO, and what to try when q may be poor
(:func:`poor_q_advice`, naming a funnel when the plan has one).
"""

from __future__ import annotations

import math

import numpy as np

from blrppl import families as fam
from blrppl.engine.build import one_exact_block
from blrppl.engine.design import MAX_SCALES
from blrppl.engine.loop import BAD_RATE, CONVERGED, NONFINITE, STATIONARY, STATIONARY_STEPS, diverged_from
from blrppl.compiler.structure import MC_JOINT_MAX_DIM
from blrppl.estimators.registry import estimator_of
from blrppl.graph.plan import FactorRole


def stop_message(outcome, plan, window: int, tol: float, num_steps: int) -> str:
    if outcome.stop == CONVERGED and plan.subsampled:
        message = (
            f"converged after {outcome.num_steps} steps (minibatch ELBO: the mean over the last "
            f"{window} steps, whole epochs, changed by less than {tol:g} relative to the "
            f"{window} before)"
        )
    elif outcome.stop == CONVERGED and window:
        message = (
            f"converged after {outcome.num_steps} steps (Monte Carlo ELBO: the mean over the "
            f"last {window} steps no longer improves on the {window} before)"
        )
    elif outcome.stop == CONVERGED and one_exact_block(plan) and outcome.num_steps == 1:
        message = (
            "converged after 1 step (the model's only block is conjugate: one step with ρ = 1 is "
            "its exact posterior)"
        )
    elif outcome.stop == CONVERGED:
        message = f"converged after {outcome.num_steps} steps (relative ELBO change below {tol:g})"
    elif outcome.stop == STATIONARY:
        message = (
            f"converged after {outcome.num_steps} steps (the ELBO moved by less than {tol:g} relative "
            f"over the last {STATIONARY_STEPS} accepted steps; some natural parameters still move by "
            f"more than {math.sqrt(tol):.1g}, along directions the ELBO hardly sees)"
        )
    elif outcome.stop == NONFINITE:
        message = (
            f"stopped after {outcome.num_steps} steps: no step size found that keeps the ELBO "
            "and the natural parameters finite (and, for exact ELBOs, does not lower it); check "
            "the data for NaN or infinite values and the priors for expectations that do not "
            "exist" + _zero_probability_hint(outcome, plan, ", and whether") + "; the last valid state is returned"
        )
    elif getattr(outcome, "exhausted", False):
        message = (
            f"stopped after {outcome.num_steps} steps: the minibatch iterable (Minibatches) ended before "
            f"num_steps={num_steps} and before the convergence test was met; the last state is returned (pass a "
            "re-iterable, a list or a DataLoader, to cycle over it, or more batches)"
        )
    elif outcome.stop == BAD_RATE:
        message = (
            f"stopped after {outcome.num_steps} steps: learning_rate(step) gave a step size that "
            "is not a finite number ≥ 0 for the next step; the last valid state is returned"
        )
    else:
        message = f"reached num_steps={num_steps} without meeting the convergence test"
        if never_finite(outcome):
            message += (
                " (no step had a finite ELBO: check the data for NaN or infinite values and the priors for "
                "expectations that do not exist" + _zero_probability_hint(outcome, plan, "; check whether") + ")"
            )
        if plan.subsampled:
            epochs = outcome.num_steps / max(p.steps_per_epoch for p in plan.subsampled)
            message += (
                f" ({epochs:g} epochs of minibatches; the minibatch noise of the global "
                "blocks shrinks with more steps)"
            )
    improper = improper_blocks(outcome, plan)
    if improper:
        message += "; " + improper_note(plan, outcome.state.nat, improper)
    if outcome.invalid_steps:
        message += (
            f"; in {outcome.invalid_steps} step(s) a block found no valid update and kept its "
            "parameters"
        )
    return message


def divergence_note(elbo, restored: int | None = None) -> str | None:
    """The note for a fit whose ELBO fell far below its best and stayed there
    (:func:`blrppl.engine.loop.diverged_from`), else None. A Monte Carlo step is taken
    whenever its ELBO is finite, so a fit can drift away step by step (a poor start whose
    steps overshoot: −2·10⁸ at the first step, −2·10³⁸ at the 35th). ``restored``: the step
    whose state the run returned instead of its last (its best), None when q is the last
    step's."""
    elbo = np.asarray(elbo, float)
    best = diverged_from(elbo)
    if best is None:
        return None
    kept = (
        f"the best state, step {restored}'s, is returned and the fit is not converged"
        if restored is not None else "q is the last step's"
    )
    return (
        f"the fit diverged: its ELBO fell from {elbo[best]:.3g} (step {best + 1}) to {elbo[-1]:.3g} (step "
        f"{elbo.size}), and {kept}; try mc_curvature='reparam', a smaller learning_rate, or another rng_key"
    )


#: a converged fit whose blocks found no valid update in more than this share of its last
#: steps stalled rather than converged
STALLED_SHARE = 0.5


def stalled_note(outcome, window: int) -> str | None:
    """The note for a fit that met its convergence test while its blocks kept failing to find
    valid updates (in more than :data:`STALLED_SHARE` of its last ``window`` steps, or
    :data:`~blrppl.engine.loop.STATIONARY_STEPS` for exact ELBOs): a block that keeps its
    parameters leaves the ELBO still, which the test reads as convergence. None otherwise."""
    valid = np.asarray(outcome.valid if outcome.valid is not None else (), bool)
    last = valid[-(window or STATIONARY_STEPS):]
    if not outcome.converged or not last.size or np.mean(~last) <= STALLED_SHARE:
        return None
    return (
        f"not converged: in {int(np.sum(~last))} of the last {last.size} steps a block found no valid update "
        "and kept its parameters, so the ELBO stood still without q improving (q may be stuck at a point mass "
        "or at its start); try mc_curvature='reparam', a smaller learning_rate, num_starts=4 or other families="
    )


def never_finite(outcome) -> bool:
    """Whether the fit took steps and none had a finite ELBO."""
    elbo = np.asarray(outcome.elbo)
    return bool(elbo.size) and not np.any(np.isfinite(elbo))


def _zero_probability_hint(outcome, plan, lead: str) -> str:
    """When no step had a finite ELBO and the plan has enumerated latents: the likely cause
    (a value of one that the model gives probability 0 given the data, which q, giving every
    value some probability, makes E_q[log p] = -inf) and the fix; else ''."""
    discrete = [b.name for b in plan.blocks if b.discrete]
    if not discrete or not never_finite(outcome):
        return ""
    listed = ", ".join(f"'{n}'" for n in discrete)
    return (
        f"{lead} the model gives some value of the enumerated latents ({listed}) probability 0 given the "
        "data (a count observed as Poisson(z * rate) with z = 0, a Bernoulli probability of exactly 0 or 1 "
        "picked by a discrete latent): q gives every value some probability, so its expected log-density "
        "is -inf; marginalise that latent in the model (dist.ZeroInflatedPoisson, dist.MixtureGeneral) or "
        "keep such probabilities inside (0, 1)"
    )


def improper_blocks(outcome, plan) -> tuple:
    """Blocks whose exact posterior is improper: every factor of the block has a closed form
    (so its messages do not depend on its own q: they sum to the exact conditional
    posterior's natural parameter) and at the last step that sum was not a valid natural
    parameter. (Other blocks with invalid messages were merely not at a fixed point.)"""
    if outcome.converged or not np.any(np.isfinite(np.asarray(outcome.elbo))):
        # (no step ever had a finite ELBO: the data, not the priors, are the likely cause,
        # and the stop message says so)
        return ()
    return tuple(
        n for n in outcome.improper if all(estimator_of(f).closed_form for f in plan.factors_of(n))
    )


def improper_note(plan, nat, names) -> str:
    """Which latents an improper (or not yet valid) posterior is about: for a Gaussian block,
    the sites that the direction of its smallest precision eigenvalue moves."""
    sites = []
    for n in names:
        b = plan.block(n)
        if isinstance(b.family, fam.GaussianDense) and b.members:
            prec = -2.0 * np.asarray(nat[n].eta2)
            _, vecs = np.linalg.eigh(0.5 * (prec + prec.T))
            v = np.abs(vecs[:, 0])
            offset = 0
            for m in b.members:
                if v[offset : offset + m.size].max() > 0.1:
                    sites.append(m.name)
                offset += m.size
        else:
            sites.extend(b.sites)
    listed = ", ".join(f"'{x}'" for x in sites)
    return (
        f"the posterior of {listed} is improper: the closed-form messages to it do not form a "
        "valid distribution (a singular precision), e.g. flat (ImproperUniform) priors the data "
        "do not identify (only a sum or difference of them is); give them proper priors"
    )


#: a latent scale read by at least this many latents' prior makes the poor-q advice speak of
#: a funnel (eight schools' effects and their spread)
FUNNEL_MIN_LATENTS = 8


def _funnel(plan):
    """``(scale, the sites it scales, their number of scalars, the scale's sites if a grid can
    integrate them, "scale" or "concentration")`` of a latent scale that the priors of at
    least :data:`FUNNEL_MIN_LATENTS` latents read (a random walk's step size, a hierarchical
    model's group sd, a volatility's shock size; summed over one site per step), or of a
    latent concentration they read (a Beta's or Dirichlet's pooling κ, a Gamma's shape:
    their spread shrinks as it grows), quoted for display; None when the plan has none. The
    scale is named by the latent sites the priors' spread arguments read (``Factor.spread``:
    read off the model's program, whatever the blocks and estimators, so eight schools' τ
    in one joint block with the effects as well).

    A Gaussian q, even one dense block over the scale and its latents, does not hold their
    joint posterior: the sd of a random walk's step scale is 0.32× NUTS's fitted apart and
    0.39× for a full-rank Gaussian fitted by SVI, a stochastic volatility's shock size 0.26×
    for both and 0.28× in one joint block (``make bench``: "Scales of many latents")."""
    sizes = {s: m.size for b in plan.blocks for m in (b.members or (b,)) for s in m.sites}
    scaled: dict = {}  # scale → (sites it scales, their scalars); one site per step adds up
    words: dict = {}  # scale → what it is to the latents: "scale" or "concentration"
    for f in plan.factors:
        if f.observed or f.role != FactorRole.SITE or not f.spread:
            continue
        sites = f.members or (f.name,)
        scale = tuple(dict.fromkeys(s for _, read in f.spread for s in read if s not in sites))
        if not scale:
            continue
        if all(arg.startswith("concentration") for arg, _ in f.spread):
            words[scale] = "concentration"
        names, count = scaled.get(scale, ((), 0))
        scaled[scale] = (names + sites, count + sum(sizes.get(s, 0) for s in sites))
    funnels = [(scale, names, count) for scale, (names, count) in scaled.items() if count >= FUNNEL_MIN_LATENTS]
    if not funnels:
        return None
    scale, names, count = funnels[0]
    shown = ", ".join(f"'{s}'" for s in scale)
    latents = f"'{names[0]}'" if len(names) == 1 else f"'{names[0]}' … '{names[-1]}'"
    # (a grid maps one scalar to a site's value: a 2 × 2 LKJ Cholesky factor has one free scalar
    # but a matrix value, which it cannot take)
    values = {s: math.prod(m.value_shape if m.site_shape is None else m.site_shape)
              for b in plan.blocks for m in (b.members or (b,)) for s in m.sites}
    return shown, latents, count, _grid_scales([f[0] for f in funnels], values), words.get(scale, "scale")


def _no_grid_note(plan, scale: str) -> str:
    """Why no grid is offered for a funnel's ``scale`` (its sites quoted, as :func:`_funnel`
    shows them): the sites whose value is more than one scalar, which a grid cannot take, and
    how to write them; '' when each is one scalar (a grid past its size, say)."""
    values = {m.name: tuple(m.value_shape if m.site_shape is None else m.site_shape)
              for b in plan.blocks for m in (b.members or (b,))}
    wide = [s for s in values if f"'{s}'" in scale.split(", ") and math.prod(values[s]) != 1]
    if not wide:
        return ""
    listed = ", ".join(f"'{s}' (shape {values[s]})" for s in wide)
    return (
        f" (a grid integrates sites whose value is one scalar, and {listed} {'is' if len(wide) == 1 else 'are'} not: "
        "written as scalar sites, a vector of scales as one site per scale and a 2 × 2 correlation as "
        "r ~ Beta(eta, eta), rho = 2 r - 1, they can be put on a grid, families={...: 'grid'}, at the cost of a "
        "few dozen fits)"
    )


def _grid_scales(scales, sizes) -> tuple:
    """The scalar sites a grid can integrate (``families={site: "grid"}``, at most
    :data:`blrppl.engine.design.MAX_SCALES`) for the plan's funnels, ``scales`` each one's scale
    sites, the funnel the advice names first: the scalar scales of every funnel together (a
    GLMM's per-group and per-item spreads), else the named funnel's alone, else ()."""
    scalar = [scale for scale in scales if all(sizes.get(s) == 1 for s in scale)]
    together = tuple(dict.fromkeys(s for scale in scalar for s in scale))
    if not scalar or scalar[0] != scales[0]:
        return ()
    if len(together) <= MAX_SCALES:
        return together
    return scales[0] if len(scales[0]) <= MAX_SCALES else ()


def named_remedies(plan, narrow=()) -> tuple:
    """``(grid scales, other remedies named)``: what :func:`poor_q_advice` offers for this plan,
    for the refinement (:mod:`blrppl.engine.refine`). The scalar scale sites of a funnel that a
    grid can integrate (``families={...: "grid"}``), or (); and whether the advice is the generic
    one, which names another structure and more starts (False where it names a Monte Carlo
    factor's spread, a product of blocks, a funnel or closed-form factors, whose remedy is no
    other structure or start: a factor model's symmetries, a funnel no Gaussian q holds).

    ``narrow``: the scalar sites along which the narrow-q check found the posterior wider than
    q (:attr:`Diagnostics.narrow <blrppl.posterior.diagnostics.Diagnostics.narrow>`, widest
    first): they are named for a grid too (after a funnel's scales; the refinement takes as many
    as a grid holds), with another structure and more starts, a Gaussian q whose spread is off
    along a scalar being what those may mend; not where the narrow sites are the funnel's own
    scales (centred eight schools' τ: its remedy is the grid alone), nor where the advice is to
    compare with NUTS (a product of blocks, a Monte Carlo factor's spread: the grid only)."""
    if _network_blocks(plan):
        return (), False
    funnel = _funnel(plan)
    sites = tuple(w.site for w in narrow)
    if _spread_factor(plan) is not None or any(f.spec.pairs for f in plan.factors):
        return sites, False
    scales = funnel[3] if funnel is not None else ()
    others = tuple(s for s in sites if s not in scales)
    if others:
        return tuple(dict.fromkeys(scales + others)), True
    if funnel is not None:
        return scales, False
    return (), not (plan.conjugate and all(conj for _, conj in plan.conjugate))


def _network_blocks(plan) -> tuple:
    """The blocks fitted by IVON's update (:class:`blrppl.families.GaussianIVON`: a large
    network's weights, :mod:`blrppl.compiler.large_blocks`)."""
    return tuple(b.name for b in plan.blocks if b.family.reparam_curvature)


#: the advice of a plan with IVON blocks (:func:`_network_blocks`)
NETWORK_ADVICE = (
    "{blocks} are fitted by IVON's mean-field Gaussian (a large network's weights): it holds no correlation "
    "between weights and covers one of the posterior's many modes, so k-hat is large by construction; judge "
    "the fit by its predictions (held-out log-likelihood, calibration), and compare with an ensemble or NUTS "
    "where the model is small enough"
)


def _spread_factor(plan):
    """``(name, scalars)`` of a Monte Carlo factor reading more scalars in blocks fitted apart
    than a dense joint block read by Monte Carlo may hold (see :func:`poor_q_advice`), or None."""
    joinable = {
        b.name: b.size for b in plan.blocks
        if not b.discrete and not b.family.banded and not b.family.arrowhead
    }
    return next(
        (
            (f.name, total) for f in plan.factors if estimator_of(f).samples_jointly
            for parts in [[joinable[n] for n in f.neighbours if n in joinable]]
            for total in [sum(parts)] if len(parts) > 1 and total > MC_JOINT_MAX_DIM
        ),
        None,
    )


def poor_q_advice(plan, num_starts: int = 1, narrow=(), grid_scales: int | None = None) -> str:
    """What the poor-q warning advises for this plan: why q may be poor given its blocks and
    estimators, and what to try (the generic advice when nothing in the plan says more;
    ``num_starts``: the fit's, several starts are offered to a fit from one). ``narrow``: the
    narrow-q check's flagged sites (:func:`narrow_advice`), ``grid_scales`` the most a grid
    holds (:data:`blrppl.engine.grid.MAX_SCALES`, passed by the caller; None: no limit)."""
    advice = _plan_advice(plan, num_starts)
    return advice if not narrow or _network_blocks(plan) else narrow_advice(narrow, grid_scales) + "; otherwise " + advice


def narrow_advice(narrow, grid_scales: int | None = None) -> str:
    """The advice for scalar sites along which the posterior is wider than q (the narrow-q
    check, :mod:`blrppl.posterior.narrow`): integrate the widest (as many as a grid holds,
    ``grid_scales``) on a grid of fits with them fixed."""
    named = tuple(narrow)[:grid_scales] if grid_scales is not None else tuple(narrow)
    grid = ", ".join(f"'{w.site}': 'grid'" for w in named)
    shown = ", ".join(f"'{w.site}'" for w in named)
    return (
        f"a Gaussian q is too narrow along {shown} (a hyperparameter whose posterior is skewed or heavy-tailed, "
        f"or in a funnel): integrate {'it' if len(named) == 1 else 'them'} on a grid of fits with "
        f"{'it' if len(named) == 1 else 'them'} fixed, families={{{grid}}}"
    )


def _plan_advice(plan, num_starts: int) -> str:
    """:func:`poor_q_advice` from the plan alone."""
    network = _network_blocks(plan)
    if network:
        return NETWORK_ADVICE.format(blocks=", ".join(f"'{n}'" for n in network))
    # (structure='joint' merges the dense Gaussian blocks: a plan with one of them, e.g. one
    # fitted with structure='joint', has none left to join)
    apart = sum(1 for b in plan.blocks if b.family.dense_event and not b.point) > 1
    tries = ["structure='joint'"] if apart else []
    tries.append("other families=")
    if num_starts == 1:
        # (NumPyro's Holt–Winters example stopped at a level smoothing of 0.70 against NUTS's
        # 0.03 with k̂ 1.0; num_starts=4 found NUTS's mode: docs/limitations.md)
        tries.append("several starts (num_starts=4: a Gaussian q finds one mode, and another start may find a better one)")
    advice = "compare with NUTS, or try " + (", ".join(tries[:-1]) + " or " if len(tries) > 1 else "") + tries[-1]
    pairs = [pair for f in plan.factors for _, ps in f.spec.pairs for pair in ps]
    sizes = {b.name: b.size for b in plan.blocks}
    # a Monte Carlo factor whose blocks were kept apart by the joint limit: joined (what
    # structure='joint' asks), its noisy updates ran off (an imputed covariate's logistic
    # regression: the ELBO fell for 60 steps, coefficients of the wrong sign). Only the
    # blocks a dense joint block could hold count: not enumerated ones, nor chains
    # (a capture–recapture model's 1,771 survival states next to 7 probabilities)
    spread = _spread_factor(plan)
    funnel = _funnel(plan)
    if spread is not None:
        advice = (
            f"the Monte Carlo factor '{spread[0]}' reads {spread[1]} scalars in blocks fitted apart, which holds "
            f"no correlation between them (a Gaussian block read by Monte Carlo holds at most {MC_JOINT_MAX_DIM} "
            "scalars: joined, its updates are too noisy to converge); compare with NUTS, and prefer a form whose "
            "factors the fit reads in closed form or by quadrature (e.g. states sampled at each step rather than "
            "built from a vector of innovations)"
        )
    elif pairs:
        # (joined, the product would be fitted by Monte Carlo: slower, and no better for a
        # factor model's sign and rotation symmetries, which no unimodal q holds)
        factor_model = any(sizes.get(a, 1) > 1 and sizes.get(b, 1) > 1 for a, b in pairs)
        advice = "the blocks a product of latents multiplies are fitted apart (variational message passing), " + (
            "and a factor model's posterior is symmetric under sign changes and rotations of its factors; "
            "compare means of identified quantities with NUTS"
            if factor_model else
            "which holds no correlation between them (a coefficient's sd may come out small); compare with NUTS"
        )
    elif funnel is not None:
        scale, latents, count, scalars, word = funnel
        grid = ", ".join(f"'{n}': 'grid'" for n in scalars)
        if word == "scale":
            # (Neal's funnel as NumPyro's example writes it, no data: the scale's sd 0.15× the
            # exact one, the latents' 0.03–0.11×)
            advice = (
                f"the {count} latents of {latents} have a latent scale ({scale}): the posterior of a scale and the "
                "latents it scales is a funnel (their spread shrinks with it), which no Gaussian q holds, fitted apart "
                "or in one joint block (structure='joint' is no better; a full-rank Gaussian fitted by SVI neither): "
                "the sds of the scale, and of the latents where the data say little of them, may come out several "
                "times too small; "
            )
        else:
            # (NumPyro's baseball example, Beta(m κ, (1 − m) κ) abilities of 18 players: m's sd
            # 0.59× NUTS's, κ's 0.08×; with both on a grid, m's 1.02×)
            advice = (
                f"the {count} latents of {latents} have a latent concentration ({scale}): the posterior of a "
                "concentration and the latents it pools is a funnel (their spread shrinks as it grows), which no "
                "Gaussian q holds: the sds of what sets the concentration may come out several times too small; "
            )
        others = [n for n in scalars if f"'{n}'" not in scale.split(", ")]
        what = f"the {word} with the other funnels' scales ({', '.join(others)})" if others else f"the {word}"
        advice += (
            f"integrate {what} on a grid of fits with {'them' if others else 'it'} fixed, families={{{grid}}}, or "
            f"compare {'them' if others else 'it'} with NUTS"
            if grid else f"compare the {word} with NUTS" + _no_grid_note(plan, scale)
        )
    elif plan.conjugate and all(conj for _, conj in plan.conjugate):
        # (every factor closed-form: no Monte Carlo to replace, no joint block to merge into)
        advice = (
            "every factor is closed-form, so q is the best of its factorisation into blocks (variational "
            "message passing), which holds no correlation between blocks"
            + (
                # (not the relabelling of the components: k̂ is read at q's draws, which the
                # posterior's relabelled copies do not reach; see relabelling_note)
                ": a mixture's assignments are fitted apart from its components, so data whose component is "
                "uncertain do not widen them (a component's sds may come out too small)"
                if has_mixture(plan) else ""
            )
            + "; compare means of identified quantities with NUTS"
        )
    return advice


def has_mixture(plan) -> bool:
    """Whether the plan has a mixture's labels: a discrete latent, not a chain, of K ≥ 2 values
    that index several components, read off the plan as a factor enumerating it that reads a
    continuous latent with an axis of K elements (a mixture's ``locs[z]``, its weights in
    ``Categorical(w)``, Dawid–Skene's ``pi[c]``): relabelling its values together with the
    components leaves the model as it was. A discrete latent whose values index no such axis
    is no label: the change point's year ``s``, enumerated over its 111 values, selects
    between two scalar rates (``jnp.where(years < s, early, late)``), and no relabelling of
    the years maps the model onto itself.
    (Components written as separate scalar sites are not seen; a latent with an axis of K
    elements read beside an unrelated label of K values is taken for components.)"""
    blocks = {b.name: b for b in plan.blocks}
    for f in plan.factors:
        labels = [blocks[d] for d in f.discrete if d in blocks and not blocks[d].chain]
        sizes = {len(m.support_values) for b in labels for m in (b.members or (b,)) if m.support_values}
        sizes.discard(1)
        if sizes and any(
            k in (m.site_shape or m.value_shape)
            for n in f.neighbours if n in blocks and not blocks[n].discrete
            for m in (blocks[n].members or (blocks[n],))
            for k in sizes
        ):
            return True
    return False


def relabelling_note(plan) -> str | None:
    """For a plan with a mixture's assignments, the note (an information, not a warning) that
    its posterior has a copy for every relabelling of its components and q holds one: that
    is no fault of q (PSIS k̂ is read at q's draws, where the other copies add nothing, and
    identified quantities, such as the sorted component means, are the same in every copy).
    None for other plans."""
    if not has_mixture(plan):
        return None
    return (
        "note: where a mixture's components have the same prior, its posterior has one copy for every "
        "relabelling of them and q holds one; that alone is no poor fit (compare identified quantities, e.g. "
        "the sorted component means)"
    )
