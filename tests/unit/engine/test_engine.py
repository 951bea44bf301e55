"""Compile guard (DESIGN.md §6, §8): the jitted chunk is traced once per (model, shapes).

The step that ``blr_fit`` builds with :func:`blrppl.engine.step.make_step` is wrapped with a
side-effect counter (it increments on every *Python* execution, i.e. every trace), and the
chunk that :func:`blrppl.engine.loop.make_chunk` builds from it is captured with the
initial state and the data leaves. Calling the jitted chunk again with new data of the same
shapes must not run the step's Python again, and must still use the new data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import blrppl.engine.build as build
import blrppl.engine.run as run_module
from blrppl.api import blr_fit
from blrppl.engine import loop as engine_loop
from blrppl.engine import step as engine_step
from blrppl.posterior.export import site_distribution

M0, S0, SIGMA = 1.0, 2.0, 0.5


def normal_normal(y):
    mu = numpyro.sample("mu", dist.Normal(M0, S0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, SIGMA), obs=y)


def exact(y):
    precision = 1 / S0**2 + len(y) / SIGMA**2
    return (M0 / S0**2 + np.sum(y) / SIGMA**2) / precision, 1 / precision


@pytest.fixture(scope="module")
def captured():
    """Run blr_fit once with counting wrappers around make_step / make_chunk / run_loop."""
    assert build.make_step is engine_step.make_step and build.make_chunk is engine_loop.make_chunk
    traces = {"count": 0}
    got = {}

    def counting_make_step(*args, **kwargs):
        step, elbo_fn, messages, carry = engine_step.make_step(*args, **kwargs)

        def counting_step(*step_args, **step_kwargs):
            traces["count"] += 1
            return step(*step_args, **step_kwargs)

        return counting_step, elbo_fn, messages, carry

    def capturing_make_chunk(step, chunk_size, *rest, **options):
        chunk = engine_loop.make_chunk(step, chunk_size, *rest, **options)
        got["chunk"] = chunk
        return chunk

    def capturing_run_loop(compiled, *args, **kwargs):
        def recording(*call_args):
            # chunk(state, data, steps_left, *extra): the first call's arguments
            got.setdefault("call", call_args)
            return compiled(*call_args)

        return engine_loop.run_loop(recording, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    # (the program store off: a fit stored by an earlier run of this test is loaded, not traced)
    mp.setenv("BLRPPL_COMPILATION_CACHE", "0")
    mp.setattr(build, "make_step", counting_make_step)
    mp.setattr(build, "make_chunk", capturing_make_chunk)
    mp.setattr(run_module, "run_loop", capturing_run_loop)
    try:
        y = 3.0 + SIGMA * np.random.default_rng(0).normal(size=20)
        result = blr_fit(
            normal_normal, {"y": y}, learning_rate=1.0, rng_key=jax.random.key(0), progress_bar=False
        )
    finally:
        mp.undo()
    assert {"chunk", "call"} <= set(got), "blr_fit no longer goes through make_chunk/run_loop"
    return result, y, got, traces


def mu_posterior(plan, state):
    """Mean and variance of the 'mu' block from a state's natural parameters."""
    q = site_distribution(plan.block("mu"), state.nat["mu"], 0)
    return float(q.mean), float(q.variance)


def test_blr_fit_traces_step_once(captured):
    result, y, _, traces = captured
    # one fit: the step is traced when the chunk is lowered (lax.while_loop traces its
    # body once); conjugacy detection is off (learning_rate given)
    assert traces["count"] == 1
    mean, var = exact(y)
    np.testing.assert_allclose(result.posterior["mu"].mean, mean, atol=1e-10)
    np.testing.assert_allclose(result.posterior["mu"].variance, var, atol=1e-10)


def _call(chunk, got, data=None, steps=1):
    """Call the chunk as blr_fit's loop did, with other data and step count."""
    state, old_data, _, *extra = got["call"]
    out = chunk(state, old_data if data is None else data, jnp.asarray(steps, jnp.int32), *extra)
    return jax.block_until_ready(out)


