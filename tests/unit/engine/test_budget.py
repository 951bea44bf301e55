"""The refinement's deadline inside a single candidate fit (:mod:`blrppl.engine.budget`): a
candidate that runs past the budget stops after its compilation or at a chunk boundary of its
loop, and the refinement reports it as stopped instead of waiting for it."""

from __future__ import annotations

import time

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import api
from blrppl.engine import budget, loop
from blrppl.engine.budget import OverBudget
from blrppl.inputs import fit_options
from blrppl.model.program import ModelProgram


def test_no_deadline_never_stops():
    budget.check("anywhere")
    with budget.deadline(None):
        budget.check("anywhere")


def test_a_passed_deadline_stops_only_inside_its_scope():
    with budget.deadline(time.perf_counter() - 1.0):
        with pytest.raises(OverBudget, match="stopped here: over the refinement's time budget"):
            budget.check("here")
        with budget.deadline(None):  # (an inner fit without one: not stopped)
            budget.check("inner")
    budget.check("after the scope")


def _slow_chunk(seconds, steps):
    """A stand-in compiled chunk: ``steps`` steps that take ``seconds`` and never converge."""
    calls = []

    def chunk(state, data, steps_left, rho, history, tol):
        calls.append(int(steps_left))
        time.sleep(seconds)
        buf = np.full((steps,), -1.0)
        return state, buf, steps, loop.CONTINUE, 0, history, {}, 0, np.ones((steps,), bool), None

    return chunk, calls


def test_the_loop_stops_at_the_first_chunk_boundary_past_the_deadline():
    """Chunks of 10 steps taking 0.2 s each against a deadline 0.3 s away: the loop runs two
    chunks (the deadline passes during the second) and stops before the third, naming the steps
    run; without a deadline it runs to num_steps."""
    chunk, calls = _slow_chunk(0.2, 10)
    with budget.deadline(time.perf_counter() + 0.3):
        with pytest.raises(OverBudget, match="after 20 steps"):
            loop.run_loop(chunk, None, None, 1.0, 1e-8, 1000, 10, False)
    assert calls == [1000, 990]
    chunk, calls = _slow_chunk(0.0, 10)
    outcome = loop.run_loop(chunk, None, None, 1.0, 1e-8, 50, 10, False)
    assert outcome.num_steps == 50 and len(calls) == 5


def model(y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(5.0))
    with numpyro.plate("data", len(y)):
        numpyro.sample("y", dist.Normal(mu, sigma), obs=y)


def test_a_candidate_fit_past_its_deadline_stops_after_its_compilation():
    """A single fit (another structure, another start) given a deadline already past stops once
    compiled, before its loop; the same fit without a deadline runs."""
    y = np.random.default_rng(0).normal(1.0, 2.0, size=20)
    program, options = ModelProgram(model), fit_options(progress_bar=False)
    with pytest.raises(OverBudget, match="after its compilation"):
        api._fit(program, (), {"y": y}, options, random.PRNGKey(0), None, deadline=time.perf_counter() - 1.0)
    result, _ = api._fit(program, (), {"y": y}, options, random.PRNGKey(0), None)
    assert result.converged and abs(float(result.posterior["mu"].mean) - y.mean()) < 1.0
