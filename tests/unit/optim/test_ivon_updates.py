"""IVON's updates against the recursion of Shen et al. (2024), Algorithm 1, written out here
in NumPy on a quadratic loss with fixed noise draws: the mean and the Hessian estimate (so
the precision) after a few steps agree to 1e-10 in float64."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from blrppl import optim

D = 6  # the parameters: a (2,) and b (2, 2), flattened in this order


def quadratic():
    """ℓ(θ) = ½ (θ − c)ᵀ A (θ − c), A symmetric positive definite and not diagonal."""
    rng = np.random.default_rng(3)
    B = rng.normal(size=(D, D))
    A = B @ B.T / D + np.eye(D)
    c = rng.normal(size=D)
    return A, c


def as_tree(v):
    v = jnp.asarray(v)
    return {"a": v[..., :2], "b": v[..., 2:].reshape(v.shape[:-1] + (2, 2))}


def as_vector(tree):
    a, b = np.asarray(tree["a"]), np.asarray(tree["b"])
    return np.concatenate([a, b.reshape(b.shape[:-2] + (4,))], axis=-1)


def reference(m, eps, A, c, *, lr, ess, h0, beta1, beta2, delta, xi, rescale):
    """Algorithm 1 by hand: the means and Hessian estimates after each step; ``eps`` holds
    the standard normal draws, shape (steps, samples, D)."""
    h, g = np.full(D, h0), np.zeros(D)
    means, hessians = [], []
    for t, e in enumerate(eps, start=1):
        sigma = 1.0 / np.sqrt(ess * (h + delta))
        theta = m + sigma * e  # (samples, D)
        grads = (theta - c) @ A  # ∇ℓ at each sample (A symmetric)
        g_hat = grads.mean(axis=0)
        h_hat = (grads * (theta - m) / sigma**2).mean(axis=0)
        g = beta1 * g + (1 - beta1) * g_hat
        h = beta2 * h + (1 - beta2) * h_hat + 0.5 * (1 - beta2) ** 2 * (h - h_hat) ** 2 / (h + delta)
        g_bar = g / (1 - beta1**t)
        alpha = lr(t - 1) * ((h0 + delta) if rescale else 1.0)
        m = m - alpha * np.clip((g_bar + delta * m) / (h + delta), -xi, xi)
        means.append(m)
        hessians.append(h)
    return means, hessians


CASES = {
    "one sample": dict(samples=1, xi=math.inf, rescale=False, schedule=False),
    "three samples, clipped, rescaled, scheduled": dict(samples=3, xi=0.05, rescale=True, schedule=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mean_and_precision_follow_algorithm_1(case):
    samples, xi, rescale, schedule = (CASES[case][k] for k in ("samples", "xi", "rescale", "schedule"))
    A, c = quadratic()
    ess, h0, beta1, beta2, delta, steps = 50.0, 0.5, 0.8, 0.9, 0.02, 5
    lr = (lambda t: 0.3 / (1.0 + t)) if schedule else (lambda t: 0.3)
    eps = np.random.default_rng(4).normal(size=(steps, samples, D))
    m0 = np.random.default_rng(5).normal(size=D)
    want_m, want_h = reference(
        m0, eps, A, c, lr=lr, ess=ess, h0=h0, beta1=beta1, beta2=beta2, delta=delta, xi=xi, rescale=rescale
    )

    opt = optim.ivon(
        learning_rate=(lambda count: 0.3 / (1.0 + count)) if schedule else 0.3,
        ess=ess,
        hess_init=h0,
        beta1=beta1,
        beta2=beta2,
        weight_decay=delta,
        mc_samples=samples,
        clip_radius=xi,
        rescale_lr=rescale,
    )
    params = as_tree(m0)
    state = opt.init(params)
    loss = lambda p: 0.5 * (as_vector_jax(p) - c) @ A @ (as_vector_jax(p) - c)  # noqa: E731
    for t in range(steps):
        m, h = as_vector(params), as_vector(state.hess)
        sigma = 1.0 / np.sqrt(ess * (h + delta))
        noise = sigma * (eps[t] if samples > 1 else eps[t, 0])  # the draws of the reference, fed in
        theta = as_tree(m + noise)
        grads = jax.vmap(jax.grad(loss))(theta) if samples > 1 else jax.grad(loss)(theta)
        updates, state = opt.update(grads, state, params, noise=as_tree(noise))
        params = optax.apply_updates(params, updates)
        np.testing.assert_allclose(as_vector(params), want_m[t], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(as_vector(state.hess), want_h[t], rtol=1e-10, atol=1e-12)
        # the precision is λ(h + δ): the posterior's sd is read off the same h
        np.testing.assert_allclose(
            as_vector(optim.posterior_stddev(state)), 1 / np.sqrt(ess * (want_h[t] + delta)), rtol=1e-10
        )
    assert int(state.count) == steps


def as_vector_jax(tree):
    return jnp.concatenate([tree["a"], tree["b"].reshape(4)])


def test_the_correction_term_keeps_the_precision_positive():
    """A Hessian estimate far below zero (a concave direction) leaves h + δ > 0: the update's
    last term (Lin et al. 2020)."""
    opt = optim.ivon(0.1, ess=10.0, hess_init=1.0, beta2=0.5, weight_decay=0.0)
    params = {"w": jnp.zeros(3)}
    state = opt.init(params)
    sigma = 1 / np.sqrt(10.0 * 1.0)
    noise = {"w": sigma * jnp.array([1.0, -1.0, 1.0])}  # ε = ±1: ĥ = ĝ (θ − m)/σ² = −1000 ε² = −1000
    grads = {"w": -1e3 * noise["w"]}  # the gradient of −500 θ² at θ = m + noise, m = 0
    _, state = opt.update(grads, state, params, noise=noise)
    h = np.asarray(state.hess["w"])
    # by hand: 0.5·1 + 0.5·(-1000) + 0.5·0.25·1001² / 1
    np.testing.assert_allclose(h, 0.5 - 500.0 + 0.125 * 1001.0**2, rtol=1e-12)
    assert np.all(h > 0)
