"""Where the scales integrated on a grid (:mod:`blrppl.engine.grid`) are evaluated, and with
what weights: the points z_k of the standardised space (u = u* + V Λ^{1/2} z, V Λ Vᵀ =
−(∇²ℓ)⁻¹ at the mode u* of ℓ) and their integration weights Δ_k, ∫ g(z) dz ≈ Σ_k Δ_k g(z_k).
Plain numpy, no fit: the refinement's advice (:mod:`blrppl.engine.advice`) reads
:data:`MAX_SCALES` from here without importing the grid's fits.

**One or two scales: a product grid** (:func:`grid_points`): spacing :data:`GRID_STEP` over
±:data:`HALF_WIDTH` Laplace sds per axis, Δ_k = spacing^d.

**Three to :data:`MAX_SCALES` scales: a central composite design** (:func:`ccd_design`), as
the integrated nested Laplace approximation integrates its hyperparameters past two
dimensions (Rue, Martino & Chopin 2009, §6.5): the centre z = 0; the 2d axial points ±f√d e_i;
and the 2^{d−p} corner points (±f, …, ±f) of a two-level factorial, full for d ≤ 4 and the
half fraction of resolution V or more for d = 5, 6 (its last column the product of the others:
every pair of columns is orthogonal, so Σ_corners s_i s_j = 0 for i ≠ j). Every point but the
centre lies on the sphere of radius r = f√d, and f = :data:`CCD_F` > 1. The weights are those
of a design that integrates a standard Gaussian φ and its second moments exactly,

    Σ_k Δ_k φ(z_k) = 1,    Σ_k Δ_k z_k z_kᵀ φ(z_k) = I,

with one weight Δ₀ at the centre and one, Δ₁, at the n − 1 other points (n = 1 + 2d + 2^{d−p}).
At every point off the centre Σ_i z_i² = r² = d f², and by the design's symmetry each axis
gets the same share of it, so the second condition reads Δ₁ φ(r) (n − 1) f² = 1, and the first
Δ₀ φ(0) + Δ₁ φ(r) (n − 1) = 1:

    Δ₁ = (2π)^{d/2} e^{d f²/2} / ((n − 1) f²),    Δ₀ = (2π)^{d/2} (1 − 1/f²),

(positive for f > 1). Odd moments vanish by the design's balance, and the corner columns'
orthogonality makes the cross moments z_i z_j exact too. The cost is n fits of the grid's
points (15, 25, 27, 45 for d = 3…6) where a product grid would need 11^d.

**Stretched on each side of the mode** (:func:`stretched`), as INLA corrects its design for
skewness: with s_j^± ℓ's spreads on each side of the mode along principal direction j (below),
the design's point x is placed at z_j = s_j^{sign x_j} x_j and its weight multiplied by
Π_j s_j^{sign x_j} (the map's volume on x's orthant; (s_j^+ + s_j^−)/2 where x_j = 0, the mean
of the two sides). Where ℓ is a product of split normals with those spreads, exp ℓ(S(x))
|S′(x)| is φ(x) Π_j (ā_j + b_j sign x_j) (ā, b the sides' half sum and half difference), and
the design sums every product of signs to 0 but, in the half fractions of d = 5, 6, the
product of all d signs: its normaliser is exact for d ≤ 4 and off by the corners' share times
Π_j b_j/ā_j beyond (a product of d small asymmetries). The stretched points reach as far
into a heavy side as it goes (a scale's tail toward 0).

**The weights' mean** (:func:`tilted`): w_k ∝ Δ_k exp ℓ(u_k) still sees nothing of a heavy
side beyond the design's farthest points, so the mean of u under them falls short of the
marginals' (below) on that side: on the three-scale GLMM of ``tests/reference_models.py``,
the per-item scale's log by 0.15 of its sd, which left the item effects' mixture
under-shrunk (0.08–0.11 NUTS sd off, at f = 1.1, at f = 1.5 and with a fifth-degree design alike). The
weights are tilted, w'_k ∝ w_k e^{λᵀu_k}, the nearest to w in KL whose mean is the
marginals' means (the item effects then within 0.02 NUTS sd).

**Each scale's marginal** (:func:`split_scales`, :func:`marginal_split`): along each
principal direction j, the drop of ℓ from the centre at two probes t = ±:data:`SKEW_PROBE`
Laplace sds out, ℓ(0) − ℓ(±t e_j) = t² / (2 s_j^±²), gives the posterior's spread on each side
in Laplace sds (s_j^± = 1 for a Gaussian ℓ; INLA's skewness corrections read such drops too).
The probes lie beyond the design's radius f√d (1.9 at d = 3) because a scale's tail toward 0
grows heavier with the distance: on the three-scale GLMM of ``tests/reference_models.py`` the
per-item scale's log had s^+ 1.07, 1.25, 1.46 at 1, 2, 3 sds, and read at the axial points
its mean was 0.13 NUTS sd off, read at 3 sds 0.01. Site i's
u_i = u*_i + Σ_j R_ij z_j (R = V Λ^{1/2}) grows with z_j on the side of z_j that R_ij's sign
says, so its marginal is taken as a split normal: mode u*_i, right sd
σ_R = √(Σ_j R_ij² s_j^{sign R_ij}²) and left sd σ_L = √(Σ_j R_ij² s_j^{−sign R_ij}²) (exactly the
Laplace marginal when ℓ is Gaussian; each axis' own split normal when V is diagonal).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

#: at most this many scales on one grid: a central composite design past two. Its cost grows
#: as d²: the Newton steps that locate ℓ's mode take 1 + 2d + d(d − 1)/2 fits each (at most
#: 4 × 28 at d = 6), the design 45 fits and its probes 12: at most 170 fits in all, about the
#: 2-D grid's 145 (121 points, 4 × 6 Newton fits), which the refinement's budget already pays
#: for; at d = 7, 79 points, 14 probes and 4 × 36 Newton fits, 237
MAX_SCALES = 6

#: the product grid's spacing in Laplace sds, by number of scales (one or two)
GRID_STEP = {1: 0.25, 2: 0.8, 3: 0.5}

#: the product grid's half-width in Laplace sds
HALF_WIDTH = 4.0

#: the central composite design's f: its points off the centre lie at radius f√d (INLA's
#: default; f > 1 keeps the centre's weight positive)
CCD_F = 1.1

#: how far out, in Laplace sds along each principal direction, ℓ's drop is read for the
#: spread on each side of the mode (2d fits more than the design's)
SKEW_PROBE = 3.0

#: the sides' spreads s_j^± are kept within these multiples of the Laplace sd (a flat or
#: failed side says little beyond "wide" or "narrow")
SKEW_RANGE = (0.25, 4.0)


def grid_points(d: int, half_width: float) -> np.ndarray:
    """The product grid in Laplace sds: spacing :data:`GRID_STEP` over ±``half_width`` for one
    scale; for two, as many points per axis as over ±:data:`HALF_WIDTH` (a widened 2-D grid is
    coarser, not larger: its points grow as the square)."""
    step = grid_spacing(d, half_width)
    count = math.floor(half_width / step + 1e-9)
    axis = np.arange(-count, count + 1) * step
    return np.array(list(itertools.product(axis, repeat=d)), dtype=float)


def grid_spacing(d: int, half_width: float) -> float:
    """The spacing of :func:`grid_points`' grid in Laplace sds."""
    return GRID_STEP[d] * (half_width / HALF_WIDTH if d > 1 else 1.0)


