"""A run's loop carries each block's view from one step to the next.

A step forms a block's view (for a chain, a forward–backward pass; for a banded or dense
Gaussian, a factorisation) after each update, and the next step reads it instead of forming
it again from the same parameters (:class:`blrppl.engine.step.BLRState`). The run must be
the one that forms every view afresh at the start of each step: same ELBO at every step
and same final parameters, to rounding, on models whose steps are exact, non-conjugate
(partial steps), and rejected by backtracking (the state kept must keep its own views).
"""

from __future__ import annotations

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.contrib.control_flow import scan

import blrppl.engine.build as build_module
from checks import fresh_fit
from blrppl.engine import loop as engine_loop


def hmm(y):
    trans = numpyro.sample("trans", dist.Dirichlet(np.ones((3, 3)) + 2.0 * np.eye(3)).to_event(1))
    with numpyro.plate("states", 3):
        loc = numpyro.sample("loc", dist.Normal(np.array([-2.0, 0.0, 2.0]), 1.0))

    def step(prev, y_t):
        x = numpyro.sample("x", dist.Categorical(trans[prev]))
        numpyro.sample("y", dist.Normal(loc[x], 0.7), obs=y_t)
        return x, None

    scan(step, 0, y)


def poisson_walk(c):
    x = numpyro.sample("x", dist.GaussianRandomWalk(0.3, num_steps=c.shape[0]))
    with numpyro.plate("t", c.shape[0]):
        numpyro.sample("c", dist.Poisson(jax.numpy.exp(x)), obs=c)


def regression(X, y):
    w = numpyro.sample("w", dist.Normal(np.zeros(3), 1.0).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    numpyro.sample("y", dist.StudentT(4.0, X @ w, sigma), obs=y)


def _cases():
    rng = np.random.default_rng(0)
    z = np.repeat(rng.integers(0, 3, 8), 5)
    X = rng.normal(size=(30, 3))
    return {
        "hmm": (hmm, (np.array([-2.0, 0.0, 2.0])[z] + 0.7 * rng.normal(size=40),)),
        # counts far above the prior's exp(0): backtracking rejects some of its first steps
        # (without the first step's line search, which probes ρ by steps it undoes)
        "poisson walk": (poisson_walk, (rng.poisson(np.exp(4.0 + np.cumsum(0.3 * rng.normal(size=50)))).astype(float),)),
        "student-t regression": (regression, (X, X @ np.array([1.0, -0.5, 0.2]) + rng.standard_t(4, size=30))),
    }


CASES = _cases()


def _fit(model, args, carry: bool, monkeypatch, search: bool = True):
    def chunk(*a, **options):
        if not carry:
            options["views_fn"] = None
        options["first_search"] = options.get("first_search", False) and search
        return engine_loop.make_chunk(*a, **options)

    monkeypatch.setattr(build_module, "make_chunk", chunk)
    return fresh_fit(model, args, monkeypatch, num_steps=25)


@pytest.mark.parametrize("name, search", [(n, True) for n in CASES] + [("poisson walk", False)])
def test_carried_views_give_the_same_run(name, search, monkeypatch):
    model, args = CASES[name]
    carried = _fit(model, args, True, monkeypatch, search)
    afresh = _fit(model, args, False, monkeypatch, search)
    assert carried.num_steps == afresh.num_steps > 1
    np.testing.assert_allclose(carried.elbo, afresh.elbo, rtol=1e-10)
    for a, b in zip(jax.tree.leaves(carried.nat), jax.tree.leaves(afresh.nat)):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
    assert carried.state.views is None  # not returned: only the loop carries them
    if name == "poisson walk" and not search:
        assert carried.diagnostics.rejected_steps == afresh.diagnostics.rejected_steps > 0
