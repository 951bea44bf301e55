"""IVON: the Bayesian learning rule for a diagonal Gaussian over a network's weights, as an
optax gradient transformation (Shen et al. 2024, "Variational Learning is Effective for
Large Deep Networks", Algorithm 1).

The posterior is q(θ) = N(m, diag(σ²)) with σ² = 1 / (λ (h + δ)): the mean m is the
parameter pytree the user holds (optax's ``params``), the Hessian estimate h and the
gradient momentum g are the optimiser's state. One step, given the gradients ĝ_s of the
loss at S samples θ_s = m + σ ε_s (:func:`blrppl.optim.sample_parameters`):

    ĝ = (1/S) Σ_s ĝ_s
    ĥ = (1/S) Σ_s ĝ_s (θ_s − m) / σ²                 (the reparameterisation-trick estimate)
    g ← β₁ g + (1 − β₁) ĝ
    h ← β₂ h + (1 − β₂) ĥ + ½ (1 − β₂)² (h − ĥ)² / (h + δ)
    m ← m − α_t clip((g / (1 − β₁ᵗ) + δ m) / (h + δ), ξ)

with α_t the learning rate (times h₀ + δ when ``rescale_lr``) and clip(·, ξ) elementwise
to [−ξ, ξ]. The last term of the h update keeps h + δ positive whatever ĥ is (Lin,
Schmidt & Khan 2020): with a = h + δ and x = (ĥ − h)/a, the new h + δ is
a (1 + r x + ½ r² x²) with r = 1 − β₂, and 1 + y + y²/2 > 0 for every y.

The loss is the mean over the training examples and λ (``ess``) their number, so that λ
times the loss is the negative log-likelihood; δ is then the prior precision divided by λ
(the prior N(0, 1/(λδ))), the weight decay of the same loss trained by SGD.

The averages and the curvature estimate are those ``blr_fit`` applies to large blocks
(:mod:`blrppl.families.gaussian_ivon`: :func:`positive_average`, :func:`momentum_average`,
:func:`reparam_curvature`), imported from there.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from blrppl.families.gaussian_ivon import momentum_average, positive_average, reparam_curvature
from blrppl.optim import settings as checks
from blrppl.optim.settings import OptimizerSettingError, PosteriorSettings


class IVONState(NamedTuple):
    """The state of :func:`ivon` (optax style: an immutable pytree).

    Attributes:
        count: the number of updates made (int32).
        momentum: g, the exponential average of the gradients (like the parameters).
        hess: h, the diagonal Hessian estimate of the loss (like the parameters); the
            posterior's precision is ``ess * (hess + weight_decay)``.
        posterior: the static settings the weight samples need (ess, weight decay, samples
            per step).
    """

    count: jax.Array
    momentum: Any
    hess: Any
    posterior: PosteriorSettings


class _Rule(NamedTuple):
    """The settings of one optimiser, checked (what the update reads besides the state)."""

    learning_rate: Any
    hess_init: float
    beta1: float
    beta2: float
    clip_radius: float
    rescale_lr: bool


def ivon(
    learning_rate,
    ess,
    hess_init=1.0,
    beta1=0.9,
    beta2=0.99999,
    weight_decay=None,
    mc_samples=1,
    clip_radius=math.inf,
    rescale_lr=True,
    *,
    prior_precision=None,
) -> optax.GradientTransformationExtraArgs:
    """The IVON optimiser: a diagonal Gaussian posterior over the parameters, fitted by the
    Bayesian learning rule (the update equations are in this module's docstring).

    Each step draws weight samples from the posterior, evaluates the loss's gradient there
    and passes both to ``update``::

        opt = ivon(learning_rate=0.1, ess=len(x_train))
        state = opt.init(params)
        loss, grads, noise = blrppl.optim.value_and_grad(loss_fn)(params, state, key, x, y)
        updates, state = opt.update(grads, state, params, noise=noise)
        params = optax.apply_updates(params, updates)

    ``params`` stay the posterior mean; :func:`blrppl.optim.predictive` averages the
    network's outputs over the posterior. The transformation chains with optax's (the
    ``noise=`` keyword reaches it through ``optax.chain``).

    Args:
        learning_rate: α, a number ≥ 0 or an optax schedule of the update count.
        ess: λ, the effective sample size > 0: the number of training examples when the
            loss is their mean.
        hess_init: h₀ > 0, the starting Hessian estimate (the first samples' spread is
            1/√(λ(h₀ + δ))).
        beta1: β₁ in [0, 1), the gradient momentum.
        beta2: β₂ in [0, 1), the Hessian estimate's averaging.
        weight_decay: δ ≥ 0, the prior precision divided by ``ess`` (default 1e-4).
        mc_samples: S ≥ 1, weight samples per step; with S > 1 the samples, their noise
            and the gradients passed to ``update`` carry a leading axis of S.
        clip_radius: ξ > 0 (``inf``: none), the bound of each element of the preconditioned
            step before the learning rate.
        rescale_lr: multiply the learning rate by h₀ + δ, so that the first steps are
            about those of SGD with momentum at ``learning_rate``.
        prior_precision: the prior precision λδ instead of ``weight_decay`` (at most one
            of the two).

    Returns:
        An ``optax.GradientTransformationExtraArgs``: ``init(params)`` and
        ``update(grads, state, params, *, noise)``, pure and jit-able.

    Raises:
        OptimizerSettingError: a setting out of range or of the wrong type (it is named).
    """
    ess = checks.positive(ess, "ess")
    posterior = PosteriorSettings(
        ess=ess,
        weight_decay=checks.weight_decay(weight_decay, prior_precision, ess),
        mc_samples=checks.sample_count(mc_samples, "ivon's mc_samples"),
    )
    if not isinstance(rescale_lr, (bool, np.bool_)):
        raise OptimizerSettingError(f"ivon's rescale_lr must be True or False, not {rescale_lr!r}")
    rule = _Rule(
        learning_rate=checks.learning_rate(learning_rate),
        hess_init=checks.positive(hess_init, "hess_init"),
        beta1=checks.unit_interval(beta1, "beta1"),
        beta2=checks.unit_interval(beta2, "beta2"),
        clip_radius=checks.clip_radius(clip_radius),
        rescale_lr=bool(rescale_lr),
    )

    def init(params):
        _check_parameters(params)
        return IVONState(
            count=jnp.zeros((), jnp.int32),
            momentum=jax.tree.map(jnp.zeros_like, params),
            hess=jax.tree.map(lambda p: jnp.full(jnp.shape(p), rule.hess_init, jnp.result_type(p)), params),
            posterior=posterior,
        )

    def update(grads, state, params=None, *, noise=None, **extra_args):
        del extra_args  # (other transformations' extra arguments, passed along by optax.chain)
        _check_update(grads, state, params, noise)
        return _step(rule, grads, state, params, noise)

    return optax.GradientTransformationExtraArgs(init, update)


def _step(rule: _Rule, grads, state: IVONState, params, noise):
    """One IVON update: (updates, new state), the equations of the module's docstring."""
    post = state.posterior
    stacked = post.mc_samples > 1
    delta = post.weight_decay
    count = state.count + 1

    def hessian(g, eps, h):
        var = 1.0 / (post.ess * (h + delta))  # σ²
        h_hat = reparam_curvature(g, eps, var)  # ĝ (θ − m) / σ²
        h_hat = jnp.mean(h_hat, axis=0) if stacked else h_hat
        # (the average of h + δ, the posterior's precision over λ)
        new = positive_average(h + delta, h_hat + delta, 1.0 - rule.beta2) - delta
        return new.astype(h.dtype)

    def momentum(g, mom):
        g_hat = jnp.mean(g, axis=0) if stacked else g
        return momentum_average(mom, g_hat, rule.beta1).astype(mom.dtype)

    hess = jax.tree.map(hessian, grads, noise, state.hess)
    mom = jax.tree.map(momentum, grads, state.momentum)
    alpha = rule.learning_rate(state.count) if callable(rule.learning_rate) else rule.learning_rate
    if rule.rescale_lr:
        alpha = alpha * (rule.hess_init + delta)

    def step(g, h, m):
        debias = 1.0 - rule.beta1 ** count.astype(g.dtype)  # (1 − β₁ᵗ)
        direction = (g / debias + delta * m) / (h + delta)
        if isinstance(rule.clip_radius, jax.core.Tracer) or rule.clip_radius != math.inf:
            direction = jnp.clip(direction, -rule.clip_radius, rule.clip_radius)
        return (-alpha * direction).astype(m.dtype)

    updates = jax.tree.map(step, mom, hess, params)
    return updates, IVONState(count=count, momentum=mom, hess=hess, posterior=post)


def _paths(tree) -> list:
    """``(name, leaf)`` of each leaf of ``tree``, the name as jax writes a key path."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [(jax.tree_util.keystr(path) or "(the parameters)", leaf) for path, leaf in leaves]


def _check_parameters(params) -> None:
    """Every leaf of ``params`` is a floating-point array."""
    leaves = _paths(params)
    if not leaves:
        raise OptimizerSettingError("ivon's init got a parameter pytree without arrays: there is nothing to fit")
    for name, leaf in leaves:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise OptimizerSettingError(
                f"ivon fits floating-point parameters; {name} is of dtype {jnp.result_type(leaf)}: cast it "
                "(jnp.asarray(x, jnp.float32)) or keep it out of the optimised pytree"
            )


def _check_update(grads, state, params, noise) -> None:
    """The update's arguments fit each other (shapes only: the check runs at trace time)."""
    if not isinstance(state, IVONState):
        raise OptimizerSettingError(
            f"ivon's update needs the state its init returned (an IVONState), not {type(state).__name__}"
        )
    if params is None:
        raise OptimizerSettingError(
            "ivon's update needs the parameters (the posterior mean): update(grads, state, params, noise=noise)"
        )
    if noise is None:
        raise OptimizerSettingError(
            "ivon's update needs the noise of the weight sample the gradients were taken at: "
            "theta, noise = blrppl.optim.sample_parameters(state, params, key), the gradients at theta, "
            "then update(grads, state, params, noise=noise) (blrppl.optim.value_and_grad does the first two)"
        )
    structure = jax.tree.structure(params)
    for what, tree in (("grads", grads), ("noise", noise)):
        if jax.tree.structure(tree) != structure:
            raise OptimizerSettingError(
                f"ivon's update: {what} must have the parameters' structure {structure}, not {jax.tree.structure(tree)}"
            )
    samples = state.posterior.mc_samples
    for (name, p), (_, g), (_, e) in zip(_paths(params), _paths(grads), _paths(noise)):
        want = (samples, *jnp.shape(p)) if samples > 1 else tuple(jnp.shape(p))
        for what, leaf in (("gradient", g), ("noise", e)):
            if tuple(jnp.shape(leaf)) != want:
                per = f" (a leading axis of the {samples} samples per step)" if samples > 1 else ""
                raise OptimizerSettingError(
                    f"ivon's update: the {what} of {name} has shape {tuple(jnp.shape(leaf))}, not {want}{per}"
                )
