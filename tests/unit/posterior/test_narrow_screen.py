"""The narrow-q check's screen (``blrppl/posterior/narrow.py``, :func:`screen`): where q's own
importance weights decide that no site is narrow, the check's widened draws are neither
compiled nor run. On hand-built weights, and on a fit whose weights leave room for the check
(relative ESS below 0.95) but whose q is good."""

from __future__ import annotations

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from scipy import stats

from blrppl import blr_fit
from blrppl.engine import build
from blrppl.posterior.diagnostics import ESS_CLOSE
from blrppl.posterior.narrow import KHAT_SCREEN, NARROW_RATIO, NARROW_Z, ScalarSite, screen

numpyro.enable_x64()

#: q's sd of the hand-built sites
SD = 0.7


def _weights(ratio, num=1000, seed=0):
    """q = N(0, SD²) along one site, the posterior N(0, (ratio · SD)²): q's draws d and their
    log weights."""
    d = np.random.default_rng(seed).normal(0.0, SD, size=num)
    return stats.norm.logpdf(d, scale=ratio * SD) - stats.norm.logpdf(d, scale=SD), d


@pytest.mark.parametrize("ratio", [1.0, 0.8])
def test_q_draws_decide_when_the_posterior_is_no_wider_than_q(ratio):
    """The posterior as wide as q, or narrower: q's weights estimate each site's ratio (within 4
    of the estimate's standard errors: 1,000 draws, a relative se of about 2 %), and no site can
    be flagged, so the screen returns the widths."""
    log_w, d = _weights(ratio)
    found = screen((ScalarSite("u", 0, 0),), log_w, d[:, None], np.asarray([SD]))
    assert found is not None
    (w,) = found
    assert w.site == "u" and abs(w.ratio - ratio) < 4 * w.se and w.ratio + NARROW_Z * w.se <= NARROW_RATIO


@pytest.mark.parametrize("ratio", [1.3, 2.0])
def test_q_draws_leave_it_to_the_check_when_a_site_may_be_narrow(ratio):
    """A posterior 1.3× (weights of finite variance, k = 1 − 1/r² = 0.41) or 2× wider than q
    along the second of two sites: its estimate reaches the threshold, and the check must draw."""
    log_w1, d1 = _weights(1.0, seed=1)
    log_w2, d2 = _weights(ratio, seed=2)
    sites = (ScalarSite("a", 0, 0), ScalarSite("b", 0, 1))
    # (independent sites: the joint weight is the product)
    assert screen(sites, log_w1 + log_w2, np.stack([d1, d2], axis=1), np.asarray([SD, SD])) is None


def test_q_draws_without_an_estimate_leave_it_to_the_check():
    log_w, d = _weights(1.0)
    log_w[0] = np.inf
    assert screen((ScalarSite("u", 0, 0),), log_w, d[:, None], np.asarray([SD])) is None


def _random_intercepts(group, x, num_groups, y=None):
    """Radon-style varying intercepts: a group scale, a slope and a residual sd."""
    mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 5.0))
    sigma_a = numpyro.sample("sigma_a", dist.HalfNormal(2.0))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("groups", num_groups):
        a = numpyro.sample("a", dist.Normal(mu_a, sigma_a))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(a[group] + b * x, sigma), obs=y)


def _random_intercepts_data():
    rng = np.random.default_rng(3)
    num_groups, n = 20, 400
    group = rng.integers(0, num_groups, size=n)
    x = rng.normal(size=n)
    a = rng.normal(1.0, 0.6, size=num_groups)
    return group, x, num_groups, a[group] - 0.7 * x + rng.normal(0.0, 0.8, size=n)


def test_a_good_fit_whose_weights_decide_compiles_no_check(monkeypatch):
    """Varying intercepts fitted well, with weights that leave room for a narrow site (relative
    ESS below 0.95, k̂ at most KHAT_SCREEN): the widths come from q's own draws, all close to 1
    (an accurate fit), nothing is flagged, and the check's program is never compiled (before,
    it was, at 19 % of such a model's first fit)."""

    def no_check(*args):
        raise AssertionError("the narrow-q check's program ran")

    monkeypatch.setattr(build.CompiledFit, "narrow", no_check)
    result = blr_fit(_random_intercepts, _random_intercepts_data(), rng_key=random.PRNGKey(0), progress_bar=False)
    d = result.diagnostics
    assert d.ess < ESS_CLOSE and d.khat <= KHAT_SCREEN and not d.poor(), d
    assert {w.site for w in d.widths} == {"mu_a", "sigma_a", "b", "sigma"}
    # (1,000 draws: the estimates' se 0.02-0.03)
    assert all(abs(w.ratio - 1.0) < 0.15 for w in d.widths), d.widths
    assert d.narrow == () and result.refinements == []
