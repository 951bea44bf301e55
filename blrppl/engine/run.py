"""Running a prepared fit: the jitted loop from its state (restarted narrower when no step
keeps the ELBO finite), then the result: the posterior export, the diagnostics, the stop
message and its warnings (:func:`finish`).
"""

from __future__ import annotations

import functools
import math
import time
import warnings

import jax
import numpy as np

from blrppl.engine.advice import (
    divergence_note,
    improper_blocks,
    improper_note,
    never_finite,
    poor_q_advice,
    relabelling_note,
    stalled_note,
    stop_message,
)
from blrppl.engine import budget
from blrppl.engine.build import model_data, one_exact_block
from blrppl.engine.cache import COMPILE_LOCK
from blrppl.engine.loop import CONVERGED, NONFINITE, run_loop
from blrppl.engine.prepare import Prepared
from blrppl.engine.restarts import NARROWED_STARTS, narrowed
from blrppl.engine.state import BLRState
from blrppl.engine.subsample import averaged_nat
from blrppl.errors import is_out_of_memory, out_of_memory_detail
from blrppl.inputs import host_fold_in
from blrppl.posterior.diagnostics import (
    ESS_CLOSE, ESS_POOR, KHAT_WARN, NUM_DRAWS, Diagnostics, importance_bound, psis_khat, relative_ess,
)
from blrppl.posterior.bulk import KHAT_BULK, check as bulk_check
from blrppl.posterior.importance import psis_smooth, weighted_draws
from blrppl.posterior.narrow import KHAT_SCREEN, flagged, screen, widths
from blrppl.posterior.result import BLRResult


def _diagnose(prepared, outcome, nat, grid_weights=None) -> Diagnostics:
    """The fit's :class:`blrppl.posterior.diagnostics.Diagnostics`: PSIS k̂ of q from one compiled call,
    and what the ELBO trace says; ``grid_weights``: the importance log-weights of a grid's
    mixture of fits (:func:`blrppl.posterior.grid_draws.mixture_log_weights`), read in place
    of q's blocks' (no narrow-q or bulk check: the scales are integrated)."""
    bundle, plan = prepared.bundle, prepared.plan
    elbo = np.asarray(outcome.elbo, dtype=float)
    finite = elbo.size >= 2 and bool(np.all(np.isfinite(elbo[-2:])))
    change = float(abs(elbo[-1] - elbo[-2]) / max(1.0, abs(elbo[-1]))) if finite else math.nan
    last = elbo[-bundle.window :] if bundle.window else elbo[:0]
    # (a window with a non-finite ELBO has no noise to measure: NaN, without numpy's
    # warning about ∞ − ∞)
    noise = (float(np.std(last)) if np.all(np.isfinite(last)) else math.nan) if last.size else 0.0
    base = dict(elbo_rel_change=change, rejected_steps=int(outcome.rejected_steps), elbo_noise=noise)
    if bundle.log_weights_fn is None:
        why = "subsampled plates" if plan.subsampled else "online fit (prior=)"
        return Diagnostics(khat=math.nan, num_draws=0, note=f"not computed: {why}", **base)
    if outcome.stop == CONVERGED and len(plan.blocks) == 1 and one_exact_block(plan):
        # the model's only latent block is conjugate: its closed-form step is the exact
        # posterior, whose importance weights are all equal (k̂ = −∞) without drawing any
        # (and the bound is the ELBO, log p(y) itself)
        return Diagnostics(
            khat=-math.inf, num_draws=0, note="one conjugate block in closed form: no draws needed",
            bound=float(elbo[-1]), **base,
        )
    key = host_fold_in(outcome.state.rng_key, 7)
    if grid_weights is not None:
        log_weights = np.asarray(grid_weights(nat, model_data(plan, prepared.dyn_data), key))
        return Diagnostics(
            khat=psis_khat(log_weights), num_draws=int(log_weights.size), ess=relative_ess(log_weights),
            bound=importance_bound(log_weights), **base
        )
    try:
        log_weights, at_draws, sd = _log_weights_read(prepared, nat, key)
        log_weights = np.asarray(log_weights)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        # (the fit is done; only its check cannot run: the result is returned without it)
        note = (
            "not computed: the model's log density at q's draws needs more memory than this machine has "
            f"({out_of_memory_detail(exc)})"
        )
        warnings.warn(f"blr_fit: PSIS k-hat {note}; q's quality is unchecked", UserWarning, stacklevel=5)
        return Diagnostics(khat=math.nan, num_draws=0, note=note, **base)
    diagnostics = Diagnostics(
        khat=psis_khat(log_weights), num_draws=int(log_weights.size), ess=relative_ess(log_weights),
        bound=importance_bound(log_weights), **base
    )
    # (weights with a relative ESS of at least ESS_CLOSE bound χ²(p‖q) by 1/0.95 − 1 = 0.053,
    # which a posterior 1.2× wider than q along one direction already exceeds (1/(r √(2 − r²))
    # − 1 = 0.11 for Gaussians): the narrow-q check, which flags from 1.2×, is not run; it cost
    # small fits 0.3 s of compilation, 50 % of a normal–gamma model's first fit)
    if diagnostics.ess >= ESS_CLOSE:
        return diagnostics
    if diagnostics.ess < ESS_POOR and diagnostics.khat <= KHAT_BULK:
        diagnostics = diagnostics._replace(bulk=_bulk(prepared, nat, host_fold_in(outcome.state.rng_key, 9)))
    found = _narrow_widths(prepared, nat, host_fold_in(outcome.state.rng_key, 8), diagnostics, (log_weights, at_draws, sd))
    return diagnostics._replace(widths=found, narrow=flagged(found))


