"""IVON as an optax transformation: float32 pytrees, jit, optax.chain; and bad settings or
arguments refused by name with a BLRError."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import random

import blrppl
from blrppl import optim
from blrppl.errors import BLRError


def mlp_params(dtype=jnp.float32):
    k1, k2 = random.split(random.PRNGKey(0))
    return {
        "hidden": {"w": 0.5 * random.normal(k1, (2, 8), dtype), "b": jnp.zeros(8, dtype)},
        "out": {"w": 0.5 * random.normal(k2, (8,), dtype), "b": jnp.zeros((), dtype)},
    }


def mlp(params, x):
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


def data(dtype=jnp.float32):
    x = random.normal(random.PRNGKey(1), (64, 2), dtype)
    y = jnp.sin(x[:, 0]) + 0.1 * random.normal(random.PRNGKey(2), (64,), dtype)
    return x, y


def loss(params, x, y):
    return 0.5 * jnp.mean((mlp(params, x) - y) ** 2)


def test_float32_pytree_trains_under_jit_and_stays_float32():
    x, y = data()
    opt = optim.ivon(learning_rate=0.05, ess=64.0, hess_init=0.1, mc_samples=2)
    assert isinstance(opt, optax.GradientTransformation)
    params = mlp_params()
    state = jax.jit(opt.init)(params)
    grad_fn = optim.value_and_grad(loss)

    @jax.jit
    def train(params, state, key):
        def step(carry, key):
            params, state = carry
            value, grads, noise = grad_fn(params, state, key, x, y)
            updates, state = opt.update(grads, state, params, noise=noise)
            return (optax.apply_updates(params, updates), state), value

        return jax.lax.scan(step, (params, state), random.split(key, 300))

    (new, state), losses = train(params, state, random.PRNGKey(3))
    for tree in (new, state.hess, state.momentum, optim.posterior_stddev(state)):
        for leaf in jax.tree.leaves(tree):
            assert leaf.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(leaf)))
    assert jax.tree.structure(new) == jax.tree.structure(params)
    assert losses.shape == (300,) and bool(jnp.all(jnp.isfinite(losses)))
    # the loss at the mean falls
    assert float(loss(new, x, y)) < 0.5 * float(loss(params, x, y))
    draws = optim.predictive(mlp, state, new, random.PRNGKey(4), 10, x)
    assert draws.shape == (10, 64) and draws.dtype == jnp.float32


def test_chains_with_optax_transforms():
    """In optax.chain, ``noise=`` reaches IVON as an extra argument, and a clipping that does
    not bind leaves IVON's update as it is; ``sample_parameters`` finds the IVON state inside
    the chain's state."""
    x, y = data()
    params = mlp_params()
    opt = optim.ivon(learning_rate=0.05, ess=64.0)
    chained = optax.chain(optax.clip_by_global_norm(1e6), opt, optax.clip(10.0))
    state, chain_state = opt.init(params), chained.init(params)
    key = random.PRNGKey(5)
    theta, noise = optim.sample_parameters(chain_state, params, key)
    same_theta, _ = optim.sample_parameters(state, params, key)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), theta, same_theta))
    grads = jax.grad(loss)(theta, x, y)
    direct, state = opt.update(grads, state, params, noise=noise)
    chained_updates, chain_state = jax.jit(chained.update)(grads, chain_state, params, noise=noise)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(chained_updates)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(optim.find_state(chain_state).hess["out"]["w"]), np.asarray(state.hess["out"]["w"]), rtol=1e-6
    )


