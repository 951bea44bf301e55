"""Gaussian rows that share one covariance: the posterior of a factor model's rows."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax.scipy.linalg import solve_triangular

from blrppl.families.gaussian import (
    _LOG_2PI,
    GaussianDense,
    GaussianNat,
    GaussianView,
    _cov_of_chol,
    _half_logdet,
    _sym,
)


def _rows(eta1: jax.Array) -> int:
    return math.prod(eta1.shape[:-1])


@dataclasses.dataclass(frozen=True)
class GaussianTied(GaussianDense):
    """Independent rows x_p ~ N(m_p, Σ), p = 1..P, with one covariance Σ = S⁻¹ shared by all.

    The family the compiler gives a plated dense Gaussian block when every factor gives
    each row the same precision (the rows of probabilistic PCA, factor analysis or a matrix
    factorisation without missing values; see :func:`blrppl.compiler.finish.tied_blocks`):
    the dense family's fixed point is then tied, and one D × D precision replaces P of
    them (one Cholesky, O(P D) elementwise work per step instead of O(P D²)).

    * T(x) = (x_p for every p, Σ_p x_p x_pᵀ); base measure 1.
    * λ = (η₁, η₂) = (S m_p, −S/2)  (:class:`GaussianNat`, shapes ``(*B, D)``, ``(D, D)``).
    * A(λ) = Σ_p ½ m_pᵀ S m_p − (P/2) log|S| + (P D/2) log 2π.
    * μ = (m_p, Σ_p (Σ + m_p m_pᵀ)).
    * rule view: :class:`GaussianView` with the rows' means ``(*B, D)`` and the shared
      covariance ``(D, D)``; :meth:`view` (the public one) broadcasts it to every row.

    BLR update, with L = Σ_i E_q[log f_i] as a function of (m_p, Σ): Σ is shared, so
    ∂L/∂Σ = Σ_p G_p sums the rows' gradients, and with Ḡ = sym(∂L/∂Σ)/P

        λ̃ = ∇_μ L = (∂L/∂m_p − 2 Ḡ m_p, Ḡ),    λ ← (1 − ρ) λ + ρ λ̃.

    When the rows' G_p are equal (the condition the compiler checks) this is the dense
    family's update of every row; otherwise it is the natural-gradient step of the
    restricted family (one covariance for all rows), still a lower bound's ascent.
    """

    name: ClassVar[str] = "gaussian_tied"
    tied_rows: ClassVar[bool] = True
    native: ClassVar[bool] = False

    def initial_nat(self, x: jax.Array) -> GaussianNat:
        """Rows' means x, shared covariance I."""
        xp = np if isinstance(x, np.ndarray) else jnp
        return GaussianNat(x, -0.5 * xp.eye(self.dim, dtype=x.dtype))

    def identity_precision(self, mean: jax.Array) -> jax.Array:
        xp = np if isinstance(mean, np.ndarray) else jnp
        return xp.eye(mean.shape[-1], dtype=mean.dtype)

    def _chol(self, nat: GaussianNat) -> jax.Array:
        return jnp.linalg.cholesky(-(nat.eta2 + nat.eta2.T))

    def _factorised(self, nat: GaussianNat, chol=None) -> tuple:
        """(rows' means, Σ, ½ log|S|) from one Cholesky factor of S (``chol``, when the caller
        has it): m_p = Σ η₁_p, a product (not two triangular solves per row)."""
        chol = self._chol(nat) if chol is None else chol
        cov = _cov_of_chol(chol)
        mean = (nat.eta1.reshape((-1, self.dim)) @ cov).reshape(nat.eta1.shape)
        return mean, cov, _half_logdet(chol)

    def _entropy_rows(self, half_logdet: jax.Array, eta1: jax.Array) -> jax.Array:
        return jnp.broadcast_to(0.5 * self.dim * (1.0 + _LOG_2PI) - half_logdet, eta1.shape[:-1])

    def expand(self, view: GaussianView) -> GaussianView:
        """A rule view with the shared covariance broadcast to every row (a dense view)."""
        if view.cov.ndim > 2:
            return view
        return GaussianView(view.mean, jnp.broadcast_to(view.cov, view.mean.shape + (self.dim,)))

    def rule_view(self, nat: GaussianNat) -> GaussianView:
        mean, cov, _ = self._factorised(nat)
        return GaussianView(mean, cov)

    def view(self, nat: GaussianNat) -> GaussianView:
        return self.expand(self.rule_view(nat))

    def rule_view_and_entropy(self, nat: GaussianNat) -> tuple:
        mean, cov, half_logdet = self._factorised(nat)
        return GaussianView(mean, cov), self._entropy_rows(half_logdet, nat.eta1)

    def view_covariance(self, view: GaussianView) -> jax.Array:
        return self.expand(view).cov

    def marginal_variance(self, view: GaussianView) -> jax.Array:
        return jnp.broadcast_to(jnp.diagonal(view.cov, axis1=-2, axis2=-1), view.mean.shape)

    def nat_from_view(self, view: GaussianView) -> GaussianNat:
        """Natural parameters of a rule view (shared covariance ``(D, D)``); a view with a
        covariance per row (a guide's parameters, which may differ by row) gives the dense
        family's parameters, which :meth:`to_numpyro` reads too."""
        if view.cov.ndim > 2:
            return super().nat_from_view(view)
        chol = jnp.linalg.cholesky(view.cov)
        prec = _sym(jax.scipy.linalg.cho_solve((chol, True), jnp.eye(self.dim, dtype=view.cov.dtype)))
        return GaussianNat(view.mean @ prec, -0.5 * prec)

    def mean_params(self, nat: GaussianNat) -> GaussianNat:
        mean, cov, _ = self._factorised(nat)
        flat = mean.reshape((-1, self.dim))
        return GaussianNat(mean, _rows(mean) * cov + flat.T @ flat)

    def nat_from_mean(self, mean_params: GaussianNat) -> GaussianNat:
        m = mean_params.eta1
        flat = m.reshape((-1, self.dim))
        cov = (_sym(mean_params.eta2) - flat.T @ flat) / _rows(m)
        return self.nat_from_view(GaussianView(m, cov))

    def log_partition(self, nat: GaussianNat) -> jax.Array:
        """Per row: ½ m_pᵀ S m_p − ½ log|S| + (D/2) log 2π (their sum is A(λ))."""
        chol = self._chol(nat)
        white = solve_triangular(chol, nat.eta1.reshape((-1, self.dim)).T, lower=True)  # L⁻¹ S m_p
        quad = 0.5 * jnp.sum(white**2, 0).reshape(nat.eta1.shape[:-1])
        return quad - _half_logdet(chol) + 0.5 * self.dim * _LOG_2PI

    def sufficient_stats(self, x: jax.Array) -> GaussianNat:
        flat = x.reshape((-1, self.dim))
        return GaussianNat(x, flat.T @ flat)

    def log_prob(self, nat: GaussianNat, x: jax.Array) -> jax.Array:
        """log N(x_p | m_p, Σ) per row (``x``: ``(*sample, *B, D)``)."""
        chol = self._chol(nat)
        mean, _, half_logdet = self._factorised(nat, chol)
        white = jnp.einsum("...i,ij->...j", x - mean, chol)  # Lᵀ(x − m)
        return -0.5 * jnp.sum(white**2, -1) + half_logdet - 0.5 * self.dim * _LOG_2PI

    def entropy(self, nat: GaussianNat, mean_params=None) -> jax.Array:
        return self._entropy_rows(_half_logdet(self._chol(nat)), nat.eta1)

    def message_at(self, nat: GaussianNat, view: GaussianView, view_grad: GaussianView) -> GaussianNat:
        g_cov = _sym(view_grad.cov) / _rows(view.mean)
        return GaussianNat(view_grad.mean - 2.0 * view.mean @ g_cov, g_cov)

    def message_from_view_grad(self, nat: GaussianNat, view_grad: GaussianView) -> GaussianNat:
        return self.message_at(nat, self.rule_view(nat), view_grad)

    def fixed_view(self, view: GaussianView) -> None:
        """None: the rows' messages read their means (a tied block is never a lone unbatched
        conjugate block)."""
        return None

    def update(self, nat: GaussianNat, message: GaussianNat, rho, retract: bool = False) -> GaussianNat:
        """As the dense family's (improved BLR for ρ < 1 or ``retract``), with one D × D
        precision: S' = ½(S + UᵀU), U = Lᵀ + ρ L⁻¹(P̂ − S), and m_p' = m_p + ρ S'⁻¹ g_p with
        g_p = λ̃₁_p − P̂ m_p, so η₁_p' = S' m_p + ρ g_p (no factorisation of S')."""
        rho = jnp.asarray(rho, nat.eta1.dtype)

        def plain(_):
            return jax.tree.map(lambda a, m: (1.0 - rho) * a + rho * m, nat, message)

        def retracted(_):
            prec = -(nat.eta2 + nat.eta2.T)
            target = -(message.eta2 + message.eta2.T)
            chol = jnp.linalg.cholesky(prec)
            rows = nat.eta1.reshape((-1, self.dim))
            mean = jax.scipy.linalg.cho_solve((chol, True), rows.T).T
            grad = message.eta1.reshape((-1, self.dim)) - mean @ target
            u = chol.T + rho * solve_triangular(chol, target - prec, lower=True)
            new_prec = _sym(0.5 * (prec + u.T @ u))
            return GaussianNat((mean @ new_prec + rho * grad).reshape(nat.eta1.shape), -0.5 * new_prec)

        return jax.lax.cond((rho < 1.0) | retract, retracted, plain, None)

    def is_valid(self, nat: GaussianNat) -> jax.Array:
        finite = jnp.all(jnp.isfinite(nat.eta1)) & jnp.all(jnp.isfinite(nat.eta2))
        return finite & jnp.all(jnp.isfinite(self._chol(nat)))

    def sample(self, nat: GaussianNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """x_p = m_p + L⁻ᵀ ε_p with S = L Lᵀ, ε_p ~ N(0, I): reparameterised."""
        chol = self._chol(nat)
        mean, _, _ = self._factorised(nat, chol)
        shape = tuple(sample_shape) + mean.shape
        eps = jax.random.normal(rng_key, shape, dtype=mean.dtype).reshape((-1, self.dim))
        z = solve_triangular(chol, eps.T, lower=True, trans="T").T
        return mean + z.reshape(shape)

    def tangent_sets(self, view: GaussianView, full: bool) -> dict:
        return super().tangent_sets(self.expand(view), full)

    def tangent_roots(self, view: GaussianView, full: bool):
        return super().tangent_roots(self.expand(view), full)

    def to_numpyro(self, nat: GaussianNat):
        """N(m_p, Σ) per row (Σ's factor given to every row, as numpyro's batch of rows
        reads it); a dense family's parameters (see :meth:`nat_from_view`) give a
        covariance per row."""
        if nat.eta2.ndim > 2:
            return super().to_numpyro(nat)
        mean, cov, _ = self._factorised(nat)
        scale_tril = jnp.broadcast_to(jnp.linalg.cholesky(cov), mean.shape + (self.dim,))
        return dist.MultivariateNormal(mean, scale_tril=scale_tril)
