"""The integration points of scales on a grid (:mod:`blrppl.engine.design`): the central
composite design past two scales, its weights derived here from the conditions they must meet,
and a Gaussian ℓ over three scales integrated exactly through the grid's own code
(:func:`blrppl.engine.grid._central_composite`, with ℓ given in closed form instead of fits).
Float64 (the test conftest enables x64).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from blrppl.engine import design
from blrppl.engine.grid import _central_composite, _grid_bound

SIZES = {2: 9, 3: 15, 4: 25, 5: 27, 6: 45}


def _phi(z):
    """The standard Gaussian density on R^d, at each row of ``z``."""
    d = z.shape[1]
    return np.exp(-0.5 * np.sum(z**2, axis=1)) / (2.0 * math.pi) ** (d / 2)


@pytest.mark.parametrize("d", [2, 3, 4, 5, 6])
def test_the_design_integrates_a_gaussians_moments_to_second_order(d):
    """INLA's design (Rue, Martino & Chopin 2009, §6.5): 1 + 2d + 2^{d−p} points (9, 15, 25, 27, 45),
    every one but the centre at radius f√d; Σ Δ φ = 1, Σ Δ z φ = 0, Σ Δ z zᵀ φ = I and every
    third moment 0, to rounding."""
    points, log_delta, axial = design.ccd_design(d)
    assert points.shape == (SIZES[d], d)
    assert np.allclose(np.linalg.norm(points[1:], axis=1), design.CCD_F * math.sqrt(d), rtol=1e-14)
    assert np.allclose(points[axial[:, 0]], design.CCD_F * math.sqrt(d) * np.eye(d))
    assert np.allclose(points[axial[:, 1]], -design.CCD_F * math.sqrt(d) * np.eye(d))
    mass = np.exp(log_delta) * _phi(points)
    np.testing.assert_allclose(mass.sum(), 1.0, rtol=1e-13)
    np.testing.assert_allclose(mass @ points, np.zeros(d), atol=1e-13)
    np.testing.assert_allclose(np.einsum("k,ki,kj->ij", mass, points, points), np.eye(d), atol=1e-13)
    third = np.einsum("k,ki,kj,kl->ijl", mass, points, points, points)
    np.testing.assert_allclose(third, 0.0, atol=1e-13)


@pytest.mark.parametrize("d", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("f", [1.1, 1.5])
def test_the_weights_are_the_solution_of_the_moment_conditions(d, f):
    """Derivation of Δ₀ (centre) and Δ₁ (every other point): the two unknowns solve the
    linear conditions Σ Δ φ = 1 and Σ Δ z_1² φ = 1 on the design's points, solved here
    numerically; the closed forms of the docstring, (2π)^{d/2} (1 − 1/f²) and
    (2π)^{d/2} e^{d f²/2} / ((n − 1) f²), are those solutions."""
    points, log_delta, _ = design.ccd_design(d, f)
    phi = _phi(points)
    centre = np.arange(len(points)) == 0
    system = np.array(
        [
            [phi[centre].sum(), phi[~centre].sum()],
            [(phi * points[:, 0] ** 2)[centre].sum(), (phi * points[:, 0] ** 2)[~centre].sum()],
        ]
    )
    delta0, delta1 = np.linalg.solve(system, np.ones(2))
    np.testing.assert_allclose(np.exp(log_delta[0]), delta0, rtol=1e-12)
    np.testing.assert_allclose(np.exp(log_delta[1:]), delta1, rtol=1e-12)
    n = len(points)
    np.testing.assert_allclose(delta0, (2 * math.pi) ** (d / 2) * (1 - 1 / f**2), rtol=1e-12)
    np.testing.assert_allclose(delta1, (2 * math.pi) ** (d / 2) * math.exp(d * f * f / 2) / ((n - 1) * f * f), rtol=1e-12)


def test_the_corner_columns_are_orthogonal_and_balanced():
    """The half fractions of d = 5, 6 (last column the product of the others) keep every pair of
    columns orthogonal and every column balanced: what the second moments need."""
    for d in (2, 3, 4, 5, 6):
        signs = design.corner_signs(d)
        assert len({tuple(row) for row in signs}) == len(signs) == (2**d if d <= 4 else 2 ** (d - 1))
        np.testing.assert_array_equal(signs.T @ signs, len(signs) * np.eye(d))
        np.testing.assert_array_equal(signs.sum(0), np.zeros(d))


def test_a_design_outside_its_range_is_refused():
    with pytest.raises(ValueError, match="2 to 6 scales"):
        design.corner_signs(7)
    with pytest.raises(ValueError, match="2 to 6 scales"):
        design.corner_signs(1)
    with pytest.raises(ValueError, match="above 1"):
        design.ccd_design(3, 1.0)


class _GaussianProfile:
    """ℓ(u) = c + log N(u; m, Σ) in closed form, called as the grid calls its fits."""

    def __init__(self, mean, cov, const):
        self.mean, self.prec, self.const = mean, np.linalg.inv(cov), const
        self.log_norm = -0.5 * (len(mean) * math.log(2 * math.pi) + np.linalg.slogdet(cov)[1])

    def __call__(self, u, weighted=False):
        r = np.asarray(u) - self.mean
        return self.const + self.log_norm - 0.5 * r @ self.prec @ r, None


def test_a_gaussian_over_three_scales_is_integrated_exactly():
    """A correlated Gaussian ℓ over three scales, its mode and curvature known (as Newton's
    steps give them): the design's weighted mean and covariance of the points are m and Σ,
    each scale's marginal (a split normal with both sides equal) has Σ_ii's variance, and the
    grid's bound log ∫ exp ℓ is c, all to rounding."""
    rng = np.random.default_rng(3)
    a = rng.normal(size=(3, 3))
    cov = a @ a.T + 0.5 * np.eye(3)
    mean, const = np.array([-0.4, 1.3, 0.2]), -17.25
    points = _central_composite(_GaussianProfile(mean, cov, const), mean, cov, False, ["s1", "s2", "s3"])
    w, us = points.weights, points.us
    np.testing.assert_allclose(w @ us, mean, atol=1e-12)
    np.testing.assert_allclose(np.einsum("k,ki,kj->ij", w, us - mean, us - mean), cov, rtol=1e-12)
    np.testing.assert_allclose(np.array(points.moments), np.stack([mean, np.diag(cov)], 1), rtol=1e-12)
    for i, marginal in enumerate(points.marginals):
        np.testing.assert_allclose([float(marginal.left), float(marginal.right)], math.sqrt(cov[i, i]), rtol=1e-12)
    np.testing.assert_allclose(_grid_bound([v[0] for v in points.values], points.log_volumes), const, rtol=1e-13)


