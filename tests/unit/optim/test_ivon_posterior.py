"""IVON's posterior: on Bayesian linear regression its fixed point is the exact mean-field
Gaussian posterior; its weight samples and predictive draws have the posterior's spread."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import random

from blrppl import optim

N, D, NOISE_SD, PRIOR_PRECISION = 200, 3, 0.5, 1.0


def regression():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N, D))
    y = X @ np.array([1.0, -2.0, 0.5]) + NOISE_SD * rng.normal(size=N)
    return jnp.asarray(X), jnp.asarray(y)


def mean_loss(params, X, y):
    """The negative log-likelihood divided by N (the mean over the examples)."""
    resid = y - X @ params["w"]
    return 0.5 * jnp.mean(resid**2) / NOISE_SD**2


def test_fixed_point_is_the_exact_mean_field_posterior():
    """The exact posterior of w under the prior N(0, I/τ) is N(μ, Λ⁻¹), Λ = XᵀX/s² + τI. For a
    Gaussian target the mean-field optimum has the exact mean μ and the precisions Λ_jj
    (Bishop 2006, §10.1.2); IVON's fixed point is that optimum: E[ĝ] + δm = 0 at m = μ, and
    E[ĥ] = diag(∇²ℓ) exactly for a quadratic loss (Stein's lemma), so N(h + δ) → Λ_jj.

    Tolerances from the Monte Carlo error of the averages over the last K = 20000 steps
    (S = 8 samples a step): ĥ_j has variance ≈ 2 h_j²/S (its term H_jj ε_j²), so the
    average of h has relative sd ≈ √(2/(S K)) = 0.0035; 2% is six of them, and the bias of
    the h update's last term, ½(1 − β₂) Var(ĥ)/h² ≈ 1e-4, is far below. The mean's noise
    per step is ≈ α σ_j/√S (a preconditioned step of learning rate α = 0.01), so its average
    over K steps is within ≈ σ_j/√(S K) ≈ 0.003 σ_j of μ; 0.05 σ_j is over ten of them.
    """
    X, y = regression()
    opt = optim.ivon(
        learning_rate=0.01,
        ess=N,
        hess_init=1.0,
        beta2=0.999,
        prior_precision=PRIOR_PRECISION,
        mc_samples=8,
        rescale_lr=False,
    )
    params = {"w": jnp.zeros(D)}
    state = opt.init(params)
    grad_fn = optim.value_and_grad(mean_loss)

    def step(carry, key):
        params, state = carry
        _, grads, noise = grad_fn(params, state, key, X, y)
        updates, state = opt.update(grads, state, params, noise=noise)
        params = optax.apply_updates(params, updates)
        precision = N * (state.hess["w"] + state.posterior.weight_decay)
        return (params, state), (params["w"], precision)

    keys = random.split(random.PRNGKey(0), 30000)
    _, (means, precisions) = jax.jit(lambda c, k: jax.lax.scan(step, c, k))((params, state), keys)
    mean, precision = np.asarray(means[-20000:]).mean(0), np.asarray(precisions[-20000:]).mean(0)

    Xn, yn = np.asarray(X), np.asarray(y)
    Lam = Xn.T @ Xn / NOISE_SD**2 + PRIOR_PRECISION * np.eye(D)
    mu = np.linalg.solve(Lam, Xn.T @ yn / NOISE_SD**2)
    sigma = 1 / np.sqrt(np.diag(Lam))
    np.testing.assert_array_less(np.abs(mean - mu), 0.05 * sigma)
    np.testing.assert_allclose(precision, np.diag(Lam), rtol=0.02)


def test_weight_samples_and_predictive_draws_have_the_posteriors_spread():
    opt = optim.ivon(0.1, ess=100.0, hess_init=0.3, weight_decay=0.01, mc_samples=4)
    params = {"w": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)}
    state = opt.init(params)
    sigma = 1 / np.sqrt(100.0 * (0.3 + 0.01))
    np.testing.assert_allclose(np.asarray(optim.posterior_stddev(state)["w"]), sigma, rtol=1e-12)

    theta, noise = optim.sample_parameters(state, params, random.PRNGKey(1))
    assert theta["w"].shape == noise["w"].shape == (4, 2) and theta["b"].shape == (4,)
    np.testing.assert_allclose(np.asarray(theta["w"] - params["w"]), np.asarray(noise["w"]), atol=1e-12)

    # 20000 draws of the weights themselves: their sd is σ within the Monte Carlo error of a
    # sample sd (relative sd 1/√(2n) = 0.005; 3% is six of them), their mean is the mean
    # within 5 standard errors
    n = 20000
    draws = optim.predictive(lambda p: p, state, params, random.PRNGKey(2), n)
    for name in ("w", "b"):
        d = np.asarray(draws[name])
        assert d.shape == (n,) + params[name].shape
        np.testing.assert_allclose(d.std(axis=0), sigma, rtol=0.03)
        np.testing.assert_array_less(np.abs(d.mean(axis=0) - np.asarray(params[name])), 5 * sigma / np.sqrt(n))

    # the predictive passes the inputs through; the draws of a linear model's output have the
    # output's posterior sd, √(Σ x_j² σ²) (+ σ² for the bias)
    x = jnp.array([[1.0, 2.0], [0.0, -1.0]])
    out = optim.predictive(lambda p, x: x @ p["w"] + p["b"], state, params, random.PRNGKey(3), n, x)
    assert out.shape == (n, 2)
    want = sigma * np.sqrt((np.asarray(x) ** 2).sum(1) + 1)
    np.testing.assert_allclose(np.asarray(out).std(0), want, rtol=0.03)


def test_value_and_grad_takes_the_gradient_at_the_samples():
    opt = optim.ivon(0.1, ess=10.0, mc_samples=3)
    params = {"w": jnp.array([0.3, -0.7])}
    state = opt.init(params)
    key = random.PRNGKey(4)
    loss = lambda p, a: jnp.sum(a * p["w"] ** 2)  # noqa: E731
    value, grads, noise = optim.value_and_grad(loss)(params, state, key, 2.0)
    theta, same_noise = optim.sample_parameters(state, params, key)
    np.testing.assert_allclose(np.asarray(noise["w"]), np.asarray(same_noise["w"]))
    np.testing.assert_allclose(np.asarray(grads["w"]), 4.0 * np.asarray(theta["w"]), rtol=1e-12)
    np.testing.assert_allclose(float(value), float(jnp.mean(2.0 * jnp.sum(theta["w"] ** 2, axis=1))), rtol=1e-12)
    # with aux data: the loss averaged, the aux stacked over the samples
    (value, aux), _, _ = optim.value_and_grad(lambda p: (jnp.sum(p["w"]), p["w"]), has_aux=True)(params, state, key)
    assert aux.shape == (3, 2)
