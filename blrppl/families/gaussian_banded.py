"""Gaussian with a banded precision: chains (random walks, AR(p), state-space models).

The posterior of a chain of Gaussian latents whose factors each touch a few neighbouring
scalars has a precision S with S_ij = 0 for |i − j| > b: a Gaussian Markov chain of order b.
Everything the fit needs of it (mean, the covariance entries within the band, entropy,
draws) costs O(n·b²) through the band Cholesky factor of S (:mod:`blrppl.families._band`),
and no n × n matrix is ever formed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import constraints

from blrppl.families import _band
from blrppl.families.base import Family

_LOG_2PI = math.log(2.0 * math.pi)


class BandedGaussianNat(NamedTuple):
    """Natural (or mean) parameters of a banded Gaussian on ℝⁿ with half-bandwidth b.

    Attributes:
        eta1: S m, shape ``(*B, n)`` (mean parameters: E[x]).
        eta2: the upper band of −S/2, shape ``(*B, n, b + 1)``: ``eta2[i, d] = −S[i, i+d]/2``
            (mean parameters: ``c_d E[x_i x_{i+d}]`` with c_0 = 1 and c_d = 2 for d > 0, so
            that the leafwise inner product ⟨λ, μ⟩ is tr(η₂ E[x xᵀ]) + η₁ᵀ E[x]).
    """

    eta1: jax.Array
    eta2: jax.Array


class BandedGaussianView(NamedTuple):
    """Mean ``(*B, n)`` and the upper band of the covariance ``(*B, n, b + 1)``:
    ``cov[i, d] = Cov[x_i, x_{i+d}]`` (the entries of Σ outside the band are not held)."""

    mean: jax.Array
    cov: jax.Array


def _weights(b: int, dtype) -> jax.Array:
    """c_d: 1 on the diagonal, 2 off it (each off-diagonal pair is stored once)."""
    return jnp.asarray([1.0] + [2.0] * b, dtype)


def _band_outer(m: jax.Array, b: int) -> jax.Array:
    """The upper band of m mᵀ (last axis)."""
    n = m.shape[-1]
    cols = [m * jnp.concatenate([m[..., d:], jnp.zeros(m.shape[:-1] + (d,), m.dtype)], -1) for d in range(b + 1)]
    return jnp.stack(cols, -1) if n else jnp.zeros(m.shape + (b + 1,), m.dtype)


def _vectorized(fn, signature):
    return jnp.vectorize(fn, signature=signature)


@dataclasses.dataclass(frozen=True)
class GaussianBanded(Family):
    """Gaussian N(m, S⁻¹) on ℝⁿ whose precision S has half-bandwidth b.

    * T(x) = (x, c_d x_i x_{i+d}) (the upper band of x xᵀ, off-diagonals doubled); base
      measure 1.
    * λ = (η₁, η₂) = (S m, upper band of −S/2)  (:class:`BandedGaussianNat`).
    * A(λ) = ½ mᵀSm − ½ log|S| + (n/2) log 2π, with log|S| = 2 Σ log L_ii (S = L Lᵀ banded).
    * view: :class:`BandedGaussianView` (m and the band of Σ = S⁻¹, Takahashi's recursion).

    BLR update, with L = Σ_i E_q[log f_i] a function of (m, band of Σ) and G the symmetric
    banded matrix with G_ii = ∂L/∂Σ_ii and G_{i,i+d} = ½ ∂L/∂Σ_{i,i+d} (each pair stored
    once):

        λ̃ = (∂L/∂m − 2 G m, G),    λ ← (1 − ρ) λ + ρ λ̃,

    the dense Gaussian's update restricted to the band. Factors that each touch a window of
    at most b + 1 consecutive scalars give messages within the band, so it holds every
    exact message of a chain (one step for a linear-Gaussian one). The plain step keeps S
    banded; where (1 − ρ)S + ρŜ is not positive definite the engine halves ρ.

    Attributes:
        dim: n, the number of scalars (the site's value, flattened in C order).
        bandwidth: b.
    """

    dim: int
    bandwidth: int
    name: ClassVar[str] = "gaussian-banded"
    gaussian: ClassVar[bool] = True
    dense_event: ClassVar[bool] = True
    banded: ClassVar[bool] = True
    splits_quadratic: ClassVar[bool] = True
    view_type: ClassVar[type] = BandedGaussianView

    @property
    def event_shape(self) -> tuple[int, ...]:
        return (self.dim,)

    @property
    def colours(self) -> int:
        """K = 2b + 1: scalars i and j ≡ i mod K within distance b of each other are equal."""
        return 2 * self.bandwidth + 1

    def canonical_batch_shape(self, value_shape: tuple, plate_axes: tuple) -> tuple:
        return tuple(value_shape[a] for a in plate_axes)

    def initial_nat(self, x) -> BandedGaussianNat:
        """Mean x, covariance I."""
        xp = np if isinstance(x, np.ndarray) else jnp
        eta2 = xp.zeros(x.shape + (self.bandwidth + 1,), dtype=x.dtype)
        if xp is np:
            eta2[..., 0] = -0.5
        else:
            eta2 = eta2.at[..., 0].set(-0.5)
        return BandedGaussianNat(x, eta2)

    # -- factorisation -------------------------------------------------------------------
    def _chol(self, nat: BandedGaussianNat) -> jax.Array:
        return _vectorized(_band.cholesky, "(n,w)->(n,w)")(-2.0 * nat.eta2)

    def _chol_and_view(self, nat: BandedGaussianNat) -> tuple:
        """The Cholesky rows and the view, in two passes over the chain: the factor and
        L⁻¹ η₁ down, m = L⁻ᵀ L⁻¹ η₁ and the band of Σ up."""
        down = _vectorized(_band.cholesky_and_solve_lower, "(n,w),(n)->(n,w),(n)")
        chol, white = down(-2.0 * nat.eta2, nat.eta1)
        up = _vectorized(_band.solve_upper_and_inverse_band, "(n,w),(n)->(n),(n,w)")
        mean, cov = up(chol, white)
        return chol, BandedGaussianView(mean, cov)

    def _entropy(self, chol) -> jax.Array:
        return 0.5 * self.dim * (1.0 + _LOG_2PI) - _band.sum_log(chol[..., 0])

    def view(self, nat: BandedGaussianNat) -> BandedGaussianView:
        return self._chol_and_view(nat)[1]

    def rule_view_and_entropy(self, nat: BandedGaussianNat) -> tuple:
        chol, view = self._chol_and_view(nat)
        return view, self._entropy(chol)

    def entropy(self, nat: BandedGaussianNat, mean_params=None) -> jax.Array:
        return self._entropy(self._chol(nat))

    def log_partition(self, nat: BandedGaussianNat) -> jax.Array:
        chol = self._chol(nat)
        white = _vectorized(_band.solve_lower, "(n,w),(n)->(n)")(chol, nat.eta1)  # L⁻¹ S m
        return 0.5 * jnp.sum(white**2, -1) - _band.sum_log(chol[..., 0]) + 0.5 * self.dim * _LOG_2PI

    def nat_from_view(self, view: BandedGaussianView) -> BandedGaussianNat:
        """The Gaussian with this mean, these covariances within the band and a banded
        precision (the maximum-entropy completion of the band: a Markov chain of order b).

        The chain's graph is decomposable with cliques C_i = {i, …, i+b} and separators
        C_i ∩ C_{i+1}, so S = Σ_i [Σ_{C_i}⁻¹]⁰ − Σ_i [Σ_{C_i ∩ C_{i+1}}⁻¹]⁰ (Lauritzen 1996,
        5.3; [·]⁰ pads with zeros): n − b inverses of (b + 1) × (b + 1) windows.
        """
        prec = _vectorized(lambda c: _precision_of_band(c, self.bandwidth), "(n,w)->(n,w)")(view.cov)
        return BandedGaussianNat(_vectorized(_band.matvec, "(n,w),(n)->(n)")(prec, view.mean), -0.5 * prec)

    def mean_params(self, nat: BandedGaussianNat) -> BandedGaussianNat:
        mean, cov = self.view(nat)
        return BandedGaussianNat(mean, (cov + _band_outer(mean, self.bandwidth)) * _weights(self.bandwidth, cov.dtype))

    def nat_from_mean(self, mean_params: BandedGaussianNat) -> BandedGaussianNat:
        m = mean_params.eta1
        cov = mean_params.eta2 / _weights(self.bandwidth, m.dtype) - _band_outer(m, self.bandwidth)
        return self.nat_from_view(BandedGaussianView(m, cov))

    def sufficient_stats(self, x: jax.Array) -> BandedGaussianNat:
        return BandedGaussianNat(x, _band_outer(x, self.bandwidth) * _weights(self.bandwidth, x.dtype))

    def log_prob(self, nat: BandedGaussianNat, x: jax.Array) -> jax.Array:
        chol = self._chol(nat)
        mean = _vectorized(_band.solve, "(n,w),(n)->(n)")(chol, nat.eta1)
        dx = x - mean
        quad = jnp.sum(dx * _vectorized(_band.matvec, "(n,w),(n)->(n)")(-2.0 * nat.eta2, dx), -1)
        return -0.5 * quad + _band.sum_log(chol[..., 0]) - 0.5 * self.dim * _LOG_2PI

    # -- the learning rule ---------------------------------------------------------------
    def message_from_view_grad(self, nat: BandedGaussianNat, view_grad: BandedGaussianView) -> BandedGaussianNat:
        mean = _vectorized(_band.solve, "(n,w),(n)->(n)")(self._chol(nat), nat.eta1)
        return self._message(view_grad, mean)

    def message_at(
        self, nat: BandedGaussianNat, view: BandedGaussianView, view_grad: BandedGaussianView, diagonal: bool = False
    ) -> BandedGaussianNat:
        """λ̃ = (∂L/∂m − 2 G m, G) at ``view``. With ``diagonal`` every factor in L reads the
        chain one scalar per element (``"scalar"`` columns: L depends on the band of Σ through
        its diagonal only), so G is diagonal and G m is elementwise: no shifted rows (a chain's
        observations, with its own prior taken apart: :func:`blrppl.engine.step.constant_factors`)."""
        if diagonal:
            g = view_grad.cov / _weights(self.bandwidth, view_grad.cov.dtype)
            return BandedGaussianNat(view_grad.mean - 2.0 * g[..., 0] * view.mean, g)
        return self._message(view_grad, view.mean)

    def _message(self, view_grad: BandedGaussianView, mean) -> BandedGaussianNat:
        g = view_grad.cov / _weights(self.bandwidth, view_grad.cov.dtype)  # band of G
        if mean is None:
            return BandedGaussianNat(view_grad.mean, g)
        gm = _vectorized(_band.matvec, "(n,w),(n)->(n)")(g, mean)
        return BandedGaussianNat(view_grad.mean - 2.0 * gm, g)

    def fixed_view(self, view: BandedGaussianView) -> BandedGaussianView:
        """m = 0 and Σ = 0 (see the dense family): no factorisation for a conjugate message."""
        return BandedGaussianView(jnp.zeros_like(view.mean), jnp.zeros_like(view.cov))

    def message_from_fixed_view_grad(self, view_grad: BandedGaussianView) -> BandedGaussianNat:
        return self._message(view_grad, None)

    def is_valid(self, nat: BandedGaussianNat) -> jax.Array:
        """Finite, with a positive definite precision: at once when the precision is
        strictly diagonally dominant with a positive diagonal (Gershgorin's circles: an
        elementwise test, which a chain's messages usually pass, a walk's precision plus
        positive curvatures), else by its Cholesky factor (a sequential pass)."""
        finite = jnp.all(jnp.isfinite(nat.eta1)) & jnp.all(jnp.isfinite(nat.eta2))
        prec = -2.0 * nat.eta2
        above = jnp.abs(prec[..., 1:])  # |M[i, i + d]|, d = 1 … b
        below = _vectorized(_band.lower_rows, "(n,w)->(n,w)")(jnp.abs(prec))[..., 1:]  # |M[i, i − d]|
        dominant = jnp.all(prec[..., 0] > jnp.sum(above, -1) + jnp.sum(below, -1))
        return finite & jax.lax.cond(dominant, lambda: jnp.array(True), lambda: jnp.all(jnp.isfinite(self._chol(nat))))

    # -- moments of arguments --------------------------------------------------------------
    def linearisation_point(self, view: BandedGaussianView) -> jax.Array:
        return view.mean

    def tangent_sets(self, view: BandedGaussianView, full: bool) -> dict:
        """K = 2b + 1 colour classes of scalars (i mod K). ``left[c]`` is the indicator of
        class c; ``right[c][k] = Σ[k, j]`` with j the scalar of class c within distance b of
        k. For an argument element x_n whose scalars (with those of every other argument it
        is paired with) lie in b + 1 consecutive positions, each class holds at most one of
        them, so Σ_c (J_x left_c)_n (J_y right_c)_n = Σ_{j,k} ∂x_n/∂w_j ∂y_n/∂w_k Σ_jk =
        Cov[x_n, y_n] from 2K pushed tangents, with only the band of Σ."""
        b, k = self.bandwidth, self.colours
        mean, cov = view
        n = mean.shape[-1]
        cls = np.arange(n) % k
        left = (cls[None, :] == np.arange(k)[:, None]).astype(np.dtype(mean.dtype))
        left = jnp.broadcast_to(left.reshape((k,) + (1,) * (mean.ndim - 1) + (n,)), (k,) + mean.shape)
        full_cov = _vectorized(_band.full_band, "(n,w)->(n,v)")(cov)  # (*B, n, 2b + 1)
        right = _colour_rows(full_cov, b)  # (K, *B, n)
        return {"left": left, "right": right}

    def scalar_tangent_sets(self, view: BandedGaussianView) -> dict:
        """The tangent pair of arguments whose elements each read one scalar: ``left`` the
        ones vector, ``right`` the diagonal of Σ. An element x_n = a_n w_p + c_n (and every
        argument it is paired with, reading the same p) gets (J left)_n (J right)_n =
        a_n² Σ_pp = Var[x_n]: two pushed rows in place of the 2(2b + 1) colour rows
        (which reads of this kind the compiler checks: :class:`blrppl.graph.band.Chain`)."""
        mean, cov = view
        return {"left": jnp.ones((1,) + mean.shape, mean.dtype), "right": cov[..., 0][None]}

    def view_covariance(self, view: BandedGaussianView) -> jax.Array:
        return view.cov

    def marginal_variance(self, view: BandedGaussianView) -> jax.Array:
        return view.cov[..., 0]

    # -- sampling and export -----------------------------------------------------------------
    def sample(self, nat: BandedGaussianNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """x = m + L⁻ᵀ ε with S = L Lᵀ, ε ~ N(0, I): reparameterised."""
        chol = self._chol(nat)
        mean = _vectorized(_band.solve, "(n,w),(n)->(n)")(chol, nat.eta1)
        eps = jax.random.normal(rng_key, tuple(sample_shape) + mean.shape, dtype=mean.dtype)
        z = _vectorized(_band.solve_upper, "(n,w),(n)->(n)")(chol, eps)
        return mean + z

    def to_numpyro(self, nat: BandedGaussianNat) -> "BandedPrecisionNormal":
        return BandedPrecisionNormal(nat.eta1, -2.0 * nat.eta2, validate_args=False)  # (valid by construction)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _colour_rows(full_cov: jax.Array, b: int) -> jax.Array:
    """``out[c, ..., i] = full_cov[..., i, (c − i + b) mod K]`` (K = 2b + 1): Σ[i, j] for
    the scalar j of class c within distance b of i, from the full band (``full[i, b + d] =
    Σ[i, i + d]``), colour first (the layout of the pushed tangent rows). For each i the map
    c ↦ diagonal is a permutation of the K diagonals, so the gradient is the inverse
    permutation. Both are K selects per colour by i mod K, one elementwise loop (as a
    gather, a table lookup per entry, the rows and their gradient took 1 ms per step at
    n = 10⁵; the gather's own gradient is a scatter-add, a serial loop over the K·n entries
    on a CPU)."""
    return _rows_permuted(full_cov, b)


def _by_phase(pick, k: int, phase: jax.Array) -> list:
    """For each output column o < K: ``pick(o, r)`` where i mod K = r (``phase``), as K − 1
    selects over the K candidates."""
    columns = []
    for o in range(k):
        out = pick(o, 0)
        for r in range(1, k):
            out = jnp.where(phase == r, pick(o, r), out)
        columns.append(out)
    return columns


def _rows_permuted(full, b: int) -> jax.Array:
    """(…, n, K) → (K, …, n): colour c of row i reads diagonal (c − i + b) mod K."""
    k = full.shape[-1]
    phase = jax.lax.broadcasted_iota(np.int32, full.shape[:-1], full.ndim - 2) % k  # i mod K
    return jnp.stack(_by_phase(lambda c, r: full[..., (c - r + b) % k], k, phase), 0)


def _rows_unpermuted(rows, b: int) -> jax.Array:
    """The inverse of :func:`_rows_permuted`, (K, …, n) → (…, n, K): diagonal d of row i
    comes from colour (d + i − b) mod K."""
    k = rows.shape[0]
    phase = jax.lax.broadcasted_iota(np.int32, rows.shape[1:], rows.ndim - 2) % k
    return jnp.stack(_by_phase(lambda d, r: rows[(d + r - b) % k], k, phase), -1)


def _colour_rows_fwd(full_cov, b):
    return _rows_permuted(full_cov, b), None


def _colour_rows_bwd(b, _, g):
    return (_rows_unpermuted(g, b),)


_colour_rows.defvjp(_colour_rows_fwd, _colour_rows_bwd)


def _precision_of_band(cov: jax.Array, b: int) -> jax.Array:
    """Upper band of the precision of the order-b Gaussian Markov chain with covariance band
    ``cov`` (see :meth:`GaussianBanded.nat_from_view`)."""
    n = cov.shape[0]
    w = min(b + 1, n)
    full = _band.full_band(cov)  # full[i, b + d] = Σ[i, i + d]
    starts = np.arange(max(n - w + 1, 1))
    idx = starts[:, None] + np.arange(w)[None, :]  # (cliques, w)
    # window matrices Σ[idx_p, idx_q] = full[idx_p, b + idx_q − idx_p]
    rel = np.arange(w)[None, :] - np.arange(w)[:, None]  # q − p
    windows = full[idx[:, :, None], b + rel[None, :, :]]
    inv_c = jnp.linalg.inv(windows)
    inv_s = jnp.linalg.inv(windows[:-1, 1:, 1:]) if w > 1 and len(starts) > 1 else None  # separators
    out = jnp.zeros((n, b + 1), cov.dtype)
    for p in range(w):
        for q in range(p, w):
            out = out.at[idx[:, p], q - p].add(inv_c[:, p, q])
            if inv_s is not None and p >= 1:
                out = out.at[idx[:-1, p], q - p].add(-inv_s[:, p - 1, q - 1])
    return out


class BandedPrecisionNormal(dist.Distribution):
    """Multivariate normal N(loc, P⁻¹) given P's upper band: O(n·b²) ``sample``/``log_prob``.

    Args:
        precision_eta1: P m, shape ``(*B, n)``.
        precision_band: the upper band of P, ``(*B, n, b + 1)`` (``[i, d] = P[i, i + d]``).
    """

    arg_constraints = {"precision_eta1": constraints.real_vector, "precision_band": constraints.real_vector}
    support = constraints.real_vector
    reparametrized_params = ["precision_eta1", "precision_band"]

    def __init__(self, precision_eta1, precision_band, validate_args=None):
        self.precision_eta1, self.precision_band = precision_eta1, precision_band
        batch = jnp.broadcast_shapes(jnp.shape(precision_eta1)[:-1], jnp.shape(precision_band)[:-2])
        super().__init__(batch, jnp.shape(precision_eta1)[-1:], validate_args=validate_args)

    @property
    def _family(self):
        return GaussianBanded(self.event_shape[0], jnp.shape(self.precision_band)[-1] - 1)

    @property
    def _nat(self):
        return BandedGaussianNat(self.precision_eta1, -0.5 * self.precision_band)

    def sample(self, key, sample_shape=()):
        return self._family.sample(self._nat, key, tuple(sample_shape))

    def log_prob(self, value):
        return self._family.log_prob(self._nat, value)

    @property
    def mean(self):
        return self._family.view(self._nat).mean

    @property
    def variance(self):
        return self._family.view(self._nat).cov[..., 0]

    def entropy(self):
        return self._family.entropy(self._nat)

    def tree_flatten(self):
        return (self.precision_eta1, self.precision_band), None

    @classmethod
    def tree_unflatten(cls, aux_data, params):
        # (no validation: rebuilding a pytree must not run host-side checks, each an XLA program)
        return cls(*params, validate_args=False)
