"""The rule as a kernel (``blrppl.blr_kernel``): ``kernel.step`` is the step ``blr_fit``'s
loop runs, with the data and step sizes bound, so a user's own ``jax.lax.scan`` under
``jax.jit`` steps it.

* a conjugate Normal-mean model, stepped by hand in ``lax.scan``, reaches the closed-form
  posterior;
* on a non-conjugate model (logistic regression) N jitted steps of the kernel give the
  natural parameters of ``blr_fit(num_steps=N)`` whose stopping test never fires;
* ``step`` is pure: the same state in, the same state out, and the state given is not
  changed;
* ``blrppl.engine.kernel.init(plan, data, key)`` is the pure start: deterministic in the
  key, random where the start is (a mixture's responsibilities, a product's blocks), equal
  to the state ``blr_kernel`` and ``blr_fit`` start from, without running the model or
  compiling a program; ``kernel.step`` in a jitted scan runs from it; bad input is a
  ``BLRError`` naming the problem.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

import blrppl
from blrppl import BLRKernel, BLRState, blr_fit, blr_kernel
from blrppl.engine.kernel import KernelData, init
from blrppl.errors import BLRError, InitValueError, TransformationError
from blrppl.model.trace import model_runs
from blrppl.runtime.counting import xla_compilations

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
    assert {"blr_kernel", "BLRKernel", "BLRState", "BLRInfo", "KernelData"} <= set(blrppl.__all__)
    assert blrppl.KernelData is KernelData


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


def mixture(y):
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(2)))
    with numpyro.plate("k", 2):
        mu = numpyro.sample("mu", dist.Normal(jnp.array([-2.0, 2.0]), 3.0))
    with numpyro.plate("n", y.shape[0]):
        z = numpyro.sample("z", dist.Categorical(w))
        numpyro.sample("y", dist.Normal(mu[z], 0.5), obs=y)


def product(y):
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(a * b, 0.5), obs=y)


def normal_data(n=20):
    return {"y": 3.0 + SIGMA * np.random.default_rng(0).normal(size=n)}


def assert_same_state(got, want):
    """Exact equality of the carried parts of two states (views and carried messages apart)."""
    for a, b in zip(host_leaves(got._replace(views=None, entropies=None, messages=None)),
                    host_leaves(want._replace(views=None, entropies=None, messages=None)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_init_is_the_start_blr_kernel_takes():
    key = random.PRNGKey(0)
    kernel, state = blr_kernel(normal_mean, normal_data(), rng_key=key)
    assert isinstance(kernel.data, KernelData) and kernel.plan.block("mu") is not None
    pure = init(kernel.plan, kernel.data, key)
    assert isinstance(pure, BLRState) and pure.views is None
    assert pure.nat["mu"].eta1.dtype == jnp.float64
    assert_same_state(pure, state)
    # the kernel's own init from the data: the same state, with its views formed
    assert_same_state(kernel.init(kernel.data), state)
    assert kernel.init(kernel.data).views is not None


def test_init_draws_the_start_of_a_product_from_the_key():
    # a ``w * x`` factor: its blocks start off the saddle at zero by a draw from the key
    y = np.random.default_rng(2).normal(size=15) + 1.0
    key = random.PRNGKey(4)
    kernel, state = blr_kernel(product, {"y": y}, rng_key=key)
    assert_same_state(init(kernel.plan, kernel.data, key), state)
    assert_same_state(init(kernel.plan, kernel.data, 4), state)  # (an int seed is that key)
    other = init(kernel.plan, kernel.data, random.PRNGKey(5))
    assert not np.array_equal(np.asarray(other.nat["a"].eta1), np.asarray(state.nat["a"].eta1))
    assert_same_state(kernel.init(kernel.data, random.PRNGKey(5)), other)


def test_steps_from_init_match_blr_fit():
    data, n = logistic_data(), 12
    key = random.PRNGKey(0)
    kernel, _ = blr_kernel(logistic, data, learning_rate=0.5, rng_key=key)
    final, elbos = scan_steps(kernel, init(kernel.plan, kernel.data, key), n)
    result = blr_fit(logistic, data, num_steps=n, tol=1e-300, progress_bar=False, learning_rate=0.5, rng_key=key)
    assert result.num_steps == n and result.diagnostics.rejected_steps == 0
    for got, want in zip(jax.tree.leaves(final.nat), jax.tree.leaves(result.nat)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(np.asarray(elbos), result.elbo, rtol=1e-9)


def test_init_of_a_mixture_is_deterministic_in_the_key():
    y = np.concatenate([np.full(10, -2.0), np.full(10, 2.0)]) + 0.3 * np.random.default_rng(1).normal(size=20)
    kernel, fit_start = blr_kernel(mixture, {"y": y}, rng_key=random.PRNGKey(0))
    values = {n: np.array(v) for n, v in kernel.data.values.items()}
    first = init(kernel.plan, kernel.data, random.PRNGKey(1))
    again = init(kernel.plan, kernel.data, random.PRNGKey(1))
    other = init(kernel.plan, kernel.data, random.PRNGKey(2))
    assert_same_state(first, again)
    # the responsibilities are drawn from the key
    z1 = np.asarray(jax.tree.leaves(first.nat["z"])[0])
    assert not np.array_equal(z1, np.asarray(jax.tree.leaves(other.nat["z"])[0]))
    # the fit's own start takes the E-step above init: responsibilities from the prior means
    pure = init(kernel.plan, kernel.data, random.PRNGKey(0))
    assert not np.array_equal(np.asarray(jax.tree.leaves(pure.nat["z"])[0]),
                              np.asarray(jax.tree.leaves(fit_start.nat["z"])[0]))
    for n in ("w", "mu"):
        for a, b in zip(jax.tree.leaves(pure.nat[n]), jax.tree.leaves(fit_start.nat[n])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # nothing the caller holds is changed
    for n, v in kernel.data.values.items():
        np.testing.assert_array_equal(np.asarray(v), values[n])


def local_means(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0], subsample_size=2) as idx:
        z = numpyro.sample("z", dist.Normal(mu, 1.0))
        numpyro.sample("x", dist.Normal(z, 1.0), obs=x[idx])


@pytest.mark.parametrize(
    "model, data",
    [
        (mixture, {"y": np.concatenate([np.full(10, -2.0), np.full(10, 2.0)])}),
        # (subsampled: the state also carries the minibatch orders and averages)
        (local_means, {"x": np.array([0.5, -1.0, 2.0, 3.0, -0.5, 1.5])}),
    ],
)
def test_init_runs_no_model_and_compiles_nothing(model, data):
    kernel, _ = blr_kernel(model, data, rng_key=random.PRNGKey(0))
    runs, compiled = model_runs(), xla_compilations()
    state = init(kernel.plan, kernel.data, random.PRNGKey(7))
    jax.block_until_ready(state)
    assert model_runs() == runs
    assert xla_compilations() == compiled


def test_scan_of_steps_from_init_is_exact():
    data = normal_data()
    kernel, _ = blr_kernel(normal_mean, data, rng_key=random.PRNGKey(0))
    final, elbos = scan_steps(kernel, init(kernel.plan, kernel.data, random.PRNGKey(3)), 3)
    y = data["y"]
    precision = 1 / S0**2 + len(y) / SIGMA**2
    np.testing.assert_allclose(final.nat["mu"].eta1, [M0 / S0**2 + y.sum() / SIGMA**2], rtol=1e-10)
    np.testing.assert_allclose(final.nat["mu"].eta2, [[-0.5 * precision]], rtol=1e-10)
    assert int(final.step) == 3 and np.all(np.isfinite(elbos))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda plan, data: ("plan", data, 0), BLRError, "Plan"),
        (lambda plan, data: (plan, {"mu": 1.0}, 0), BLRError, "KernelData"),
        (lambda plan, data: (plan, data, None), BLRError, "key"),
        (lambda plan, data: (plan, data, "seed"), BLRError, "key"),
        (lambda plan, data: (plan, data._replace(values={}), 0), BLRError, "missing mu"),
        (lambda plan, data: (plan, data._replace(values={**data.values, "nu": 1.0}), 0), BLRError, "not in the plan: nu"),
        (lambda plan, data: (plan, data._replace(values={"mu": np.zeros(3)}), 0), InitValueError, "shape"),
        (lambda plan, data: (plan, data._replace(values={"mu": np.array(np.nan)}), 0), InitValueError, "not finite"),
        (lambda plan, data: (plan, data._replace(given=frozenset({"nu"})), 0), BLRError, "given"),
        (lambda plan, data: (plan, data._replace(previous={"mu": data.values["mu"]}), 0), BLRError, "online"),
    ],
)
def test_bad_input_to_init_is_named(change, error, match):
    kernel, _ = blr_kernel(normal_mean, normal_data(), rng_key=random.PRNGKey(0))
    with pytest.raises(error, match=match):
        init(*change(kernel.plan, kernel.data))


def test_init_under_jit_is_refused():
    kernel, _ = blr_kernel(normal_mean, normal_data(), rng_key=random.PRNGKey(0))
    with pytest.raises(TransformationError, match="outside jax.jit"):
        jax.jit(lambda k: init(kernel.plan, kernel.data, k).step)(random.PRNGKey(0))


FLOAT32 = r"""
import json
import jax, numpy as np
import numpyro, numpyro.distributions as dist
from jax import random
assert not jax.config.jax_enable_x64
from blrppl import blr_kernel
from blrppl.engine.kernel import init

