"""The weight samples' noise: one ``jax.random.normal`` call over all the leaves of a dtype
(not one per leaf), each leaf a slice of it in pytree order, of the leaf's shape and dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import random

from blrppl import optim


def network_params(dtype=jnp.float64):
    """A small MLP's parameters (the leaves in pytree order: b1, b2, w1, w2)."""
    k1, k2 = random.split(random.PRNGKey(0))
    return {
        "w1": random.normal(k1, (4, 3), dtype), "b1": jnp.zeros(3, dtype),
        "w2": random.normal(k2, (3, 2), dtype), "b2": jnp.zeros(2, dtype),
    }


@pytest.mark.parametrize("samples", [1, 3])
def test_one_draw_over_all_leaves_scaled_by_the_posterior_sd(samples):
    params = network_params()
    opt = optim.ivon(0.1, ess=50.0, hess_init=0.5, mc_samples=samples)
    state = opt.init(params)
    key = random.PRNGKey(7)
    theta, noise = optim.sample_parameters(state, params, key)

    lead = (samples,) if samples > 1 else ()
    flat = np.asarray(random.normal(key, lead + (12 + 3 + 6 + 2,), jnp.float64))
    sigma = 1.0 / np.sqrt(50.0 * (0.5 + 1e-4))  # h₀ = 0.5, δ = the default 1e-4
    start = 0
    for name in ("b1", "b2", "w1", "w2"):  # pytree order: the dict's sorted keys
        shape = params[name].shape
        size = int(np.prod(shape))
        want = sigma * flat[..., start : start + size].reshape(lead + shape)
        start += size
        assert noise[name].shape == lead + shape and noise[name].dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(noise[name]), want, rtol=1e-12)
        np.testing.assert_allclose(np.asarray(theta[name]), np.asarray(params[name]) + want, rtol=1e-12, atol=1e-15)


def test_leaves_of_two_dtypes_keep_their_dtypes_and_draw_from_split_keys():
    params = {"a": jnp.ones((2, 2), jnp.float32), "b": jnp.ones(3, jnp.float64), "c": jnp.ones(5, jnp.float32)}
    key = random.PRNGKey(3)
    eps = optim.standard_noise(params, key)
    assert {k: (v.shape, v.dtype) for k, v in eps.items()} == {
        "a": ((2, 2), jnp.float32), "b": ((3,), jnp.float64), "c": ((5,), jnp.float32)
    }
    k32, k64 = random.split(key)  # float32 appears first (leaf "a")
    f32 = np.asarray(random.normal(k32, (9,), jnp.float32))
    np.testing.assert_array_equal(np.asarray(eps["a"]).ravel(), f32[:4])
    np.testing.assert_array_equal(np.asarray(eps["c"]), f32[4:])
    np.testing.assert_array_equal(np.asarray(eps["b"]), np.asarray(random.normal(k64, (3,), jnp.float64)))
    # the draws are standard normal whatever the dtype, and leaves do not share draws
    big = optim.standard_noise({"u": jnp.zeros(20000, jnp.float32), "v": jnp.zeros(20000, jnp.float32)}, key)
    u, v = np.asarray(big["u"], float), np.asarray(big["v"], float)
    # Monte Carlo error: the sd of a mean of 20,000 N(0, 1) is 0.007, of their variance 0.01, of
    # the correlation 0.007: five of them
    assert abs(u.mean()) < 0.035 and abs(u.var() - 1) < 0.05 and abs(np.corrcoef(u, v)[0, 1]) < 0.035


def test_float32_draws_stay_float32_and_finite():
    params = network_params(jnp.float32)
    opt = optim.ivon(0.1, ess=1000.0)
    state = opt.init(params)
    theta, noise = optim.sample_parameters(state, params, random.PRNGKey(0))
    for tree in (theta, noise):
        for name, leaf in tree.items():
            assert leaf.dtype == jnp.float32 and leaf.shape == params[name].shape
            assert np.all(np.isfinite(np.asarray(leaf)))


def test_draws_of_several_steps_at_once_give_the_steps_of_their_slices():
    """A scan over the slices of ``standard_noise(params, key, K)`` in place of a key per step:
    step t's sample is m_t + σ_t ε_t with ε_t the t-th slice, and the update is the one
    ``update`` makes from that sample (compared with the same step taken by hand)."""
    params = network_params()
    opt = optim.ivon(0.1, ess=50.0, hess_init=0.5, mc_samples=2)
    state = opt.init(params)
    loss = lambda p, x: jnp.sum(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]) ** 2 / 10  # noqa: E731
    x = random.normal(random.PRNGKey(1), (5, 4), jnp.float64)
    eps = optim.standard_noise(params, random.PRNGKey(2), (3, 2))  # 3 steps of 2 samples
    assert eps["w1"].shape == (3, 2, 4, 3)
    vg = optim.value_and_grad(loss)

    def step(carry, e):
        p, s = carry
        _, g, noise = vg(p, s, e, x)
        u, s = opt.update(g, s, p, noise=noise)
        return (optax.apply_updates(p, u), s), noise

    (p_scan, s_scan), noises = jax.lax.scan(step, (params, state), eps)
    p, s = params, state
    for t in range(3):
        sigma = optim.posterior_stddev(s)
        want_noise = jax.tree.map(lambda sd, e: sd * e[t], sigma, eps)
        theta = jax.tree.map(jnp.add, p, want_noise)
        g = jax.vmap(jax.grad(loss), in_axes=(0, None))(theta, x)
        for name in p:
            np.testing.assert_allclose(np.asarray(noises[name][t]), np.asarray(want_noise[name]), rtol=1e-12)
        u, s = opt.update(g, s, p, noise=want_noise)
        p = optax.apply_updates(p, u)
    for name in p:
        np.testing.assert_allclose(np.asarray(p_scan[name]), np.asarray(p[name]), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(np.asarray(s_scan.hess[name]), np.asarray(s.hess[name]), rtol=1e-10)


def test_typed_keys_and_draws_of_the_wrong_shape():
    params = network_params(jnp.float32)
    state = optim.ivon(0.1, ess=100.0).init(params)
    key = random.key(5)
    _, noise = optim.sample_parameters(state, params, key)
    eps = optim.standard_noise(params, key)
    sigma = optim.posterior_stddev(state)
    for name in params:
        np.testing.assert_allclose(np.asarray(noise[name]), np.asarray(sigma[name] * eps[name]), rtol=1e-6)
    bad = dict(eps, w1=eps["w1"][:2])
    with pytest.raises(optim.OptimizerSettingError, match=r"\['w1'\].*shape \(2, 3\), not \(4, 3\)"):
        optim.sample_parameters(state, params, bad)
    with pytest.raises(optim.OptimizerSettingError, match="structure"):
        optim.sample_parameters(state, params, {"w1": eps["w1"]})
    with pytest.raises(optim.OptimizerSettingError, match="num_samples"):
        optim.standard_noise(params, key, 0)
    with pytest.raises(optim.OptimizerSettingError, match=r"\['steps'\] is of dtype int32"):
        optim.standard_noise({"w": params["w1"], "steps": jnp.zeros(2, jnp.int32)}, key)
