"""``blr_fit``: fit a NumPyro model by the Bayesian learning rule."""

import contextlib
import warnings
from typing import Callable

import numpy as np
import numpyro

from blrppl.engine.fit import COMPILE_LOCK, plan_model, prepare, run
from blrppl.engine.grid import grid_sites, grid_fit
from blrppl.errors import BLRError, out_of_memory_as_error
from blrppl.model.trace import trace_model
from blrppl.inputs import as_key, fit_options, host_fold_in, host_split, model_arguments
from blrppl.result import BLRResult


def plan_of(model, data=None, *, rng_key=None, **options):
    """The plan ``blr_fit(model, data, rng_key=rng_key, **options)`` fits, without compiling
    the fit: blocks, factors and estimators (``plan_of(...).describe()``)."""
    args, kwargs = model_arguments(data)
    options = fit_options(**options)
    k_trace, k_probe, _, _ = host_split(as_key(rng_key), 4)
    with COMPILE_LOCK:
        records, data_spec, dyn_data, _ = trace_model(model, args, kwargs, k_trace)
        with numpyro.validation_enabled(False):
            return plan_model(model, records, data_spec, dyn_data, options, None, k_probe)[0]


def blr_fit(
    model: Callable,
    data=None,
    *,
    num_steps: int | None = None,
    learning_rate: float | Callable | None = None,
    schedule: str | None = None,
    families: dict | None = None,
    structure: str | None = None,
    point: tuple | list | None = None,
    mc_curvature: str = "auto",
    rng_key=None,
    tol: float | None = None,
    progress_bar: bool = True,
    prior: BLRResult | None = None,
    point_space: str = "unconstrained",
    iterate_average: bool = True,
    num_starts: int = 1,
) -> BLRResult:
    """Fit the latent variables of a NumPyro model by the Bayesian learning rule.

    Every latent gets a candidate posterior from an exponential family chosen by its support
    (Gaussian, Gamma, Beta, Dirichlet, Categorical/Bernoulli) and all are fitted by

        λ_b ← (1 − ρ) λ_b + ρ Σ_{i ∋ b} ∇_{μ_b} E_q[log f_i]

    in one jitted loop. For conjugate models one step with ρ = 1 is the exact posterior; for
    conditionally conjugate models the sequential schedule is variational message passing.

    Models with subsampled plates (``numpyro.plate(name, N, subsample_size=M)``) are fitted
    by stochastic BLR (SVI, Hoffman et al. 2013): each step draws a minibatch of every such
    plate by random reshuffling (each element once per epoch of ⌊N/M⌋ steps), updates the
    *local* latents inside the plate with ρ = 1 at the minibatch elements (the others keep
    their parameters), then the *global* latents with ρ_t = (t + 10)^−0.7 from messages in
    which the minibatch's likelihood terms carry N/M. The ELBO is a minibatch estimate
    (convergence: windowed means, no backtracking).

    Args:
        model: a NumPyro model.
        data: the model's arguments: a dict of keyword arguments, a tuple of positional ones, or
            one array (NumPy, JAX or pandas), the model's only positional argument.
        num_steps: the most steps to run (default 1000).
        learning_rate: ρ, a float or a callable of the step number. By default ρ = 1 (for
            conjugate blocks an exact coordinate step; for the others a natural-gradient
            Newton-like step, halved by backtracking when it lowers the ELBO, with the improved
            BLR retraction for Gaussians at ρ < 1), and ρ_t = 0.5 (1 + t/10)^−0.6 for blocks
            with Monte Carlo messages. Under subsampling it is the step size of the global
            blocks (default ρ_t = (t + 10)^−0.7; e.g. ``lambda t: (t + 1.0) ** -0.9`` for
            other κ, τ); local blocks always take ρ = 1.
        schedule: ``"sequential"`` (default; one block at a time with the newest
            neighbours, i.e. VMP) or ``"parallel"`` (all blocks from the same state).
        families: optional overrides, site → family name (``"gaussian"``,
            ``"gaussian-diag"``, ``"gamma"``, ``"beta"``, ``"dirichlet"``,
            ``"categorical"``, ``"bernoulli"``). Latents whose factors have no closed form
            in their native family get a Gaussian on their unconstrained space. ``"grid"``
            (at most two scalar continuous latents): the site is integrated on a grid of
            fits with it held fixed (:mod:`blrppl.engine.grid`), for a scale that many
            latents' prior reads, whose sd no Gaussian q gets right (a funnel); its
            ``result.posterior`` entry and draws are the grid's marginal.
        structure: ``"joint"`` fits the Gaussian latents of non-closed-form factors as one
            dense Gaussian (their posterior correlations kept), ``"mean-field"`` one block
            per site; by default joint when their total dimension is at most 500, except
            chains (banded at any length) and scales on log space their factors read (apart,
            so that those factors keep their closed form).
        point: sites fitted by the delta method: a Gaussian seen at its mean by the other
            factors, updated by Newton steps (ρ = 1 gives Newton's method; the posterior is
            Laplace's approximation at convergence).
        mc_curvature: how Monte Carlo factors estimate the curvature ½E[∇² log f] of their
            messages to Gaussian blocks: ``"auto"`` (default: per block, the exact Hessian at
            the draws for dense blocks of at most 64 scalars per plate element, Stein's
            estimate for larger ones, Hutchinson's diagonal for diagonal blocks; the
            reparameterisation estimate where a factor also sees enumerated or
            non-Gaussian latents), ``"reparam"`` (autodiff of the sample average through the
            Cholesky factor), ``"hessian"`` (exact Hessians at the draws; small blocks),
            ``"diagonal"`` (Hutchinson's diagonal; large blocks), ``"gauss-newton"``
            (empirical Fisher over the factors' elements) or ``"stein"``
            (Σ⁻¹(x − m)∇ log fᵀ, no second derivatives).
        rng_key: a ``jax.random`` key, ``jax.random.PRNGKey`` key data or an int seed (the
            k-means++ starts of mixtures, Monte Carlo draws).
        tol: convergence tolerance on the relative ELBO change (default 1e-8 in float64,
            1e-5 in float32); natural parameters must also move less than ``sqrt(tol)``.
            An argument of the compiled loop: a refit with another ``tol`` compiles nothing.
        progress_bar: show a progress bar.
        prior: a previous fit's :class:`BLRResult`, whose posterior replaces the model's
            prior (online / sequential Bayes: fit the new data only). Each *global* block
            (no site in a plate that also holds an observed site) fitted before with the
            same family and shape takes its previous posterior q_prev as its prior: its
            sites' own prior factors and its ``"<block>:jacobian"`` term are replaced by the
            exact constant message λ_prev, and the ELBO uses E_q[log q_prev]. *Local*
            latents (per-datum, e.g. mixture assignments) belong to the old data and keep
            the model's prior, as do blocks the previous fit does not have. The prior's
            dependence on other latents is dropped (assumed-density filtering: q_prev is a
            product over blocks). Successive updates with data of the same shapes reuse one
            compiled fit. See :mod:`blrppl.online`.
        point_space: where the ``point`` latents are point estimates: ``"unconstrained"``
            (default; their log|det J| term is kept, so the fit is the mode and Laplace's
            approximation on the unconstrained space) or ``"constrained"`` (no log|det J|
            term: the mode of the density in the site's own space, what numpyro's AutoDelta
            fits). ``numpyro.param`` sites are always point estimates in their own
            (constrained) space: the fit maximises the model's log density over them
            (Newton's method to convergence in every sweep), with the other latents'
            posteriors fitted as usual, so a model whose latents are enumerated and whose
            continuous quantities are params is fitted by EM; ``result.point_estimates()``
            returns their values.
        iterate_average: under subsampling, report for the global latents the average of
            their natural parameters over the last half to three quarters of the run with
            weights ∝ t + 1 (Polyak–Ruppert tail averaging: several times closer to the
            full-batch fit than the last iterate, whose minibatch noise decays only like
            ρ_t); ``False`` reports the last iterate. No effect without subsampled plates.
        num_starts: fits from this many starting points, keeping the one with the best final
            ELBO (the others reuse the compiled fit). With enumerated discrete latents (e.g.
            a mixture's assignments) the first start takes an E-step under the prior means
            (the prior's order of the components), or k-means++ seeds among the observations
            when the prior cannot tell the components apart; the others start from k-means++
            seeds of their own (see :mod:`blrppl.engine.start`).

    Returns:
        :class:`blrppl.BLRResult`.
    """
    args, kwargs = model_arguments(data)
    options = fit_options(
        num_steps=num_steps,
        learning_rate=learning_rate,
        schedule=schedule,
        families=families,
        structure=structure,
        point=point,
        mc_curvature=mc_curvature,
        tol=tol,
        progress_bar=progress_bar,
        point_space=point_space,
        iterate_average=iterate_average,
        num_starts=num_starts,
    )
    key = as_key(rng_key)
    scales = grid_sites(options.families_dict)
    if scales:
        if prior is not None or options.num_starts > 1:
            raise BLRError(
                "families='grid' (scales integrated on a grid) works with one start and without prior=; "
                f"got {'prior=' if prior is not None else f'num_starts={options.num_starts}'}",
                site=scales[0],
            )
        with out_of_memory_as_error("the fit"):
            result = grid_fit(model, args, kwargs, options, key, scales)
        result.model_call = (model, args, kwargs)
        return result
    # (inline, not in a function of its own: warnings keep pointing at the caller's line)
    with out_of_memory_as_error("the fit"):
        best, finals = None, []
        for start in range(options.num_starts):
            prepared = prepare(model, args, kwargs, options, key if start == 0 else host_fold_in(key, start), prior, start=start)
            # with several starts, each start's warnings (a poor q, a stop) are held back and only
            # the kept start's reach the user
            held = warnings.catch_warnings(record=True) if options.num_starts > 1 else contextlib.nullcontext()
            with held as caught:
                if caught is not None:
                    warnings.simplefilter("always")
                result = run(prepared, prepared.state, options.num_steps, options.progress_bar)
            final = float(result.elbo[-1]) if len(result.elbo) else -np.inf
            finals.append(final)
            if best is None or (np.isfinite(final) and not final <= finals[best[0]]):
                best = (start, result, caught or ())
        index, result, held = best
        for w in held:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        result.model_call = (model, args, kwargs)
        result.deterministic_sites = prepared.bundle.tracer.meta.get("deterministic")
        if options.num_starts > 1:
            listed = ", ".join(f"{e:.6g}" for e in finals)
            result.message += f"; best of {options.num_starts} starts (start {index}; final ELBOs {listed})"
        return result
