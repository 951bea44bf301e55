"""Factors whose messages to a chain are the same at every q are taken apart from the others.

A chain's own prior (a random walk, an AR prior with known coefficients) and a Normal
observation of an affine form of it with a known scale have a closed form quadratic in the
chain: their message λ̃ does not depend on q, and E_q[log f] = log f(m) + ⟨G, band of Σ⟩.
The step takes the message at the family's fixed view (computed once, outside the run's
loop) and the ELBO term from the model's log-density at the mean, not through the chain's
colour rows (:func:`blrppl.engine.step.constant_factors`). What must hold: the same fit, to
rounding, as the one that reads every factor at the current view, and only such factors
taken apart.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl.model.program import ModelProgram
from blrppl.engine.step import constant_factors, make_objective, make_split_expectation, views_of
from blrppl.families import BandedGaussianNat, GaussianBanded
from blrppl.model.trace import trace_model
from blrppl.compiler.pipeline import compile_model
from checks import fresh_fit
from unit.families.test_banded import logistic_scan as logistic_ar1, poisson_walk

numpyro.enable_x64()

T = 80


def counts_and_gauge(c, g):
    """A walk far from 0 (level 1,000), counted through its difference from the level and
    read by a Normal gauge of two neighbouring steps with a known scale: the walk's prior
    and the gauge are constant, the counts are not."""
    x = numpyro.sample("x", dist.GaussianRandomWalk(0.2, num_steps=c.shape[0]))
    level = 1000.0 + x
    with numpyro.plate("t", c.shape[0]):
        numpyro.sample("c", dist.Poisson(jnp.exp(level - 1000.0 + 1.0)), obs=c)
    with numpyro.plate("s", c.shape[0] - 1):
        numpyro.sample("g", dist.Normal(0.5 * (level[1:] + level[:-1]), 0.3), obs=g)


def counts_and_a_masked_gauge(c, g):
    """The gauge missing (NaN) on a third of the steps, masked out with ``handlers.mask``."""
    x = numpyro.sample("x", dist.GaussianRandomWalk(0.2, num_steps=c.shape[0]))
    with numpyro.plate("t", c.shape[0]):
        numpyro.sample("c", dist.Poisson(jnp.exp(x + 1.0)), obs=c)
    seen = jnp.arange(c.shape[0] - 1) % 3 != 0
    with numpyro.plate("s", c.shape[0] - 1), numpyro.handlers.mask(mask=seen):
        numpyro.sample("g", dist.Normal(1000.0 + 0.5 * (x[1:] + x[:-1]), 0.3), obs=jnp.where(seen, g, jnp.nan))


def walk_with_unknown_scale(c):
    """The walk's prior also reads sigma: its message to x depends on q(sigma)."""
    sigma = numpyro.sample("sigma", dist.HalfNormal(0.2))
    x = numpyro.sample("x", dist.GaussianRandomWalk(sigma, num_steps=c.shape[0]))
    with numpyro.plate("t", c.shape[0]):
        numpyro.sample("c", dist.Poisson(jnp.exp(x)), obs=c)


def _data():
    rng = np.random.default_rng(7)
    x = np.cumsum(0.2 * rng.normal(size=T))
    c = rng.poisson(np.exp(1.0 + x)).astype(float)
    g = 1000.0 + 0.5 * (x[1:] + x[:-1]) + 0.3 * rng.normal(size=T - 1)
    y = (rng.uniform(size=T) < 0.6).astype(float)
    return {"c": c, "g": g, "y": y}


CASES = {
    "poisson walk": (poisson_walk, ("c",), {"x": ("x",)}),
    "logistic AR(1) with scan": (logistic_ar1, ("y",), {"x": ("x",)}),
    "counts and a gauge": (counts_and_gauge, ("c", "g"), {"x": ("x", "g")}),
    "counts and a masked gauge": (counts_and_a_masked_gauge, ("c", "g"), {"x": ("x", "g")}),
    "walk with an unknown scale": (walk_with_unknown_scale, ("c",), {}),
}


def _compiled(model, args):
    records, spec, dyn, _ = trace_model(model, args, {}, random.PRNGKey(0))
    plan, fns, *_ = compile_model(ModelProgram(model), records, spec, dyn, rng_key=random.PRNGKey(1))
    return plan, fns, dyn


@pytest.mark.parametrize("name", list(CASES))
def test_constant_factors_of_user_models(name):
    """The chain's own prior and a Normal reading of it with a known scale, never an
    observation through a link nor a prior that reads another latent."""
    model, keys, expected = CASES[name]
    data = _data()
    plan, _, _ = _compiled(model, tuple(jnp.asarray(data[k]) for k in keys))
    assert plan.block("x").family.banded, plan.describe()
    assert constant_factors(plan) == expected


