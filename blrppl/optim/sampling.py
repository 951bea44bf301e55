"""The posterior of an IVON fit: its weight samples, their gradients, its predictions.

Each function takes the optimiser's state as ``init``/``update`` return it: the
:class:`~blrppl.optim.ivon.IVONState` itself, or the state of an ``optax.chain`` (or of
another optax wrapper) that holds exactly one.
"""

from __future__ import annotations

import math
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


def standard_noise(params, key, num_samples=None):
    """ε ~ N(0, I) like ``params``: the standard normal draws that :func:`sample_parameters`
    scales by the posterior's sd.

    All the leaves of one dtype are drawn by one call of ``jax.random.normal`` over their
    sizes summed, the leaves in pytree order, each a slice of it (``key`` itself when the
    leaves share one dtype, else one key of ``jax.random.split(key, G)`` for each of the G
    dtypes in the order they first appear): one draw per step rather than one per leaf.

    The draws of many steps at once (``num_samples=K``, then one slice a step, passed to
    :func:`sample_parameters` or :func:`value_and_grad` in place of the key) are the same
    distribution, independent across steps, and cost less on the CPU: threefry runs there
    as a loop of rounds that XLA splits across the cores, once per call (a full-batch step
    of a 2,410-weight network took 1.6 times Adam's with a draw per step on two cores
    shared with other jobs, 1.2 times with the draws of 50 steps at once).

    Args:
        params: the parameter pytree (floating-point leaves).
        key: a ``jax.random`` key.
        num_samples: None for one draw, an int for a leading axis of that many draws, or a
            tuple of ints for several leading axes (``(K, S)``: K steps of S samples each).

    Returns:
        A pytree like ``params``: each leaf of the leaf's dtype and shape (after the leading
        axes of ``num_samples``).

    Raises:
        OptimizerSettingError: a leaf that is not floating-point, or a bad ``num_samples``.
    """
    leaves, treedef = jax.tree.flatten(params)
    shape = _leading(num_samples)
    groups: dict = {}  # dtype -> the indices of its leaves, in pytree order
    for i, (path, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(params)):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise OptimizerSettingError(
                f"standard_noise draws floating-point parameters; {jax.tree_util.keystr(path) or 'the parameters'} "
                f"is of dtype {dtype}: cast it (jnp.asarray(x, jnp.float32)) or keep it out of the pytree"
            )
        groups.setdefault(dtype, []).append(i)
    key = as_key(key, "key")
    keys = [key] if len(groups) == 1 else list(jax.random.split(key, len(groups)))
    noise = [None] * len(leaves)
    for k, (dtype, members) in zip(keys, groups.items()):
        sizes = [math.prod(jnp.shape(leaves[i])) for i in members]
        flat = jax.random.normal(k, shape + (sum(sizes),), dtype)
        start = 0
        for i, size in zip(members, sizes):
            noise[i] = flat[..., start : start + size].reshape(shape + jnp.shape(leaves[i]))
            start += size
    return jax.tree.unflatten(treedef, noise)


def _leading(num_samples) -> tuple:
    """The leading axes of :func:`standard_noise`'s draws, checked."""
    if num_samples is None:
        return ()
    if isinstance(num_samples, tuple):
        return tuple(sample_count(n, "standard_noise's num_samples") for n in num_samples)
    return (sample_count(num_samples, "standard_noise's num_samples"),)


def _is_draws(key_or_eps) -> bool:
    """Whether a step was given standard normal draws (floating-point leaves), not a key."""
    leaves = jax.tree.leaves(key_or_eps)
    return bool(leaves) and all(
        hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in leaves
    )


def _given_draws(params, eps, samples: int | None):
    """The step's draws ``eps`` checked against ``params`` and cast to their dtypes."""
    if jax.tree.structure(eps) != jax.tree.structure(params):
        raise OptimizerSettingError(
            "the step's standard normal draws must have the parameters' structure "
            f"{jax.tree.structure(params)}, not {jax.tree.structure(eps)}: pass a jax.random key, or one step's "
            "slice of blrppl.optim.standard_noise(params, key, num_samples)"
        )
    lead = () if samples is None else (samples,)
    for (path, p), e in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(eps)):
        if tuple(jnp.shape(e)) != lead + tuple(jnp.shape(p)):
            raise OptimizerSettingError(
                f"the step's standard normal draws of {jax.tree_util.keystr(path) or 'the parameters'} have shape "
                f"{tuple(jnp.shape(e))}, not {lead + tuple(jnp.shape(p))}"
                + (f" (a leading axis of the {samples} samples per step)" if samples else "")
            )
    return jax.tree.map(lambda e, p: jnp.asarray(e, jnp.result_type(p)), eps, params)


def _draw(state: IVONState, params, key, num_samples: int | None):
    """(θ, θ − m) for ``num_samples`` draws (a leading axis) or one (None, no axis); ``key``
    may be the standard normal draws themselves."""
    eps = _given_draws(params, key, num_samples) if _is_draws(key) else standard_noise(params, key, num_samples)
    noise = jax.tree.map(jnp.multiply, posterior_stddev(state), eps)
    return jax.tree.map(jnp.add, params, noise), noise


def sample_parameters(state, params, key):
    """The weight samples of one step: θ = m + σ ε with ε ~ N(0, I) (drawn by
    :func:`standard_noise`).

    Args:
        state: the optimiser's state (see the module docstring).
        params: the posterior mean m (the parameters the optimiser updates).
        key: a ``jax.random`` key (``jax.random.PRNGKey(0)`` or ``jax.random.key(0)``), or
            the step's standard normal draws ε themselves: a pytree like ``params`` (one
            step's slice of :func:`standard_noise` drawn for several steps at once).

    Returns:
        ``(theta, noise)``, pytrees like ``params``, ``noise = theta − params``: the loss's
        gradient at ``theta`` and this ``noise`` are what ``update`` takes. With
        ``mc_samples`` S > 1 every leaf has a leading axis of S (as must ε's).

    Raises:
        OptimizerSettingError: draws ε not shaped like ``params``.
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
        by :func:`sample_parameters` (``key`` a key or the step's standard normal draws), the loss averaged over them (with ``has_aux``,
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
