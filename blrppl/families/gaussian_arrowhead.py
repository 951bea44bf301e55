"""Gaussian with an arrowhead precision: hierarchical and item-response models.

The posterior of a model whose many *local* scalars (per-student effects, per-group
intercepts) each meet only a few *global* ones (question effects, a global mean, a shared
slope) has a precision S that, with the block's positions split into the locals L and the
globals G, is diagonal on L × L and dense on L × G and G × G: an arrowhead (after ordering
the locals first). Its graph is chordal, with one clique {i} ∪ G per local i.

Everything the fit needs of it (the mean, the covariance entries on the pattern, the
entropy, draws) goes through the Schur complement C = S_GG − S_GL S_LL⁻¹ S_LG of the
diagonal block and its Cholesky factor: O(n_l·n_g² + n_g³) time and O(n_l·n_g + n_g²)
memory for n_l locals and n_g globals. No n × n matrix is ever formed (the export,
:class:`ArrowheadPrecisionNormal`, samples and evaluates densities the same way).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import constraints
from jax.scipy.linalg import cho_solve, solve_triangular

from blrppl.families.base import Family

_LOG_2PI = math.log(2.0 * math.pi)


class ArrowheadGaussianNat(NamedTuple):
    """Natural (or mean) parameters of an arrowhead Gaussian on ℝⁿ with n_l locals and n_g
    globals.

    Attributes:
        eta1: S m, shape ``(*B, n)`` in block order (mean parameters: E[x]).
        diag: −½ diag(S_LL), shape ``(*B, n_l)`` (mean parameters: E[x_L²]).
        cross: −½ S_LG, shape ``(*B, n_l, n_g)`` (mean parameters: 2 E[x_L x_Gᵀ]: each
            local-global pair appears twice in the dense inner product tr(η₂ E[x xᵀ])).
        glob: −½ S_GG, shape ``(*B, n_g, n_g)`` (mean parameters: E[x_G x_Gᵀ]).

    With these mean parameters the leafwise inner product ⟨λ, μ⟩ equals the dense
    Gaussian's η₁ᵀ E[x] + tr(η₂ E[x xᵀ]).
    """

    eta1: jax.Array
    diag: jax.Array
    cross: jax.Array
    glob: jax.Array


class ArrowheadGaussianView(NamedTuple):
    """Mean ``(*B, n)`` (block order) and the covariance entries on the arrowhead pattern:
    ``var = Var[x_L]`` ``(*B, n_l)``, ``cross = Cov[x_L, x_G]`` ``(*B, n_l, n_g)`` and
    ``glob = Cov[x_G]`` ``(*B, n_g, n_g)`` (the covariances between two different locals
    are not held)."""

    mean: jax.Array
    var: jax.Array
    cross: jax.Array
    glob: jax.Array


def _sym(a: jax.Array) -> jax.Array:
    return 0.5 * (a + jnp.swapaxes(a, -1, -2))


def _eye_like(a: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)


class _Factor(NamedTuple):
    """The factorisation of an arrowhead precision S = [[D, B], [Bᵀ, S_GG]] (locals first)."""

    d: jax.Array  # diag(S_LL), (*B, n_l)
    b: jax.Array  # S_LG, (*B, n_l, n_g)
    s_gg: jax.Array  # S_GG (symmetrised), (*B, n_g, n_g)
    dinv_b: jax.Array  # D⁻¹ B, (*B, n_l, n_g)
    chol: jax.Array  # lower Cholesky factor of C = S_GG − Bᵀ D⁻¹ B, (*B, n_g, n_g)


@dataclasses.dataclass(frozen=True)
class GaussianArrowhead(Family):
    """Gaussian N(m, S⁻¹) on ℝⁿ whose precision S is diagonal among the local scalars.

    The block's positions (C order) split into the globals G (the spans ``globals``) and
    the locals L (the others); S_LL is diagonal, S_LG and S_GG dense.

    * T(x) = (x, x_L², 2 x_L x_Gᵀ, x_G x_Gᵀ) (the pattern entries of x xᵀ, the local-global
      ones doubled); base measure 1.
    * λ = (S m, −½ diag S_LL, −½ S_LG, −½ S_GG)  (:class:`ArrowheadGaussianNat`).
    * A(λ) = ½ mᵀSm − ½ log|S| + (n/2) log 2π, with log|S| = Σ log S_ii (i ∈ L) + log|C|,
      C = S_GG − S_GL S_LL⁻¹ S_LG the Schur complement.
    * μ = ∇A(λ) = (E[x], E[x_L²], 2 E[x_L x_Gᵀ], E[x_G x_Gᵀ]).
    * view: :class:`ArrowheadGaussianView` (m and the pattern entries of Σ = S⁻¹:
      Σ_GG = C⁻¹, Σ_LG = −S_LL⁻¹ S_LG Σ_GG, Var[x_L] = 1/S_LL + the row sums of
      (S_LL⁻¹ S_LG Σ_GG) ∘ (S_LL⁻¹ S_LG)).

    BLR update, with L = Σ_i E_q[log f_i] a function of (m, pattern of Σ) and G the
    symmetric arrowhead matrix with G_ii = ∂L/∂Var[x_i] (i ∈ L), G_ig = ½ ∂L/∂Cov[x_i, x_g]
    (each local-global pair stored once) and G_GG = sym(∂L/∂Σ_GG):

        λ̃ = (∂L/∂m − 2 G m, G),    λ ← (1 − ρ) λ + ρ λ̃,

    the dense Gaussian's update restricted to the pattern. Factors that each read at most
    one local scalar (and any globals) give messages on the pattern, so it holds every
    exact message of such a model (one step for a linear-Gaussian one). The plain step keeps
    S arrowhead; where (1 − ρ)S + ρŜ is not positive definite the engine halves ρ.

    Attributes:
        dim: n, the number of scalars (the site's value, flattened in C order).
        globals: the global positions, as sorted disjoint ``(start, stop)`` spans.
    """

    dim: int
    globals: tuple
    name: ClassVar[str] = "gaussian-arrowhead"
    gaussian: ClassVar[bool] = True
    dense_event: ClassVar[bool] = True
    banded: ClassVar[bool] = False
    arrowhead: ClassVar[bool] = True
    view_type: ClassVar[type] = ArrowheadGaussianView

    def __post_init__(self):
        spans = tuple((int(a), int(b)) for a, b in self.globals)
        stop = 0
        for a, b in spans:
            if not stop <= a < b <= self.dim:
                raise ValueError(
                    f"GaussianArrowhead: the global spans (start, stop) must be sorted, disjoint, "
                    f"non-empty and with 0 <= start < stop <= dim = {self.dim}; got {self.globals!r}"
                )
            stop = b
        object.__setattr__(self, "globals", spans)

    @property
    def event_shape(self) -> tuple[int, ...]:
        return (self.dim,)

    @property
    def global_index(self) -> np.ndarray:
        """The global positions in block order, ``(n_g,)``."""
        return np.concatenate([np.arange(a, b) for a, b in self.globals] + [np.zeros(0, int)]).astype(int)

    @property
    def local_index(self) -> np.ndarray:
        """The local positions in block order, ``(n_l,)``."""
        return np.setdiff1d(np.arange(self.dim), self.global_index).astype(int)

    @property
    def num_globals(self) -> int:
        """n_g."""
        return sum(b - a for a, b in self.globals)

    @property
    def num_locals(self) -> int:
        """n_l = n − n_g."""
        return self.dim - self.num_globals

    def canonical_batch_shape(self, value_shape: tuple, plate_axes: tuple) -> tuple:
        return tuple(value_shape[a] for a in plate_axes)

    def initial_nat(self, x) -> ArrowheadGaussianNat:
        """Mean x, covariance I."""
        xp = np if isinstance(x, np.ndarray) else jnp
        batch, nl, ng = x.shape[:-1], self.num_locals, self.num_globals
        return ArrowheadGaussianNat(
            x,
            xp.full(batch + (nl,), -0.5, dtype=x.dtype),
            xp.zeros(batch + (nl, ng), dtype=x.dtype),
            xp.broadcast_to(-0.5 * xp.eye(ng, dtype=x.dtype), batch + (ng, ng)),
        )

    # -- positions ---------------------------------------------------------------------
    def _split(self, x):
        """(x_L, x_G) of a block-order ``x`` (last axis)."""
        return x[..., self.local_index], x[..., self.global_index]

    def _merge(self, x_l, x_g):
        """The block-order vector with locals ``x_l`` and globals ``x_g`` (last axis; the
        leading dims broadcast)."""
        order = np.argsort(np.concatenate([self.local_index, self.global_index]))
        xp = np if isinstance(x_l, np.ndarray) and isinstance(x_g, np.ndarray) else jnp
        lead = np.broadcast_shapes(x_l.shape[:-1], x_g.shape[:-1])
        x_l = xp.broadcast_to(x_l, lead + x_l.shape[-1:])
        x_g = xp.broadcast_to(x_g, lead + x_g.shape[-1:])
        return xp.concatenate([x_l, x_g], -1)[..., order]

    # -- factorisation -------------------------------------------------------------------
    def _factor(self, nat: ArrowheadGaussianNat) -> _Factor:
        d = -2.0 * nat.diag
        b = -2.0 * nat.cross
        s_gg = -(nat.glob + jnp.swapaxes(nat.glob, -1, -2))
        dinv_b = b / d[..., None]
        schur = s_gg - jnp.einsum("...li,...lj->...ij", b, dinv_b)
        return _Factor(d, b, s_gg, dinv_b, jnp.linalg.cholesky(schur))

    def _mean(self, f: _Factor, eta1) -> jax.Array:
        """m = S⁻¹ η₁ by block elimination of the locals."""
        eta_l, eta_g = self._split(eta1)
        rhs = eta_g - jnp.einsum("...li,...l->...i", f.dinv_b, eta_l)
        m_g = cho_solve((f.chol, True), rhs[..., None])[..., 0]
        m_l = (eta_l - jnp.einsum("...li,...i->...l", f.b, m_g)) / f.d
        return self._merge(m_l, m_g)

    def _view_of(self, f: _Factor, eta1) -> ArrowheadGaussianView:
        glob = _sym(cho_solve((f.chol, True), _eye_like(f.chol)))  # Σ_GG = C⁻¹
        t = jnp.einsum("...li,...ij->...lj", f.dinv_b, glob)  # D⁻¹ B Σ_GG
        var = 1.0 / f.d + jnp.sum(t * f.dinv_b, -1)
        return ArrowheadGaussianView(self._mean(f, eta1), var, -t, glob)

    def _half_logdet(self, f: _Factor) -> jax.Array:
        """½ log|S| = ½ Σ log d + Σ log diag L."""
        return 0.5 * jnp.sum(jnp.log(f.d), -1) + jnp.sum(jnp.log(jnp.diagonal(f.chol, axis1=-2, axis2=-1)), -1)

    def _entropy(self, f: _Factor) -> jax.Array:
        return 0.5 * self.dim * (1.0 + _LOG_2PI) - self._half_logdet(f)

    def _matvec(self, f: _Factor, x) -> jax.Array:
        """S x, blockwise: (S x)_L = d ∘ x_L + B x_G, (S x)_G = Bᵀ x_L + S_GG x_G."""
        x_l, x_g = self._split(x)
        out_l = f.d * x_l + jnp.einsum("...li,...i->...l", f.b, x_g)
        out_g = jnp.einsum("...li,...l->...i", f.b, x_l) + jnp.einsum("...ij,...j->...i", f.s_gg, x_g)
        return self._merge(out_l, out_g)

    def view(self, nat: ArrowheadGaussianNat) -> ArrowheadGaussianView:
        return self._view_of(self._factor(nat), nat.eta1)

    def rule_view_and_entropy(self, nat: ArrowheadGaussianNat) -> tuple:
        """The view and the entropy from one Cholesky factor of the Schur complement."""
        f = self._factor(nat)
        return self._view_of(f, nat.eta1), self._entropy(f)

    def entropy(self, nat: ArrowheadGaussianNat, mean_params=None) -> jax.Array:
        return self._entropy(self._factor(nat))

    def log_partition(self, nat: ArrowheadGaussianNat) -> jax.Array:
        """A(λ) with mᵀSm = η₁ᵀS⁻¹η₁ = Σ η_L²/d + |L⁻¹(η_G − BᵀD⁻¹η_L)|² (block elimination)."""
        f = self._factor(nat)
        eta_l, eta_g = self._split(nat.eta1)
        rhs = eta_g - jnp.einsum("...li,...l->...i", f.dinv_b, eta_l)
        white = solve_triangular(f.chol, rhs[..., None], lower=True)[..., 0]
        quad = jnp.sum(eta_l**2 / f.d, -1) + jnp.sum(white**2, -1)
        return 0.5 * quad - self._half_logdet(f) + 0.5 * self.dim * _LOG_2PI

    def nat_from_view(self, view: ArrowheadGaussianView) -> ArrowheadGaussianNat:
        """The Gaussian with this mean, these covariances on the pattern and an arrowhead
        precision (the maximum-entropy completion of the pattern).

        The graph is decomposable with cliques {i} ∪ G (i ∈ L) and every separator G, so
        S = Σ_i [Σ_{{i}∪G}⁻¹]⁰ − (n_l − 1) [Σ_GG⁻¹]⁰ (Lauritzen 1996, 5.3; [·]⁰ pads with
        zeros). With P = Σ_GG⁻¹, c_i = Cov[x_G, x_i] and s_i = Var[x_i] − c_iᵀ P c_i (the
        Schur complement of each clique): S_ii = 1/s_i, S_iG = −(P c_i)ᵀ/s_i and
        S_GG = P + Σ_i (P c_i)(P c_i)ᵀ/s_i. One n_g × n_g Cholesky factor.
        """
        chol = jnp.linalg.cholesky(_sym(view.glob))
        p = _sym(cho_solve((chol, True), _eye_like(chol)))
        pc = jnp.einsum("...ij,...lj->...li", p, view.cross)  # rows P c_i
        s = view.var - jnp.sum(view.cross * pc, -1)
        d = 1.0 / s
        b = -pc * d[..., None]
        s_gg = _sym(p + jnp.einsum("...li,...lj->...ij", pc * d[..., None], pc))
        f = _Factor(d, b, s_gg, None, None)
        return ArrowheadGaussianNat(self._matvec(f, view.mean), -0.5 * d, -0.5 * b, -0.5 * s_gg)

    def mean_params(self, nat: ArrowheadGaussianNat) -> ArrowheadGaussianNat:
        mean, var, cross, glob = self.view(nat)
        m_l, m_g = self._split(mean)
        return ArrowheadGaussianNat(
            mean,
            var + m_l**2,
            2.0 * (cross + m_l[..., :, None] * m_g[..., None, :]),
            glob + m_g[..., :, None] * m_g[..., None, :],
        )

    def nat_from_mean(self, mean_params: ArrowheadGaussianNat) -> ArrowheadGaussianNat:
        m = mean_params.eta1
        m_l, m_g = self._split(m)
        view = ArrowheadGaussianView(
            m,
            mean_params.diag - m_l**2,
            0.5 * mean_params.cross - m_l[..., :, None] * m_g[..., None, :],
            _sym(mean_params.glob) - m_g[..., :, None] * m_g[..., None, :],
        )
        return self.nat_from_view(view)

    def sufficient_stats(self, x: jax.Array) -> ArrowheadGaussianNat:
        x_l, x_g = self._split(x)
        return ArrowheadGaussianNat(
            x, x_l**2, 2.0 * x_l[..., :, None] * x_g[..., None, :], x_g[..., :, None] * x_g[..., None, :]
        )

    def log_prob(self, nat: ArrowheadGaussianNat, x: jax.Array) -> jax.Array:
        f = self._factor(nat)
        dx = x - self._mean(f, nat.eta1)
        quad = jnp.sum(dx * self._matvec(f, dx), -1)
        return -0.5 * quad + self._half_logdet(f) - 0.5 * self.dim * _LOG_2PI

    # -- the learning rule ---------------------------------------------------------------
    def message_from_view_grad(
        self, nat: ArrowheadGaussianNat, view_grad: ArrowheadGaussianView
    ) -> ArrowheadGaussianNat:
        return self._message(view_grad, self._mean(self._factor(nat), nat.eta1))

    def message_at(self, nat: ArrowheadGaussianNat, view: ArrowheadGaussianView, view_grad: ArrowheadGaussianView):
        return self._message(view_grad, view.mean)

    def _message(self, view_grad: ArrowheadGaussianView, mean) -> ArrowheadGaussianNat:
        g_d = view_grad.var
        g_c = 0.5 * view_grad.cross  # each local-global pair held once in the view
        g_g = _sym(view_grad.glob)
        if mean is None:
            return ArrowheadGaussianNat(view_grad.mean, g_d, g_c, g_g)
        m_l, m_g = self._split(mean)
        gm_l = g_d * m_l + jnp.einsum("...li,...i->...l", g_c, m_g)
        gm_g = jnp.einsum("...li,...l->...i", g_c, m_l) + jnp.einsum("...ij,...j->...i", g_g, m_g)
        return ArrowheadGaussianNat(view_grad.mean - 2.0 * self._merge(gm_l, gm_g), g_d, g_c, g_g)

    def fixed_view(self, view: ArrowheadGaussianView) -> ArrowheadGaussianView:
        """m = 0 and Σ = 0 (see the dense family): no factorisation for a conjugate message."""
        return ArrowheadGaussianView(*(jnp.zeros_like(leaf) for leaf in view))

    def message_from_fixed_view_grad(self, view_grad: ArrowheadGaussianView) -> ArrowheadGaussianNat:
        return self._message(view_grad, None)

    def is_valid(self, nat: ArrowheadGaussianNat) -> jax.Array:
        """Every leaf finite, S_LL > 0 and the Schur complement C positive definite (together:
        S positive definite)."""
        finite = jnp.all(jnp.isfinite(nat.eta1)) & jnp.all(jnp.isfinite(nat.diag))
        finite = finite & jnp.all(jnp.isfinite(nat.cross)) & jnp.all(jnp.isfinite(nat.glob))
        f = self._factor(nat)
        return finite & jnp.all(f.d > 0) & jnp.all(jnp.isfinite(f.chol))

    # -- moments of arguments --------------------------------------------------------------
    def linearisation_point(self, view: ArrowheadGaussianView) -> jax.Array:
        return view.mean

    def tangent_sets(self, view: ArrowheadGaussianView, full: bool) -> dict:
        """K = 2 n_g + 1 pairs of tangents that give Cov[x_n, y_n] = J_x Σ J_yᵀ for every
        argument element whose scalars (with those of every argument it is paired with)
        include at most one local, from the pattern entries of Σ only.

        * set 0: ``left`` the indicator of L, ``right`` Var[x_L] on L (0 on G): the pair
          (j, j) of the element's local j;
        * set g (1 ≤ g ≤ n_g): ``left`` e_g, ``right`` the column Σ[:, g] (Cov[x_L, x_g] on
          L, Cov[x_G, x_g] on G): the pairs (g, j) and (g, h), h ∈ G;
        * set n_g + g: ``left`` Cov[x_L, x_g] on L (0 on G), ``right`` e_g: the pairs (j, g).

        Σ_c (J_x left_c)_n (J_y right_c)_n then sums each pattern entry Σ_jk once, times
        ∂x_n/∂w_j ∂y_n/∂w_k. ``full`` is not read: every set spans the whole block.
        """
        mean, var, cross, glob = view
        dtype, bshape = mean.dtype, mean.shape[:-1]
        nl, ng = self.num_locals, self.num_globals

        def stack(x_l, x_g):  # (K', *B or 1s, n_l), (K', *B or 1s, n_g) → (K', *B, n)
            return self._merge(
                jnp.broadcast_to(x_l, x_l.shape[:1] + bshape + (nl,)),
                jnp.broadcast_to(x_g, x_g.shape[:1] + bshape + (ng,)),
            )

        ones_l = jnp.ones((1,) + bshape + (nl,), dtype)
        zero_g = jnp.zeros((1,) + bshape + (ng,), dtype)
        unit = jnp.eye(ng, dtype=dtype).reshape((ng,) + (1,) * len(bshape) + (ng,))  # e_g on G
        zeros_l = jnp.zeros((ng,) + (1,) * len(bshape) + (nl,), dtype)
        zeros_g = jnp.zeros((ng,) + (1,) * len(bshape) + (ng,), dtype)
        cross_cols = jnp.moveaxis(cross, -1, 0)  # (n_g, *B, n_l): [g] = Cov[x_L, x_g]
        glob_cols = jnp.moveaxis(glob, -1, 0)  # (n_g, *B, n_g): [g] = Cov[x_G, x_g]
        left = jnp.concatenate([stack(ones_l, zero_g), stack(zeros_l, unit), stack(cross_cols, zeros_g)])
        right = jnp.concatenate([stack(var[None], zero_g), stack(cross_cols, glob_cols), stack(zeros_l, unit)])
        return {"left": left, "right": right}

    def view_covariance(self, view: ArrowheadGaussianView) -> jax.Array:
        raise NotImplementedError(
            "GaussianArrowhead holds only the arrowhead pattern of the covariance (Var[x_L], "
            "Cov[x_L, x_G], Cov[x_G]); it has no curvature layout, so view_covariance is not "
            "supported for this family"
        )

    def marginal_variance(self, view: ArrowheadGaussianView) -> jax.Array:
        return self._merge(view.var, jnp.diagonal(view.glob, axis1=-2, axis2=-1))

    def covariance_column(self, view: ArrowheadGaussianView, index: int) -> jax.Array | None:
        """Column ``index`` of Σ for a global position (Σ_LG and Σ_GG hold it); None for a
        local one (the view holds no covariance between two locals) or a block of plate
        elements."""
        where = np.flatnonzero(self.global_index == index)
        if not where.size or view.mean.ndim != 1:
            return None
        g = int(where[0])
        return self._merge(view.cross[:, g], view.glob[:, g])

    # -- sampling and export -----------------------------------------------------------------
    def sample(
        self, nat: ArrowheadGaussianNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()
    ) -> jax.Array:
        """x_G = m_G + L⁻ᵀ ε_G (C = L Lᵀ) and x_L = m_L − D⁻¹B (x_G − m_G) + D^{-1/2} ε_L,
        ε ~ N(0, I): reparameterised, with the covariance S⁻¹."""
        f = self._factor(nat)
        m_l, m_g = self._split(self._mean(f, nat.eta1))
        batch, ng, nl = m_g.shape[:-1], self.num_globals, self.num_locals
        num = math.prod(sample_shape)
        key_g, key_l = jax.random.split(rng_key)
        eps_g = jax.random.normal(key_g, batch + (ng, num), dtype=m_g.dtype)
        z_g = solve_triangular(f.chol, eps_g, lower=True, trans="T")  # (*B, n_g, N)
        z_g = jnp.moveaxis(z_g, -1, 0).reshape(tuple(sample_shape) + batch + (ng,))
        eps_l = jax.random.normal(key_l, tuple(sample_shape) + batch + (nl,), dtype=m_l.dtype)
        z_l = eps_l / jnp.sqrt(f.d) - jnp.einsum("...li,...i->...l", f.dinv_b, z_g)
        return self._merge(m_l + z_l, m_g + z_g)

    def to_numpyro(self, nat: ArrowheadGaussianNat) -> "ArrowheadPrecisionNormal":
        """:class:`ArrowheadPrecisionNormal`: ``sample``/``log_prob`` at the family's cost."""
        return ArrowheadPrecisionNormal(self, nat)


class ArrowheadPrecisionNormal(dist.Distribution):
    """Multivariate normal N(m, S⁻¹) with an arrowhead precision S
    (:class:`GaussianArrowhead`): ``sample``, ``log_prob``, ``mean`` and ``variance`` in
    O(n_l·n_g² + n_g³), no n × n matrix.

    Args:
        family: the :class:`GaussianArrowhead` (dimension and global positions).
        nat: its natural parameters (:class:`ArrowheadGaussianNat`).
    """

    arg_constraints = {}
    support = constraints.real_vector
    reparametrized_params = []

    def __init__(self, family: GaussianArrowhead, nat: ArrowheadGaussianNat, validate_args=None):
        self.family, self.nat = family, nat
        super().__init__(jnp.shape(nat.eta1)[:-1], (family.dim,), validate_args=validate_args)

    def sample(self, key, sample_shape=()):
        return self.family.sample(self.nat, key, tuple(sample_shape))

    def log_prob(self, value):
        return self.family.log_prob(self.nat, value)

    @property
    def mean(self):
        return self.family.view(self.nat).mean

    @property
    def variance(self):
        return self.family.marginal_variance(self.family.view(self.nat))

    def entropy(self):
        return self.family.entropy(self.nat)

    def tree_flatten(self):
        return tuple(self.nat), self.family

    @classmethod
    def tree_unflatten(cls, family, params):
        return cls(family, ArrowheadGaussianNat(*params), validate_args=False)
