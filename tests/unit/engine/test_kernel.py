"""The rule as a kernel (``blrppl.blr_kernel``): ``kernel.step`` is the step ``blr_fit``'s
loop runs, with the data and step sizes bound, so a user's own ``jax.lax.scan`` under
``jax.jit`` steps it.

* a conjugate Normal-mean model, stepped by hand in ``lax.scan``, reaches the closed-form
  posterior;
* on a non-conjugate model (logistic regression) N jitted steps of the kernel give the
  natural parameters of ``blr_fit(num_steps=N)`` whose stopping test never fires;
* ``step`` is pure: the same state in, the same state out, and the state given is not
  changed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

import blrppl
from blrppl import BLRKernel, BLRState, blr_fit, blr_kernel
from blrppl.errors import BLRError

M0, S0, SIGMA = 1.0, 2.0, 0.5


def normal_mean(y):
    mu = numpyro.sample("mu", dist.Normal(M0, S0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, SIGMA), obs=y)


def logistic(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)


def logistic_data(n=40, d=3):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, d))
    logits = x @ np.array([1.0, -0.5, 0.25]) + 0.3
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-logits))).astype(float)
    return {"x": x, "y": y}


def scan_steps(kernel, state, n):
    """``n`` steps of ``kernel`` in a jitted ``lax.scan``: the final state and the ELBOs."""

    @jax.jit
    def run(state):
        def body(state, _):
            state, info = kernel.step(state)
            return state, info.elbo

        return jax.lax.scan(body, state, None, length=n)

    return run(state)


def test_public_names():
    assert blrppl.blr_kernel is blr_kernel
    assert {"blr_kernel", "BLRKernel", "BLRState", "BLRInfo"} <= set(blrppl.__all__)


def test_conjugate_model_stepped_in_scan_is_exact():
    y = 3.0 + SIGMA * np.random.default_rng(0).normal(size=20)
    kernel, state = blr_kernel(normal_mean, {"y": y}, rng_key=random.PRNGKey(0))
    assert isinstance(kernel, BLRKernel) and isinstance(state, BLRState)
    assert state.nat["mu"].eta1.dtype == jnp.float64
    final, elbos = scan_steps(kernel, state, 5)
    precision = 1 / S0**2 + len(y) / SIGMA**2
    # the Gaussian's natural parameters: (Σ⁻¹ m, −½ Σ⁻¹)
    np.testing.assert_allclose(final.nat["mu"].eta1, [M0 / S0**2 + y.sum() / SIGMA**2], rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(final.nat["mu"].eta2, [[-0.5 * precision]], rtol=1e-8, atol=1e-8)
    assert int(final.step) == 5
    # a conjugate step at ρ = 1 is exact: the ELBO (log evidence) is reached after one step
    assert np.all(np.isfinite(elbos)) and np.ptp(np.asarray(elbos)) < 1e-8


def test_kernel_steps_match_blr_fit_steps():
    data, n = logistic_data(), 12
    options = dict(learning_rate=0.5, rng_key=random.PRNGKey(0))
    kernel, state = blr_kernel(logistic, data, **options)
    final, elbos = scan_steps(kernel, state, n)
    # (tol at the smallest float: the ELBO never moves that little before step N)
    result = blr_fit(logistic, data, num_steps=n, tol=1e-300, progress_bar=False, **options)
    assert result.num_steps == n and result.diagnostics.rejected_steps == 0
    assert set(final.nat) == set(result.nat)
    for got, want in zip(jax.tree.leaves(final.nat), jax.tree.leaves(result.nat)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(np.asarray(elbos), result.elbo, rtol=1e-9)


def host_leaves(tree) -> list:
    """The leaves of ``tree`` as numpy arrays (a typed key as its key data)."""
    return [
        np.array(jax.random.key_data(x)) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else np.array(x)
        for x in jax.tree.leaves(tree)
    ]


def test_step_is_pure():
    kernel, state = blr_kernel(logistic, logistic_data(), learning_rate=0.5, rng_key=random.PRNGKey(0))
    before, structure = host_leaves(state), jax.tree.structure(state)
    step = jax.jit(kernel.step)
    first, second = step(state), step(state)
    eager = kernel.step(state)
    for a, b in zip(host_leaves(first), host_leaves(second), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(first[0].nat), jax.tree.leaves(eager[0].nat)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12)
    # the state given is not changed
    assert jax.tree.structure(state) == structure
    for a, b in zip(before, host_leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_init_from_natural_parameters_and_values():
    y = 3.0 + SIGMA * np.random.default_rng(0).normal(size=20)
    kernel, state = blr_kernel(normal_mean, {"y": y}, rng_key=random.PRNGKey(0))
    moved, _ = kernel.step(state)
    again = kernel.init(moved.nat, random.PRNGKey(3))
    assert int(again.step) == 0
    np.testing.assert_array_equal(np.asarray(again.nat["mu"].eta1), np.asarray(moved.nat["mu"].eta1))
    at_two = kernel.init({"mu": 2.0})
    np.testing.assert_allclose(np.asarray(at_two.nat["mu"].eta1), [2.0])
    with pytest.raises(BLRError):
        kernel.init(3.0)


def test_several_starts_are_an_option_of_blr_fit():
    with pytest.raises(BLRError, match="blr_kernel"):
        blr_kernel(normal_mean, {"y": np.zeros(3)}, num_starts=2)
