"""The advice's reading of a plan (``blrppl/engine/advice.py``): which discrete latents are a
mixture's labels, whose relabelling note a fit's message carries. Plans only: no fit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

import example_models as em
from blrppl.api import plan_of
from blrppl.engine.advice import has_mixture, relabelling_note

numpyro.enable_x64()


def _mixture(y):
    """Three Normal components with exchangeable priors: each datum's label ``z`` reads its
    component's location, ``locs[z]``, and the weights ``w`` (the label's own prior)."""
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(3)))
    with numpyro.plate("components", 3):
        locs = numpyro.sample("locs", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", y.shape[0]):
        z = numpyro.sample("z", dist.Categorical(w))
        numpyro.sample("y", dist.Normal(locs[z], 1.0), obs=y)


def _zero_inflated(y):
    """A zero-inflated Poisson with a latent indicator per count: a discrete latent of two
    values selecting between a point mass at zero and one scalar rate."""
    p = numpyro.sample("p", dist.Beta(1.0, 1.0))
    rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5))
    with numpyro.plate("n", y.shape[0]):
        zero = numpyro.sample("zero", dist.Bernoulli(p))
        numpyro.sample("y", dist.Poisson(jnp.where(zero == 1, 1e-6, rate)), obs=y)


_Y = np.concatenate([np.random.default_rng(0).normal(-5.0, 1.0, 30), np.random.default_rng(1).normal(5.0, 1.0, 30)])


@pytest.mark.parametrize(
    "model, data, mixture",
    [
        # the switch year indexes no components: early or late rate by the year's position
        (em.change_point_model, em.change_point_data(), False),
        (_zero_inflated, (np.random.default_rng(2).poisson(3.0, size=40).astype(float),), False),
        (_mixture, (_Y,), True),
        # Dawid–Skene: each item's true class c indexes its rows of the annotators' beta and pi
        (em.dawid_skene_model, em.dawid_skene_data(), True),
    ],
)
def test_the_relabelling_note_is_for_mixture_labels_only(model, data, mixture):
    """A discrete latent is a mixture's label when its values index several components (a
    label-switching symmetry); the change point's enumerated switch year is none, and its
    message must not say that its posterior has one copy per relabelling of components."""
    plan = plan_of(model, data, rng_key=random.PRNGKey(0))
    assert any(b.discrete for b in plan.blocks)
    assert has_mixture(plan) is mixture
    note = relabelling_note(plan)
    assert (note is not None and "relabelling" in note) is mixture