def _with_y(got, y):
    data = got["call"][1]
    return jax.tree.unflatten(jax.tree.structure(data), [jnp.asarray(y)])


def test_chunk_does_not_retrace_for_new_data(captured):
    result, y, got, traces = captured
    chunk = jax.jit(got["chunk"])
    leaves = jax.tree.leaves(got["call"][1])
    assert len(leaves) == 1 and np.shape(leaves[0]) == y.shape, "y must travel as a jit argument"

    before = traces["count"]
    out1 = _call(chunk, got)
    # 0 when jit's trace cache already holds the chunk from blr_fit's own lowering, else 1
    assert traces["count"] - before <= 1
    base = traces["count"]

    y2 = y[::-1] * 1.5 - 2.0  # same shape and dtype, different values
    out2 = _call(chunk, got, _with_y(got, y2))
    _call(chunk, got, steps=5)
    assert traces["count"] == base, "the jitted chunk was retraced for data of the same shapes"

    # the second call did use the new data: one step is the exact posterior for y2
    for out, yy in ((out1, y), (out2, y2)):
        mean, var = mu_posterior(result.plan, out[0])
        want_mean, want_var = exact(yy)
        assert mean == pytest.approx(want_mean, abs=1e-10)
        assert var == pytest.approx(want_var, abs=1e-10)
    assert int(out1[2]) == 1 and int(out2[2]) == 1


def test_chunk_retraces_only_for_new_shapes(captured):
    """Sanity check of the counter itself: a new data shape does trace again."""
    _, y, got, traces = captured
    chunk = jax.jit(got["chunk"])
    _call(chunk, got)
    base = traces["count"]
    try:
        _call(chunk, got, _with_y(got, np.concatenate([y, y])))
    except Exception:  # the plan may hold shape-specific constants; the trace still ran
        pass
    assert traces["count"] == base + 1


def test_a_float32_elbo_falling_by_rounding_is_not_backtracked():
    """At a fixed point a float32 ELBO moves by an ulp or so from step to step. A step whose
    ELBO falls by that much is accepted (the fall is below 16 machine epsilons, relative)
    and the run converges; a fall of 10⁻⁴ (relative) is still undone, ρ halved, until the
    run stops. (Undoing every ulp-sized fall stopped a float32 HMM as if no step size
    worked, after 60 halvings.)"""
    from blrppl.engine.loop import CONVERGED, NONFINITE
    from blrppl.engine.step import BLRInfo, initial_state

    def run(fall):
        def step(state, data, rho):
            elbo = (state.elbo - fall * jnp.abs(state.elbo)).astype(jnp.float32)
            info = BLRInfo(elbo=elbo, valid=jnp.array(True), proper={})
            return state._replace(step=state.step + 1, elbo=elbo), info

        chunk = jax.jit(engine_loop.make_chunk(step, 200))
        state = initial_state({"x": jnp.zeros((), jnp.float32)}, jax.random.key(0))
        state = state._replace(elbo=jnp.asarray(-1000.0, jnp.float32), damping=jnp.asarray(1.0, jnp.float32))
        out = chunk(state, None, jnp.asarray(200, jnp.int32), {}, engine_loop.empty_history(0), jnp.float32(1e-5))
        return int(out[3]), int(out[7])  # stop code, steps undone

    ulp = float(np.spacing(np.float32(1000.0))) / 1000.0
    assert run(ulp) == (CONVERGED, 0)
    stop, undone = run(1e-4)
    assert stop == NONFINITE and undone > 50