def corner_signs(d: int) -> np.ndarray:
    """The ±1 corners of the design's two-level factorial: all 2^d for d ≤ 4, else the half
    fraction whose last column is the product of the others (resolution d ≥ V)."""
    if d < 2 or d > MAX_SCALES:
        raise ValueError(f"a central composite design here serves 2 to {MAX_SCALES} scales, not {d}")
    free = d if d <= 4 else d - 1
    signs = np.array(list(itertools.product((-1.0, 1.0), repeat=free)))
    if free < d:
        signs = np.concatenate([signs, np.prod(signs, axis=1, keepdims=True)], axis=1)
    return signs


def ccd_design(d: int, f: float = CCD_F) -> tuple:
    """``(points, log Δ, axial)``: the central composite design of the module docstring in the
    standardised space (centre first, then the axial points +r e_1, −r e_1, +r e_2, …, then the
    corners), the logs of its integration weights, and the indices of its axial points as a
    (d, 2) array ``[[+e_1, −e_1], …]``."""
    if not f > 1.0:
        raise ValueError(f"the design's f must be above 1 (its centre's weight is 1 − 1/f²), not {f}")
    radius = f * math.sqrt(d)
    axial = np.concatenate([radius * np.eye(d)[:, None, :], -radius * np.eye(d)[:, None, :]], axis=1).reshape(-1, d)
    points = np.concatenate([np.zeros((1, d)), axial, f * corner_signs(d)])
    n = points.shape[0]
    log_norm = 0.5 * d * math.log(2.0 * math.pi)
    log_delta = np.full(n, log_norm + 0.5 * d * f * f - math.log((n - 1) * f * f))
    log_delta[0] = log_norm + math.log(1.0 - 1.0 / (f * f))
    return points, log_delta, 1 + np.arange(2 * d).reshape(d, 2)


