"""The jitted loop: chunks of steps inside ``lax.while_loop``, convergence and stopping.

A chunk runs up to ``chunk_size`` steps without leaving the device; between chunks the host
updates the progress bar. A run stops when

* the relative ELBO change is at most ``tol`` and the largest relative change of a natural
  parameter is at most ``sqrt(tol)`` (converged), or
* backtracking finds no acceptable step: a step that makes the ELBO or a natural parameter
  non-finite, or lowers an exact ELBO by more than rounding (:func:`drop_slack`), is undone
  and every ρ halved (doubled again, up to 1, after two accepted steps in a row); when the
  damping falls below ``MIN_DAMPING`` the run ends with the last valid state, or
* ``num_steps`` steps have run.

A Monte Carlo step is taken whenever its ELBO is finite, so a fit can drift away step by step
(a poor start whose steps overshoot); its chunks carry the best state by ELBO, and a run
whose last ELBO fell far below the best (:func:`diverged_from`) returns that best state.

The first step from a fresh start of a plan with non-conjugate blocks is a line search:
from an arbitrary starting point a full step (a damped Newton step on the factors' expected
log-densities) can overshoot far beyond the optimum of a log-density that is nearly linear
there (a Student-t's log-scale far above its data) and still raise the start's ELBO, which
its Σ = I makes very low; the fit may then end in another basin. So the first step is
probed at ρ, ρ/2, ρ/4, … from the start while the ELBO keeps rising, and taken at the best
(the probes are undone and not counted as steps; ρ grows back as after backtracking).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.engine import budget
from blrppl.engine.interrupt import deferred_interrupts
from blrppl.engine.kernel import bind_step
from blrppl.engine.state import BLRState
from blrppl.engine.step import all_finite, relative_delta
from blrppl.graph.data import host_array

CONTINUE, CONVERGED, NONFINITE, BAD_RATE, STATIONARY = 0, 1, 2, 3, 4
#: exact ELBOs: also converged when the ELBO moved by less than tol (relative) over this many
#: accepted steps, though the parameters still drift along directions the ELBO hardly sees
STATIONARY_STEPS = 20


def history_size(window: int) -> int:
    """Length of the ring buffer of recent ELBOs a chunk carries."""
    return 2 * window if window else STATIONARY_STEPS


def empty_history(window: int):
    """A ring buffer of recent ELBOs before any step (NaN: not yet filled)."""
    # built on the host: an eager jnp.full would compile an XLA computation of its own
    return host_array(np.full((history_size(window),), np.nan), jnp.result_type(float))
#: backtracking gives up when the damping of ρ falls below this (an exp link far below its
#: data, e.g. Poisson counts of 10⁹ from a prior at 0, needs ρ ≈ 2⁻³¹ on its first step)
MIN_DAMPING = 2.0**-60
#: the first step's line search probes ρ down to this
SEARCH_FLOOR = 2.0**-20
#: a fit's last ELBO this many times its best's magnitude below the best: it diverged
DIVERGED_FALL = 10.0
#: a fresh start with a chunk in more than this fraction of whose steps some block found no
#: valid update is stuck (see :func:`run_loop`'s ``give_up``)
STUCK_FRACTION = 0.8


def diverged_from(elbo) -> int | None:
    """The index of the best ELBO of a fit whose last ELBO fell far below it (below best −
    :data:`DIVERGED_FALL` · max(|best|, 100)), else None (a last ELBO that is not finite is
    the stop message's, not a divergence)."""
    elbo = np.asarray(elbo, float)
    finite = np.flatnonzero(np.isfinite(elbo))
    if finite.size < 2 or not np.isfinite(elbo[-1]):
        return None
    best = int(finite[np.argmax(elbo[finite])])
    if elbo[-1] >= elbo[best] - DIVERGED_FALL * max(abs(elbo[best]), 100.0):
        return None
    return best


class LoopOutcome(NamedTuple):
    state: BLRState
    elbo: np.ndarray
    num_steps: int
    converged: bool
    stop: int
    invalid_steps: int
    #: blocks whose messages did not form a valid natural parameter at the last step
    improper: tuple = ()
    #: steps undone by backtracking
    rejected_steps: int = 0
    #: per step run, whether every block found a valid update
    valid: np.ndarray | None = None
    #: the step (counted from 1) whose state a diverged run returns instead of its last
    restored: int | None = None
    #: a run told to ``give_up`` stopped after a chunk in most of whose steps some block found
    #: no valid update (:data:`STUCK_FRACTION`)
    stuck: bool = False
    #: the run's minibatch iterator (``feed``) ended before its last step
    exhausted: bool = False


def drop_slack(elbo) -> float:
    """The relative fall of an exact ELBO that backtracking undoes a step for: 10⁻⁹, or
    16 machine epsilons when that is larger (float32: 1.9·10⁻⁶). Below it the fall is
    rounding: at a fixed point a float32 ELBO of 10³ moves by an ulp (6·10⁻⁵) from step to
    step, and a step undone for that is undone again at every smaller ρ until the run stops
    as if no step size worked."""
    return max(1e-9, 16 * float(jnp.finfo(jnp.result_type(elbo)).eps))


def make_chunk(
    step, chunk_size: int, window: int = 0, epoch: int = 0, rate_fn=None, blocks=(),
    elbo_fn=None, exact_block=None, views_fn=None, first_search: bool = False,
):
    """``chunk(state, data, steps_left, rho, history, tol) -> (state, elbo buffer, steps run,
    stop code, invalid steps, history)``; ``rho`` is the per-block step-size dict passed to
    ``step``, ``tol`` the convergence tolerance (a scalar array: a fit with another ``tol``
    runs the same program).

    With ``window`` > 0 the ELBO is a Monte Carlo estimate and convergence is tested on
    windowed means: the mean of the last ``window`` ELBOs against the mean of the
    ``window`` before them, converged (after at least 4·window steps) when they differ by
    less than ``tol`` relative or by less than half the standard error of the difference
    (no progress the noise lets one detect). ``history`` is the ring buffer of the last
    2·window ELBOs carried across chunks.

    With ``epoch`` > 0 the ELBO is a minibatch estimate under random reshuffling with
    ``epoch`` steps per pass over the data and ``window`` a multiple of it: the test runs at
    epoch ends only, where each window mean covers every data element once (the noise of
    which minibatch was drawn cancels), and only on the relative change ``tol``: the spread
    within a window is dominated by that cancelled noise, so half its standard error would
    declare convergence while the global parameters are still several posterior sd away.

    With ``elbo_fn`` and exact ELBOs (``window`` 0: backtracking reads it), a fresh state's
    ELBO (NaN) is computed before the first step; a Monte Carlo chunk has no such program. With
    ``exact_block`` (the plan's only block, conjugate: one step at ρ = 1 is its exact
    posterior) the run converges after one such step. With ``views_fn`` (``(state, data)`` →
    the state with its views, and the messages its step reads first: the ``carry``
    of :func:`blrppl.engine.step.make_step`) the loop carries each block's view (and
    messages) from step to step (formed once per chunk, then at the end of each step); the
    chunk returns the state without them.

    The chunk also returns whether each of its steps was valid (every block found a valid
    update) and, for Monte Carlo ELBOs (``window`` > 0, no minibatches), the best state it
    reached, ``(ELBO, natural parameters, step within the chunk)`` (ELBO −∞ when it accepted
    no step; None for other fits).

    A step in which some block found no valid update (it kept its parameters, so the ELBO
    may not move) never counts as converged, nor does a step after which the messages to a
    block in ``blocks`` (the names the step reports in ``info.proper``) were not a valid
    natural parameter. With a user schedule ``rate_fn`` the run stops
    (code ``BAD_RATE``) before a step whose ρ is not a finite number ≥ 0.

    With ``first_search`` (exact ELBOs only), the first step of a fresh state (step 0) is
    the line search of the module docstring: probes at halved damping while each raises
    the ELBO above the last, then the step again at the best damping (only scalars are
    carried: the best probe is computed once more, not kept).
    """
    def chunk(state, data, steps_left, rho, history, tol):
        dtype = jnp.result_type(float)
        tol = jnp.asarray(tol, dtype)
        buf = jnp.full((chunk_size,), jnp.nan, dtype)
        valid_buf = jnp.zeros((chunk_size,), bool)
        track_best = bool(window) and not epoch
        best0 = (jnp.full((), -jnp.inf, dtype), state.nat, jnp.full((), -1, jnp.int32)) if track_best else None
        limit = jnp.minimum(steps_left, chunk_size)
        proper0 = {n: jnp.array(True) for n in blocks}
        # the first step's line search: (probing, best ELBO so far, its damping)
        search0 = (
            jnp.asarray(first_search) & (state.step == 0),
            jnp.full((), -jnp.inf, jnp.result_type(state.elbo)),
            jnp.ones((), jnp.result_type(state.damping)),
        )
        if elbo_fn is not None and exact_block is None and not window:
            state = jax.lax.cond(
                jnp.isnan(state.elbo),
                lambda s: s._replace(elbo=jnp.asarray(elbo_fn(s.nat, data, s.rng_key), dtype)),
                lambda s: s,
                state,
            )

        if views_fn is not None:
            state = views_fn(state, data)
        # the kernel's step (blrppl.engine.kernel): the rule with this chunk's data and ρ bound
        kernel_step = bind_step(step, data, rho)

        def cond(carry):
            _, i, _, stop, _, _, _, _, _, _, _ = carry
            return (i < limit) & (stop == CONTINUE)

        def body(carry):
            st, i, buf, _, invalid, history, _, undone, search, valid_buf, best = carry
            if rate_fn is not None:
                rate = jnp.asarray(rate_fn(st.step))
                bad_rate = ~(jnp.isfinite(rate) & (rate >= 0))
            else:
                bad_rate = jnp.array(False)
            new, info = kernel_step(st)
            finite = jnp.isfinite(info.elbo) & all_finite(new.nat)
            if window:
                history = jnp.where(finite, jnp.roll(history, -1).at[-1].set(info.elbo), history)
                accept, stationary = finite, None
                conv = finite & info.valid & _windowed_converged(history, new.step, tol, window, epoch)
            else:
                exact_rho = rho[exact_block] if exact_block is not None and rate_fn is None else None
                accept, conv, stationary, history = _exact_tests(st, new, info, finite, history, tol, exact_rho)
            accept, conv, probe, ends, search = _line_search(search, st, info, accept, conv)
            accept = accept & ~bad_rate
            new = _accepted_or_rejected(st, new, accept, probe, ends, search[2])
            buf = buf.at[i].set(jnp.where(accept, info.elbo, st.elbo))
            valid_buf = valid_buf.at[i].set(info.valid)
            best = _best_state(best, accept & ~bad_rate, info.elbo, new.nat, i) if track_best else best
            stuck = ~accept & ~ends & (new.damping < MIN_DAMPING)
            converged_code = CONVERGED if window else jnp.where(stationary, STATIONARY, CONVERGED)
            stop = jnp.where(stuck, NONFINITE, jnp.where(conv & ~bad_rate, converged_code, CONTINUE))
            stop = jnp.where(bad_rate, BAD_RATE, stop)
            new = jax.tree.map(lambda a, b: jnp.where(bad_rate, a, b), st, new)
            invalid = invalid + jnp.where(info.valid | bad_rate | probe, 0, 1).astype(jnp.int32)
            i = i + jnp.where(stuck | bad_rate | probe, 0, 1).astype(jnp.int32)
            last_proper = info.proper if info.proper is not None else {}
            undone = undone + jnp.where(accept | bad_rate | probe, 0, 1).astype(jnp.int32)
            return new, i, buf, stop.astype(jnp.int32), invalid, history, last_proper, undone, search, valid_buf, best

        zero = jnp.zeros((), jnp.int32)
        init = (state, zero, buf, zero, zero, history, proper0, zero, search0, valid_buf, best0)
        state, n, buf, stop, invalid, history, proper, undone, _, valid_buf, best = jax.lax.while_loop(cond, body, init)
        state = state._replace(views=None, entropies=None, messages=None)
        return state, buf, n, stop, invalid, history, proper, undone, valid_buf, best

    return chunk


def _best_state(best, accepted, elbo, nat, i):
    """The best ``(ELBO, natural parameters, step in the chunk)`` so far, after a step ``i``
    to ``nat`` with ``elbo``, ``accepted`` or not."""
    better = accepted & (elbo > best[0])
    return jax.tree.map(lambda a, b: jnp.where(better, b, a), best, (elbo.astype(best[0].dtype), nat, i))


def _windowed_converged(history, count, tol, window: int, epoch: int):
    """The windowed-mean convergence test of Monte Carlo and minibatch ELBOs (see
    :func:`make_chunk`) on the ring buffer ``history`` after ``count`` steps."""
    recent, previous = history[window:], history[:window]
    diff = jnp.abs(recent.mean() - previous.mean())
    se = jnp.sqrt((recent.var() + previous.var()) / window)
    scale = jnp.maximum(1.0, jnp.abs(recent.mean()))
    if epoch:
        return (count >= 4 * window) & (jnp.mod(count, epoch) == 0) & (diff <= tol * scale)
    return (count >= 4 * window) & ((diff <= tol * scale) | (diff <= 0.5 * se))


def _exact_tests(st, new, info, finite, history, tol, exact_rho):
    """Backtracking and the convergence tests of exact ELBOs for the step ``st`` → ``new``:
    ``(accept, converged, stationary, history)``. A step that lowers the ELBO is not
    accepted (undone, ρ halved); ``exact_rho``: the ρ of the plan's only block when it is
    conjugate (one step at ρ = 1 converges), else None."""
    known = jnp.isfinite(st.elbo)
    drop = info.elbo < st.elbo - drop_slack(st.elbo) * jnp.maximum(1.0, jnp.abs(st.elbo))
    accept = finite & ~(known & drop)
    change = jnp.abs(info.elbo - st.elbo) <= tol * jnp.maximum(1.0, jnp.abs(info.elbo))
    proper = jnp.all(jnp.stack([jnp.array(True)] + list(jax.tree.leaves(info.proper))))
    # (the parameters' relative change, a reduction over all of them, only once
    # the ELBO has settled)
    settled = jax.lax.cond(
        change & known, lambda: relative_delta(st.nat, new.nat) <= jnp.sqrt(tol), lambda: jnp.array(False)
    )
    if exact_rho is not None:
        settled = settled | ((exact_rho == 1.0) & (st.damping == 1.0))
    history = jnp.where(accept, jnp.roll(history, -1).at[-1].set(info.elbo), history)
    spread = jnp.max(history) - jnp.min(history)
    flat = jnp.all(jnp.isfinite(history)) & (spread <= tol * jnp.maximum(1.0, jnp.abs(info.elbo)))
    stationary = accept & info.valid & proper & flat & ~settled
    conv = accept & info.valid & proper & (settled | flat)
    return accept, conv, stationary, history


def _line_search(search, st, info, accept, conv):
    """The first step's line search: every probe is undone; one that raises the ELBO above
    the best probe is recorded and the next probe halves ρ; the search ends at the first
    probe that does not (or at the floor), and the step is then computed again at the best
    damping (accepted: its ELBO did not drop). Returns ``(accept, converged, probe, ends,
    search)``, the step's acceptance and convergence with a probe's withdrawn, whether it
    was a probe, whether the search ends with it, and the new ``(probing, best ELBO, its
    damping)``."""
    probing, best_elbo, best_damping = search
    better = probing & accept & (info.elbo > best_elbo)
    ends = probing & jnp.isfinite(best_elbo) & (~better | (st.damping <= SEARCH_FLOOR))
    best_damping = jnp.where(better, st.damping, best_damping)
    best_elbo = jnp.where(better, info.elbo, best_elbo)
    return accept & ~probing, conv & ~probing, probing, ends, (probing & ~ends, best_elbo, best_damping)


def _accepted_or_rejected(st, new, accept, probe, ends, best_damping):
    """The state after a step: ``new`` when accepted, with ρ growing back (×2, up to 1)
    after two accepted steps in a row (a damped step that worked right after a rejection
    does not restore the step that failed); else ``st`` with ρ halved (or, at the end of the
    line search, the best probe's damping) and its step counted unless it was a probe."""
    streak = st.streak + 1
    grown = jnp.where(streak >= 2, jnp.minimum(1.0, 2.0 * st.damping), st.damping)
    rejected = st._replace(
        step=jnp.where(probe, st.step, st.step + 1),
        rng_key=new.rng_key,
        damping=jnp.where(ends, best_damping, 0.5 * st.damping),
        streak=jnp.zeros_like(st.streak),
    )
    return jax.tree.map(lambda a, b: jnp.where(accept, b, a), rejected, new._replace(damping=grown, streak=streak))


def run_loop(
    chunk_fn, state: BLRState, data, rho, tol: float, num_steps: int, chunk_size: int, progress_bar: bool,
    window: int = 0, give_up: bool = False, feed=None,
):
    """Run chunks until convergence (relative tolerance ``tol``), a stop, or ``num_steps``; a
    run whose ELBO diverged returns its best state (:func:`diverged_from`). With ``give_up``
    (a fresh start that may be started again narrower), a chunk in more than
    :data:`STUCK_FRACTION` of whose steps some block found no valid update ends the run
    (``stuck``; with a ``feed``, of ``chunk_size`` steps at a time): a Gaussian block started
    with unit variances where its Monte Carlo messages overflow (a Poisson rate a·P^b with b
    on a log scale and populations of 10³–10⁴) drifted off in its first hundred steps, then
    kept its parameters in 900 of the next 900 and ended 775 posterior sds away.

    Ctrl-C stops the run at the next chunk boundary with ``KeyboardInterrupt``
    (:func:`blrppl.engine.interrupt.deferred_interrupts`), even where Python would drop it; so
    does a refinement candidate's deadline, with :class:`blrppl.engine.budget.OverBudget`.

    With ``feed`` (a :class:`blrppl.graph.minibatches.BatchFeed`), every step is a chunk of
    one step on the feed's next batch (``data`` unused), whose following batch the feed
    reads on a host thread while the step runs; the run ends (``exhausted``) when the feed
    has no batch left.
    """
    history = empty_history(window)
    tol = host_array(tol, jnp.result_type(float))
    elbos, valid, total, stop, invalid, proper, rejected = [], [], 0, CONTINUE, 0, {}, 0
    best = None  # (ELBO, natural parameters, step counted from 1) of Monte Carlo fits
    stuck = exhausted = False
    span = [0, 0]  # (steps and invalid steps since the last stuck test: a chunk's, or chunk_size steps of a feed)
    bar = _progress_bar(num_steps) if progress_bar else None
    try:
        with deferred_interrupts() as interrupt:
            while total < num_steps and stop == CONTINUE:
                interrupt.check()
                budget.check(f"after {total} steps")
                steps, chunk_data = num_steps - total, data
                if feed is not None:
                    steps, chunk_data = 1, feed.next(ahead=total + 1 < num_steps)
                    if chunk_data is None:
                        exhausted = True
                        break
                state, buf, n, stop_arr, inv, history, last_proper, rej, valid_buf, chunk_best = chunk_fn(
                    state, chunk_data, host_array(steps, np.int32), rho, history, tol
                )
                n = int(n)
                rejected += int(rej)
                if n:
                    proper = last_proper
                if chunk_best is not None and float(chunk_best[0]) > (best[0] if best else -np.inf):
                    best = (float(chunk_best[0]), chunk_best[1], total + int(chunk_best[2]) + 1)
                elbos.append(np.asarray(buf)[:n])
                valid.append(np.asarray(valid_buf)[:n])
                total += n
                stop = int(stop_arr)
                invalid += int(inv)
                if bar is not None:
                    bar.update(n)
                    if n:
                        # (a step per call with a feed: drawn at tqdm's pace, not at every step)
                        bar.set_postfix(elbo=f"{float(elbos[-1][-1]):.4g}", refresh=feed is None)
                if n == 0 and stop == CONTINUE:
                    break
                span = [span[0] + n, span[1] + int(inv)]
                if feed is not None and span[0] < chunk_size:
                    continue  # (a feed's steps are tested for being stuck chunk_size at a time, as a chunk's)
                if give_up and stop == CONTINUE and span[1] > STUCK_FRACTION * span[0]:
                    stuck = True
                    break
                span = [0, 0]
    finally:
        if bar is not None:
            bar.close()
    elbo = np.concatenate(elbos) if elbos else np.zeros((0,))
    improper = tuple(k for k, v in proper.items() if not bool(v))
    outcome = LoopOutcome(
        state, elbo, total, stop in (CONVERGED, STATIONARY), stop, invalid, improper, rejected,
        np.concatenate(valid) if valid else np.zeros((0,), bool), stuck=stuck, exhausted=exhausted,
    )
    return restored_best(outcome, best)


def _progress_bar(num_steps: int):
    """A tqdm progress bar of ``num_steps`` steps, or None without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=num_steps, desc="blr", leave=False)


def restored_best(outcome: LoopOutcome, best) -> LoopOutcome:
    """``outcome`` with the state of ``best`` ``(ELBO, natural parameters, step)`` when its
    ELBO trace diverged (:func:`diverged_from`) and that best is as good as the trace's (a
    diverged run is not converged); else ``outcome``."""
    at = diverged_from(outcome.elbo)
    if best is None or at is None or best[0] < outcome.elbo[at]:
        return outcome
    dtype = jnp.result_type(outcome.state.elbo)
    state = outcome.state._replace(nat=best[1], elbo=host_array(best[0], dtype))
    return outcome._replace(state=state, converged=False, restored=best[2])
