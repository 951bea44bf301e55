"""Special functions the families use (blrppl.families._special) against jax.scipy's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import digamma, polygamma

from blrppl.families._special import formed_once, trigamma

#: the shape parameters a fit meets: tiny to huge, and dense where the recurrence hands over
POINTS = np.concatenate([np.logspace(-8, 8, 401), np.linspace(0.01, 30.0, 601)])


@pytest.mark.parametrize("dtype, rtol", [(jnp.float64, 4e-15), (jnp.float32, 2e-6)])
def test_trigamma_matches_polygamma(dtype, rtol):
    x = jnp.asarray(POINTS, dtype)
    got = trigamma(x)
    assert got.dtype == dtype
    want = polygamma(1, jnp.asarray(np.asarray(x, np.float64)))  # the float64 value at the same point
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol)


def test_trigamma_is_nan_outside_its_domain():
    assert np.all(np.isnan(trigamma(jnp.array([0.0, -1.0, -2.5, jnp.nan]))))


def _psi_table(a):
    return digamma(a) - digamma(a.sum(-1, keepdims=True))


@pytest.mark.parametrize("rows, materialised", [(5, True), (2000, False)])
def test_a_small_table_read_by_many_elements_is_formed_once(rows, materialised):
    """A Dirichlet's ψ table gathered by many elements (an HMM's transitions): its value is
    ψ's, and the compiled program forms a small one in a conditional of its own (a buffer
    the gather reads) instead of fusing ψ into the gather; a large one is left to fusion."""
    a = jnp.asarray(np.random.default_rng(0).gamma(2.0, size=(rows, 5)) + 0.1)
    idx = jnp.asarray(np.random.default_rng(1).integers(0, rows, size=100_000))

    def read(a, idx):
        return formed_once(_psi_table, a)[idx, idx % 5]

    want = np.asarray(_psi_table(a))[np.asarray(idx), np.asarray(idx) % 5]
    np.testing.assert_allclose(jax.jit(read)(a, idx), want, rtol=1e-12)
    np.testing.assert_allclose(formed_once(_psi_table, a), _psi_table(a), rtol=0)  # concrete: fn itself
    hlo = jax.jit(read).lower(a, idx).compile().as_text()
    assert ("conditional(" in hlo) == materialised
    # parameters no valid state has (a non-finite concentration) give NaN, as ψ's table would
    # give inf or NaN: the fit's finite checks reject either
    bad = jax.jit(lambda a: formed_once(_psi_table, a))(a.at[0, 0].set(jnp.inf))
    assert not np.all(np.isfinite(bad))
