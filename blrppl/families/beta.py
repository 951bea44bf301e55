"""Beta candidate family."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.special import digamma, gammaln

from blrppl.families._special import (
    dirichlet_concentration_from_mean, formed_once, inside_unit_interval, sherman_morrison_denominator, trigamma,
)
from blrppl.families.base import Family


class BetaNat(NamedTuple):
    """Natural parameters of elementwise Betas (also used for their mean parameters).

    Attributes:
        eta1: α − 1, shape ``(*B,)`` (mean parameters: E[log x] = ψ(α) − ψ(α + β)).
        eta2: β − 1, shape ``(*B,)`` (mean parameters: E[log(1 − x)] = ψ(β) − ψ(α + β)).
    """

    eta1: jax.Array
    eta2: jax.Array


class BetaView(NamedTuple):
    """Concentrations α and β, each ``(*B,)``."""

    alpha: jax.Array
    beta: jax.Array


class BetaRuleView(NamedTuple):
    """What the expected-log-density rules read of a Beta block (internal): α, β and the
    mean parameters E[log x] = ψ(α) − ψ(α₀), E[log(1 − x)] = ψ(β) − ψ(α₀) as separate,
    redundant leaves (see :class:`Beta`). Each field is ``(*B,)``."""

    alpha: jax.Array
    beta: jax.Array
    mean_log: jax.Array
    mean_log1m: jax.Array


@dataclasses.dataclass(frozen=True)
class Beta(Family):
    """Independent Beta(α, β) distributions on (0, 1), one per batch element.

    * T(x) = (log x, log(1 − x)); base measure 1.
    * λ = (η₁, η₂) = (α − 1, β − 1)  (:class:`BetaNat`, each ``(*B,)``).
    * A(λ) = log B(α, β) = log Γ(α) + log Γ(β) − log Γ(α₀),  α₀ = α + β.
    * μ = (ψ(α) − ψ(α₀), ψ(β) − ψ(α₀)).
    * view: :class:`BetaView` (α, β).
    * Fisher F(λ) = [[ψ′(α) − ψ′(α₀), −ψ′(α₀)], [−ψ′(α₀), ψ′(β) − ψ′(α₀)]].

    BLR update. The rules see the block through :class:`BetaRuleView` (:meth:`rule_view`):
    L = Σ_i E_q[log f_i] is a function of (α, β) and of μ held as separate leaves, and its
    total derivative in μ is

        λ̃ = ∇_μ L = ∂L/∂μ + F(λ)⁻¹ ∇_λ L,   ∇_λ L = (∂L/∂α, ∂L/∂β),
        λ ← (1 − ρ) λ + ρ λ̃,

    the solve written as Sherman–Morrison on F = diag(ψ′(α), ψ′(β)) − ψ′(α₀) 11ᵀ with the
    cancellation-free 1/ψ′(α₀) − 1/ψ′(α) − 1/ψ′(β), so it stays accurate for large α, β.

    A conjugate factor x^{c₁} (1 − x)^{c₂} (e.g. a Bernoulli observation) reads only μ and
    sends exactly (c₁, c₂), also in float32 (through (α, β) its ψ(α₀) terms would cancel
    only up to rounding, amplified by F⁻¹ at large α₀). Non-conjugate expectations (E[x],
    Var[x], E[x^k]) go through (α, β) and the solve; a gradient with respect to a plain
    :class:`BetaView` is the solve alone.
    """

    name: ClassVar[str] = "beta"
    view_type: ClassVar[type] = BetaView
    support: ClassVar[str] = "unit_interval"
    native: ClassVar[bool] = True
    argument_kind: ClassVar[str] = "beta"

    def initial_nat(self, x: jax.Array) -> BetaNat:
        """Mean near x: α = 2x + ½, β = 2(1 − x) + ½."""
        return self.nat_from_view(BetaView(2.0 * x + 0.5, 2.0 * (1.0 - x) + 0.5))

    def view(self, nat: BetaNat) -> BetaView:
        return BetaView(nat.eta1 + 1.0, nat.eta2 + 1.0)

    def rule_view(self, nat: BetaNat) -> BetaRuleView:
        """(α, β, ψ(α) − ψ(α₀), ψ(β) − ψ(α₀)): the view with the mean parameters as extra leaves."""
        alpha, beta = self.view(nat)
        mean_params = formed_once(self.mean_params, nat)
        return BetaRuleView(alpha, beta, mean_params.eta1, mean_params.eta2)

    def mean_params_in(self, view) -> BetaNat | None:
        """(E[log p], E[log(1 − p)]) of a :class:`BetaRuleView`."""
        return BetaNat(view.mean_log, view.mean_log1m) if isinstance(view, BetaRuleView) else None

    def nat_from_view(self, view: BetaView) -> BetaNat:
        return BetaNat(view.alpha - 1.0, view.beta - 1.0)

    def mean_params(self, nat: BetaNat) -> BetaNat:
        alpha, beta = self.view(nat)
        psi0 = digamma(alpha + beta)
        return BetaNat(digamma(alpha) - psi0, digamma(beta) - psi0)

    def nat_from_mean(self, mean_params: BetaNat) -> BetaNat:
        stacked = jnp.stack(jnp.broadcast_arrays(mean_params.eta1, mean_params.eta2), -1)
        conc = dirichlet_concentration_from_mean(stacked)
        return BetaNat(conc[..., 0] - 1.0, conc[..., 1] - 1.0)

    def log_partition(self, nat: BetaNat) -> jax.Array:
        alpha, beta = self.view(nat)
        return gammaln(alpha) + gammaln(beta) - gammaln(alpha + beta)

    def sufficient_stats(self, x: jax.Array) -> BetaNat:
        return BetaNat(jnp.log(x), jnp.log1p(-x))

    def message_from_view_grad(self, nat: BetaNat, view_grad: BetaView | BetaRuleView) -> BetaNat:
        alpha, beta = self.view(nat)
        # F = diag(ψ′(α), ψ′(β)) − ψ′(α₀) 11ᵀ, inverted by Sherman–Morrison with
        # s = 1/ψ′(α₀) − 1/ψ′(α) − 1/ψ′(β) > 0 (det F = ψ′(α) ψ′(β) ψ′(α₀) s)
        t1, t2 = trigamma(alpha), trigamma(beta)
        s = sherman_morrison_denominator(jnp.stack(jnp.broadcast_arrays(alpha, beta), -1))[..., 0]
        g1, g2 = view_grad.alpha / t1, view_grad.beta / t2  # D⁻¹ g
        shift = (g1 + g2) / s
        eta1, eta2 = g1 + shift / t1, g2 + shift / t2
        if isinstance(view_grad, BetaRuleView):  # direct part ∂L/∂μ
            eta1, eta2 = eta1 + view_grad.mean_log, eta2 + view_grad.mean_log1m
        return BetaNat(eta1, eta2)

    def is_valid(self, nat: BetaNat) -> jax.Array:
        finite = jnp.all(jnp.isfinite(nat.eta1)) & jnp.all(jnp.isfinite(nat.eta2))
        return finite & jnp.all(nat.eta1 > -1.0) & jnp.all(nat.eta2 > -1.0)

    def sample(self, nat: BetaNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """x = g₁ / (g₁ + g₂), g ~ Gamma(α, 1), Gamma(β, 1) (implicitly reparameterised), inside
        (0, 1) (:func:`inside_unit_interval`)."""
        alpha, beta = self.view(nat)
        shape = tuple(sample_shape) + jnp.broadcast_shapes(alpha.shape, beta.shape)
        return inside_unit_interval(jax.random.beta(rng_key, alpha, beta, shape=shape, dtype=alpha.dtype))

    def linearisation_point(self, view) -> jax.Array:
        return view.alpha / (view.alpha + view.beta)

    def tangent_sets(self, view, full: bool) -> dict:
        """Rows α, β (and E[log p], E[log(1 − p)] for a rule view), gathered by the
        indexing map (:class:`blrppl.moments.BetaIdentity`)."""
        rows = [view.alpha, view.beta]
        if getattr(view, "mean_log", None) is not None:  # BetaRuleView: E[log p], E[log(1 − p)]
            rows += [view.mean_log, view.mean_log1m]
        return {"beta": jnp.stack(jnp.broadcast_arrays(*rows))}

    def to_numpyro(self, nat: BetaNat) -> dist.Beta:
        alpha, beta = self.view(nat)
        return dist.Beta(alpha, beta)
