"""The bulk check (:mod:`blrppl.posterior.bulk`): q's importance-corrected coordinates against
q's own, on draws whose exact weights are known (q = N(0, I), p a product of Gaussians).

Monte Carlo error: S = 4000 draws; at a relative ESS of ~0.25 about 1000 are effective, so a
coordinate's estimated shift has an sd of about 0.03 and its log sd ratio about 0.025; the
check subtracts 3 of these before comparing with 0.1 and log 1.2 (0.18)."""

import math

import numpy as np
import pytest

from blrppl.posterior.bulk import BULK_RATIO, BULK_SHIFT, MAX_COORDINATES, Bulk, Coordinate, check, coordinates
from blrppl.posterior.diagnostics import ESS_POOR, Diagnostics, relative_ess

S = 4000


def weighted(mu, sd, seed=0):
    """Draws of q = N(0, I) over len(mu) coordinates and the log weights of p = Π N(mu_i, sd_i²)."""
    rng = np.random.default_rng(seed)
    mu, sd = np.asarray(mu, float), np.asarray(sd, float)
    x = rng.normal(size=(S, mu.size))
    log_p = np.sum(-0.5 * ((x - mu) / sd) ** 2 - np.log(sd), axis=1)
    log_q = np.sum(-0.5 * x**2, axis=1)
    return x, log_p - log_q


def test_many_small_differences_give_a_low_ess_but_no_coordinate_off():
    """40 coordinates each 0.05 sd off in mean and 1.12x in sd: 1 + χ² = 1.0375^40, a
    relative ESS near 0.23, below ESS_POOR; every marginal is close, and the check says so."""
    d = 40
    x, log_w = weighted(np.full(d, 0.05), np.full(d, 1.12))
    assert relative_ess(log_w) < ESS_POOR
    found = check({"beta": x}, log_w)
    assert found == Bulk(d, ())
    coords = coordinates({"beta": x}, log_w)
    assert [c.index for c in coords] == list(range(d))
    # the estimates are the exact differences to Monte Carlo error (4 sds of it)
    assert np.allclose([c.shift for c in coords], 0.05, atol=4 * 0.035)
    assert np.allclose([c.ratio for c in coords], 1.12, atol=4 * 0.035)


@pytest.mark.parametrize(
    "mu0, sd0, what",
    [
        (0.6, 1.0, "shift"),  # the posterior's mean 0.6 of q's sds away along one coordinate
        (0.0, 0.6, "ratio"),  # q 1.7x wider than the posterior along one coordinate
        (-0.5, 0.8, "both"),
    ],
)
def test_one_coordinate_off_is_named(mu0, sd0, what):
    d = 20
    mu, sd = np.zeros(d), np.ones(d)
    mu[3], sd[3] = mu0, sd0
    x, log_w = weighted(mu, sd, seed=1)
    found = check({"theta": x[:, :10], "beta": x[:, 10:]}, log_w)
    assert found.coordinates == d
    assert [(c.site, c.index) for c in found.off] == [("theta", 3)]
    c = found.off[0]
    # the sd of q's draws of coordinate 3 is 1 up to MC error: shift ≈ mu0, ratio ≈ sd0
    assert c.shift == pytest.approx(mu0, abs=0.1) and c.ratio == pytest.approx(sd0, abs=0.1)
    assert ("theta[3]" in c.describe()) and ("mean" in c.describe())


def test_coordinate_thresholds():
    """A table of hand-made estimates: off only beyond the bounds after 3 standard errors."""
    close = Coordinate("a", -1, BULK_SHIFT + 0.05, 0.02, 1.0, 0.01)  # 0.15 − 0.06 < 0.1
    assert not close.off()
    assert Coordinate("a", -1, BULK_SHIFT + 0.05, 0.01, 1.0, 0.01).off()  # 0.15 − 0.03 > 0.1
    assert not Coordinate("a", -1, 0.0, 0.01, BULK_RATIO * 1.05, 0.03).off()  # log 1.05 < 3 · 0.03 / 1.26
    assert Coordinate("a", -1, 0.0, 0.01, BULK_RATIO * 1.2, 0.01).off()
    assert Coordinate("a", -1, 0.0, 0.01, 1.0 / (BULK_RATIO * 1.2), 0.001).off()
    assert Coordinate("a", -1, math.nan, 0.01, 1.0, 0.01).off()
    assert "'a' mean" in close.describe()


def test_undecided_without_finite_weights_or_with_too_many_coordinates():
    x, log_w = weighted(np.zeros(3), np.ones(3))
    bad = log_w.copy()
    bad[5] = np.nan
    assert check({"b": x}, bad) is None
    bad[5] = np.inf
    assert check({"b": x}, bad) is None
    zero = log_w.copy()
    zero[5] = -np.inf  # (a draw where the model has no mass weighs nothing)
    assert check({"b": x}, zero) is not None
    wide = np.zeros((S, MAX_COORDINATES + 1))
    assert check({"b": wide}, log_w) is None


def test_a_scalar_site_is_named_without_an_index():
    x, log_w = weighted([0.0, 0.8], [1.0, 1.0])
    found = check({"mu": x[:, 0], "tau": x[:, 1]}, log_w)
    assert [(c.site, c.index) for c in found.off] == [("tau", -1)]
    assert "'tau' mean" in found.off[0].describe()


@pytest.mark.parametrize(
    "bulk, poor",
    [
        (None, True),  # not checked: the ESS decides
        (Bulk(31, ()), False),  # every coordinate close
        (Bulk(31, (Coordinate("b", 2, 0.5, 0.05, 1.0, 0.02),)), True),
    ],
)
def test_low_ess_is_poor_unless_the_bulk_check_clears_it(bulk, poor):
    d = Diagnostics(khat=0.35, num_draws=1000, elbo_rel_change=0.0, rejected_steps=0, elbo_noise=0.0, ess=0.3, bulk=bulk)
    assert d.poor() is poor
    assert (bulk is None) or (d.bulk_note() in d.describe())
    # a k̂ above its threshold is poor whatever the bulk check says
    assert d._replace(khat=0.9).poor()