def test_the_probes_read_each_sides_spread():
    """ℓ a split normal along each principal direction (sds s_j^± in Laplace sds): its drops at
    the probes ±3 e_j give back every s_j^± exactly, and with a diagonal R each scale's
    split-normal sds are R_jj s_j^∓ (left) and R_jj s_j^± (right, the side R_jj's sign raises)."""
    plus, minus = np.array([1.3, 0.7, 1.0]), np.array([0.8, 1.6, 1.0])
    probes = design.probe_points(3)
    ell = -0.5 * np.sum((probes / np.where(probes > 0, plus, minus)) ** 2, axis=1) + 4.0
    spreads = design.split_scales(4.0, ell)
    np.testing.assert_allclose(spreads, np.stack([plus, minus], 1), rtol=1e-12)
    sides = design.marginal_split(np.diag([0.5, -2.0, 1.0]), spreads)
    np.testing.assert_allclose(sides[:, 0], [0.5 * 0.8, 2.0 * 0.7, 1.0], rtol=1e-12)
    np.testing.assert_allclose(sides[:, 1], [0.5 * 1.3, 2.0 * 1.6, 1.0], rtol=1e-12)


def test_a_side_that_does_not_fall_or_failed_is_clipped():
    """A side where ℓ rose (a mislocated mode) reads as the widest spread allowed, a side whose
    fit failed (ℓ = −∞) as the narrowest: finite sds, no NaN."""
    probes = design.probe_points(3)
    ell = -0.5 * np.sum(probes**2, axis=1)
    ell[0], ell[3] = 1.0, -np.inf  # (+e_1 rose, −e_2 failed)
    spreads = design.split_scales(0.0, ell)
    assert spreads[0, 0] == design.SKEW_RANGE[1] and spreads[1, 1] == design.SKEW_RANGE[0]
    np.testing.assert_allclose(spreads[2], 1.0, rtol=1e-12)


