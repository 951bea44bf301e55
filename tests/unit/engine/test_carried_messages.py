"""A step carries the messages it reads first, computed by the previous step's ELBO pass.

The pass that computes a step's ELBO at the updated q also gives the messages the next step
reads first (every block's in the parallel schedule, the first block's in the sequential),
so a step makes one pass over the data fewer (:func:`blrppl.engine.step.one_pass_of`). The
run must be the one that computes the messages when it reads them: same steps, same ELBO at
every step and same final parameters, to rounding, on exact models, one with non-conjugate
blocks (its first step a line search, then partial steps) and one whose steps backtracking
rejects; and a step traced with carried messages evaluates the expected log factors once,
not twice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

import blrppl.engine.build as build_module
import blrppl.engine.step as engine_step
from blrppl import blr_fit
from blrppl.engine import loop as engine_loop
from blrppl.model.program import ModelProgram


def logistic(X, y):
    w = numpyro.sample("w", dist.Normal(np.zeros(X.shape[1]), 1.0).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def normal_gamma(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    tau = numpyro.sample("tau", dist.Gamma(2.0, 1.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0 / jnp.sqrt(tau)), obs=y)


def poisson_regression(x, c):
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("c", dist.Poisson(jnp.exp(a + b * x)), obs=c)


def _cases():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3))
    y = (rng.random(200) < 1 / (1 + np.exp(-(X @ np.array([1.0, -1.0, 0.5]) + 0.3)))).astype(float)
    x = rng.normal(size=60)
    return {
        "logistic": (logistic, (X, y)),
        "normal-gamma": (normal_gamma, (rng.normal(2.0, 0.5, size=50),)),
        # counts far above the prior's exp(0): backtracking rejects steps (no line search)
        "poisson": (poisson_regression, (x, rng.poisson(np.exp(5.0 + 0.5 * x)).astype(float))),
    }


CASES = _cases()


def _fit(model, args, schedule, carry: bool, monkeypatch, search: bool = True):
    def chunk(*a, **options):
        if not carry:
            options["views_fn"] = None  # (neither views nor messages carried)
        options["first_search"] = options.get("first_search", False) and search
        return engine_loop.make_chunk(*a, **options)

    monkeypatch.setattr(build_module, "make_chunk", chunk)
    monkeypatch.setenv("BLRPPL_COMPILATION_CACHE", "0")
    return blr_fit(
        lambda *a: model(*a), args, schedule=schedule, num_steps=30, tol=1e-30, rng_key=random.PRNGKey(0),
        progress_bar=False, refine=False,
    )


@pytest.mark.parametrize(
    "name, schedule, search",
    [(n, s, True) for n in CASES for s in ("sequential", "parallel")] + [("poisson", "sequential", False)],
)
def test_carried_messages_give_the_same_run(name, schedule, search, monkeypatch):
    model, args = CASES[name]
    carried = _fit(model, args, schedule, True, monkeypatch, search)
    afresh = _fit(model, args, schedule, False, monkeypatch, search)
    # (the ELBOs agree to rounding: a run may stop a step earlier or later at its fixed point)
    steps = min(carried.num_steps, afresh.num_steps)
    assert steps > 1 and abs(carried.num_steps - afresh.num_steps) <= 1
    np.testing.assert_allclose(carried.elbo[:steps], afresh.elbo[:steps], rtol=1e-10)
    for a, b in zip(jax.tree.leaves(carried.nat), jax.tree.leaves(afresh.nat)):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
    assert carried.state.messages is None  # not returned: only the loop carries them
    if not search:
        assert carried.diagnostics.rejected_steps == afresh.diagnostics.rejected_steps > 0


def _plan(model, args):
    from blrppl.compiler.pipeline import compile_model
    from blrppl.model.trace import trace_model

    records, spec, dyn, _ = trace_model(model, args, None, jax.random.key(0))
    plan, fns, dyn, init, _ = compile_model(ModelProgram(model), records, spec, dyn, rng_key=jax.random.key(1))
    return plan, fns, dyn, init


@pytest.mark.parametrize("schedule, passes", [("sequential", 1), ("parallel", 1)])
def test_a_step_with_carried_messages_makes_one_pass_over_the_factors(schedule, passes, monkeypatch):
    """Traced with its messages carried, a step of the logistic regression (two blocks)
    evaluates the expected log factors ``passes`` times for its messages and ELBO together,
    where the step that computes them afresh evaluates them once more."""
    from blrppl.compiler.families import init_nat
    from blrppl.engine.step import initial_state, make_step, with_views

    model, args = CASES["logistic"]
    plan, fns, dyn, init = _plan(model, args)
    step, _, messages, carry = make_step(plan, fns, schedule)
    nat = {b.name: init_nat(b, init[b.name]) for b in plan.blocks}
    rho = {n: jnp.asarray(1.0) for n in plan.order}
    state = initial_state(nat, jax.random.key(2))
    calls = {"n": 0}
    counted = engine_step.expected_log_factors

    def counting(*a, **k):
        calls["n"] += 1
        return counted(*a, **k)

    monkeypatch.setattr(engine_step, "expected_log_factors", counting)
    ahead = carry(state, dyn)
    assert set(ahead.messages.sums) == set(plan.order if schedule == "parallel" else plan.order[:1])
    calls["n"] = 0
    jax.make_jaxpr(step)(ahead, dyn, rho)
    with_carried = calls["n"]
    calls["n"] = 0
    jax.make_jaxpr(step)(with_views(plan, state), dyn, rho)
    afresh = calls["n"]
    # the messages read later in a sequential step (the second block's) still take a pass
    later = len(plan.order) - 1 if schedule == "sequential" else 0
    assert with_carried == passes + later
    assert afresh == with_carried + 1


def test_plans_whose_first_messages_are_not_one_gradient_compute_them_when_read():
    """A lone conjugate block (taken at its fixed view), a chain whose prior's messages
    are constant (taken apart from the ELBO's value) and a Monte Carlo factor (its messages
    are not taken from the ELBO estimate's draws) carry no messages."""

    def walk(c):
        x = numpyro.sample("x", dist.GaussianRandomWalk(0.3, num_steps=c.shape[0]))
        with numpyro.plate("t", c.shape[0]):
            numpyro.sample("c", dist.Poisson(jnp.exp(x)), obs=c)

    def quartic():
        with numpyro.plate("copies", 5):
            x = numpyro.sample("x", dist.Normal(0.0, 3.0))
        numpyro.factor("f", -0.5 * jnp.sum((x - 1.0) ** 4))

    def mean_only(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    cases = ((walk, (np.arange(1.0, 101.0),)), (mean_only, (np.ones(5),)), (quartic, ()))
    for model, args in cases:
        plan, fns, _, _ = _plan(model, args)
        assert model is not quartic or [f.estimator for f in plan.factors if f.name == "f"] == ["monte_carlo"]
        objective = engine_step.make_objective(plan, fns)
        for schedule in ("sequential", "parallel"):
            assert engine_step.one_pass_of(plan, objective, schedule) is None
    plan, fns, _, _ = _plan(*CASES["logistic"])
    objective = engine_step.make_objective(plan, fns)
    assert engine_step.one_pass_of(plan, objective, "parallel").blocks == tuple(plan.order)
    assert engine_step.one_pass_of(plan, objective, "sequential").blocks == tuple(plan.order[:1])
