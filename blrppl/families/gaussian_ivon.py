"""Elementwise Gaussians updated by IVON's rule: the family of large continuous blocks (a
network's weights) whose factors have no closed form.

IVON (Shen et al. 2024, "Variational Learning is Effective for Large Deep Networks",
Algorithm 1) is the Bayesian learning rule for a diagonal Gaussian (Khan & Rue 2023, "The
Bayesian Learning Rule", section on deep learning) with three choices that make it cost
about as much as Adam: the curvature from the reparameterisation trick at one draw
θ = m + σ ε per step, ĥ = −∇ log f(θ) · (θ − m) / σ² (no second derivatives), the
positivity-preserving average of the precision, and momentum on the gradient. In the
learning rule's terms, with precision s = 1/v, the message's precision
ŝ = −2 λ̃₂ (prior precision plus ĥ summed over the data) and its gradient
ĝ = λ̃₁ − ŝ m = ∂L/∂m (the expected log joint's gradient), one step at step size ρ is

    s ← s + ρ (ŝ − s) + ½ ρ² (ŝ − s)² / s          (:func:`positive_average`)
    g ← β₁ g + (1 − β₁) ĝ,   w ← β₁ w + (1 − β₁)     (:func:`momentum_average`)
    m ← m + clip(ρ (g / w) / s, ±κ/√s)

With s = λ (h + δ) (λ the data's size, δ the prior precision per datum) the first line
is IVON's h ← β₂ h + (1 − β₂) ĥ + ½ (1 − β₂)² (h − ĥ)² / (h + δ) at 1 − β₂ = ρ, and the
last its mean step m ← m − α (ḡ + δ m) / (h + δ) at α = ρ, w = 1 − β₁ᵗ its debiasing. The
step size ρ is the fit's (a Robbins–Monro schedule of the Monte Carlo blocks, or a
subsampled fit's), which plays β₂'s part; with β₁ = 0 and no clip the step is the
improved learning rule of :class:`blrppl.families.GaussianDiag` at ρ < 1. The momentum and
its weight are carried as leaves of the natural parameters (:class:`IVONNat`): the fit's
state holds them with the block's λ, O(d) numbers for d weights.

Two choices differ from the optimiser's defaults, both measured on a two-layer tanh
network (1,153 weights, 100 points of 1-D regression, 3,000 steps, three keys):

* the blocks start at variance 0.01 (sd 0.1) about their starting values, where
  ``blr_fit``'s other Gaussians start at 1: a network's posterior is far narrower than
  that, and draws that wide make the first gradients 10⁴–10⁵ times the last ones (IVON's
  ``hess_init`` plays this part). At 1,000 steps the ELBO reached −456 and −467 (two keys)
  from variance 0.01, −713 and −590 from 0.1, −815 and −417 from 1;
* the clip κ (IVON's ξ, here in units of the posterior's own sd: a trust region in q's
  scale) is 1 by default: without it, from variance 1, the mean ran off (ELBO −10⁷ after
  3,000 steps);
* β₁ is 0 by default: at the learning rule's decaying step sizes (0.5 at the start)
  momentum kept those first gradients in its average and ended lower (mean ELBO over the
  last 200 steps −671, −845, −575 with β₁ = 0.9 against −358, −448, −406 without).
  A family with momentum is one registration away:
  ``blrppl.register_family(GaussianIVON(beta1=0.9), name="gaussian-ivon-momentum")``.

:mod:`blrppl.optim.ivon` (the optax optimiser) uses the same two averages.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.families.gaussian import DiagGaussianView, GaussianDiag


def positive_average(prec, target, rate):
    """The positivity-preserving average of a precision ``prec`` towards a noisy estimate
    ``target`` at step ``rate`` (Lin, Schmidt & Khan 2020; IVON's Hessian update):
    ``prec + rate (target − prec) + ½ rate² (target − prec)² / prec``, positive whenever
    ``prec`` is, whatever the sign of ``target`` (with x = (target − prec)/prec it is
    prec (1 + rate x + ½ rate² x²), and 1 + y + y²/2 > 0 for every y).

    Args:
        prec: the current precision (> 0), any shape.
        target: the estimate (any sign), broadcastable to ``prec``.
        rate: the step size in [0, 1] (1 − β₂ in IVON's notation).

    Returns:
        The new precision, of ``prec``'s shape.
    """
    diff = target - prec
    return prec + rate * diff + 0.5 * rate * rate * jnp.square(diff) / prec


def momentum_average(momentum, grad, beta1):
    """The exponential average ``β₁ momentum + (1 − β₁) grad`` of the gradients.

    Args:
        momentum: the running average (any shape).
        grad: the new gradient estimate, broadcastable to it.
        beta1: β₁ in [0, 1).

    Returns:
        The new average.
    """
    return beta1 * momentum + (1.0 - beta1) * grad


def reparam_curvature(grad, noise, var):
    """IVON's curvature estimate ``grad · noise / var`` at a draw θ = m + noise from N(m, var)
    (an unbiased estimate of E_q[∇² F] for F whose gradient at θ is ``grad``, by Stein's
    lemma: E[∇F(θ) (θ − m)] = var E[∇²F] elementwise on the diagonal).

    Args:
        grad: ∇F at the draw (a leading axis of draws is averaged by the caller).
        noise: θ − m.
        var: the variances.
    """
    return grad * noise / var


class IVONNat(NamedTuple):
    """Natural parameters of elementwise Gaussians with IVON's momentum.

    Attributes:
        eta1: m / v, shape ``(*B,)``.
        eta2: −1 / (2v), shape ``(*B,)``.
        momentum: g, the average of ∂L/∂m, shape ``(*B,)`` (in a message: ∂L/∂m itself).
        weight: w = 1 − β₁ᵗ, the weight of the average (a scalar; 1 in a message).
    """

    eta1: jax.Array
    eta2: jax.Array
    momentum: jax.Array
    weight: jax.Array


@dataclasses.dataclass(frozen=True)
class GaussianIVON(GaussianDiag):
    """Independent scalar Gaussians N(m, v) fitted by IVON's update (see the module).

    The view, the entropy, the draws and the export are those of
    :class:`blrppl.families.GaussianDiag`; the natural parameters carry the momentum
    (:class:`IVONNat`), and Monte Carlo messages to the block take IVON's curvature estimate
    from :data:`mc_draws` draws per step (:mod:`blrppl.estimators.monte_carlo`).

    Attributes:
        beta1: β₁, the momentum of the gradient (0, the default: none; see the module).
        max_step: κ, the most a step moves each mean, in posterior sds (None: no bound).
        init_var: the variance of every weight at the start (see the module).
    """

    name: ClassVar[str] = "gaussian-ivon"
    #: never a latent's default: the compiler chooses it for large blocks
    #: (:mod:`blrppl.compiler.large_blocks`), or ``families=`` names it
    native: ClassVar[bool] = False
    #: Monte Carlo messages to the block: IVON's reparameterisation estimate
    #: (:func:`reparam_curvature`), never the Hessian, and no control variate
    reparam_curvature: ClassVar[bool] = True
    #: draws per step of a Monte Carlo factor group that reads the block (IVON's one)
    mc_draws: ClassVar[int | None] = 1

    beta1: float = 0.0
    max_step: float | None = 1.0
    init_var: float = 0.01

    def _nat(self, eta1, eta2, momentum=None, weight=None) -> IVONNat:
        xp = np if isinstance(eta1, np.ndarray) else jnp
        momentum = xp.zeros_like(eta1) if momentum is None else momentum
        weight = xp.zeros((), xp.result_type(eta1)) if weight is None else weight
        return IVONNat(eta1, eta2, momentum, weight)

    def initial_nat(self, x) -> IVONNat:
        """Mean x, variance :attr:`init_var` (numpy for a numpy ``x``: no XLA program)."""
        xp = np if isinstance(x, np.ndarray) else jnp
        return self.nat_from_view(DiagGaussianView(x, self.init_var * xp.ones_like(x)))

    def nat_from_view(self, view: DiagGaussianView) -> IVONNat:
        """λ of N(mean, var), with no momentum yet."""
        return self._nat(view.mean / view.var, -0.5 / view.var)

    def mean_params(self, nat: IVONNat) -> IVONNat:
        mean, var = self.view(nat)
        return IVONNat(mean, var + mean**2, jnp.zeros_like(mean), jnp.zeros_like(nat.weight))

    def nat_from_mean(self, mean_params: IVONNat) -> IVONNat:
        m = mean_params.eta1
        return self.nat_from_view(DiagGaussianView(m, mean_params.eta2 - m**2))

    def sufficient_stats(self, x: jax.Array) -> IVONNat:
        return IVONNat(x, x**2, jnp.zeros_like(x), jnp.zeros((), jnp.result_type(x)))

    def message_from_view_grad(self, nat: IVONNat, view_grad: DiagGaussianView) -> IVONNat:
        """λ̃ = (∂L/∂m − 2 (∂L/∂v) m, ∂L/∂v), with ∂L/∂m as its momentum (weight 1)."""
        mean = -0.5 * nat.eta1 / nat.eta2
        return IVONNat(
            view_grad.mean - 2.0 * view_grad.var * mean, view_grad.var, view_grad.mean, jnp.ones_like(nat.weight)
        )

    def update(self, nat: IVONNat, message: IVONNat, rho, retract: bool = False) -> IVONNat:
        """IVON's step at step size ρ (the module's equations), at every ρ: its precision
        average keeps the block valid whatever the message (``retract`` changes nothing)."""
        del retract
        prec = -2.0 * nat.eta2
        mean = nat.eta1 / prec
        target = -2.0 * message.eta2
        grad = message.eta1 - target * mean  # ∂L/∂m
        new_prec = positive_average(prec, target, rho)
        momentum = momentum_average(nat.momentum, grad, self.beta1)
        weight = momentum_average(nat.weight, 1.0, self.beta1)
        step = rho * (momentum / weight) / new_prec
        if self.max_step is not None:  # at most max_step posterior sds: a trust region in q's own scale
            bound = self.max_step / jnp.sqrt(new_prec)
            step = jnp.clip(step, -bound, bound)
        new_mean = mean + step
        dtype = jnp.result_type(nat.eta1)
        return IVONNat(
            (new_prec * new_mean).astype(dtype), (-0.5 * new_prec).astype(dtype), momentum.astype(dtype),
            jnp.asarray(weight, dtype),
        )

    def is_valid(self, nat: IVONNat) -> jax.Array:
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in nat]))
        return finite & jnp.all(nat.eta2 < 0)
