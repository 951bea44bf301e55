"""What a step's program traces of a Monte Carlo factor (issue 55: compile time).

NumPyro's partially pooled baseball model: each player's average ``phi`` ~ Beta(m κ,
(1 − m) κ) has no closed form in its Gaussian on logit space, so the ``phi`` factor is
sampled; it reads two Gaussian blocks, ``m`` and ``(kappa, phi)``, each updated by its own
message program in the sequential schedule. A block's program builds that block's
curvature surrogate only, and not the factor's sample mean (whose gradient is zero with
explicit curvature): the model's density is traced once per message program and once for
the ELBO. The messages are those of the surrogate over every block. Counts and exact
equalities only: nothing here is timed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl.api import blr_kernel
from blrppl.compiler.pipeline import compile_model
from blrppl.engine.state import start_nat
from blrppl.engine.step import make_objective, views_of
from blrppl.estimators.monte_carlo import standard_normals
from blrppl.model import functions
from blrppl.model.program import ModelProgram
from blrppl.model.trace import trace_model

numpyro.enable_x64()

#: Efron & Morris (1975): hits of 18 players in their first 45 at-bats
HITS = np.array([18, 17, 16, 15, 14, 14, 13, 12, 11, 11, 10, 10, 10, 10, 10, 9, 8, 7], dtype=float)


def partially_pooled(at_bats, hits=None):
    m = numpyro.sample("m", dist.Uniform(0, 1))
    kappa = numpyro.sample("kappa", dist.Pareto(1, 1.5))
    with numpyro.plate("players", at_bats.shape[0]):
        phi = numpyro.sample("phi", dist.Beta(m * kappa, (1 - m) * kappa))
        numpyro.sample("obs", dist.Binomial(at_bats, probs=phi), obs=hits)


def _data():
    return {"at_bats": jnp.full(HITS.shape, 45.0), "hits": jnp.asarray(HITS)}


def _density_traces(monkeypatch, site: str) -> tuple:
    """``(plan, traces)``: the plan, and how many times the step's program traces the density
    of ``site`` (a run of several sites at once counts once)."""
    kernel, state = blr_kernel(partially_pooled, _data(), rng_key=random.PRNGKey(0))
    real = functions.ModelFunctions.log_probs
    calls = []

    def counted(self, names, values, data):
        calls.extend([1] if site in names else [])
        return real(self, names, values, data)

    monkeypatch.setattr(functions.ModelFunctions, "log_probs", counted)
    jax.make_jaxpr(kernel.step)(state)
    monkeypatch.setattr(functions.ModelFunctions, "log_probs", real)
    return kernel.plan, len(calls)


def test_monte_carlo_density_traced_once_per_message_program(monkeypatch):
    plan, traces = _density_traces(monkeypatch, "phi")
    factor = next(f for f in plan.factors if f.name == "phi")
    assert factor.estimator == "monte_carlo", plan.describe()
    # one linearisation per block's message program (its own curvature), one ELBO's run
    assert traces == len(factor.neighbours) + 1


def _plan_and_views():
    args = (jnp.full(HITS.shape, 45.0), jnp.asarray(HITS))
    program = ModelProgram(partially_pooled)
    records, spec, dyn, _ = trace_model(partially_pooled, args, {}, random.PRNGKey(0))
    plan, fns, dyn, init_values, _ = compile_model(program, records, spec, dyn, rng_key=random.PRNGKey(1))
    # a start away from the prior's: each block's mean moved, its covariance the start's
    nat = start_nat(plan, init_values, {})
    views = views_of(plan, nat)
    views = {n: v._replace(mean=v.mean + 0.3) for n, v in views.items()}
    return plan, fns, dyn, views


@pytest.mark.parametrize("curvature", ["auto", "stein", "diagonal"])
def test_one_blocks_messages_equal_those_of_every_blocks_surrogate(curvature):
    """∂E/∂view of each block from its own program (its surrogate alone, no sample means)
    equals the gradient of the objective holding every block's surrogate and the values
    (float64, exactly: the same draws and estimates)."""
    plan, fns, dyn, views = _plan_and_views()
    objective = make_objective(plan, fns, curvature)
    key = random.PRNGKey(5)
    for block in plan.order:
        wanted = {f.name for f in plan.factors_of(block)}
        whole = jax.grad(lambda v: objective({**views, block: v}, dyn, wanted, key))(views[block])
        alone = jax.grad(lambda v: objective({**views, block: v}, dyn, wanted, key, (block,), False))(views[block])
        for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(whole)):
            assert np.all(np.isfinite(np.asarray(a)))
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_standard_normals_are_the_separate_draws(dtype):
    """One mapped draw for several blocks gives each block the numbers its own
    ``jax.random.normal`` gives (JAX's default threefry: each number a function of its key
    and position)."""
    keys = random.split(random.PRNGKey(2), 3)
    shapes = [(16, 19), (16, 1), (16, 3, 4)]
    together = standard_normals(keys, shapes, dtype)
    for k, shape, x in zip(keys, shapes, together):
        assert x.shape == shape and x.dtype == dtype
        if jax.config.jax_threefry_partitionable:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(random.normal(k, shape, dtype)))