def probe_points(d: int) -> np.ndarray:
    """The probes of :func:`split_scales` in the standardised space: +t e_1, −t e_1, +t e_2, …
    (t = :data:`SKEW_PROBE`), shape (2d, d)."""
    return np.stack([SKEW_PROBE * np.eye(d), -SKEW_PROBE * np.eye(d)], axis=1).reshape(-1, d)


def split_scales(centre: float, probes, distance: float = SKEW_PROBE) -> np.ndarray:
    """The spreads (s_j^+, s_j^−) of ℓ on each side of its centre along each principal
    direction, in Laplace sds: ``centre`` ℓ at the mode, ``probes`` ℓ at
    :func:`probe_points` (``distance`` out). A side whose ℓ did not fall (a flat or mislocated
    mode) or is not finite (a failed fit) is clipped to :data:`SKEW_RANGE`. Shape (d, 2)."""
    drop = float(centre) - np.asarray(probes, float).reshape(-1, 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = distance / np.sqrt(2.0 * drop)
    spread = np.where(np.isnan(spread) | (drop <= 0), SKEW_RANGE[1], spread)
    return np.clip(spread, *SKEW_RANGE)


def marginal_split(root, spreads) -> np.ndarray:
    """Each scale's split-normal sds (σ_L, σ_R) on u from R = V Λ^{1/2} (``root``) and the
    sides' spreads (s_j^+, s_j^−) of :func:`split_scales` (module docstring). Shape (d, 2)."""
    root = np.asarray(root, float)
    plus, minus = np.asarray(spreads, float)[:, 0], np.asarray(spreads, float)[:, 1]
    up = np.where(root > 0, plus[None, :], minus[None, :])  # (the side of z_j that raises u_i)
    down = np.where(root > 0, minus[None, :], plus[None, :])
    return np.stack([np.sqrt(np.sum(root**2 * down**2, axis=1)), np.sqrt(np.sum(root**2 * up**2, axis=1))], axis=1)


def stretched(points, log_delta, spreads) -> tuple:
    """``(points, log Δ)`` of the design (:func:`ccd_design`) stretched by the sides' spreads
    (s_j^+, s_j^−) of :func:`split_scales` (module docstring)."""
    plus, minus = np.asarray(spreads, float)[:, 0], np.asarray(spreads, float)[:, 1]
    scale = np.where(points > 0, plus, minus)
    volume = np.where(points > 0, plus, np.where(points < 0, minus, 0.5 * (plus + minus)))
    return points * scale, np.asarray(log_delta, float) + np.sum(np.log(volume), axis=1)


def tilted(weights, points, target, steps: int = 50) -> np.ndarray:
    """The weights w'_k ∝ w_k exp(λᵀ x_k) nearest to ``weights`` (in KL) whose mean Σ_k w'_k x_k
    is ``target`` (``points`` (K, d) x_k), λ by Newton steps on the convex log Σ_k w_k e^{λᵀx_k} −
    λᵀ target; ``weights`` unchanged where no such λ is found (a target outside the points'
    hull)."""
    w, x, target = np.asarray(weights, float), np.asarray(points, float), np.asarray(target, float)
    centred = x - target
    lam = np.zeros(x.shape[1])
    for _ in range(steps):
        log_t = np.log(np.maximum(w, 1e-300)) + centred @ lam
        t = np.exp(log_t - np.max(log_t))
        t /= t.sum()
        grad = t @ centred
        if np.max(np.abs(grad)) < 1e-12 * (1.0 + np.max(np.abs(x))):
            return t
        hess = np.einsum("k,ki,kj->ij", t, centred, centred) - np.outer(grad, grad)
        try:
            lam = lam - np.linalg.solve(hess, grad)
        except np.linalg.LinAlgError:
            break
    return w


def split_normal_moments(mode: float, left: float, right: float) -> tuple:
    """(mean, variance) of the split normal of mode ``mode`` and sds ``left``, ``right``:
    mode + √(2/π)(σ_R − σ_L) and (1 − 2/π)(σ_R − σ_L)² + σ_L σ_R."""
    gap = right - left
    return mode + math.sqrt(2.0 / math.pi) * gap, (1.0 - 2.0 / math.pi) * gap * gap + left * right