@pytest.mark.parametrize("name", ["poisson walk", "counts and a gauge", "counts and a masked gauge"])
def test_split_expectation_equals_the_expectation(name):
    """At a view far from the fixed one (means near the data, a valid band of Σ), the split
    E_q[log p] equals the one read through the colour rows (float64, 1e-12 relative), and
    the constant factors' gradient at the fixed view equals their gradient there."""
    import jax

    model, keys, _ = CASES[name]
    data = _data()
    plan, fns, dyn = _compiled(model, tuple(jnp.asarray(data[k]) for k in keys))
    block = plan.block("x")
    rng = np.random.default_rng(1)
    mean = np.cumsum(0.2 * rng.normal(size=T)) + 0.5
    prec = np.diag(np.full(T, 30.0)) + np.diag(np.full(T - 1, -12.0), 1) + np.diag(np.full(T - 1, -12.0), -1)
    band = np.stack([np.diag(prec), np.append(np.diag(prec, 1), 0.0)], axis=1)
    nat = BandedGaussianNat(jnp.asarray(prec @ mean), jnp.asarray(-0.5 * band))
    views = views_of(plan, {"x": nat})
    objective = make_objective(plan, fns)
    expected, constant, grads = make_split_expectation(plan, fns, objective)
    full = float(objective(views, dyn))
    split = float(expected(views, dyn))
    assert abs(split - full) <= 1e-12 * abs(full), (split, full)
    at_view = jax.grad(lambda v: objective({"x": v}, dyn, set(constant["x"])))(views["x"])
    at_fixed = grads("x", views, dyn)
    np.testing.assert_allclose(np.asarray(at_fixed.cov), np.asarray(at_view.cov), rtol=1e-12, atol=1e-12)
    # (∂E/∂m moves with m; λ̃₁ = ∂E/∂m − 2 G m does not)
    msg_view = block.family.message_at(nat, views["x"], at_view)
    msg_fixed = block.family.message_from_fixed_view_grad(at_fixed)
    np.testing.assert_allclose(np.asarray(msg_fixed.eta1), np.asarray(msg_view.eta1), rtol=1e-10, atol=1e-8)
    np.testing.assert_allclose(np.asarray(msg_fixed.eta2), np.asarray(msg_view.eta2), rtol=1e-12)


@pytest.mark.parametrize("name", ["poisson walk", "logistic AR(1) with scan", "counts and a masked gauge"])
def test_fit_equals_the_fit_reading_every_factor_at_q(name, monkeypatch):
    """Eight steps taken apart and read whole: the same ELBOs and posterior (float64, 1e-9)."""
    model, keys, _ = CASES[name]
    data = _data()
    args = tuple(jnp.asarray(data[k]) for k in keys)
    split = fresh_fit(model, args, monkeypatch, num_steps=8)
    monkeypatch.setattr(GaussianBanded, "splits_quadratic", False)
    whole = fresh_fit(model, args, monkeypatch, num_steps=8)
    np.testing.assert_allclose(np.asarray(split.elbo), np.asarray(whole.elbo), rtol=1e-9)
    np.testing.assert_allclose(split.posterior["x"].mean, whole.posterior["x"].mean, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(split.posterior["x"].variance, whole.posterior["x"].variance, rtol=1e-9)


@pytest.mark.parametrize("b", [1, 2])
def test_diagonal_message_equals_the_banded_one_for_a_diagonal_gradient(b):
    """A chain's observations, one scalar per element, give ∂L/∂Σ on the diagonal only:
    the elementwise G m equals the banded product there (float64, 1e-14)."""
    rng = np.random.default_rng(b)
    n = 40
    family = GaussianBanded(dim=n, bandwidth=b)
    cov = np.zeros((n, b + 1))
    cov[:, 0] = rng.uniform(0.5, 2.0, size=n)
    grad = family.view_type(jnp.asarray(rng.normal(size=n)), jnp.asarray(cov))
    view = family.view_type(jnp.asarray(100.0 + rng.normal(size=n)), jnp.asarray(rng.normal(size=(n, b + 1))))
    banded = family.message_at(None, view, grad)
    diagonal = family.message_at(None, view, grad, diagonal=True)
    np.testing.assert_allclose(np.asarray(diagonal.eta1), np.asarray(banded.eta1), rtol=1e-14)
    np.testing.assert_array_equal(np.asarray(diagonal.eta2), np.asarray(banded.eta2))
