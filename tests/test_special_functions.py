"""Special functions the families use (blrppl.families._special) against jax.scipy's."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import polygamma

from blrppl.families._special import trigamma

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
