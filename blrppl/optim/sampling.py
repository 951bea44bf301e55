"""The posterior of an IVON fit: its weight samples, their gradients, its predictions.

Each function takes the optimiser's state as ``init``/``update`` return it: the
:class:`~blrppl.optim.ivon.IVONState` itself, or the state of an ``optax.chain`` (or of
another optax wrapper) that holds exactly one.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from blrppl.inputs import as_key
from blrppl.optim.ivon import IVONState
from blrppl.optim.settings import OptimizerSettingError, sample_count


def find_state(state) -> IVONState:
    """The one :class:`IVONState` inside ``state`` (an optax state: tuples, named tuples,
    lists and dicts of states).

    Raises:
        OptimizerSettingError: ``state`` holds no IVON state, or more than one.
    """
    found = []

    def walk(node):
        if isinstance(node, IVONState):
            found.append(node)
        elif isinstance(node, (tuple, list)):
            for child in node:
                walk(child)
        elif isinstance(node, dict):
            for child in node.values():
                walk(child)

    walk(state)
    if len(found) != 1:
        raise OptimizerSettingError(
            f"the optimiser state holds {'no' if not found else len(found)} IVON states: pass the state that "
            "blrppl.optim.ivon(...).init returned (or the state of an optax.chain with one ivon in it)"
        )
    return found[0]


def posterior_stddev(state):
    """σ = 1/√(λ (h + δ)), the posterior's standard deviation of every parameter (a pytree
    like the parameters)."""
    ivon = find_state(state)
    post = ivon.posterior
    return jax.tree.map(lambda h: jax.lax.rsqrt(post.ess * (h + post.weight_decay)), ivon.hess)


def _draw(state: IVONState, params, key, num_samples: int | None):
    """(θ, θ − m) for ``num_samples`` draws (a leading axis) or one (None, no axis)."""
    sigma = posterior_stddev(state)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(as_key(key, "key"), len(leaves))
    shape = () if num_samples is None else (num_samples,)
    noise = [
        s * jax.random.normal(k, shape + jnp.shape(p), jnp.result_type(p))
        for k, p, s in zip(keys, leaves, jax.tree.leaves(sigma))
    ]
    theta = [p + e for p, e in zip(leaves, noise)]
    return jax.tree.unflatten(treedef, theta), jax.tree.unflatten(treedef, noise)


def sample_parameters(state, params, key):
    """The weight samples of one step: θ = m + σ ε with ε ~ N(0, I).

    Args:
        state: the optimiser's state (see the module docstring).
        params: the posterior mean m (the parameters the optimiser updates).
        key: a ``jax.random`` key (``jax.random.PRNGKey(0)`` or ``jax.random.key(0)``).

    Returns:
        ``(theta, noise)``, pytrees like ``params``, ``noise = theta − params``: the loss's
        gradient at ``theta`` and this ``noise`` are what ``update`` takes. With
        ``mc_samples`` S > 1 every leaf has a leading axis of S.
    """
    ivon = find_state(state)
    samples = ivon.posterior.mc_samples
    return _draw(ivon, params, key, samples if samples > 1 else None)


def value_and_grad(loss_fn: Callable, has_aux: bool = False) -> Callable:
    """``loss_fn`` evaluated, with its gradient, at the step's weight samples.

    Args:
        loss_fn: ``loss_fn(params, *args, **kwargs)``, the mean loss over a batch of
            examples (a scalar; with ``has_aux``, ``(loss, aux)``).
        has_aux: whether ``loss_fn`` returns auxiliary data.

    Returns:
        ``f(params, state, key, *args, **kwargs) -> (loss, grads, noise)``: the samples drawn
        by :func:`sample_parameters`, the loss averaged over them (with ``has_aux``,
        ``(loss, aux)``, aux stacked over the samples when there are several), and the
        gradients and noise to pass to ``update``.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def evaluate(params, state, key, *args, **kwargs):
        theta, noise = sample_parameters(state, params, key)
        if find_state(state).posterior.mc_samples == 1:
            value, grads = grad_fn(theta, *args, **kwargs)
            return value, grads, noise
        value, grads = jax.vmap(lambda t: grad_fn(t, *args, **kwargs))(theta)
        if has_aux:
            value = (jnp.mean(value[0]), value[1])
        else:
            value = jnp.mean(value)
        return value, grads, noise

    return evaluate


def predictive(apply_fn: Callable, state, params, key, num_samples: int, *args, **kwargs):
    """The network's outputs at ``num_samples`` draws from the posterior: their mean over
    the draws (of the class probabilities, say) is the Bayesian model average.

    Args:
        apply_fn: ``apply_fn(params, *args, **kwargs)``, the network's output (any pytree).
        state: the optimiser's state (see the module docstring).
        params: the posterior mean.
        key: a ``jax.random`` key.
        num_samples: the number of draws (≥ 1).
        *args: passed to ``apply_fn`` (the inputs), as are ``**kwargs``.

    Returns:
        ``apply_fn``'s output with a leading axis of ``num_samples`` on every leaf.
    """
    num_samples = sample_count(num_samples, "predictive's num_samples")
    theta, _ = _draw(find_state(state), params, key, num_samples)
    return jax.vmap(lambda t: apply_fn(t, *args, **kwargs))(theta)