def _log_weights_read(prepared, nat, key) -> tuple:
    """``(log_weights, at_draws, sd)`` of :meth:`blrppl.engine.build.CompiledFit.log_weights_read`;
    over several processes, computed over the mesh on every process's rows (the host holds
    this process's only: :mod:`blrppl.engine.processes`)."""
    bundle = prepared.bundle
    if not _spans_processes(prepared):
        return bundle.log_weights_read(nat, model_data(prepared.plan, prepared.dyn_data), key)
    read = functools.partial(model_data, prepared.plan)
    out = prepared.chunk.diagnostic(bundle.log_weights_fn, nat, prepared.dyn_data, read, key)
    return out if bundle.narrow_sites else (out, None, None)


def _narrow_draws(prepared, nat, key):
    """The narrow-q check's draws (:meth:`blrppl.engine.build.CompiledFit.narrow`), over the
    mesh over several processes (see :func:`_log_weights_read`)."""
    bundle = prepared.bundle
    if not _spans_processes(prepared) or bundle.narrow_fn is None:
        return bundle.narrow(nat, model_data(prepared.plan, prepared.dyn_data), key)
    read = functools.partial(model_data, prepared.plan)
    return prepared.chunk.diagnostic(bundle.narrow_fn, nat, prepared.dyn_data, read, key)


def _spans_processes(prepared) -> bool:
    """Whether the fit runs over several processes' devices (:mod:`blrppl.engine.processes`):
    its data on the host are this process's rows only."""
    return bool(getattr(prepared.chunk, "spans_processes", False))


def _narrow_widths(prepared, nat, key, diagnostics, read) -> tuple:
    """The :class:`blrppl.posterior.narrow.Width` of every scalar site the narrow-q check
    reads: from k̂'s own draws and weights (``read``: their log-weights, the sites at them,
    q's sds) where they suffice (:func:`blrppl.posterior.narrow.screen`: q otherwise good,
    k̂ ≤ KHAT_SCREEN, no site near the threshold), else from the check's widened draws (one
    compiled call, compiled then: random intercepts' first fit was 19 % slower for it); ()
    when it reads none or the machine lacks the memory."""
    bundle = prepared.bundle
    if read[1] is not None and not diagnostics.poor() and diagnostics.khat <= KHAT_SCREEN:
        found = screen(bundle.narrow_sites, *read)
        if found is not None:
            return found
    try:
        out = _narrow_draws(prepared, nat, key)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        return ()
    return () if out is None else widths(bundle.narrow_sites, *out)


def _bulk(prepared, nat, key):
    """The bulk check (:mod:`blrppl.posterior.bulk`) on q's importance-corrected draws, or
    None where they do not apply or the check cannot decide."""
    source = _importance_source(prepared, nat, None)
    if source is None:
        return None
    try:
        draws, log_w = weighted_draws(source, key, NUM_DRAWS)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        return None
    return bulk_check(draws, psis_smooth(log_w)[0])


def _infinite_khat_note(diagnostics) -> str | None:
    """The note for an infinite PSIS k̂ from importance weights that are not finite (the model's
    log density is −∞ or NaN at some of q's draws: q puts mass where the model has none), which
    no converged fit has; else None. (An infinite k̂ from finite weights too few of which carry
    weight is the poor-q warning's: a float32 fit of Poisson counts of 10⁹, whose posterior sd
    is below float32's resolution of its mean, has weights that are float32 rounding.)"""
    if diagnostics.khat != math.inf or not math.isnan(diagnostics.ess):
        return None
    return (
        "not converged: PSIS k-hat is infinite, the model's log density not being finite at some of q's draws "
        "(q puts mass where the model has none, or its densities overflow there)"
    )


