"""Full garbage collections are rare while a fit is traced and compiled, and the user's
thresholds are back after it."""

from __future__ import annotations

import gc

import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random

from blrppl.api import blr_fit
from blrppl.runtime.collection import FULL_COLLECTION_THRESHOLD, fewer_full_collections

numpyro.enable_x64()


def test_thresholds_raised_inside_and_restored():
    before = gc.get_threshold()
    try:
        gc.set_threshold(500, 7, 3)
        with fewer_full_collections():
            assert gc.get_threshold() == (500, 7, FULL_COLLECTION_THRESHOLD)
        assert gc.get_threshold() == (500, 7, 3)
    finally:
        gc.set_threshold(*before)


def test_restored_when_the_block_raises():
    before = gc.get_threshold()
    try:
        with fewer_full_collections():
            raise ValueError("inside")
    except ValueError:
        pass
    assert gc.get_threshold() == before


def test_collection_turned_off_by_the_user_stays_off():
    before = gc.get_threshold()
    try:
        gc.set_threshold(0)
        off = gc.get_threshold()
        with fewer_full_collections():
            assert gc.get_threshold() == off
    finally:
        gc.set_threshold(*before)


def test_a_fit_compiles_with_rare_full_collections():
    seen = []

    def model(y):
        seen.append(gc.get_threshold()[2])
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    before = gc.get_threshold()
    blr_fit(model, {"y": np.linspace(-1.0, 1.0, 5)}, rng_key=random.PRNGKey(0), progress_bar=False, refine=False)
    assert seen and all(t >= FULL_COLLECTION_THRESHOLD for t in seen[:1])
    assert gc.get_threshold() == before
