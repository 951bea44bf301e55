"""Dirichlet candidate family."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax.scipy.special import digamma, gammaln

from blrppl.families._special import (
    dirichlet_concentration_from_mean, dirichlet_fisher_solve, formed_once, inside_unit_interval,
)
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


class DirichletRuleView(NamedTuple):
    """What the expected-log-density rules read of a Dirichlet block (internal): α and the
    mean parameters E[log x_k] = ψ(α_k) − ψ(α₀) as a separate, redundant leaf (see
    :class:`Dirichlet`). Both ``(*B, K)``."""

    concentration: jax.Array
    mean_log: jax.Array


@dataclasses.dataclass(frozen=True)
class Dirichlet(Family):
    """Dirichlet(α) on the (K − 1)-simplex, event shape ``(K,)``.

    * T(x) = (log x_k)_k; base measure 1 (w.r.t. the Lebesgue measure of the simplex).
    * λ = α − 1  (:class:`DirichletNat`, ``(*B, K)``).
    * A(λ) = Σ_k log Γ(α_k) − log Γ(α₀),  α₀ = Σ_k α_k.
    * μ = (ψ(α_k) − ψ(α₀))_k.
    * view: :class:`DirichletView` (concentration α).
    * Fisher F(λ) = diag ψ′(α) − ψ′(α₀) 11ᵀ.

    BLR update. The rules see the block through :class:`DirichletRuleView`
    (:meth:`rule_view`): L = Σ_i E_q[log f_i] is a function of α and of μ held as a separate
    leaf, and its total derivative in μ is, with the solve in O(K) by Sherman–Morrison,

        λ̃ = ∇_μ L = ∂L/∂μ + F(λ)⁻¹ ∇_λ L,   ∇_λ L = ∂L/∂α,
        λ ← (1 − ρ) λ + ρ λ̃.

    A conjugate factor Π_k x_k^{c_k} (e.g. a Categorical observation, c = onehot) reads
    only μ and sends exactly c, also in float32 (through α its ψ(α₀) terms would cancel only
    up to rounding, amplified by F⁻¹ at large α₀). Other expectations (E[x_k],
    E[log(1 − x_k)], ...) go through α and the solve; a gradient with respect to a plain
    :class:`DirichletView` is the solve alone.

    Attributes:
        dim: K, the number of categories.
    """

    dim: int
    name: ClassVar[str] = "dirichlet"
    view_type: ClassVar[type] = DirichletView
    support: ClassVar[str] = "simplex"
    native: ClassVar[bool] = True
    argument_kind: ClassVar[str] = "dirichlet"

    @classmethod
    def for_value(cls, value_shape: tuple, plate_axes: tuple = (), num_values: int | None = None) -> "Dirichlet":
        """Over the value's last axis (K categories)."""
        return cls(value_shape[-1])

    def initial_nat(self, x: jax.Array) -> DirichletNat:
        """Concentrations α = K x + ½ (mean near x, broad)."""
        return self.nat_from_view(DirichletView(x * x.shape[-1] + 0.5))

    @property
    def event_shape(self) -> tuple[int, ...]:
        return (self.dim,)

    def view(self, nat: DirichletNat) -> DirichletView:
        return DirichletView(nat.eta + 1.0)

    def rule_view(self, nat: DirichletNat) -> DirichletRuleView:
        """(α, ψ(α) − ψ(α₀)): the view with the mean parameters as an extra leaf."""
        return DirichletRuleView(nat.eta + 1.0, formed_once(lambda n: self.mean_params(n).eta, nat))

    def mean_params_in(self, view) -> DirichletNat | None:
        """E[log p] of a :class:`DirichletRuleView`."""
        return DirichletNat(view.mean_log) if isinstance(view, DirichletRuleView) else None

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

    def message_from_view_grad(self, nat: DirichletNat, view_grad: DirichletView | DirichletRuleView) -> DirichletNat:
        eta = dirichlet_fisher_solve(nat.eta + 1.0, view_grad.concentration)
        if isinstance(view_grad, DirichletRuleView):  # direct part ∂L/∂μ
            eta = eta + view_grad.mean_log
        return DirichletNat(eta)

    def is_valid(self, nat: DirichletNat) -> jax.Array:
        return jnp.all(jnp.isfinite(nat.eta)) & jnp.all(nat.eta > -1.0)

    def sample(self, nat: DirichletNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """Normalised independent Gamma(α_k, 1) draws (implicitly reparameterised), each
        coordinate inside (0, 1) (:func:`inside_unit_interval`)."""
        alpha = nat.eta + 1.0
        shape = tuple(sample_shape) + alpha.shape[:-1]
        return inside_unit_interval(jax.random.dirichlet(rng_key, alpha, shape=shape, dtype=alpha.dtype))

    def linearisation_point(self, view) -> jax.Array:
        return view.concentration / view.concentration.sum(-1, keepdims=True)

    def tangent_sets(self, view, full: bool) -> dict:
        """Rows α, Σα (and E[log π] for a rule view), gathered by the indexing map
        (:class:`blrppl.moments.DirichletIdentity`)."""
        a = view.concentration
        rows = [a, jnp.broadcast_to(a.sum(-1, keepdims=True), a.shape)]
        if getattr(view, "mean_log", None) is not None:  # DirichletRuleView: E[log π]
            rows.append(view.mean_log)
        return {"dirichlet": jnp.stack(rows)}

    def to_numpyro(self, nat: DirichletNat) -> dist.Dirichlet:
        return dist.Dirichlet(nat.eta + 1.0)
