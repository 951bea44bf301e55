"""Gaussian candidate families: dense multivariate and elementwise (diagonal)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax.scipy.linalg import solve_triangular
from numpyro.distributions.util import cholesky_of_inverse

from blrppl.families.base import Family

_LOG_2PI = math.log(2.0 * math.pi)


class GaussianNat(NamedTuple):
    """Natural parameters of a dense Gaussian (also used for its mean parameters).

    Attributes:
        eta1: S m, shape ``(*B, D)`` (mean parameters: E[x] = m).
        eta2: −S/2, shape ``(*B, D, D)`` (mean parameters: E[x xᵀ] = Σ + m mᵀ).
    """

    eta1: jax.Array
    eta2: jax.Array


class GaussianView(NamedTuple):
    """Mean ``(*B, D)`` and covariance ``(*B, D, D)`` of a dense Gaussian."""

    mean: jax.Array
    cov: jax.Array


class DiagGaussianNat(NamedTuple):
    """Natural parameters of elementwise Gaussians (also used for their mean parameters).

    Attributes:
        eta1: m / v, shape ``(*B,)`` (mean parameters: E[x] = m).
        eta2: −1 / (2v), shape ``(*B,)`` (mean parameters: E[x²] = v + m²).
    """

    eta1: jax.Array
    eta2: jax.Array


class DiagGaussianView(NamedTuple):
    """Mean and variance of elementwise Gaussians, each ``(*B,)``."""

    mean: jax.Array
    var: jax.Array


def _sym(a: jax.Array) -> jax.Array:
    return 0.5 * (a + jnp.swapaxes(a, -1, -2))


def _outer(a: jax.Array) -> jax.Array:
    return a[..., :, None] * a[..., None, :]


def _eye_like(a: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)


def _chol_solve(chol: jax.Array, b: jax.Array) -> jax.Array:
    """(L Lᵀ)⁻¹ b for a vector b (last axis), batched over leading dims."""
    y = solve_triangular(chol, b[..., None], lower=True)
    return solve_triangular(chol, y, lower=True, trans="T")[..., 0]


def _cov_of_chol(chol: jax.Array) -> jax.Array:
    """(L Lᵀ)⁻¹ = L⁻ᵀ L⁻¹: one triangular solve against the identity and a product (fewer
    LAPACK calls per matrix than two solves: for small matrices their overhead dominates)."""
    inv = solve_triangular(chol, _eye_like(chol), lower=True)
    return _sym(jnp.einsum("...ki,...kj->...ij", inv, inv))


def _half_logdet(chol: jax.Array) -> jax.Array:
    return jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)).sum(-1)


#: a batch of precisions larger than this is inverted by halves (:func:`_batched_inverse`)
BLOCK_LEAF = 16


def _batched_inverse(prec: jax.Array) -> tuple:
    """(S⁻¹, ½ log|S|) of a batch of symmetric positive definite S, by halves: with
    S = [[A, B], [Bᵀ, C]], K = A⁻¹ B and the Schur complement Z = C − Bᵀ K,

        S⁻¹ = [[A⁻¹ + K Z⁻¹ Kᵀ, −K Z⁻¹], [−Z⁻¹ Kᵀ, Z⁻¹]],   log|S| = log|A| + log|Z|,

    A⁻¹ and Z⁻¹ in turn, down to :data:`BLOCK_LEAF` rows, which are factorised (Cholesky,
    one triangular solve and a product). The products are batched matrix products, the
    LAPACK calls are on matrices of at most BLOCK_LEAF rows: CPU LAPACK on a batch of
    small matrices runs one call per few matrices (a 40 × 40 triangular solve, a call per
    3 of them: :mod:`blrppl.runtime.lapack`), and 2,000 rows of D = 40 took 100–140 ms this way
    against 60 ms by halves. A matrix that is not positive definite has a non-positive
    definite A or Z, whose factor is NaN: the result is NaN, as the Cholesky factor's."""
    n = prec.shape[-1]
    if n <= BLOCK_LEAF:
        chol = jnp.linalg.cholesky(prec)
        return _cov_of_chol(chol), _half_logdet(chol)
    h = n // 2
    a, b, c = prec[..., :h, :h], prec[..., :h, h:], prec[..., h:, h:]
    a_inv, half_logdet_a = _batched_inverse(a)
    k = a_inv @ b
    z_inv, half_logdet_z = _batched_inverse(_sym(c - jnp.swapaxes(b, -1, -2) @ k))
    off = -k @ z_inv
    top = jnp.concatenate([_sym(a_inv - off @ jnp.swapaxes(k, -1, -2)), off], -1)
    bottom = jnp.concatenate([jnp.swapaxes(off, -1, -2), z_inv], -1)
    return jnp.concatenate([top, bottom], -2), half_logdet_a + half_logdet_z


