"""``BLR.update`` (and ``evaluate``, ``run`` from a state) with the same values in another
dtype than ``BLR.init`` compiled for: converted where that keeps them, refused by name where
it would not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import BLR, BLRError


def regression(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([x.shape[1]]).to_event(1))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, s), obs=y)


def counts(y):
    rate = numpyro.sample("rate", dist.Gamma(2.0, 1.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Poisson(rate), obs=y)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 2))
    y = np.round(x @ np.array([2.0, -1.0]) + rng.normal(size=40))  # integral values, as float64
    return x, y


def leaves_equal(a, b):
    """Two states (or parts of them) bit for bit, keys included."""

    def plain(x):
        return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(plain(u), plain(v))


@pytest.mark.filterwarnings("ignore:blr_fit. q may be a poor")  # (three steps only)
def test_int_observations_after_float_init_give_the_float_step(data):
    x, y = data
    svi = BLR(regression)
    state = svi.init(random.PRNGKey(0), x, y)
    as_float, loss = svi.update(state, x, y)
    as_int, int_loss = svi.update(state, x, y.astype(np.int64))
    leaves_equal(as_int, as_float)
    assert int_loss == loss
    assert svi.evaluate(as_float, x, jnp.asarray(y, jnp.int32)) == svi.evaluate(as_float, x, y)
    # inside the user's jit too, and from a state through run
    _, jit_loss = jax.jit(svi.update)(state, x, y.astype(np.int64))
    np.testing.assert_allclose(jit_loss, loss, rtol=1e-12)
    ran_int = svi.run(random.PRNGKey(0), 3, x, y.astype(np.int64), init_state=state, progress_bar=False)
    ran_float = svi.run(random.PRNGKey(0), 3, x, y, init_state=state, progress_bar=False)
    leaves_equal(ran_int.state.nat, ran_float.state.nat)


def test_float_counts_after_int_init_are_taken_when_integral_and_refused_otherwise():
    y = np.array([3, 0, 2, 5, 1, 4], dtype=np.int64)
    svi = BLR(counts)
    state = svi.init(random.PRNGKey(0), y)
    as_int, loss = svi.update(state, y)
    as_float, float_loss = svi.update(state, y.astype(np.float64))
    leaves_equal(as_float, as_int)
    assert float_loss == loss
    with pytest.raises(BLRError, match=r"'args\[0\]' is float64.*int64.*BLR.init"):
        svi.update(state, y + 0.5)


def test_float64_values_float32_holds_are_taken_after_a_float32_init(data):
    x, y = data
    svi = BLR(regression)
    state = svi.init(random.PRNGKey(0), x.astype(np.float32), y.astype(np.float32))
    as_32, loss = svi.update(state, x.astype(np.float32), y.astype(np.float32))
    as_64, loss_64 = svi.update(state, x.astype(np.float32).astype(np.float64), y)
    leaves_equal(as_64, as_32)
    assert loss_64 == loss
    with pytest.raises(BLRError, match=r"'args\[0\]' is float64.*float32"):
        svi.update(state, x, y.astype(np.float32))  # (x in float64: not exactly float32)
