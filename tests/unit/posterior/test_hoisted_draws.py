"""q's draws for the importance weights made ahead of the batches of model evaluations
(:func:`blrppl.posterior.diagnostics.log_weights_of`): the same weights as drawn batch by batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import blr_fit
from blrppl.posterior import diagnostics
from blrppl.posterior.diagnostics import Density, _site_values, log_weights_of


def logistic(X, y=None):
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.5).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ beta), obs=y)


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 6))
    y = (rng.random(200) < 1 / (1 + np.exp(-X @ np.linspace(-1, 1, 6)))).astype(float)
    result = blr_fit(logistic, (X, y), rng_key=random.PRNGKey(0), progress_bar=False, refine=False)
    return result, X, y


def _density(result, X, y, num, at_once):
    (block,) = [b for b in result.plan.blocks if b.name == "beta" or "beta" in (b.sites or ())]

    def log_joint(values, data):
        beta = values["beta"]
        prior = dist.Normal(0.0, 2.5).log_prob(beta).sum()
        return prior + dist.Bernoulli(logits=data["X"] @ beta).log_prob(data["y"]).sum()

    return Density([block], lambda nat: {}, _site_values, log_joint, num, at_once, X.size + y.size, 1)


@pytest.mark.parametrize("with_values", [False, True])
def test_draws_made_ahead_give_the_batches_weights(fitted, monkeypatch, with_values):
    result, X, y = fitted
    data, key = {"X": jnp.asarray(X), "y": jnp.asarray(y)}, random.key(3)  # (a typed key, as the fit passes)
    density = _density(result, X, y, num=200, at_once=20)
    ahead = jax.jit(log_weights_of(density, with_values=with_values))(result.nat, data, key)
    monkeypatch.setattr(diagnostics, "HOISTED_DRAWS", 0)  # (every draw inside its batch, as before)
    batched = jax.jit(log_weights_of(density, with_values=with_values))(result.nat, data, key)
    # the same draws (the same keys) and densities: equal up to the rounding of the triangular
    # solve of q's draws, made for 200 columns at once instead of 20
    for a, b in zip(jax.tree.leaves(ahead), jax.tree.leaves(batched)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)
    # and the draws are those of every draw at once (the small-data path)
    everything = jax.jit(log_weights_of(density._replace(at_once=200), with_values=with_values))(result.nat, data, key)
    for a, b in zip(jax.tree.leaves(ahead), jax.tree.leaves(everything)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)


def test_draws_too_large_to_hold_stay_in_their_batches(fitted, monkeypatch):
    """Above HOISTED_DRAWS draw × scalars, the draws are made batch by batch: the program
    holds no array of every draw of the block."""
    result, X, y = fitted
    density = _density(result, X, y, num=200, at_once=20)
    data, key = {"X": jnp.asarray(X), "y": jnp.asarray(y)}, random.key(3)  # (a typed key, as the fit passes)
    shapes = {}
    for limit, name in ((diagnostics.HOISTED_DRAWS, "ahead"), (200 * 6 - 1, "batched")):
        monkeypatch.setattr(diagnostics, "HOISTED_DRAWS", limit)
        jaxpr = jax.make_jaxpr(log_weights_of(density))(result.nat, data, key)
        shapes[name] = {tuple(v.aval.shape) for e in jaxpr.jaxpr.eqns for v in e.outvars}
    assert (200, 6) in shapes["ahead"] and (200, 6) not in shapes["batched"]