def test_a_settled_elbo_converges_only_once_the_parameters_stop_moving():
    """With the ELBO unchanged from step to step, the run converges at once when the natural
    parameters do not move, and not while they move by more than sqrt(tol) relative (it ends
    as stationary, on its flat ELBO history, instead)."""
    from blrppl.engine.loop import CONVERGED, STATIONARY
    from blrppl.engine.step import BLRInfo, initial_state

    def run(growth):
        def step(state, data, rho):
            nat = {"x": state.nat["x"] * (1.0 + growth)}
            info = BLRInfo(elbo=state.elbo, valid=jnp.array(True), proper={})
            return state._replace(nat=nat, step=state.step + 1), info

        chunk = jax.jit(engine_loop.make_chunk(step, 50))
        state = initial_state({"x": jnp.ones((3,))}, jax.random.key(0))
        state = state._replace(elbo=jnp.asarray(-10.0), damping=jnp.asarray(1.0))
        out = chunk(state, None, jnp.asarray(50, jnp.int32), {}, engine_loop.empty_history(0), jnp.asarray(1e-8))
        return int(out[3]), int(out[2])  # stop code, steps run

    assert run(0.0) == (CONVERGED, 1)
    stop, steps = run(1e-2)
    assert stop == STATIONARY and steps > 1


@pytest.mark.parametrize(
    "gain, first_search, start_step, x1, elbo1, damping1",
    [
        # probes ρ = 1 (x 17.8, ELBO -282: up from -441), ½ (x -1.1, ELBO -4.41: better),
        # ¼ (x -10.55, ELBO -133: worse): the step is taken at ½
        (1.8, True, 0, -1.1, -4.41, 0.5),
        # no search: the full step raises the ELBO and is kept
        (1.8, False, 0, 17.8, -282.24, 1.0),
        # not a fresh start (a continued run): no search either
        (1.8, True, 5, 17.8, -282.24, 1.0),
        # ρ = 1 lowers the ELBO (x 32.5: -992): undone, then ½ (x 6.25, -27.6) is the best
        (2.5, True, 0, 6.25, -27.5625, 0.5),
        # ρ = 1 is the exact step: ½ is worse and the step is taken at 1
        (1.0, True, 0, 1.0, 0.0, 1.0),
    ],
)
def test_the_first_step_from_a_fresh_start_is_a_line_search(gain, first_search, start_step, x1, elbo1, damping1):
    """A toy step that may overshoot: x ← x + gain · ρ (1 − x) with ELBO −(x − 1)², from
    x = −20. With ``first_search`` the first step of a fresh state is taken at the probed ρ
    with the best ELBO; the probes are neither counted as steps nor as undone steps."""
    from blrppl.engine.step import BLRInfo, initial_state

    def step(state, data, rho):
        x = state.nat["x"]
        x = x + state.damping * gain * (1.0 - x)
        elbo = -((x - 1.0) ** 2)
        info = BLRInfo(elbo=elbo, valid=jnp.array(True), proper={})
        return state._replace(nat={"x": x}, step=state.step + 1, elbo=elbo), info

    chunk = jax.jit(engine_loop.make_chunk(step, 10, first_search=first_search))
    state = initial_state({"x": jnp.asarray(-20.0)}, jax.random.key(0))
    state = state._replace(elbo=jnp.asarray(-441.0), damping=jnp.asarray(1.0), step=jnp.asarray(start_step))
    out = chunk(state, None, jnp.asarray(1, jnp.int32), {}, engine_loop.empty_history(0), jnp.asarray(1e-8))
    new, buf, n, undone = out[0], out[1], int(out[2]), int(out[7])
    assert (n, undone) == (1, 0)
    assert float(new.nat["x"]) == pytest.approx(x1)
    assert float(buf[0]) == pytest.approx(elbo1)
    assert float(new.damping) == damping1
    assert int(new.step) == start_step + 1


def _runaway_step(state, data, rho):
    """A Monte Carlo-like step with ELBO −100 (x − 1)² − 50: the first step moves x from −9
    to 4 (ELBO −950, the best), each later one triples the distance from 1, so the ELBO falls
    without bound (no backtracking: Monte Carlo steps are taken whenever their ELBO is
    finite)."""
    from blrppl.engine.step import BLRInfo

    x = 1.0 + 3.0 * (state.nat["x"] - 1.0) * jnp.where(state.step == 0, -0.1, 1.0)
    elbo = -100.0 * (x - 1.0) ** 2 - 50.0
    info = BLRInfo(elbo=elbo, valid=jnp.array(True), proper={})
    return state._replace(nat={"x": x}, step=state.step + 1, elbo=elbo), info


