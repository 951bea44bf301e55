"""``mesh=`` (:mod:`blrppl.engine.sharding`): the checks of the option, which axis of an array
is read as its plate axis, and a fit over a one-device mesh, which runs the sharded program
on whatever device this process has (the fits over 8 devices are in
``tests/integration/test_mesh.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import BLR, MeshError, blr_fit, blr_kernel
from blrppl.engine.sharding import plate_axis
from blrppl.inputs import as_mesh

Y = np.random.default_rng(0).normal(2.0, 1.0, size=37)


def normal_mean(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def no_plate(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def logistic(X, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def test_a_device_count_is_a_mesh_of_the_first_devices():
    mesh = as_mesh(1)
    assert isinstance(mesh, jax.sharding.Mesh)
    assert mesh.axis_names == ("data",) and list(mesh.devices.flat) == jax.devices()[:1]
    assert as_mesh(None) is None
    given = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
    assert as_mesh(given) is given


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "8", [0]])
def test_a_mesh_that_is_neither_a_mesh_nor_a_count_is_refused(bad):
    with pytest.raises(MeshError, match="mesh="):
        blr_fit(normal_mean, (Y,), mesh=bad, progress_bar=False)


def test_more_devices_than_there_are_are_refused_naming_how_to_get_them():
    n = jax.device_count() + 1
    with pytest.raises(MeshError, match=f"mesh={n} devices, but JAX sees {n - 1}.*xla_force_host_platform_device_count"):
        blr_fit(normal_mean, (Y,), mesh=n, progress_bar=False)
    with pytest.raises(MeshError, match=f"mesh={n}"):
        BLR(normal_mean, mesh=n)


def test_a_mesh_of_two_axes_is_refused():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("a", "b"))
    with pytest.raises(MeshError, match=r"one axis.*\('a', 'b'\)"):
        blr_fit(normal_mean, (Y,), mesh=mesh, progress_bar=False)


def test_a_model_without_a_plate_is_refused():
    with pytest.raises(MeshError, match="numpyro.plate"):
        blr_fit(no_plate, (Y,), mesh=1, progress_bar=False)


def test_the_kernel_refuses_a_mesh():
    with pytest.raises(MeshError, match="blr_fit and BLR"):
        blr_kernel(normal_mean, (Y,), mesh=1)


def test_the_plate_axis_is_the_axis_of_the_largest_plate():
    assert plate_axis((1003,), {1003}) == 0
    assert plate_axis((3, 1003), {1003, 3}) == 1
    assert plate_axis((7, 5), {5, 7}) == 0
    assert plate_axis((4, 4), {4}) == 0
    assert plate_axis((3,), {1003}) is None
    assert plate_axis((), {1003}) is None
    assert plate_axis((1, 1), {1}) is None


def test_a_fit_over_a_one_device_mesh_is_the_fit():
    """The sharded program on one device computes what the fit computes, in the same order:
    equal to rounding (1e-12 relative), and the user's data are not changed."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(41, 2))
    y = (rng.random(41) < 0.5).astype(float)
    before = (X.copy(), y.copy())
    plain = blr_fit(logistic, (X, y), rng_key=random.PRNGKey(0), progress_bar=False)
    mesh = blr_fit(logistic, (X, y), rng_key=random.PRNGKey(0), progress_bar=False, mesh=1)
    assert mesh.num_steps == plain.num_steps > 1
    for a, b in zip(jax.tree.leaves(plain.nat), jax.tree.leaves(mesh.nat)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mesh.posterior["w"].mean, plain.posterior["w"].mean, rtol=1e-12)
    assert isinstance(mesh.posterior["w"].mean, jnp.ndarray)
    np.testing.assert_array_equal(X, before[0])
    np.testing.assert_array_equal(y, before[1])