def test_blrppl_optim_is_loaded_on_first_use():
    assert blrppl.optim is optim
    assert "optim" in blrppl.__all__


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        (dict(learning_rate=0.1, ess=0.0), "ess"),
        (dict(learning_rate=0.1, ess=-10), "ess"),
        (dict(learning_rate=0.1, ess=math.inf), "ess"),
        (dict(learning_rate=-0.1, ess=10), "learning_rate"),
        (dict(learning_rate=math.nan, ess=10), "learning_rate"),
        (dict(learning_rate=lambda count: -0.1, ess=10), "learning_rate"),
        (dict(learning_rate="0.1", ess=10), "learning_rate"),
        (dict(learning_rate=0.1, ess=10, hess_init=0.0), "hess_init"),
        (dict(learning_rate=0.1, ess=10, beta1=1.0), "beta1"),
        (dict(learning_rate=0.1, ess=10, beta2=1.5), "beta2"),
        (dict(learning_rate=0.1, ess=10, weight_decay=-1e-4), "weight_decay"),
        (dict(learning_rate=0.1, ess=10, prior_precision=-1.0), "prior_precision"),
        (dict(learning_rate=0.1, ess=10, weight_decay=1e-4, prior_precision=1.0), "prior_precision"),
        (dict(learning_rate=0.1, ess=10, mc_samples=0), "mc_samples"),
        (dict(learning_rate=0.1, ess=10, mc_samples=2.5), "mc_samples"),
        (dict(learning_rate=0.1, ess=10, clip_radius=0.0), "clip_radius"),
        (dict(learning_rate=0.1, ess=10, rescale_lr="yes"), "rescale_lr"),
    ],
)
def test_bad_settings_raise_naming_the_setting(kwargs, setting):
    with pytest.raises(optim.OptimizerSettingError, match=setting) as info:
        optim.ivon(**kwargs)
    assert isinstance(info.value, BLRError)


def test_prior_precision_is_weight_decay_times_ess():
    opt = optim.ivon(0.1, ess=50.0, prior_precision=2.0)
    assert opt.init({"w": jnp.zeros(2)}).posterior.weight_decay == pytest.approx(2.0 / 50.0)


def test_bad_arguments_raise_naming_what_to_pass():
    opt = optim.ivon(0.1, ess=10.0, mc_samples=2)
    params = {"w": jnp.zeros(3)}
    state = opt.init(params)
    theta, noise = optim.sample_parameters(state, params, random.PRNGKey(0))
    grads = {"w": jnp.ones((2, 3))}
    with pytest.raises(optim.OptimizerSettingError, match="noise=noise"):
        opt.update(grads, state, params)
    with pytest.raises(optim.OptimizerSettingError, match="params"):
        opt.update(grads, state, None, noise=noise)
    with pytest.raises(optim.OptimizerSettingError, match=r"gradient of \['w'\] has shape \(3,\), not \(2, 3\)"):
        opt.update({"w": jnp.ones(3)}, state, params, noise=noise)
    with pytest.raises(optim.OptimizerSettingError, match="structure"):
        opt.update({"v": jnp.ones((2, 3))}, state, params, noise=noise)
    with pytest.raises(optim.OptimizerSettingError, match="no IVON states"):
        optim.sample_parameters(optax.sgd(0.1).init(params), params, random.PRNGKey(0))
    with pytest.raises(optim.OptimizerSettingError, match="dtype int32"):
        opt.init({"n": jnp.arange(3, dtype=jnp.int32)})
    with pytest.raises(optim.OptimizerSettingError, match="num_samples"):
        optim.predictive(lambda p: p, state, params, random.PRNGKey(0), 0)
    with pytest.raises(BLRError, match="key"):
        optim.sample_parameters(state, params, "seed")
    # nothing the user passed was changed
    assert np.all(np.asarray(params["w"]) == 0.0)


def test_inject_hyperparams_schedules_the_learning_rate():
    """optax.inject_hyperparams passes IVON's numbers as arrays into a jitted update: the
    learning rate (and β's, h₀, ξ) may be traced, the static ess and samples per step are
    named as static_args; without that the error says so."""
    x, y = data()
    params = mlp_params()
    plain = optim.ivon(learning_rate=0.05, ess=64.0)
    injected = optax.inject_hyperparams(optim.ivon, static_args=("ess", "mc_samples"))(learning_rate=0.05, ess=64.0)
    state, inj_state = plain.init(params), injected.init(params)
    theta, noise = optim.sample_parameters(inj_state, params, random.PRNGKey(6))
    grads = jax.grad(loss)(theta, x, y)
    want, _ = plain.update(grads, state, params, noise=noise)
    got, inj_state = jax.jit(injected.update)(grads, inj_state, params, noise=noise)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4)  # (β₂ as a float32 array)
    inj_state.hyperparams["learning_rate"] = jnp.zeros((), jnp.float32)
    frozen, _ = jax.jit(injected.update)(grads, inj_state, params, noise=noise)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(frozen))

    traced_ess = optax.inject_hyperparams(optim.ivon, static_args=("mc_samples",))(learning_rate=0.05, ess=64.0)
    with pytest.raises(optim.OptimizerSettingError, match="list 'ess' in its static_args"):
        jax.jit(traced_ess.update)(grads, traced_ess.init(params), params, noise=noise)
