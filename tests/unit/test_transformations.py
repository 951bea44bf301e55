"""A fit called under a JAX transformation (``jax.jit``, ``jax.vmap``, ``jax.grad``) is
refused with a :class:`blrppl.TransformationError` saying what to do instead, never JAX's
own tracer errors; what is meant to run inside one's own jit (``kernel.step``,
``BLR.update``) still does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import BLR, TransformationError, blr_fit, blr_kernel
from blrppl.api import plan_of

Y = np.array([0.3, -1.2, 0.8, 2.1, 0.4])


def model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def fit(y, key=random.PRNGKey(0)):
    return blr_fit(model, {"y": y}, rng_key=key, progress_bar=False).posterior["mu"].loc


def refused(call, entry):
    with pytest.raises(TransformationError) as info:
        call()
    message = str(info.value)
    assert entry in message and "JAX transformation" in message and "blr_kernel" in message
    return message


def test_blr_fit_under_jit_vmap_and_grad_is_refused():
    assert "traced arrays" in refused(lambda: jax.jit(fit)(jnp.asarray(Y)), "blr_fit")
    refused(lambda: jax.vmap(fit)(jnp.stack([Y, Y + 1.0])), "blr_fit")
    refused(lambda: jax.vmap(lambda k: fit(Y, k))(random.split(random.PRNGKey(0), 2)), "blr_fit")
    refused(lambda: jax.grad(lambda y: fit(y).sum())(jnp.asarray(Y)), "blr_fit")
    # data closed over, nothing traced among the arguments: the trace in progress is seen
    refused(lambda: jax.jit(lambda: fit(Y))(), "blr_fit")
    refused(lambda: jax.jit(lambda y: plan_of(model, {"y": y}))(jnp.asarray(Y)), "plan_of")
    refused(lambda: jax.jit(lambda y: blr_kernel(model, {"y": y})[1].elbo)(jnp.asarray(Y)), "blr_kernel")


def test_blr_init_and_run_under_jit_are_refused_and_update_inside_jit_runs():
    svi = BLR(model)
    refused(lambda: jax.jit(lambda y: svi.init(random.PRNGKey(0), y).elbo)(jnp.asarray(Y)), "BLR.init")
    refused(lambda: jax.jit(lambda y: svi.run(random.PRNGKey(0), 10, y, progress_bar=False).losses)(jnp.asarray(Y)), "BLR.run")
    state = svi.init(random.PRNGKey(0), Y)
    _, loss = jax.jit(svi.update)(state, Y)
    _, eager_loss = svi.update(state, Y)
    np.testing.assert_allclose(loss, eager_loss, rtol=1e-12)


def test_a_kernel_made_outside_steps_inside_jit_and_fits_run_after_a_refusal():
    kernel, state = blr_kernel(model, {"y": Y}, rng_key=random.PRNGKey(0))
    _, info = jax.jit(kernel.step)(state)
    assert np.isfinite(info.elbo)
    with pytest.raises(TransformationError):
        jax.jit(fit)(jnp.asarray(Y))
    # nothing left behind: the same fit outside runs, with the conjugate posterior's mean
    n, prior_var = len(Y), 100.0
    np.testing.assert_allclose(fit(Y), Y.sum() / (n + 1.0 / prior_var), rtol=1e-8)
