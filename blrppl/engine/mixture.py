"""Mixtures of Gaussians fitted by the learning rule: ``blr_fit(..., families={"x":
("gaussian-mixture", K)})`` (``"gaussian-mixture"``: :data:`DEFAULT_COMPONENTS`).

A posterior with several modes (a sign that the data do not fix, a label switch, a ridge
that bends) is missed by every Gaussian: the single Gaussian's fit sits in one mode. The
mixture candidate of :mod:`blrppl.families.gaussian_mixture` holds them, at the cost of K
components' Monte Carlo gradients per step. Like a grid (:mod:`blrppl.engine.grid`), it is
an option of ``families=`` handled above the compiler, in three stages:

1. the fit as asked, each mixture site in the Gaussian block the fit gives it (its own,
   or a joint block with the sites it is correlated with), or else a diagonal Gaussian of
   its own on its unconstrained space (``families={"x": "gaussian-diag"}``; always so with
   ``structure="mean-field"``): the single-component fit;
2. from it, the mixture's start (:func:`blrppl.families.gaussian_mixture.spread_start`),
   then ``num_steps`` steps of the mixture's rule
   (:func:`blrppl.families.gaussian_mixture.mixture_step`), jitted in chunks of
   :data:`CHUNK` steps, at step sizes ρ_t = ρ₀ / (1 + t / :data:`RHO_HALF`) (ρ₀: a float
   ``learning_rate``, else :data:`RHO0`: a callable one is the single fit's only), with
   the collapse guard
   (:func:`blrppl.families.gaussian_mixture.respread`) between chunks in the first half;
   the model's log density is the fit's own (:class:`blrppl.posterior.diagnostics.Density`,
   the one its importance weights read);
3. the result: the mixture blocks' posteriors a numpyro ``MixtureSameFamily`` (pushed
   through the site's bijection when it is constrained), in the result's plan and natural
   parameters (so that ``result.sample``, ``result.guide`` and ``summary()`` draw from
   it), and PSIS k̂, the relative ESS and the importance-weighted bound of the mixture's q.

The mixture is over the block that holds the site: its own block (diagonal Gaussian
start), or with ``structure="joint"`` the joint block of the model's Gaussians (dense
start), whose sites' posteriors are then the mixture's marginals (each site's scalars: a
``MixtureSameFamily`` too) and whose draws keep the mixture's coupling. Several sites
asked in one joint block make one mixture, of the largest K asked.

The other latents' plain Gaussian blocks (dense over one vector, or diagonal: those the
mixture does not hold) are fitted again given the mixture: the mixture's rule steps each as a
mixture of one component (:func:`blrppl.families.gaussian_mixture.as_component`: its steps
are then the learning rule's Gaussian steps, by Monte Carlo) in the same loop, with the
mixtures drawn from their current q, and the result holds them in their own family. The
other blocks (a conjugate Gamma, Beta, ..., a chain's, a local block, IVON's, tied rows) keep
the single fit's q: they are drawn from it at every step (one draw per step, shared by the
mixture's draws). A mixture site must be continuous, not a point, and the plan free of
subsampled plates and ``prior=``.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.engine import budget
from blrppl.engine.build import model_data
from blrppl.engine.prepare import prepare
from blrppl.engine.run import run
from blrppl.errors import BLRError, FamilyError
from blrppl.families import gaussian_mixture as gm
from blrppl.posterior.diagnostics import importance_bound, psis_khat, relative_ess
from blrppl.posterior.export import TransformedPosterior, site_distribution
from blrppl.runtime.compile import jit as _jit

#: the first step size of the mixture's rule, when ``learning_rate`` gives none
RHO0 = 0.3
#: the steps over which the step size halves (ρ_t = ρ₀ / (1 + t / RHO_HALF))
RHO_HALF = 100.0
#: steps per jitted chunk (the collapse guard runs between chunks)
CHUNK = 100
#: draws per component per step (S/2 antithetic pairs)
NUM_DRAWS = 16
#: draws of the mixture's q behind its PSIS k̂
DIAGNOSTIC_DRAWS = 2000


def mixture_fit(program, args, kwargs, options, key):
    """Fit the model with the mixtures ``options.mixtures`` asks for (see the module).

    Args:
        program: the model's :class:`blrppl.model.program.ModelProgram`.
        args, kwargs: the model's arguments.
        options: the checked :class:`blrppl.inputs.FitOptions` (``mixtures`` not empty).
        key: the fit's key.

    Returns:
        :class:`blrppl.BLRResult` with the mixture blocks in its plan, natural parameters and
        posteriors.

    Raises:
        FamilyError: a mixture site is discrete, a point, integrated out, or a site with
            plate axes in a dense block of its own (``structure="joint"``).
        BLRError: the model has subsampled plates, or ``prior=`` (the mixture's steps read
            the model's density at all the data).
    """
    asked = dict(options.mixtures)
    prepared = _prepare_base(program, args, kwargs, options, key, asked)
    plan = prepared.plan
    blocks, counts = _mixture_blocks(plan, asked, prepared.bundle.density)
    with warnings.catch_warnings(record=True):  # (the single fit's advice is not the mixture's)
        warnings.simplefilter("always")
        base = run(prepared, prepared.state, options.num_steps, options.progress_bar)
    t0 = time.perf_counter()
    density = prepared.bundle.density
    data = model_data(plan, prepared.dyn_data)
    others = [b for b in density.drawn if b.name not in blocks]
    refit = _refitted_blocks(plan, blocks, [b for b in others if _refittable(b, base.nat[b.name])])
    others = [b for b in others if b.name not in refit]
    k_start, k_run, k_diag = jax.random.split(jax.random.fold_in(key, 53), 3)
    start = {}
    for i, (name, b) in enumerate(blocks.items()):
        view = b.family.view(base.nat[name])
        where = b.family.view(prepared.state.nat[name]).mean
        var = b.family.marginal_variance(view)
        dense = gm.dense_components(tuple(jnp.shape(view.mean)))
        cov = b.family.view_covariance(view) if dense else None
        start[name] = gm.spread_start(view.mean, var, where, counts[name], jax.random.fold_in(k_start, i), dense, cov)
    start.update({n: gm.as_component(b.family.view(base.nat[n])) for n, b in refit.items()})
    log_joint = _log_joint(density, {**blocks, **refit}, others, data)
    nat, elbo, moved, rejected = _run_mixture(log_joint, base.nat, start, options, k_run)
    refitted = {n: nat.pop(n) for n in refit}  # (the other Gaussians, fitted again given the mixtures)
    # (the single fit's component alone left: a Gaussian whose optimum the single fit is, taken
    # as it is rather than a Monte Carlo step's noise away from it)
    alone = {n for n, v in nat.items() if gm.kept_components(v).tolist() == [True] + [False] * (len(v.logits) - 1)}
    kept = {n: gm.drop_floored(v) for n, v in nat.items()}
    nat, dropped = {n: v[0] for n, v in kept.items()}, sum(v[1] for v in kept.values())
    nat = {n: gm.first_component(start[n]) if n in alone else v for n, v in nat.items()}
    entropy_rest = sum(float(jnp.sum(b.family.entropy(base.nat[b.name]))) for b in others)
    elbo = elbo + entropy_rest
    return _package(
        prepared, base, (blocks, refit), counts, (nat, refitted), (elbo, moved, rejected, dropped), log_joint, k_diag,
        time.perf_counter() - t0,
    )


def _refitted_blocks(plan, mixtures: dict, candidates: list) -> dict:
    """name → block of the ``candidates`` (:func:`_refittable`) that a mixture can move: those
    that share a factor with a mixture block or with another such candidate. The others' q given
    the mixture is the single fit's (no factor joins them to it), which a Monte Carlo refit would
    only blur."""
    by_name = {b.name: b for b in candidates}
    reached, frontier = set(mixtures), list(mixtures)
    while frontier:
        name = frontier.pop()
        for factor in plan.factors:
            if name in factor.neighbours:
                new = [n for n in factor.neighbours if n in by_name and n not in reached]
                reached.update(new)
                frontier.extend(new)
    return {n: b for n, b in by_name.items() if n in reached}


def _refittable(block, nat) -> bool:
    """Whether a drawn block that holds no mixture is fitted again given the mixtures: a plain
    Gaussian (dense over one vector, or diagonal) on its own, which the mixture's rule steps as a
    mixture of one component (:func:`blrppl.families.gaussian_mixture.as_component`); the
    others (a conjugate Gamma, Beta, ..., a chain's, a local block, IVON's, tied rows) keep the
    single fit's q."""
    family = block.family
    if not family.gaussian or block.chain or block.local is not None or family.reparam_curvature or family.tied_rows:
        return False
    return gm.as_component(family.view(nat)) is not None


def _prepare_base(program, args, kwargs, options, key, counts):
    """The single fit's prepared state, a discrete mixture site refused by name. A mixture
    site keeps the Gaussian block the fit gives it (its own, or a joint block with the sites
    it is correlated with: the mixture then contains the single fit); a site the fit gives
    another family or layout (:func:`_needs_own_block`) is fitted again as a diagonal
    Gaussian of its own."""
    prepared = _prepare_named(program, args, kwargs, options, key, counts)
    own = sorted(s for s in counts if _needs_own_block(prepared.plan, s))
    if own:
        families = {**options.families_dict, **{s: "gaussian-diag" for s in own}}
        options = dataclasses.replace(options, families=tuple(sorted(families.items())))
        prepared = _prepare_named(program, args, kwargs, options, key, counts)
    if prepared.plan.subsampled or prepared.bundle.density is None:
        raise BLRError(
            "families= asks a Gaussian mixture: its steps read the model's density at all the data, which a fit "
            "with subsampled plates or prior= does not have; fit without them or without the mixture",
            site=next(iter(counts)),
        )
    return prepared


def _needs_own_block(plan, site: str) -> bool:
    """Whether the fit's block of ``site`` is no Gaussian the mixture can start from: another
    family (a conjugate Gamma, Beta, ...), a structured Gaussian (a chain's, banded, an
    arrowhead, IVON's), or a site that is not a vector in a dense block of its own (a scalar,
    whose dense layout is a vector of one, or a site with plate axes): the mixture's
    components are laid out as the site's values."""
    block = next((b for b in plan.blocks if site in b.sites), None)
    if block is None or block.discrete or block.point or block.param:
        return False  # (refused by name in _mixture_blocks)
    family = block.family
    return (
        not family.gaussian or block.chain or block.local is not None or family.banded or family.arrowhead
        or family.reparam_curvature
        or (not block.members and family.dense_event and (bool(block.batch_shape) or len(block.value_shape) != 1))
    )


def _prepare_named(program, args, kwargs, options, key, counts):
    try:
        return prepare(program, args, kwargs, options, key)
    except FamilyError as err:
        if err.site in counts:
            raise FamilyError(
                f"families= asks a Gaussian mixture for '{err.site}', which no Gaussian on an unconstrained space "
                f"can represent ({err}): a mixture is for continuous latents; remove '{err.site}' from families=",
                site=err.site,
            ) from err
        raise


def _mixture_blocks(plan, asked: dict, density) -> tuple:
    """``(block name → block, block name → K)``: the single fit's block of every mixture site
    (one mixture per block: K the largest its sites ask), each drawn, continuous, not a
    point, and in its value layout or a joint block."""
    blocks, counts = {}, {}
    drawn = {b.name for b in density.drawn} if density is not None else set()
    for site, k in asked.items():
        block = next((b for b in plan.blocks if site in b.sites), None)
        if block is None:
            raise FamilyError(
                "families= asks a Gaussian mixture for a site the fit has no block of (no other site reads it: "
                "it is integrated out exactly); remove it from families=",
                site=site,
            )
        if block.discrete:
            raise FamilyError("a Gaussian mixture is for continuous latents: remove it from families=", site=site)
        if block.point or block.name not in drawn:
            raise FamilyError(
                "a Gaussian mixture is not a point (delta-method) block: remove it from point= or from families=",
                site=site,
            )
        if not block.members and block.family.dense_event and block.batch_shape:
            raise FamilyError(
                "a Gaussian mixture over a site with plate axes is fitted on its own block: fit it without "
                "structure='joint'",
                site=site,
            )
        blocks[block.name] = block
        counts[block.name] = max(k, counts.get(block.name, 0))
    return blocks, counts


def _log_joint(density, blocks: dict, others: list, data):
    """``(xs, rest_nat, key) → log p(y, x) + log|det J|``: ``xs`` the mixture blocks' values
    (canonical layout), the other drawn blocks drawn from ``rest_nat`` with ``key``."""

    def log_joint(xs: dict, rest_nat: dict, key):
        values, log_det = dict(density.point_values(rest_nat)), 0.0
        keys = jax.random.split(key, max(len(others), 1))
        for k, b in zip(keys, others):
            vals, ld = density.site_values(b, b.family.sample(rest_nat[b.name], k))
            values.update(vals)
            log_det = log_det + ld
        for name, b in blocks.items():
            vals, ld = density.site_values(b, xs[name])
            values.update(vals)
            log_det = log_det + ld
        return density.log_joint(values, data) + log_det

    return log_joint


def _run_mixture(log_joint, rest_nat: dict, nat: dict, options, key) -> tuple:
    """``num_steps`` steps of every mixture block (see the module): ``(nat, ELBOs, re-spread
    components, rejected steps)``; each block steps with the other mixtures drawn from their
    current q. A step whose parameters or ELBO are not finite (an overflow of the model's
    density at a draw) is not taken, and counted."""
    rate = options.learning_rate
    rho0 = RHO0 if rate is None or callable(rate) else float(rate)
    names, total = list(nat), int(options.num_steps)

    def step(nat, t):
        k = jax.random.fold_in(key, t)
        rho = rho0 / (1.0 + t / RHO_HALF)
        k_rest, k_mix, k_steps = jax.random.split(k, 3)
        drawn = {n: gm.mixture_distribution(nat[n]).sample(jax.random.fold_in(k_mix, i)) for i, n in enumerate(names)}
        new, elbo = {}, 0.0
        for i, n in enumerate(names):

            def log_p(x, n=n):
                return log_joint({**drawn, n: x}, rest_nat, k_rest)

            new[n], e = gm.mixture_step(nat[n], log_p, jax.random.fold_in(k_steps, i), rho, NUM_DRAWS)
            elbo = e if i == 0 else elbo  # (one block's estimate: with several, each holds the others' draws)
        # (the other blocks' entropies beside the first block's estimate: a one-component
        # block's in closed form, a mixture's by draws of it)
        elbo = elbo + sum(
            gm.component_entropy(nat[n]) if nat[n].logits.shape[0] == 1
            else gm.entropy_estimate(nat[n], jax.random.fold_in(k_rest, 1 + i), NUM_DRAWS)
            for i, n in enumerate(names[1:])
        )
        ok = jnp.isfinite(elbo) & jnp.all(jnp.stack([gm.mixture_is_valid(new[n]) for n in names]))
        kept = jax.tree.map(lambda a, b: jnp.where(ok & (t < total), a, b), new, nat)
        return kept, (elbo, ~ok & (t < total))

    @_jit
    def chunk(nat, t0):
        return jax.lax.scan(lambda s, i: step(s, t0 + i), nat, jnp.arange(CHUNK))

    elbos, moved, rejected = [], 0, 0
    chunks = int(math.ceil(total / CHUNK))
    for c in range(chunks):
        budget.check("in the mixture's steps")  # (the refinement's candidate: blrppl.engine.budget)
        nat, (e, bad) = chunk(nat, c * CHUNK)
        elbos.append(np.asarray(e)[np.asarray(~bad)][: total - c * CHUNK])
        rejected += int(np.sum(np.asarray(bad)))
        if (c + 1) * CHUNK <= total // 2:
            for i, n in enumerate(names):
                nat[n], m = gm.respread(nat[n], jax.random.fold_in(key, 10**6 + 100 * c + i))
                moved += m
    return nat, np.concatenate(elbos), moved, rejected


def _diagnose(log_joint, rest_nat, others, blocks, nat, key) -> tuple:
    """PSIS k̂, relative ESS, the importance-weighted bound and the draws of the mixture's q."""

    def one(k):
        k_mix, k_rest = jax.random.split(k)
        xs, log_q = {}, 0.0
        for i, (name, _) in enumerate(blocks.items()):
            x = gm.mixture_distribution(nat[name]).sample(jax.random.fold_in(k_mix, i))
            xs[name] = x
            log_q = log_q + gm.mixture_log_prob(nat[name], x)
        # (the other blocks: drawn inside log_joint from the same key, their log q read there too)
        rest_q = 0.0
        keys = jax.random.split(k_rest, max(len(others), 1))
        for kk, b in zip(keys, others):
            rest_q = rest_q + jnp.sum(b.family.log_prob(rest_nat[b.name], b.family.sample(rest_nat[b.name], kk)))
        return log_joint(xs, rest_nat, k_rest) - log_q - rest_q

    log_w = np.asarray(_jit(jax.vmap(one))(jax.random.split(key, DIAGNOSTIC_DRAWS)), dtype=float)
    return psis_khat(log_w), relative_ess(log_w), importance_bound(log_w), log_w.size


def _settled(elbo) -> bool:
    """Whether the mean ELBOs of the last two windows of :data:`CHUNK` steps agree within two
    standard errors (no window of steps that did not reach: not settled)."""
    if elbo.size < 2 * CHUNK:
        return False
    tail, before = elbo[-CHUNK:], elbo[-2 * CHUNK : -CHUNK]
    se = math.sqrt(np.var(tail) / tail.size + np.var(before) / before.size)
    return bool(abs(tail.mean() - before.mean()) <= 2.0 * se + 1e-12)


def _exported(block, nat) -> dict:
    """site → posterior of a mixture block's sites: the mixture itself, or for the members of
    a joint block each one's marginal, pushed through the site's bijection."""
    if not block.members:
        return {block.name: site_distribution(block, nat, len(block.site_shape or block.value_shape))}
    out = {}
    for m, positions in zip(block.members, block.member_positions()):
        marginal = gm.marginal_distribution(nat, positions, tuple(m.value_shape))
        out[m.name] = marginal if m.transform is None else TransformedPosterior(marginal, m.transform)
    return out


def _exported_gaussian(block, nat, before: dict) -> dict:
    """site → posterior of a refitted Gaussian block's sites (each member's marginal in a joint
    block), each with the event dims of its posterior in ``before`` (the single fit's)."""
    if not block.members:
        return {block.name: site_distribution(block, nat, len(before[block.name].event_shape))}
    return {
        m.name: site_distribution(m, m.family.nat_from_view(view), len(before[m.name].event_shape))
        for m, view in block.member_views(block.family.view(nat))
    }


def _package(prepared, base, stepped, counts, fitted, run, log_joint, key, run_time):
    """The result: the single fit's, with the mixture blocks in its plan, its natural
    parameters and its posteriors, the other Gaussians fitted again given them, the mixture's
    ELBOs and diagnostics (``stepped``: the mixture blocks and the refitted ones, ``fitted``
    their parameters, the refitted ones' as one-component mixtures; ``run``: the ELBOs, the
    components re-spread and the steps rejected, :func:`_run_mixture`'s, and the components
    dropped at the end, :func:`blrppl.families.gaussian_mixture.drop_floored`)."""
    (blocks, refit), (nat, refitted) = stepped, fitted
    elbo, moved, rejected, dropped = run
    plan = prepared.plan
    others = [b for b in prepared.bundle.density.drawn if b.name not in blocks and b.name not in refit]
    new_blocks, posterior, all_nat = [], dict(base.posterior), dict(base.nat)
    for b in plan.blocks:
        if b.name in blocks:
            # (K: the components left at the end, gm.drop_floored)
            family = gm.GaussianMixture(int(jnp.shape(nat[b.name].logits)[0]), tuple(jnp.shape(nat[b.name].mean)[1:]))
            b = dataclasses.replace(b, family=family, kind=f"{gm.NAME}({family.num_components})")
            all_nat[b.name] = nat[b.name]
            posterior.update(_exported(b, nat[b.name]))
        elif b.name in refit:
            all_nat[b.name] = b.family.nat_from_view(gm.component_view(refitted[b.name], type(b.family).view_type))
            posterior.update(_exported_gaussian(b, all_nat[b.name], base.posterior))
        new_blocks.append(b)
    new_plan = dataclasses.replace(plan, blocks=tuple(new_blocks))
    budget.check("before the mixture's diagnostics")
    khat, ess, bound, num = _diagnose(log_joint, base.nat, others, {**blocks, **refit}, {**nat, **refitted}, key)
    diagnostics = base.diagnostics._replace(
        khat=khat, ess=ess, bound=bound, num_draws=num, widths=(), narrow=(), bulk=None, note=""
    )
    converged = _settled(elbo)
    weights = "; ".join(
        f"'{n}': weights " + ", ".join(f"{w:.3f}" for w in np.asarray(jax.nn.softmax(nat[n].logits))) for n in blocks
    )
    message = (
        f"Gaussian mixture fitted by {elbo.size} steps of its rule ({weights}; "
        + ("the ELBO's last two windows of steps agree within their noise" if converged else
           "the ELBO still moved over the last window of steps, or there were too few steps to compare two: "
           "more num_steps may help")
        + f"; {moved} component(s) re-spread by the collapse guard"
        + (f"; {dropped} component(s) at the weights' floor dropped" if dropped else "")
        + (f"; {rejected} step(s) with a non-finite result not taken" if rejected else "")
        + f") from the single Gaussian's fit ({base.message.split('; ')[0]})"
    )
    if refit:
        message += f"; the other Gaussian blocks ({', '.join(refit)}) fitted again given the mixture"
    if others:
        message += "; " + ("the others" if refit else "the other latents") + " keep the single Gaussian fit's q"
    if diagnostics.poor():
        warnings.warn(
            f"blr_fit: the Gaussian mixture may be a poor approximation of the posterior (PSIS k-hat = {khat:.2f}, "
            f"importance ESS {100 * ess:.0f} %): try more components or more num_steps",
            UserWarning,
            stacklevel=4,
        )
    return dataclasses.replace(
        base, posterior=posterior, plan=new_plan, nat=all_nat, elbo=elbo, num_steps=base.num_steps + elbo.size,
        converged=converged, message=message, diagnostics=diagnostics._replace(rejected_steps=rejected), importance=None,
        run_time=base.run_time + run_time,
        deterministic_sites=prepared.bundle.tracer.meta.get("deterministic"),
    )

