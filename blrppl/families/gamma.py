"""Gamma candidate family (shape–rate)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.special import digamma, gammaln

from blrppl.families._special import gamma_shape_from_mean, trigamma, x_trigamma_minus_one
from blrppl.families.base import Family


class GammaNat(NamedTuple):
    """Natural parameters of elementwise Gammas (also used for their mean parameters).

    Attributes:
        eta1: a − 1, shape ``(*B,)`` (mean parameters: E[log x] = ψ(a) − log b).
        eta2: −b, shape ``(*B,)`` (mean parameters: E[x] = a / b).
    """

    eta1: jax.Array
    eta2: jax.Array


class GammaView(NamedTuple):
    """Shape a and rate b, each ``(*B,)``."""

    shape: jax.Array
    rate: jax.Array


@dataclasses.dataclass(frozen=True)
class Gamma(Family):
    """Independent Gamma(a, rate b) distributions on (0, ∞), one per batch element.

    * T(x) = (log x, x); base measure 1.
    * λ = (η₁, η₂) = (a − 1, −b)  (:class:`GammaNat`, each ``(*B,)``).
    * A(λ) = log Γ(η₁ + 1) − (η₁ + 1) log(−η₂).
    * μ = (ψ(a) − log b, a / b).
    * view: :class:`GammaView` (shape a, rate b).
    * Fisher F(λ) = ∇²A = [[ψ′(a), 1/b], [1/b, a/b²]], det F = (a ψ′(a) − 1)/b² > 0.

    BLR update, with L = Σ_i E_q[log f_i] as a function of (a, b): the chain rule gives
    ∇_λ L = (∂L/∂a, −∂L/∂b), and the message is the closed-form 2×2 solve

        λ̃ = ∇_μ L = F(λ)⁻¹ ∇_λ L
          = ((a ∇₁ − b ∇₂), b (b ψ′(a) ∇₂ − ∇₁)) / (a ψ′(a) − 1),
        λ ← (1 − ρ) λ + ρ λ̃.

    A conjugate factor x^{c₁} e^{c₂ x} sends exactly (c₁, c₂).
    """

    name: ClassVar[str] = "gamma"

    def view(self, nat: GammaNat) -> GammaView:
        return GammaView(nat.eta1 + 1.0, -nat.eta2)

    def nat_from_view(self, view: GammaView) -> GammaNat:
        return GammaNat(view.shape - 1.0, -view.rate)

    def mean_params(self, nat: GammaNat) -> GammaNat:
        a, b = self.view(nat)
        return GammaNat(digamma(a) - jnp.log(b), a / b)

    def nat_from_mean(self, mean_params: GammaNat) -> GammaNat:
        a = gamma_shape_from_mean(mean_params.eta1, mean_params.eta2)
        return self.nat_from_view(GammaView(a, a / mean_params.eta2))

    def log_partition(self, nat: GammaNat) -> jax.Array:
        a = nat.eta1 + 1.0
        return gammaln(a) - a * jnp.log(-nat.eta2)

    def sufficient_stats(self, x: jax.Array) -> GammaNat:
        return GammaNat(jnp.log(x), x)

    def message_from_view_grad(self, nat: GammaNat, view_grad: GammaView) -> GammaNat:
        a, b = self.view(nat)
        g1, g2 = view_grad.shape, -view_grad.rate  # ∇_λ L
        h = x_trigamma_minus_one(a)  # b² det F
        return GammaNat((a * g1 - b * g2) / h, b * (b * trigamma(a) * g2 - g1) / h)

    def is_valid(self, nat: GammaNat) -> jax.Array:
        finite = jnp.all(jnp.isfinite(nat.eta1)) & jnp.all(jnp.isfinite(nat.eta2))
        return finite & jnp.all(nat.eta1 > -1.0) & jnp.all(nat.eta2 < 0.0)

    def sample(self, nat: GammaNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """x = g / b with g ~ Gamma(a, 1) (implicitly reparameterised in a)."""
        a, b = self.view(nat)
        shape = tuple(sample_shape) + jnp.broadcast_shapes(a.shape, b.shape)
        return jax.random.gamma(rng_key, a, shape=shape, dtype=a.dtype) / b

    def to_numpyro(self, nat: GammaNat) -> dist.Gamma:
        a, b = self.view(nat)
        return dist.Gamma(a, b)
