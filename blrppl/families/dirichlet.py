"""Dirichlet candidate family."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.special import digamma, gammaln

from blrppl.families._special import dirichlet_concentration_from_mean, dirichlet_fisher_solve
from blrppl.families.base import Family


class DirichletNat(NamedTuple):
    """Natural parameters of batched Dirichlets (also used for their mean parameters).

    Attributes:
        eta: α − 1, shape ``(*B, K)`` (mean parameters: E[log x_k] = ψ(α_k) − ψ(α₀)).
    """

    eta: jax.Array


class DirichletView(NamedTuple):
    """Concentration α, shape ``(*B, K)``."""

    concentration: jax.Array


@dataclasses.dataclass(frozen=True)
class Dirichlet(Family):
    """Dirichlet(α) on the (K − 1)-simplex, event shape ``(K,)``.

    * T(x) = (log x_k)_k; base measure 1 (w.r.t. the Lebesgue measure of the simplex).
    * λ = α − 1  (:class:`DirichletNat`, ``(*B, K)``).
    * A(λ) = Σ_k log Γ(α_k) − log Γ(α₀),  α₀ = Σ_k α_k.
    * μ = (ψ(α_k) − ψ(α₀))_k.
    * view: :class:`DirichletView` (concentration α).
    * Fisher F(λ) = diag ψ′(α) − ψ′(α₀) 11ᵀ.

    BLR update, with L = Σ_i E_q[log f_i] as a function of α (∇_λ L = ∂L/∂α): the message is
    solved in O(K) by Sherman–Morrison,

        λ̃ = ∇_μ L = F(λ)⁻¹ ∇_λ L,    λ ← (1 − ρ) λ + ρ λ̃.

    A conjugate factor Π_k x_k^{c_k} (e.g. a Categorical observation, c = onehot) sends c.

    Attributes:
        dim: K, the number of categories.
    """

    dim: int
    name: ClassVar[str] = "dirichlet"

    @property
    def event_shape(self) -> tuple[int, ...]:
        return (self.dim,)

    def view(self, nat: DirichletNat) -> DirichletView:
        return DirichletView(nat.eta + 1.0)

    def nat_from_view(self, view: DirichletView) -> DirichletNat:
        return DirichletNat(view.concentration - 1.0)

    def mean_params(self, nat: DirichletNat) -> DirichletNat:
        alpha = nat.eta + 1.0
        return DirichletNat(digamma(alpha) - digamma(alpha.sum(-1, keepdims=True)))

    def nat_from_mean(self, mean_params: DirichletNat) -> DirichletNat:
        return DirichletNat(dirichlet_concentration_from_mean(mean_params.eta) - 1.0)

    def log_partition(self, nat: DirichletNat) -> jax.Array:
        alpha = nat.eta + 1.0
        return gammaln(alpha).sum(-1) - gammaln(alpha.sum(-1))

    def sufficient_stats(self, x: jax.Array) -> DirichletNat:
        return DirichletNat(jnp.log(x))

    def message_from_view_grad(self, nat: DirichletNat, view_grad: DirichletView) -> DirichletNat:
        return DirichletNat(dirichlet_fisher_solve(nat.eta + 1.0, view_grad.concentration))

    def is_valid(self, nat: DirichletNat) -> jax.Array:
        return jnp.all(jnp.isfinite(nat.eta)) & jnp.all(nat.eta > -1.0)

    def sample(self, nat: DirichletNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """Normalised independent Gamma(α_k, 1) draws (implicitly reparameterised)."""
        alpha = nat.eta + 1.0
        shape = tuple(sample_shape) + alpha.shape[:-1]
        return jax.random.dirichlet(rng_key, alpha, shape=shape, dtype=alpha.dtype)

    def to_numpyro(self, nat: DirichletNat) -> dist.Dirichlet:
        return dist.Dirichlet(nat.eta + 1.0)