def run(
    prepared: Prepared, state: BLRState, num_steps: int, progress_bar: bool, grid_scales: int | None = None, feed=None,
) -> BLRResult:
    """Run the jitted loop from ``state`` and package the result.

    A fresh start from which no step size keeps the ELBO finite, or with a chunk in most of
    whose steps no valid update was found (:data:`blrppl.engine.loop.STUCK_FRACTION`), is started
    again with its Gaussian blocks narrowed (:func:`narrowed`): with unit variances on a log scale, a
    Weibull's (y/λ)^k overflows at the quadrature's outer nodes (k = 2e^4.5, λ = 2e^−4.5),
    its expectation is infinite, and the fit stopped after 0 steps. So is one whose Monte Carlo
    ELBO diverged (:func:`blrppl.engine.loop.diverged_from`; the run returned its best state):
    from unit variances on a log scale, a power law of populations up to 275,000 overflowed
    its messages. ``grid_scales``: the most scales a grid holds, for the advice (see
    :func:`finish`); ``feed``: the fit's minibatches from an iterator
    (:class:`blrppl.graph.minibatches.BatchFeed`), one per step (a restart reads on)."""
    bundle = prepared.bundle
    t1 = time.perf_counter()
    restarts = NARROWED_STARTS if int(state.step) == 0 else 0

    def loop(state, attempt):
        # (the last start runs to its end, stuck or not)
        return run_loop(
            prepared.run_chunk, state, prepared.dyn_data, prepared.rho, prepared.tol, num_steps, prepared.chunk_size,
            progress_bar, bundle.window, give_up=attempt < restarts, feed=feed,
        )

    try:
        outcome = first = loop(state, 0)
        for attempt in range(1, restarts + 1):
            stuck = (outcome.num_steps == 0 and outcome.stop == NONFINITE) or outcome.stuck
            if outcome.exhausted or (not stuck and outcome.restored is None):
                break
            state = narrowed(prepared.plan, state)
            outcome = loop(state, attempt)
        if outcome.num_steps == 0 and outcome.stop == NONFINITE:
            outcome = first  # (no narrowed start took a step either: the model's own start is returned)
        if outcome.stuck and not outcome.exhausted:  # (the model's own start, cut short: run on from it)
            outcome = loop(outcome.state, restarts)
    finally:
        if feed is not None:
            feed.close()
    jax.block_until_ready(outcome.state)
    t2 = time.perf_counter()
    budget.check(f"after {outcome.num_steps} steps, before its diagnostics")
    plan = prepared.plan
    nat = averaged_nat(plan, outcome.state) if prepared.iterate_average and plan.subsampled else outcome.state.nat
    return finish(prepared, outcome, nat, num_steps, t1, t2, grid_scales=grid_scales)