@pytest.mark.parametrize("d", [2, 3, 4, 5, 6])
def test_the_stretched_design_integrates_a_product_of_split_normals(d):
    """ℓ(z) = −Σ_j z_j² / (2 (s_j^{sign z_j})²): in the design's own space the stretched
    integrand is φ(x) Π_j (ā_j + b_j sign x_j) (ā, b the half sum and half difference of the
    sides' spreads), whose Gaussian integral is Π_j ā_j (times (2π)^{d/2}). The design sums every
    product of signs to 0 except, in the half fractions of d = 5, 6, the product of all d signs,
    which is 1 at every corner: its integral is exact for d ≤ 4 and off by the corners' share
    N_c / ((n − 1) f²) times Π_j b_j / ā_j beyond."""
    rng = np.random.default_rng(d)
    spreads = rng.uniform(0.5, 2.0, size=(d, 2))
    points, log_delta, _ = design.ccd_design(d)
    zs, log_delta = design.stretched(points, log_delta, spreads)
    ell = -0.5 * np.sum((zs / np.where(zs > 0, spreads[:, 0], spreads[:, 1])) ** 2, axis=1)
    half_sum, half_diff = spreads.mean(1), 0.5 * (spreads[:, 0] - spreads[:, 1])
    exact = np.sum(0.5 * np.log(2 * math.pi) + np.log(half_sum))
    corners = len(design.corner_signs(d))
    share = corners / ((len(points) - 1) * design.CCD_F**2) if d >= 5 else 0.0
    expected = exact + np.log1p(share * np.prod(half_diff / half_sum))
    np.testing.assert_allclose(_grid_bound(ell, log_delta), expected, rtol=1e-12)


def test_tilted_weights_hold_the_target_mean_and_stay_nearest():
    """The tilt meets its target mean exactly, leaves weights whose mean is already the target
    unchanged, and is the exponential family through the weights (log w'/w affine in x)."""
    points, log_delta, _ = design.ccd_design(3)
    w = np.exp(log_delta) * _phi(points)
    np.testing.assert_allclose(design.tilted(w, points, np.zeros(3)), w, rtol=1e-12)
    target = np.array([-0.3, 0.1, 0.2])
    t = design.tilted(w, points, target)
    np.testing.assert_allclose(t @ points, target, atol=1e-12)
    coef, *_ = np.linalg.lstsq(np.c_[np.ones(len(points)), points], np.log(t / w), rcond=None)
    np.testing.assert_allclose(np.c_[np.ones(len(points)), points] @ coef, np.log(t / w), atol=1e-10)
    far = design.tilted(w, points, np.array([9.0, 0.0, 0.0]))  # (outside the points' hull)
    assert np.all(np.isfinite(far)) and abs(far.sum() - 1.0) < 1e-12


def test_the_product_grid_is_unchanged():
    """One and two scales keep the product grid: 33 points at spacing 0.25, 11 × 11 at 0.8."""
    assert design.grid_points(1, design.HALF_WIDTH).shape == (33, 1)
    pts = design.grid_points(2, design.HALF_WIDTH)
    assert pts.shape == (121, 2) and np.isclose(np.diff(np.unique(pts[:, 0]))[0], 0.8)