def _chol_inverse(chol: jax.Array) -> jax.Array:
    """(L Lᵀ)⁻¹ by two triangular solves against the identity, symmetrised."""
    inv = jax.scipy.linalg.cho_solve((chol, True), _eye_like(chol))
    return _sym(inv)


@dataclasses.dataclass(frozen=True)
class GaussianDense(Family):
    """Dense multivariate Gaussian N(m, Σ) on ℝᴰ, precision S = Σ⁻¹.

    * T(x) = (x, x xᵀ); base measure 1.
    * λ = (η₁, η₂) = (S m, −S/2)  (:class:`GaussianNat`, shapes ``(*B, D)``, ``(*B, D, D)``).
    * A(λ) = −¼ η₁ᵀ η₂⁻¹ η₁ − ½ log|−2η₂| + (D/2) log 2π
      = ½ mᵀSm − ½ log|S| + (D/2) log 2π.
    * μ = (m, Σ + m mᵀ).
    * view: :class:`GaussianView` (mean m, covariance Σ).

    BLR update, with L = Σ_i E_q[log f_i] as a function of (m, Σ) and G = sym(∂L/∂Σ):

        λ̃ = ∇_μ L = (∂L/∂m − 2 G m, G),    λ ← (1 − ρ) λ + ρ λ̃,
        i.e.  S ← (1 − ρ) S − 2ρ G,   S m ← (1 − ρ) S m + ρ (∂L/∂m − 2 G m).

    All linear algebra goes through the Cholesky factor of S; ``is_valid`` requires
    −η₂ positive definite.

    Attributes:
        dim: D, the event dimension.
    """

    dim: int
    name: ClassVar[str] = "gaussian"
    gaussian: ClassVar[bool] = True
    dense_event: ClassVar[bool] = True
    view_type: ClassVar[type] = GaussianView
    native: ClassVar[bool] = True

    @classmethod
    def for_value(cls, value_shape: tuple, plate_axes: tuple = (), num_values: int | None = None) -> "GaussianDense":
        """Dense over the value's non-plate axes (D = their product)."""
        return cls(math.prod(s for a, s in enumerate(value_shape) if a not in plate_axes))

    @property
    def event_shape(self) -> tuple[int, ...]:
        return (self.dim,)

    def canonical_batch_shape(self, value_shape: tuple, plate_axes: tuple) -> tuple:
        """The plate axes' sizes: the other axes of the value are flattened into the event."""
        return tuple(value_shape[a] for a in plate_axes)

    def initial_nat(self, x: jax.Array) -> GaussianNat:
        """Mean x, covariance I: the natural parameters (x, −½ I) directly (no factorisation of I)."""
        return GaussianNat(x, -0.5 * self.identity_precision(x))

    def view_covariance(self, view: GaussianView) -> jax.Array:
        return view.cov

    def marginal_variance(self, view: GaussianView) -> jax.Array:
        return jnp.diagonal(view.cov, axis1=-2, axis2=-1)

    def covariance_column(self, view: GaussianView, index: int) -> jax.Array | None:
        """Column ``index`` of Σ (None for a block of plate elements: several Σ)."""
        return view.cov[:, index] if view.mean.ndim == 1 and view.cov.ndim == 2 else None

    def curvature_of_hessian(self, hessian: jax.Array, shape: tuple) -> jax.Array:
        dim = shape[-1]
        nb = math.prod(shape) // dim
        hb = hessian.reshape(nb, dim, nb, dim)[jnp.arange(nb), :, jnp.arange(nb), :]  # per plate element
        return hb.reshape(tuple(shape[:-1]) + (dim, dim))

    def precision_times(self, prec: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.einsum("...ij,...j->...i", prec, x)

    def solve_precision(self, prec: jax.Array, g: jax.Array) -> jax.Array:
        return jnp.linalg.solve(prec, g[..., None])[..., 0]

    def identity_precision(self, mean: jax.Array) -> jax.Array:
        xp = np if isinstance(mean, np.ndarray) else jnp
        dim = mean.shape[-1]
        return xp.broadcast_to(xp.eye(dim, dtype=mean.dtype), mean.shape + (dim,))

    def positive_curvature(self, prec: jax.Array) -> jax.Array:
        eps = jnp.finfo(prec.dtype).eps
        prec = 0.5 * (prec + jnp.swapaxes(prec, -1, -2))
        pd = jnp.all(jnp.isfinite(jnp.linalg.cholesky(prec)), axis=(-2, -1))
        w, v = jnp.linalg.eigh(prec)
        floor = jnp.sqrt(eps) * jnp.maximum(1.0, jnp.max(jnp.abs(w), axis=-1, keepdims=True))
        modified = jnp.einsum("...ij,...j,...kj->...ik", v, jnp.maximum(jnp.abs(w), floor), v)
        return jnp.where(pd[..., None, None], prec, modified)

    def _prec_chol(self, nat: GaussianNat) -> jax.Array:
        # S = −2 sym(η₂) = −(η₂ + η₂ᵀ); the Cholesky factor of S.
        return jnp.linalg.cholesky(-(nat.eta2 + jnp.swapaxes(nat.eta2, -1, -2)))

    def view(self, nat: GaussianNat) -> GaussianView:
        mean, cov, _ = self._factorised(nat)
        return GaussianView(mean, cov)

    def _factorised(self, nat: GaussianNat) -> tuple:
        """(m, Σ, ½ log|S|) from the Cholesky factor L of the precision S: for a batch,
        Σ = L⁻ᵀ L⁻¹ (one triangular solve and a product), and m = S⁻¹ η₁ (two solves with
        the vector; Σ η₁ when the batch shares S, or when its matrices have more than
        :data:`BLOCK_LEAF` rows and are inverted by halves, :func:`_batched_inverse`).

        When every plate element has the same precision (rows of a factor model without
        missing values, a regression's coefficients per group with one design), one
        factorisation serves all of them; the test (bitwise equality of the precisions) and
        the choice happen at run time."""
        batch, dim = nat.eta2.shape[:-2], nat.eta2.shape[-1]
        count = math.prod(batch)

        def each():
            prec = -(nat.eta2 + jnp.swapaxes(nat.eta2, -1, -2))
            if count > 1 and dim > BLOCK_LEAF:
                cov, half_logdet = _batched_inverse(prec)
                return jnp.einsum("...ij,...j->...i", cov, nat.eta1), cov, half_logdet
            chol = jnp.linalg.cholesky(prec)
            # (one matrix: two solves, whose rounding a fixed point of the fit has settled to)
            cov = _cov_of_chol(chol) if count > 1 else _chol_inverse(chol)
            return _chol_solve(chol, nat.eta1), cov, _half_logdet(chol)

        if count <= 1:
            return each()

        def shared():
            first = nat.eta2.reshape((count, dim, dim))[0]
            chol = jnp.linalg.cholesky(-(first + first.T))
            cov = _cov_of_chol(chol)
            # (a product with Σ, not two triangular solves with every row: LAPACK's solves
            # with many right-hand sides cost far more than the product at small D)
            mean = (nat.eta1.reshape((count, dim)) @ cov).reshape(nat.eta1.shape)
            return mean, jnp.broadcast_to(cov, nat.eta2.shape), jnp.broadcast_to(_half_logdet(chol), batch)

        flat = nat.eta2.reshape((count, dim * dim))
        return jax.lax.cond(jnp.all(flat == flat[:1]), shared, each)

    def nat_from_view(self, view: GaussianView) -> GaussianNat:
        chol = jnp.linalg.cholesky(view.cov)
        return GaussianNat(_chol_solve(chol, view.mean), -0.5 * _chol_inverse(chol))

    def mean_params(self, nat: GaussianNat) -> GaussianNat:
        mean, cov = self.view(nat)
        return GaussianNat(mean, cov + _outer(mean))

    def nat_from_mean(self, mean_params: GaussianNat) -> GaussianNat:
        m = mean_params.eta1
        return self.nat_from_view(GaussianView(m, _sym(mean_params.eta2) - _outer(m)))

    def log_partition(self, nat: GaussianNat) -> jax.Array:
        chol = self._prec_chol(nat)
        white = solve_triangular(chol, nat.eta1[..., None], lower=True)[..., 0]  # L⁻¹ S m
        half_logdet = jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)).sum(-1)
        return 0.5 * jnp.sum(white**2, -1) - half_logdet + 0.5 * self.dim * _LOG_2PI

    def sufficient_stats(self, x: jax.Array) -> GaussianNat:
        return GaussianNat(x, _outer(x))

    def log_prob(self, nat: GaussianNat, x: jax.Array) -> jax.Array:
        chol = self._prec_chol(nat)
        mean = _chol_solve(chol, nat.eta1)
        white = jnp.einsum("...i,...ij->...j", x - mean, chol)  # Lᵀ(x − m)
        half_logdet = jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)).sum(-1)
        return -0.5 * jnp.sum(white**2, -1) + half_logdet - 0.5 * self.dim * _LOG_2PI

    def entropy(self, nat: GaussianNat) -> jax.Array:
        return self._entropy(self._prec_chol(nat))

    def _entropy(self, chol: jax.Array) -> jax.Array:
        half_logdet = jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)).sum(-1)
        return 0.5 * self.dim * (1.0 + _LOG_2PI) - half_logdet

    def rule_view_and_entropy(self, nat: GaussianNat) -> tuple:
        """The view and the entropy from one Cholesky factor of the precision."""
        mean, cov, half_logdet = self._factorised(nat)
        return GaussianView(mean, cov), 0.5 * self.dim * (1.0 + _LOG_2PI) - half_logdet

    def message_from_view_grad(self, nat: GaussianNat, view_grad: GaussianView) -> GaussianNat:
        mean = _chol_solve(self._prec_chol(nat), nat.eta1)
        g_cov = _sym(view_grad.cov)
        return GaussianNat(view_grad.mean - 2.0 * jnp.einsum("...ij,...j->...i", g_cov, mean), g_cov)

    def message_at(self, nat: GaussianNat, view: GaussianView, view_grad: GaussianView) -> GaussianNat:
        g_cov = _sym(view_grad.cov)
        return GaussianNat(view_grad.mean - 2.0 * jnp.einsum("...ij,...j->...i", g_cov, view.mean), g_cov)

    def fixed_view(self, view: GaussianView) -> GaussianView:
        """m = 0, Σ = 0: there λ̃ = (∂L/∂m, ∂L/∂Σ) needs no mean, hence no factorisation of
        the block's precision (a D × D Cholesky per conjugate message)."""
        return GaussianView(jnp.zeros_like(view.mean), jnp.zeros_like(view.cov))

    def message_from_fixed_view_grad(self, view_grad: GaussianView) -> GaussianNat:
        return GaussianNat(view_grad.mean, _sym(view_grad.cov))

    def update(self, nat: GaussianNat, message: GaussianNat, rho, retract: bool = False) -> GaussianNat:
        """Learning-rule step; for ρ < 1 (and at every ρ where ``retract``, a bool that may be
        traced) the improved BLR (Lin, Schmidt & Khan 2020).

        With S the precision, P̂ = −2 λ̃₂ the message's precision, g = λ̃₁ − P̂ m and
        Ĝ = P̂ − S:  S' = S + ρĜ + ½ρ² Ĝ S⁻¹ Ĝ = ½(S + UᵀU) with U = Lᵀ + ρ L⁻¹Ĝ (S = LLᵀ),
        always positive definite, and m' = m + ρ S'⁻¹ g, so that η₁' = S' m' = S' m + ρ g
        needs no solve with S' (no LU factorisation per plate element). Without ``retract``
        the plain update λ' = λ̃ is kept at ρ = 1 (exact for conjugate messages).
        """
        rho = jnp.asarray(rho, nat.eta1.dtype)

        def plain(_):
            return jax.tree.map(lambda a, m: (1.0 - rho) * a + rho * m, nat, message)

        def retracted(_):
            prec = -2.0 * nat.eta2
            prec = 0.5 * (prec + jnp.swapaxes(prec, -1, -2))
            target = -2.0 * message.eta2
            target = 0.5 * (target + jnp.swapaxes(target, -1, -2))
            chol = jnp.linalg.cholesky(prec)
            mean = jax.scipy.linalg.cho_solve((chol, True), nat.eta1[..., None])[..., 0]
            grad = message.eta1 - jnp.einsum("...ij,...j->...i", target, mean)
            diff = target - prec
            u = jnp.swapaxes(chol, -1, -2) + rho * jax.scipy.linalg.solve_triangular(chol, diff, lower=True)
            new_prec = 0.5 * (prec + jnp.swapaxes(u, -1, -2) @ u)
            new_prec = 0.5 * (new_prec + jnp.swapaxes(new_prec, -1, -2))
            return GaussianNat(jnp.einsum("...ij,...j->...i", new_prec, mean) + rho * grad, -0.5 * new_prec)

        # only the branch taken runs: at ρ = 1 no Cholesky, solve or product of D × D matrices
        return jax.lax.cond((rho < 1.0) | retract, retracted, plain, None)

    def is_valid(self, nat: GaussianNat) -> jax.Array:
        finite = jnp.all(jnp.isfinite(nat.eta1)) & jnp.all(jnp.isfinite(nat.eta2))
        return finite & jnp.all(jnp.isfinite(self._prec_chol(nat)))

    def sample(self, nat: GaussianNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """x = m + L⁻ᵀ ε with S = L Lᵀ (so Cov x = Σ), ε ~ N(0, I): reparameterised."""
        chol = self._prec_chol(nat)
        mean = _chol_solve(chol, nat.eta1)
        batch = mean.shape[:-1]
        n = math.prod(sample_shape)
        eps = jax.random.normal(rng_key, batch + (self.dim, n), dtype=mean.dtype)
        z = solve_triangular(chol, eps, lower=True, trans="T")  # (*B, D, n)
        z = jnp.moveaxis(z, -1, 0).reshape(tuple(sample_shape) + batch + (self.dim,))
        return mean + z

    def linearisation_point(self, view: GaussianView) -> jax.Array:
        return view.mean

    def tangent_sets(self, view: GaussianView, full: bool) -> dict:
        """``left``: unit columns, ``right``: the covariance columns Σ e_j (the inputs of
        :class:`blrppl.moments.AffineGaussian`). By default one column per scalar of an
        element (D per plate element, every element at once); ``full``: one per scalar of
        the whole block (arguments that mix plate elements), each nonzero at one element."""
        cov = view.cov  # (*B, D, D)
        bshape, dim = cov.shape[:-2], cov.shape[-1]
        if not full:
            eye = jnp.eye(dim, dtype=cov.dtype)
            basis = jnp.broadcast_to(eye.reshape((dim,) + (1,) * len(bshape) + (dim,)), (dim,) + bshape + (dim,))
            return {"left": basis, "right": jnp.moveaxis(cov, -1, 0)}  # column j of each Σ_p
        nb = math.prod(bshape)
        n = nb * dim
        eye = jnp.eye(n, dtype=cov.dtype).reshape((n,) + bshape + (dim,))
        # column (p, j): Σ_p[:, j] at plate element p, zero elsewhere
        sel = jnp.eye(nb, dtype=cov.dtype)
        right = jnp.einsum("pq,qdj->pjqd", sel, cov.reshape((nb, dim, dim))).reshape((n,) + bshape + (dim,))
        return {"left": eye, "right": right}

    def tangent_roots(self, view: GaussianView, full: bool):
        """Column k of each plate element's Cholesky factor L_p (Σ_p = L_p L_pᵀ): D tangents
        (None with ``full``)."""
        if full:
            return None
        return jnp.moveaxis(jnp.linalg.cholesky(view.cov), -1, 0)

    def to_numpyro(self, nat: GaussianNat) -> dist.MultivariateNormal:
        """N(m, Σ) with Σ = T Tᵀ, T the lower Cholesky factor of Σ = S⁻¹ (numpyro's own
        precision-to-scale map: one Cholesky and one triangular inverse), m = T Tᵀ η₁."""
        scale_tril = cholesky_of_inverse(-2.0 * _sym(nat.eta2))
        white = jnp.einsum("...ji,...j->...i", scale_tril, nat.eta1)
        mean = jnp.einsum("...ij,...j->...i", scale_tril, white)
        return dist.MultivariateNormal(mean, scale_tril=scale_tril)


@dataclasses.dataclass(frozen=True)
class GaussianDiag(Family):
    """Independent scalar Gaussians N(m, v), one per batch element (event shape ``()``).

    * T(x) = (x, x²); base measure 1.
    * λ = (η₁, η₂) = (m / v, −1 / (2v))  (:class:`DiagGaussianNat`, each ``(*B,)``).
    * A(λ) = −η₁² / (4η₂) − ½ log(−2η₂) + ½ log 2π.
    * μ = (m, v + m²).
    * view: :class:`DiagGaussianView` (mean m, variance v).

    BLR update, with L = Σ_i E_q[log f_i] as a function of (m, v):

        λ̃ = ∇_μ L = (∂L/∂m − 2 (∂L/∂v) m, ∂L/∂v),    λ ← (1 − ρ) λ + ρ λ̃,
        i.e.  1/v ← (1 − ρ)/v − 2ρ ∂L/∂v.
    """

    name: ClassVar[str] = "gaussian-diag"
    gaussian: ClassVar[bool] = True
    view_type: ClassVar[type] = DiagGaussianView

    def initial_nat(self, x: jax.Array) -> DiagGaussianNat:
        """Mean x, variance 1."""
        return self.nat_from_view(DiagGaussianView(x, self.identity_precision(x)))

    def view_covariance(self, view: DiagGaussianView) -> jax.Array:
        return view.var

    def marginal_variance(self, view: DiagGaussianView) -> jax.Array:
        return view.var

    def covariance_column(self, view: DiagGaussianView, index: int) -> jax.Array:
        """v_i at position ``index`` of the flattened variances, zeros elsewhere."""
        var = jnp.ravel(view.var)
        return jnp.zeros_like(var).at[index].set(var[index])

    def curvature_of_hessian(self, hessian: jax.Array, shape: tuple) -> jax.Array:
        return jnp.diagonal(hessian).reshape(shape)

    def precision_times(self, prec: jax.Array, x: jax.Array) -> jax.Array:
        return prec * x

    def solve_precision(self, prec: jax.Array, g: jax.Array) -> jax.Array:
        return g / prec

    def identity_precision(self, mean: jax.Array) -> jax.Array:
        return (np if isinstance(mean, np.ndarray) else jnp).ones_like(mean)

    def positive_curvature(self, prec: jax.Array) -> jax.Array:
        eps = jnp.finfo(prec.dtype).eps
        floor = jnp.sqrt(eps) * jnp.maximum(1.0, jnp.max(jnp.abs(prec)))
        return jnp.where(prec > floor, prec, jnp.maximum(jnp.abs(prec), floor))

    def view(self, nat: DiagGaussianNat) -> DiagGaussianView:
        var = -0.5 / nat.eta2
        return DiagGaussianView(nat.eta1 * var, var)

    def nat_from_view(self, view: DiagGaussianView) -> DiagGaussianNat:
        return DiagGaussianNat(view.mean / view.var, -0.5 / view.var)

    def mean_params(self, nat: DiagGaussianNat) -> DiagGaussianNat:
        mean, var = self.view(nat)
        return DiagGaussianNat(mean, var + mean**2)

    def nat_from_mean(self, mean_params: DiagGaussianNat) -> DiagGaussianNat:
        m = mean_params.eta1
        return self.nat_from_view(DiagGaussianView(m, mean_params.eta2 - m**2))

    def log_partition(self, nat: DiagGaussianNat) -> jax.Array:
        return -0.25 * nat.eta1**2 / nat.eta2 - 0.5 * jnp.log(-2.0 * nat.eta2) + 0.5 * _LOG_2PI

    def sufficient_stats(self, x: jax.Array) -> DiagGaussianNat:
        return DiagGaussianNat(x, x**2)

    def log_prob(self, nat: DiagGaussianNat, x: jax.Array) -> jax.Array:
        mean, var = self.view(nat)
        return -0.5 * (x - mean) ** 2 / var - 0.5 * jnp.log(var) - 0.5 * _LOG_2PI

    def entropy(self, nat: DiagGaussianNat) -> jax.Array:
        return 0.5 * (1.0 + _LOG_2PI) - 0.5 * jnp.log(-2.0 * nat.eta2)

    def message_from_view_grad(self, nat: DiagGaussianNat, view_grad: DiagGaussianView) -> DiagGaussianNat:
        mean = -0.5 * nat.eta1 / nat.eta2
        return DiagGaussianNat(view_grad.mean - 2.0 * view_grad.var * mean, view_grad.var)

    def update(self, nat: DiagGaussianNat, message: DiagGaussianNat, rho, retract: bool = False) -> DiagGaussianNat:
        """Learning-rule step; for ρ < 1 (and at every ρ with ``retract``) the improved BLR:
        with s = −2η₂, p̂ = −2λ̃₂, g = λ̃₁ − p̂ m and ĝ = p̂ − s:  s' = s + ρĝ + ½ρ²ĝ²/s > 0
        and m' = m + ρ g / s'."""
        plain = jax.tree.map(lambda a, m: (1.0 - rho) * a + rho * m, nat, message)
        prec = -2.0 * nat.eta2
        mean = nat.eta1 / prec
        target = -2.0 * message.eta2
        grad = message.eta1 - target * mean
        diff = target - prec
        new_prec = prec + rho * diff + 0.5 * rho**2 * diff**2 / prec
        new_mean = mean + rho * grad / new_prec
        retracted = DiagGaussianNat(new_prec * new_mean, -0.5 * new_prec)
        return jax.tree.map(lambda a, b: jnp.where((rho < 1.0) | retract, b, a), plain, retracted)

    def is_valid(self, nat: DiagGaussianNat) -> jax.Array:
        finite = jnp.all(jnp.isfinite(nat.eta1)) & jnp.all(jnp.isfinite(nat.eta2))
        return finite & jnp.all(nat.eta2 < 0)

    def sample(self, nat: DiagGaussianNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """x = m + √v ε, ε ~ N(0, 1): reparameterised."""
        mean, var = self.view(nat)
        eps = jax.random.normal(rng_key, tuple(sample_shape) + mean.shape, dtype=mean.dtype)
        return mean + jnp.sqrt(var) * eps

    def linearisation_point(self, view: DiagGaussianView) -> jax.Array:
        return view.mean

    def tangent_sets(self, view: DiagGaussianView, full: bool) -> dict:
        """``left``/``right`` as for the dense family: elementwise, one column of ones and
        the variances; ``full``: one unit column per scalar."""
        var = view.var
        if not full:
            return {"left": jnp.ones((1,) + var.shape, var.dtype), "right": var[None]}
        n = var.size
        eye = jnp.eye(n, dtype=var.dtype)
        return {"left": eye.reshape((n,) + var.shape), "right": (eye * var.reshape(-1)).reshape((n,) + var.shape)}

    def tangent_roots(self, view: DiagGaussianView, full: bool):
        """The standard deviations: one tangent (None with ``full``)."""
        return None if full else jnp.sqrt(view.var)[None]

    def to_numpyro(self, nat: DiagGaussianNat) -> dist.Normal:
        mean, var = self.view(nat)
        return dist.Normal(mean, jnp.sqrt(var))
