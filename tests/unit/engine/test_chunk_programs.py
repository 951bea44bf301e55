"""What a chunk of steps holds besides the step (issue 55: compile time).

A chunk computes a fresh state's ELBO before its first step only where backtracking reads
it, for exact ELBOs: a Monte Carlo ELBO undoes no step for its value, and a second copy of
the ELBO's program in its chunk cost XLA 14 % of the Lorenz bridge's chunk
(docs/benchmarks.md). The Lorenz bridge (Inference Gym's, ported in
``blrppl.bench.compile_sizes``) is a Monte Carlo fit whose chunk leaves it out, and whose
step's program does not grow with the bridge's steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from blrppl import blr_kernel
from blrppl.bench import compile_sizes
from blrppl.engine import build as build_module
from blrppl.engine.loop import make_chunk
from blrppl.engine.state import BLRInfo, BLRState
from blrppl.model.trace import equation_count


def _toy_step(state, data, rho):
    """One block's natural parameter halved towards ``data``; the ELBO its negative square."""
    nat = {"a": state.nat["a"] + rho["a"] * (data - state.nat["a"])}
    new = state._replace(nat=nat, step=state.step + 1)
    return new, BLRInfo(elbo=-jnp.sum(nat["a"] ** 2), valid=jnp.array(True), proper={"a": jnp.array(True)})


def _chunk_elbo_calls(window: int) -> int:
    calls = []

    def elbo_fn(nat, data, key):
        calls.append(1)
        return -jnp.sum(nat["a"] ** 2)

    chunk = make_chunk(_toy_step, 4, window=window, blocks=("a",), elbo_fn=elbo_fn)
    state = BLRState(
        nat={"a": jnp.ones(3)}, step=jnp.zeros((), jnp.int32), elbo=jnp.full((), jnp.nan),
        rng_key=jax.random.PRNGKey(0), damping=jnp.ones(()), streak=jnp.zeros((), jnp.int32),
    )
    history = jnp.full((max(2 * window, 1),), jnp.nan)
    jax.make_jaxpr(chunk)(state, jnp.zeros(3), jnp.asarray(4, jnp.int32), {"a": jnp.asarray(0.5)}, history, 1e-6)
    return len(calls)


def test_exact_chunk_computes_a_fresh_states_elbo():
    assert _chunk_elbo_calls(window=0) == 1


def test_monte_carlo_chunk_holds_no_elbo_program():
    assert _chunk_elbo_calls(window=5) == 0


@pytest.fixture(scope="module")
def bridge_steps():
    """The Lorenz bridge's kernels at 12 and 16 Euler steps (one joint Gaussian block of 39
    and 51 scalars; below 33 scalars its dense algebra takes another form): their steps'
    jaxpr equations and plans, and whether each fit's chunk traced the ELBO's program."""
    traced = {}
    original = build_module.make_chunk

    def spying_make_chunk(step, chunk_size, window=0, *args, elbo_fn=None, **kwargs):
        def spied(*a):
            traced[current] = True
            return elbo_fn(*a)

        return original(step, chunk_size, window, *args, elbo_fn=None if elbo_fn is None else spied, **kwargs)

    out = {}
    build_module.make_chunk = spying_make_chunk
    try:
        for current in (12, 16):
            traced[current] = False
            kernel, state = blr_kernel(
                compile_sizes.lorenz_bridge, compile_sizes.lorenz_data(current), rng_key=jax.random.PRNGKey(0)
            )
            out[current] = (equation_count(jax.make_jaxpr(kernel.step)(state).jaxpr), kernel.plan)
    finally:
        build_module.make_chunk = original
    return out, traced


def test_bridge_step_does_not_grow_with_its_steps(bridge_steps):
    out, _ = bridge_steps
    assert out[12][0] == out[16][0]


def test_bridge_is_a_monte_carlo_fit_whose_chunk_has_no_elbo_program(bridge_steps):
    out, traced = bridge_steps
    plan = out[12][1]
    assert "monte_carlo" in plan.describe()
    assert traced == {12: False, 16: False}