def finish(
    prepared: Prepared, outcome, nat: dict, num_steps: int, t1: float, t2: float, grid=None,
    grid_scales: int | None = None, grid_weights=None,
) -> BLRResult:
    """Package a run of the loop (``outcome``, reporting ``nat``): the posterior export, the
    diagnostics, the stop message and its warnings (at the line that called ``blr_fit`` or
    ``BLR.run``). ``grid``: the note of the scales integrated on a grid
    (:mod:`blrppl.engine.grid`), whose marginals ``nat`` holds; ``grid_scales``: the most
    scales a grid holds (:data:`blrppl.engine.grid.MAX_SCALES`, which this module cannot
    import: the grid runs fits through it), so that the advice for sites the narrow-q check
    flags names no more (None: every flagged site); ``grid_weights``: the grid's mixture's
    importance log-weights, for its diagnostics (:func:`_diagnose`)."""
    bundle, plan = prepared.bundle, prepared.plan
    with COMPILE_LOCK:
        posterior = bundle.posterior_fn(nat)
        diagnostics = _diagnose(prepared, outcome, nat, grid_weights)
    t3 = time.perf_counter()
    improper = improper_blocks(outcome, plan)
    if improper:
        warnings.warn("blr_fit: " + improper_note(plan, outcome.state.nat, improper), UserWarning, stacklevel=4)
    message = stop_message(outcome, plan, bundle.window, prepared.tol, num_steps)
    if outcome.stop == NONFINITE or never_finite(outcome):
        # (the result holds the last valid state, or no step's: without a warning only the
        # message says so)
        warnings.warn("blr_fit: " + message, UserWarning, stacklevel=4)
    diverged = divergence_note(outcome.elbo, outcome.restored)
    if diverged is not None:
        message += "; " + diverged
        warnings.warn("blr_fit: " + diverged, UserWarning, stacklevel=4)
    failed = [note for note in (stalled_note(outcome, bundle.window), _infinite_khat_note(diagnostics)) if note]
    if failed and outcome.converged:
        message = message.replace("converged after", "met the convergence test after", 1)
        message += "; " + "; ".join(failed)
        warnings.warn("blr_fit: " + "; ".join(failed), UserWarning, stacklevel=4)
    if grid is not None:
        message += "; " + grid
    relabelled = relabelling_note(plan)
    if relabelled is not None:
        message += "; " + relabelled
    if diagnostics.khat > KHAT_WARN and diagnostics.ess >= ESS_CLOSE:
        # (nearly equal weights: q's bulk is the posterior's; k̂ reads the tail of a ratio
        # that hardly varies, no warning)
        message += (
            f"; PSIS k-hat = {diagnostics.khat:.2f} > {KHAT_WARN}, but importance sampling from q keeps "
            f"{100 * diagnostics.ess:.0f} % of its draws effective: q's tails differ from the posterior's, "
            "its bulk is close"
        )
    if diagnostics.ess < ESS_POOR and diagnostics.bulk is not None and not diagnostics.bulk.off:
        # (many dimensions each a little off make the ESS low: blrppl.posterior.bulk)
        message += (
            f"; importance sampling from q keeps only {100 * diagnostics.ess:.0f} % of its draws effective, but "
            + diagnostics.bulk_note()
        )
    if diagnostics.poor():
        advice = poor_q_advice(plan, prepared.num_starts, diagnostics.narrow, grid_scales) if grid is None else (
            "the scales integrated on a grid have their marginals from it, but k-hat is that of q's blocks drawn "
            "independently (on a product grid result.sample draws the grid's mixture jointly; result.guide does not); "
            "compare with NUTS"
        )
        reasons = []
        if diagnostics.khat > KHAT_WARN and not diagnostics.ess >= ESS_CLOSE:
            reasons.append(f"PSIS k-hat = {diagnostics.khat:.2f} > {KHAT_WARN}")
        elif diagnostics.low_ess():
            # (k̂ fits the tail of the weights only; their spread says how far q's bulk is:
            # see blrppl.posterior.diagnostics.ESS_POOR)
            reasons.append(
                f"importance sampling from q keeps only {100 * diagnostics.ess:.0f} % of its draws effective "
                f"(PSIS k-hat = {diagnostics.khat:.2f}): q's bulk differs from the posterior's, where a mean may lie "
                f"up to {math.sqrt(1.0 / diagnostics.ess - 1.0):.1f} of q's sds from q's, and sds may be too small"
                + (f" ({diagnostics.bulk_note()})" if diagnostics.bulk is not None else "")
            )
        if diagnostics.narrow:
            # (q's draws do not reach where the posterior is wider than q: PSIS cannot see it,
            # blrppl.posterior.narrow can)
            reasons.append(diagnostics.narrow_note())
        note = f"q may be a poor approximation of the posterior ({'; '.join(reasons)}): {advice}"
        message += "; " + note
        warnings.warn("blr_fit: " + note, UserWarning, stacklevel=4)
    result = BLRResult(
        posterior=posterior,
        elbo=np.asarray(outcome.elbo),
        num_steps=outcome.num_steps,
        converged=outcome.converged and diverged is None and not failed,
        message=message,
        diagnostics=diagnostics,
        diagnostic_time=t3 - t2,
        plan=prepared.plan,
        nat=nat,
        compile_time=t1 - prepared.start_time,
        run_time=t2 - t1,
        graph=bundle.graph,
        state=outcome.state,
        compile_counts=prepared.compile_counts,
        model_lock=COMPILE_LOCK,
        importance=_importance_source(prepared, nat, grid),
    )
    return result


def _importance_source(prepared: Prepared, nat: dict, grid):
    """``key → (log-weights, draws)`` of q against the model for the result's importance-
    corrected summaries (:mod:`blrppl.posterior.importance`), or None where they do not apply:
    no weights (subsampled plates, an online fit), enumerated discrete latents (summed out of
    the weights, so their draws would not be reweighted with the rest), scales on a grid
    (whose marginals are the grid's, not q's)."""
    bundle, plan = prepared.bundle, prepared.plan
    if bundle.weighted_draws_fn is None or grid is not None or _spans_processes(prepared) or any(b.discrete and not b.chain for b in plan.blocks):
        return None
    data = model_data(plan, prepared.dyn_data)
    return functools.partial(bundle.weighted_draws, nat, data)