def test_a_diverged_monte_carlo_run_returns_its_best_state():
    """The run's chunks carry the best state by ELBO: the run diverges (its last ELBO far
    below its best) and returns the state of its best step, not converged, and the stop
    note says that state is returned."""
    from blrppl.engine.advice import divergence_note
    from blrppl.engine.step import initial_state

    window = 4
    chunk = jax.jit(engine_loop.make_chunk(_runaway_step, 5, window))
    state = initial_state({"x": jnp.asarray(-9.0)}, jax.random.key(0))._replace(damping=jnp.asarray(1.0))
    outcome = engine_loop.run_loop(chunk, state, None, {}, 1e-8, 12, 5, False, window)
    elbo = np.asarray(outcome.elbo)
    best = int(np.argmax(elbo))
    assert elbo[-1] < elbo[best] - 10 * max(abs(elbo[best]), 100.0)  # (it diverged)
    assert outcome.restored == best + 1 and not outcome.converged
    # the state of that step: x₀ = −9, x₁ = 1 + 3 · 10 · 0.1 = 4, then x ← 1 + 3 (x − 1)
    x = [-9.0]
    for t in range(best + 1):
        x.append(1.0 + 3.0 * (x[-1] - 1.0) * (-0.1 if t == 0 else 1.0))
    assert float(outcome.state.nat["x"]) == pytest.approx(x[-1])
    assert float(outcome.state.elbo) == pytest.approx(elbo[best])
    note = divergence_note(elbo, outcome.restored)
    assert f"the best state, step {best + 1}'s, is returned" in note


def test_a_run_that_did_not_diverge_keeps_its_last_state():
    """A run that has not diverged (one step) returns its last state."""
    from blrppl.engine.step import initial_state

    chunk = jax.jit(engine_loop.make_chunk(_runaway_step, 5, 4))
    state = initial_state({"x": jnp.asarray(-9.0)}, jax.random.key(0))._replace(damping=jnp.asarray(1.0))
    outcome = engine_loop.run_loop(chunk, state, None, {}, 1e-8, 1, 5, False, 4)
    assert outcome.restored is None and float(outcome.state.nat["x"]) == pytest.approx(4.0)


def _mostly_stuck_step(state, data, rho):
    """A step in which some block finds no valid update except at every 10th step (its Monte
    Carlo-like ELBO climbs by 10 a step: never converged)."""
    from blrppl.engine.step import BLRInfo

    info = BLRInfo(elbo=10.0 * state.step, valid=state.step % 10 == 0, proper={})
    return state._replace(step=state.step + 1, elbo=info.elbo), info


@pytest.mark.parametrize("give_up, steps, stuck", [(True, 10, True), (False, 30, False)])
def test_a_fresh_start_stuck_for_most_of_a_chunk_gives_up(give_up, steps, stuck):
    """With ``give_up`` (a fresh start that may start again narrower) the run ends after the
    first chunk in more than 80 % of whose steps some block found no valid update (9 of its
    10); without it the run goes on to its ``num_steps``."""
    from blrppl.engine.step import initial_state

    chunk = jax.jit(engine_loop.make_chunk(_mostly_stuck_step, 10, 4))
    state = initial_state({"x": jnp.asarray(0.0)}, jax.random.key(0))._replace(damping=jnp.asarray(1.0))
    outcome = engine_loop.run_loop(chunk, state, None, {}, 1e-8, 30, 10, False, 4, give_up=give_up)
    assert outcome.num_steps == steps and outcome.stuck is stuck
    assert outcome.invalid_steps == steps - steps // 10 and not outcome.converged
