"""Bayesian deep learning with IVON: a small multilayer perceptron in plain JAX, trained
by ``blrppl.optim.ivon`` beside Adam, on two interleaved half-moons.

IVON's parameters are the mean of a Gaussian posterior over the weights; the predictions
average the network's class probabilities over draws from it (the Bayesian model average).
Run with ``python examples/ivon_mlp.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import random

from blrppl import optim


def moons(n, rng, noise=0.25):
    """``n`` points of two interleaved half-circles, labels 0 and 1."""
    label = rng.integers(0, 2, size=n)
    angle = rng.uniform(0.0, np.pi, size=n)
    x = np.where(label == 0, np.cos(angle), 1.0 - np.cos(angle))
    y = np.where(label == 0, np.sin(angle), 0.5 - np.sin(angle))
    points = np.stack([x, y], axis=1) + noise * rng.normal(size=(n, 2))
    return jnp.asarray(points, jnp.float32), jnp.asarray(label)


def init_mlp(key, sizes=(2, 32, 32, 2)):
    params = []
    for k, (n_in, n_out) in zip(random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        params.append({"w": random.normal(k, (n_in, n_out)) / np.sqrt(n_in), "b": jnp.zeros(n_out)})
    return params


def mlp(params, x):
    """The logits of the two classes."""
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, label):
    """The mean cross-entropy over the batch (IVON's ess is then the training set's size)."""
    logp = jax.nn.log_softmax(mlp(params, x))
    return -jnp.mean(jnp.take_along_axis(logp, label[:, None], axis=1))


def metrics(probs, label):
    """Accuracy and mean negative log-likelihood of class probabilities."""
    accuracy = float(jnp.mean(jnp.argmax(probs, axis=1) == label))
    nll = float(-jnp.mean(jnp.log(jnp.take_along_axis(probs, label[:, None], axis=1) + 1e-12)))
    return accuracy, nll


def batches(key, n, batch_size, epochs):
    """The indices of each step's minibatch: a permutation of the training set per epoch."""
    keys = random.split(key, epochs)
    perms = jax.vmap(lambda k: random.permutation(k, n))(keys)
    steps = n // batch_size
    return perms[:, : steps * batch_size].reshape(epochs * steps, batch_size)


def train(tx, params, x, label, key, epochs, batch_size, ivon=False):
    """``epochs`` passes over the data in one jitted scan; with ``ivon``, the gradients are
    taken at the posterior's weight samples and ``update`` gets their noise."""
    state = tx.init(params)
    index_key, sample_key = random.split(key)
    index = batches(index_key, x.shape[0], batch_size, epochs)
    keys = random.split(sample_key, index.shape[0])
    grad_fn = optim.value_and_grad(loss_fn)

    def step(carry, inputs):
        params, state = carry
        idx, k = inputs
        if ivon:
            _, grads, noise = grad_fn(params, state, k, x[idx], label[idx])
            updates, state = tx.update(grads, state, params, noise=noise)
        else:
            grads = jax.grad(loss_fn)(params, x[idx], label[idx])
            updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), None

    (params, state), _ = jax.jit(lambda c, xs: jax.lax.scan(step, c, xs))((params, state), (index, keys))
    return params, state


@functools.partial(jax.jit, static_argnums=4)
def model_average(state, params, key, x, num_samples):
    """The Bayesian model average: the class probabilities averaged over ``num_samples``
    draws of the weights from the posterior."""
    probs = optim.predictive(lambda p, x: jax.nn.softmax(mlp(p, x)), state, params, key, num_samples, x)
    return probs.mean(axis=0)


def main(n_train=512, epochs=60, batch_size=32, num_samples=32, seed=0):
    rng = np.random.default_rng(seed)
    x, label = moons(n_train, rng)
    x_test, label_test = moons(1000, rng)
    key_init, key_adam, key_ivon, key_pred = random.split(random.PRNGKey(seed), 4)
    params = init_mlp(key_init)

    adam_params, _ = train(optax.adam(1e-2), params, x, label, key_adam, epochs, batch_size)
    adam = metrics(jax.nn.softmax(mlp(adam_params, x_test)), label_test)

    # ess: the training set's size (the loss is a mean over it); the weight decay δ makes
    # the prior N(0, 1/(ess·δ)) over every weight; beta2 = 0.999 lets the Hessian estimate
    # average over the last ~1000 steps, about the whole of this short run (the default,
    # 0.99999, suits runs of 10⁵ steps and more)
    settings = dict(ess=n_train, weight_decay=1e-3, hess_init=0.5)
    opt = optim.ivon(learning_rate=0.2, beta2=0.999, **settings)
    mean_params, state = train(opt, params, x, label, key_ivon, epochs, batch_size, ivon=True)
    bma = metrics(model_average(state, mean_params, key_pred, x_test, num_samples), label_test)
    at_mean = metrics(jax.nn.softmax(mlp(mean_params, x_test)), label_test)

    rows = {"Adam": adam, "IVON, posterior mean": at_mean, "IVON, model average": bma}
    print(f"{'':24s} {'accuracy':>9s} {'test NLL':>9s}")
    for name, (accuracy, nll) in rows.items():
        print(f"{name:24s} {accuracy:9.3f} {nll:9.3f}")
    sd = jnp.concatenate([s.ravel() for s in jax.tree.leaves(optim.posterior_stddev(state))])
    print(f"posterior sd of the weights: median {float(jnp.median(sd)):.3f}, max {float(sd.max()):.3f}")
    return rows, state, settings


if __name__ == "__main__":
    main()
