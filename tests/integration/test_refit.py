"""Refits: a second ``blr_fit`` of a model, which reuses its compiled fit, checks q as the
first fit did (issue 55: a refit's fixed cost is cut, never its warnings)."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random

from blrppl import blr_fit


def funnel(y=None):
    """Neal's funnel with a few noisy observations of x: a Gaussian q misses its neck."""
    v = numpyro.sample("v", dist.Normal(0.0, 3.0))
    with numpyro.plate("i", 9):
        x = numpyro.sample("x", dist.Normal(0.0, jnp.exp(v / 2)))
        numpyro.sample("y", dist.Normal(x, 10.0), obs=y)


def _fit(y):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = blr_fit(funnel, {"y": y}, rng_key=random.PRNGKey(0), progress_bar=False, refine=False)
    return result, [str(w.message) for w in caught if "poor approximation" in str(w.message)]


def test_a_refit_of_a_poor_fit_warns_as_its_first_fit_did():
    y = np.linspace(-0.5, 0.5, 9)
    first, first_warned = _fit(y)
    again, again_warned = _fit(y)
    assert first_warned and again_warned == first_warned
    assert again.diagnostics == first.diagnostics
    # new data of the same layout (a cross-validation fold's, an online batch's) reuse the
    # compiled fit: its q is checked on its own draws, and it warns too
    other, other_warned = _fit(y[::-1] * 1.5)
    assert other_warned and other.diagnostics.khat != first.diagnostics.khat
    assert other.diagnostics.poor()
