"""Gamma candidate family (shape–rate)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax.scipy.special import digamma, gammaln

from blrppl.families._special import formed_once, gamma_shape_from_mean, trigamma, x_trigamma_minus_one
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


class GammaRuleView(NamedTuple):
    """What the expected-log-density rules read of a Gamma block (internal).

    Shape a and rate b, and the mean parameters μ₁ = E[log x] = ψ(a) − log b and
    μ₂ = E[x] = a / b as separate, redundant leaves (equal to their values from (a, b)).
    Rules read E[log x] and E[x] from the μ leaves, so a conjugate factor's gradient lands
    on them directly and its message needs no Fisher solve (see
    :meth:`Gamma.message_from_view_grad`). Each field is ``(*B,)``.
    """

    shape: jax.Array
    rate: jax.Array
    mean_log: jax.Array
    mean: jax.Array


@dataclasses.dataclass(frozen=True)
class Gamma(Family):
    """Independent Gamma(a, rate b) distributions on (0, ∞), one per batch element.

    * T(x) = (log x, x); base measure 1.
    * λ = (η₁, η₂) = (a − 1, −b)  (:class:`GammaNat`, each ``(*B,)``).
    * A(λ) = log Γ(η₁ + 1) − (η₁ + 1) log(−η₂).
    * μ = (ψ(a) − log b, a / b).
    * view: :class:`GammaView` (shape a, rate b).
    * Fisher F(λ) = ∇²A = [[ψ′(a), 1/b], [1/b, a/b²]], det F = (a ψ′(a) − 1)/b² > 0.

    BLR update. The rules see the block through :class:`GammaRuleView` (:meth:`rule_view`):
    L = Σ_i E_q[log f_i] is a function of (a, b) and of μ = (μ₁, μ₂) held as separate
    leaves, and its total derivative in μ is

        λ̃ = ∇_μ L = ∂L/∂μ + F(λ)⁻¹ ∇_λ L,
        ∇_λ L = (∂L/∂a, −∂L/∂b)  (chain rule through a = η₁ + 1, b = −η₂),
        F⁻¹ ∇_λ L = ((a ∇₁ − b ∇₂), b (b ψ′(a) ∇₂ − ∇₁)) / (a ψ′(a) − 1),
        λ ← (1 − ρ) λ + ρ λ̃.

    A conjugate factor x^{c₁} e^{c₂ x} reads only E[log x] = μ₁ and E[x] = μ₂, so its
    gradient in (a, b) is zero and it sends exactly (c₁, c₂), in float32 too: computing
    E[x] = a/b from (a, b) would make the c₂ terms of ∂L/∂a and ∂L/∂b cancel only up to
    rounding, an error that 1/(a ψ′(a) − 1) ≈ 2a amplifies at large shape. Non-conjugate
    expectations (E[x^k] with k ≠ 1) go through (a, b) and the Fisher solve.
    A gradient with respect to a plain :class:`GammaView` (no μ leaves) is the Fisher
    solve alone.
    """

    name: ClassVar[str] = "gamma"
    view_type: ClassVar[type] = GammaView
    support: ClassVar[str] = "positive"
    native: ClassVar[bool] = True
    argument_kind: ClassVar[str] = "power_gamma"
    any_power: ClassVar[bool] = True

    def initial_nat(self, x: jax.Array) -> GammaNat:
        """Mean x, shape 10."""
        return self.nat_from_view(GammaView((np if isinstance(x, np.ndarray) else jnp).full_like(x, 10.0), 10.0 / x))

    def view(self, nat: GammaNat) -> GammaView:
        return GammaView(nat.eta1 + 1.0, -nat.eta2)

    def rule_view(self, nat: GammaNat) -> GammaRuleView:
        """(a, b, ψ(a) − log b, a / b): the view with the mean parameters as extra leaves."""
        a, b = self.view(nat)
        return GammaRuleView(a, b, formed_once(lambda a, b: digamma(a) - jnp.log(b), a, b), a / b)

    def mean_params_in(self, view) -> GammaNat | None:
        """(E[log x], E[x]) of a :class:`GammaRuleView`."""
        return GammaNat(view.mean_log, view.mean) if isinstance(view, GammaRuleView) else None

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

    def message_from_view_grad(self, nat: GammaNat, view_grad: GammaView | GammaRuleView) -> GammaNat:
        a, b = self.view(nat)
        g1, g2 = view_grad.shape, -view_grad.rate  # ∇_λ L
        h = x_trigamma_minus_one(a)  # b² det F
        eta1 = (a * g1 - b * g2) / h
        eta2 = b * (b * trigamma(a) * g2 - g1) / h
        if isinstance(view_grad, GammaRuleView):  # direct part ∂L/∂μ
            eta1 = eta1 + view_grad.mean_log
            eta2 = eta2 + view_grad.mean
        return GammaNat(eta1, eta2)

    def is_valid(self, nat: GammaNat) -> jax.Array:
        finite = jnp.all(jnp.isfinite(nat.eta1)) & jnp.all(jnp.isfinite(nat.eta2))
        return finite & jnp.all(nat.eta1 > -1.0) & jnp.all(nat.eta2 < 0.0)

    def sample(self, nat: GammaNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """x = g / b with g ~ Gamma(a, 1) (implicitly reparameterised in a), at least the dtype's
        smallest normal number (a draw of a small shape rounds to 0, where a density with
        shape below 1 is infinite)."""
        a, b = self.view(nat)
        shape = tuple(sample_shape) + jnp.broadcast_shapes(a.shape, b.shape)
        x = jax.random.gamma(rng_key, a, shape=shape, dtype=a.dtype) / b
        return jnp.maximum(x, jnp.finfo(x.dtype).tiny)

    def linearisation_point(self, view) -> jax.Array:
        """log τ = 0: a power c·τ^a of the block then reads c."""
        return jnp.zeros(jnp.broadcast_shapes(jnp.shape(view.shape), jnp.shape(view.rate)), view.shape.dtype)

    def from_linearisation(self, x: jax.Array) -> jax.Array:
        return jnp.exp(x)  # linearised in log τ

    def tangent_sets(self, view, full: bool) -> dict:
        """Rows 1, α, β (and E[log τ], E[τ] for a rule view) pushed through x = c τ^a at
        τ = 1 come back multiplied by the slope c a (:class:`blrppl.moments.PowerGamma`)."""
        ones = jnp.ones(jnp.broadcast_shapes(jnp.shape(view.shape), jnp.shape(view.rate)), view.shape.dtype)
        rows = [ones, view.shape, view.rate]
        if getattr(view, "mean_log", None) is not None:  # GammaRuleView: E[log τ], E[τ] leaves
            rows += [jnp.broadcast_to(view.mean_log, ones.shape), jnp.broadcast_to(view.mean, ones.shape)]
        return {"gamma": jnp.stack(jnp.broadcast_arrays(*rows))}

    def to_numpyro(self, nat: GammaNat) -> dist.Gamma:
        a, b = self.view(nat)
        return dist.Gamma(a, b)
