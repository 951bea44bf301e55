"""Wishart candidate family (precision matrices)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax.scipy.linalg import solve_triangular
from jax.scipy.special import digamma, multigammaln

from blrppl.families._special import trigamma
from blrppl.families.base import Family

#: Newton steps of the mean → natural parameter inversion (the degrees of freedom from
#: E[log|Λ|] − log|E[Λ]|); quadratic convergence from the asymptotic guess
WISHART_NEWTON_STEPS = 12


class WishartNat(NamedTuple):
    """Natural parameters of batched Wisharts (also used for their mean parameters).

    Attributes:
        eta_mat: −½ W⁻¹, shape ``(*B, D, D)``, symmetric (mean parameters: E[Λ] = ν W).
        eta_logdet: (ν − D − 1) / 2, shape ``(*B,)`` (mean parameters: E[log|Λ|]).
    """

    eta_mat: jax.Array
    eta_logdet: jax.Array


class WishartView(NamedTuple):
    """Degrees of freedom ν ``(*B,)`` and scale matrix W ``(*B, D, D)`` (E[Λ] = ν W)."""

    df: jax.Array
    scale_matrix: jax.Array


class WishartRuleView(NamedTuple):
    """What the expected-log-density rules read of a Wishart block (internal): its mean
    parameters E[Λ] ``(*B, D, D)`` and E[log|Λ|] ``(*B,)``, the only expectations a
    conjugate factor of a precision matrix needs."""

    mean: jax.Array
    mean_logdet: jax.Array


def _sym(x):
    return 0.5 * (x + jnp.swapaxes(x, -1, -2))


def _spd_inv(x):
    """The inverse of symmetric positive definite matrices through their Cholesky factor
    L: (L⁻¹)ᵀ L⁻¹. (``jnp.linalg.inv`` pivots an LU factorisation: its permutation is a
    loop of scatters per matrix, which unoptimised programs run op by op.) NaN where x is
    not positive definite."""
    chol = jnp.linalg.cholesky(x)
    eye = jnp.broadcast_to(jnp.eye(x.shape[-1], dtype=x.dtype), x.shape)
    inv_chol = solve_triangular(chol, eye, lower=True)
    return jnp.swapaxes(inv_chol, -1, -2) @ inv_chol


def _logdet(x):
    chol = jnp.linalg.cholesky(x)
    return 2.0 * jnp.sum(jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)), axis=-1)


def _digamma_sum(df, dim: int):
    """Σ_{i=1}^{D} ψ((ν + 1 − i) / 2), and the same sum of ½ ψ′ (its derivative in ν)."""
    half = 0.5 * (df[..., None] - jnp.arange(dim, dtype=df.dtype))
    return digamma(half).sum(-1), 0.5 * trigamma(half).sum(-1)


def expected_logdet(df, scale_matrix):
    """E[log|Λ|] = Σ_{i=1}^{D} ψ((ν + 1 − i)/2) + D log 2 + log|W| under Wishart(ν, W)."""
    dim = scale_matrix.shape[-1]
    return _digamma_sum(df, dim)[0] + dim * math.log(2.0) + _logdet(scale_matrix)


@dataclasses.dataclass(frozen=True)
class Wishart(Family):
    """Wishart(ν, W) over D × D positive-definite matrices Λ, event shape ``(D, D)``.

    * T(Λ) = (Λ, log|Λ|); base measure 1 (w.r.t. the Lebesgue measure of Λ's D(D+1)/2
      free entries).
    * λ = (Ψ, η) = (−½ W⁻¹, (ν − D − 1)/2)  (:class:`WishartNat`).
    * A(λ) = (ν/2) log|W| + (νD/2) log 2 + log Γ_D(ν/2),  ν = 2η + D + 1,  W = (−2Ψ)⁻¹.
    * μ = (ν W, Σ_{i=1}^{D} ψ((ν + 1 − i)/2) + D log 2 + log|W|).
    * view: :class:`WishartView` (ν, W).

    BLR update. The rules read the block through :class:`WishartRuleView` (:meth:`rule_view`),
    its mean parameters μ = (E[Λ], E[log|Λ|]) alone: a factor that is conjugate to a precision
    matrix (a Gaussian's ``precision_matrix``, the Wishart prior) is linear in them, and its
    message is its coefficients,

        λ̃ = ∇_μ L = (sym ∂L/∂E[Λ], ∂L/∂E[log|Λ|]),   λ ← (1 − ρ) λ + ρ λ̃,

    (sym: the symmetric part, since ⟨Ψ, Λ⟩ only reads it) exact in one step. A gradient with
    respect to the plain :class:`WishartView` (ν, W) is pulled back to μ through the inverse
    map μ → (ν, W) (:meth:`nat_from_mean`, a scalar Newton solve for ν): ∇_μ L = J_{(ν,W)←μ}ᵀ
    ∇_{(ν,W)} L.

    Attributes:
        dim: D, the matrices' dimension.
    """

    dim: int
    name: ClassVar[str] = "wishart"
    view_type: ClassVar[type] = WishartView
    support: ClassVar[str] = "positive_definite"
    native: ClassVar[bool] = True
    argument_kind: ClassVar[str] = "wishart"
    #: an argument that is the block itself must read whole matrices in place: E[log|Λ|] is
    #: not an expectation of Λ's entries (read off the program: :func:`blrppl.compiler.reads.whole_matrices`)
    whole_events: ClassVar[bool] = True

    @classmethod
    def for_value(cls, value_shape: tuple, plate_axes: tuple = (), num_values: int | None = None) -> "Wishart":
        """Over the value's last two axes (D × D)."""
        return cls(value_shape[-1])

    @property
    def event_shape(self) -> tuple[int, ...]:
        return (self.dim, self.dim)

    def initial_nat(self, x) -> WishartNat:
        """ν = D + 2 and W = x / ν (mean x, broad)."""
        xp = np if isinstance(x, np.ndarray) else jnp
        df = xp.full(x.shape[:-2], self.dim + 2.0, dtype=x.dtype)
        inv = xp.linalg.inv(x)
        return WishartNat(-0.5 * df[..., None, None] * 0.5 * (inv + xp.swapaxes(inv, -1, -2)), 0.5 * (df - self.dim - 1.0))

    def view(self, nat: WishartNat) -> WishartView:
        df = 2.0 * nat.eta_logdet + self.dim + 1.0
        return WishartView(df, _spd_inv(-2.0 * _sym(nat.eta_mat)))

    def rule_view(self, nat: WishartNat) -> WishartRuleView:
        """(E[Λ], E[log|Λ|])."""
        return WishartRuleView(*self.mean_params(nat))

    def mean_params_in(self, view) -> WishartNat | None:
        return WishartNat(view.mean, view.mean_logdet) if isinstance(view, WishartRuleView) else None

    def nat_from_view(self, view: WishartView) -> WishartNat:
        inv = _spd_inv(view.scale_matrix)
        return WishartNat(-0.5 * _sym(inv), 0.5 * (view.df - self.dim - 1.0))

    def mean_params(self, nat: WishartNat) -> WishartNat:
        df, scale = self.view(nat)
        return WishartNat(df[..., None, None] * scale, expected_logdet(df, scale))

    def nat_from_mean(self, mean_params: WishartNat) -> WishartNat:
        """ν from g(ν) = Σ_i ψ((ν + 1 − i)/2) + D log 2 − D log ν = E[log|Λ|] − log|E[Λ]|
        (g increases from −∞ at ν = D − 1 to 0), by Newton steps on u = log(ν − D + 1) from
        g(ν) ≈ −D(D + 1)/(2ν); then W = E[Λ] / ν."""
        dim = self.dim
        target = mean_params.eta_logdet - _logdet(mean_params.eta_mat)
        target = jnp.minimum(target, -1e-12)
        guess = jnp.maximum(-dim * (dim + 1) / (2.0 * target), dim - 1.0 + 1e-3)
        u = jnp.log(guess - dim + 1.0)

        def body(_, u):
            df = jnp.exp(u) + dim - 1.0
            s, ds = _digamma_sum(df, dim)
            g = s + dim * math.log(2.0) - dim * jnp.log(df) - target
            dg = (ds - dim / df) * jnp.exp(u)
            return u - jnp.clip(g / dg, -2.0, 2.0)

        u = jax.lax.fori_loop(0, WISHART_NEWTON_STEPS, body, u)
        df = jnp.exp(u) + dim - 1.0
        return self.nat_from_view(WishartView(df, mean_params.eta_mat / df[..., None, None]))

    def log_partition(self, nat: WishartNat) -> jax.Array:
        df = 2.0 * nat.eta_logdet + self.dim + 1.0
        logdet_w = -_logdet(-2.0 * _sym(nat.eta_mat))
        return 0.5 * df * logdet_w + 0.5 * df * self.dim * math.log(2.0) + multigammaln(0.5 * df, self.dim)

    def sufficient_stats(self, x: jax.Array) -> WishartNat:
        return WishartNat(x, _logdet(x))

    def message_from_view_grad(self, nat: WishartNat, view_grad) -> WishartNat:
        if isinstance(view_grad, WishartRuleView):
            return WishartNat(_sym(view_grad.mean), view_grad.mean_logdet)
        _, pull = jax.vjp(lambda mp: self.view(self.nat_from_mean(mp)), self.mean_params(nat))
        (grad,) = pull(view_grad)
        return WishartNat(_sym(grad.eta_mat), grad.eta_logdet)

    def is_valid(self, nat: WishartNat) -> jax.Array:
        finite = jnp.all(jnp.isfinite(nat.eta_mat)) & jnp.all(jnp.isfinite(nat.eta_logdet))
        chol = jnp.linalg.cholesky(-2.0 * _sym(nat.eta_mat))
        return finite & jnp.all(jnp.isfinite(chol)) & jnp.all(nat.eta_logdet > -1.0)

    def sample(self, nat: WishartNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """Bartlett draws (numpyro's ``Wishart``), in the parameters' dtype."""
        return self.to_numpyro(nat).sample(rng_key, tuple(sample_shape)).astype(nat.eta_mat.dtype)

    def linearisation_point(self, view) -> jax.Array:
        """E[Λ] (positive definite: the model runs there)."""
        return self._moments(view)[0]

    def tangent_sets(self, view, full: bool) -> dict:
        """Rows gathered by the indexing map and multiplied by the argument's constant c in
        c Λ (:class:`blrppl.moments.WishartIdentity`): E[Λ], and E[log|Λ|] and 1 in one
        symmetric row, E[log|Λ|] at (0, 0) and 1 at (0, 1) and (1, 0), which a transpose
        leaves in place (for D = 1, two rows: E[log|Λ|] and 1). Each pushed row costs a
        copy of every matrix the argument reads: N of them in a mixture's Λ[z]."""
        mean, mean_logdet = self._moments(view)
        dim = mean.shape[-1]
        if dim == 1:
            return {"wishart": jnp.stack([mean, mean_logdet[..., None, None], jnp.ones_like(mean)])}
        unit = np.zeros((dim, dim))
        unit[0, 1] = unit[1, 0] = 1.0
        corner = np.zeros((dim, dim))
        corner[0, 0] = 1.0
        packed = mean_logdet[..., None, None] * corner + unit
        return {"wishart": jnp.stack([mean, packed.astype(mean.dtype)])}

    def _moments(self, view):
        if isinstance(view, WishartRuleView):
            return view.mean, view.mean_logdet
        return view.df[..., None, None] * view.scale_matrix, expected_logdet(view.df, view.scale_matrix)

    def to_numpyro(self, nat: WishartNat) -> dist.Wishart:
        df, scale = self.view(nat)
        return dist.Wishart(df, scale_matrix=_sym(scale))