def normal_mean(y):
    mu = numpyro.sample("mu", dist.Normal(1.0, 2.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 0.5), obs=y)

y = np.asarray(json.loads(DATA), np.float32)
kernel, _ = blr_kernel(normal_mean, {"y": y}, rng_key=random.PRNGKey(0))
state = init(kernel.plan, kernel.data, random.PRNGKey(1))
final, _ = jax.jit(lambda s: jax.lax.scan(lambda s, _: (kernel.step(s)[0], None), s, None, length=3))(state)
print("RESULT" + json.dumps({
    "dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(state.nat)}),
    "eta1": float(final.nat["mu"].eta1[0]), "eta2": float(final.nat["mu"].eta2[0, 0]),
}))
"""


def test_init_and_steps_in_float32():
    """In a process without x64 the start is float32 and the steps from it reach the
    closed-form posterior; rtol 1e-5: float32 sums of 20 terms round to about 20 · 2⁻²⁴."""
    y = (3.0 + SIGMA * np.random.default_rng(0).normal(size=20)).astype(np.float32)
    env = dict(os.environ)
    env.pop("JAX_ENABLE_X64", None)
    proc = subprocess.run(
        [sys.executable, "-c", FLOAT32.replace("DATA", repr(json.dumps(y.tolist())))],
        capture_output=True, text=True, cwd=pathlib.Path(__file__).resolve().parents[3], env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    fit = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT"):])
    assert fit["dtypes"] == ["float32"]
    y64 = y.astype(np.float64)
    np.testing.assert_allclose(fit["eta1"], M0 / S0**2 + y64.sum() / SIGMA**2, rtol=1e-5)
    np.testing.assert_allclose(fit["eta2"], -0.5 * (1 / S0**2 + len(y) / SIGMA**2), rtol=1e-5)
