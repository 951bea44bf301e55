"""The narrow-q check (``blrppl/posterior/narrow.py``): the estimate on hand-built weights, the
flagging rule, a Gaussian q a tenth as wide as the exact posterior along one direction (the
compiled check on a hand-built q), and what the diagnostics, the advice and the refinement
make of a flagged site."""

from __future__ import annotations

import math
import types

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

import reference_models as rm
from blrppl import blr_fit
from blrppl.api import plan_of
from blrppl.engine import refine as refine_mod
from blrppl.engine.advice import named_remedies, poor_q_advice
from blrppl.engine.build import model_data
from blrppl.engine.grid import MAX_SCALES
from blrppl.engine.prepare import prepare
from blrppl.families.gaussian import GaussianView
from blrppl.inputs import fit_options
from blrppl.model.program import ModelProgram
from blrppl.posterior.diagnostics import ESS_POOR, Diagnostics, relative_ess
from blrppl.posterior.narrow import NARROW_RATIO, NARROW_Z, Width, flagged, width_of, widths

numpyro.enable_x64()


@pytest.mark.parametrize(
    "log_w, d, sd, ratio, se",
    [
        # equal weights: the sample sd over q's
        ([0.0, 0.0], [-1.0, 1.0], 1.0, 1.0, 0.0),
        ([0.0, 0.0], [-2.0, 2.0], 1.0, 2.0, 0.0),
        ([0.0, 0.0], [-2.0, 2.0], 4.0, 0.5, 0.0),
        # weights 1 : 3 at d = 0, 4: mean 3, variance (1·9 + 3·1)/4 = 3; each (d − μ)² − v is
        # ±6 and 2, w̄ = (¼, ¾): Var v̂ ≈ (¼)²·36 + (¾)²·4 = 4.5, se of √v = √4.5 / (2 √3)
        ([0.0, math.log(3.0)], [0.0, 4.0], 1.0, math.sqrt(3.0), math.sqrt(4.5) / (2.0 * 3.0) * math.sqrt(3.0)),
        # a draw where the model's density is NaN or −∞ (a kernel overflowing far out) weighs nothing
        ([0.0, 0.0, np.nan, -np.inf], [-1.0, 1.0, 50.0, -50.0], 1.0, 1.0, 0.0),
        # an infinite weight, or none finite: no estimate
        ([0.0, np.inf], [-1.0, 1.0], 1.0, math.nan, math.nan),
        ([np.nan, np.nan], [-1.0, 1.0], 1.0, math.nan, math.nan),
    ],
)
def test_width_of_table(log_w, d, sd, ratio, se):
    got_ratio, got_se, _ = width_of(np.asarray(log_w), np.asarray(d), sd)
    if math.isnan(ratio):
        assert math.isnan(got_ratio) and math.isnan(got_se)
    else:
        assert got_ratio == pytest.approx(ratio, rel=1e-12)
        assert got_se == pytest.approx(se, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(
    "width, narrow",
    [
        (Width("kernel_var", 1.29, 0.03, 0.69), True),  # the GP example's, measured
        (Width("a", NARROW_RATIO + NARROW_Z * 0.03 + 0.01, 0.03, 0.5), True),
        (Width("a", NARROW_RATIO + NARROW_Z * 0.03 - 0.01, 0.03, 0.5), False),  # within its error
        (Width("kernel_length", 2.58, 0.84, 0.09), False),  # a few heavy weights: too uncertain
        (Width("sigma_a", 1.09, 0.03, 0.65), False),  # accurate fits measured 0.95-1.09
        (Width("mu", 0.5, 0.01, 0.7), False),  # q wider than the posterior: not this check's
        (Width("x", math.nan, math.nan, math.nan), False),
    ],
)
def test_a_site_is_narrow_beyond_the_estimates_error(width, narrow):
    assert width.narrow() is narrow
    assert flagged([width]) == ((width,) if narrow else ())


def test_flagged_sites_come_widest_first():
    found = (Width("a", 1.5, 0.01, 0.5), Width("b", 9.0, 0.3, 0.3), Width("c", 1.0, 0.01, 0.7))
    assert [w.site for w in flagged(found)] == ["b", "a"]


def _two_means(z1, z2):
    """x and y independent a posteriori: N(0, 1) priors, one N(·, 0.5) observation each, so
    each posterior is N(z / 1.25, 0.2)."""
    x = numpyro.sample("x", dist.Normal(0.0, 1.0))
    y = numpyro.sample("y", dist.Normal(0.0, 1.0))
    numpyro.sample("z1", dist.Normal(x, 0.5), obs=z1)
    numpyro.sample("z2", dist.Normal(y, 0.5), obs=z2)


POSTERIOR_VAR = 1.0 / (1.0 + 1.0 / 0.25)


def _scaled_along(direction, scale):
    """The exact posterior's covariance with its sd along ``direction`` (unit) times ``scale``."""
    v = np.asarray(direction, float) / np.linalg.norm(direction)
    proj = np.outer(v, v)
    return POSTERIOR_VAR * (np.eye(2) - proj + scale**2 * proj)


@pytest.mark.parametrize(
    "direction, scale, expected",
    [
        # the constructed case: q's sd a tenth of the posterior's along x
        ((1.0, 0.0), 0.1, {"x": 10.0, "y": 1.0}),
        # q exact, or twice too wide along x: nothing flagged
        ((1.0, 0.0), 1.0, {"x": 1.0, "y": 1.0}),
        ((1.0, 0.0), 2.0, {"x": 0.5, "y": 1.0}),
    ],
)
def test_a_q_narrower_than_the_exact_posterior_along_one_direction(direction, scale, expected):
    """A hand-built Gaussian q over (x, y), the exact posterior's with its sd along one direction
    scaled, checked by the fit's own compiled program: the estimated sd ratio of each site is the
    exact one (within 4 of its standard errors and 15 %: 1,000 draws per site, where the 1-D
    estimate's relative sd measured 2-4 %), and the sites whose ratio is above the threshold are
    flagged."""
    z1, z2 = np.array(0.8), np.array(-0.4)
    options = fit_options(structure="joint")
    prepared = prepare(ModelProgram(_two_means), (z1, z2), {}, options, random.PRNGKey(0))
    (block,) = prepared.plan.blocks
    assert block.sites == ("x", "y")
    mean = jnp.asarray([z1, z2]) / 1.25
    nat = {block.name: block.family.nat_from_view(GaussianView(mean, jnp.asarray(_scaled_along(direction, scale))))}
    out = prepared.bundle.narrow(nat, model_data(prepared.plan, prepared.dyn_data), random.PRNGKey(1))
    found = {w.site: w for w in widths(prepared.bundle.narrow_sites, *out)}
    assert set(found) == {"x", "y"}
    for site, ratio in expected.items():
        w = found[site]
        assert abs(w.ratio - ratio) < 4 * w.se + 0.01 and abs(w.ratio / ratio - 1) < 0.15, (site, w, ratio)
        assert w.narrow() is (ratio > 1.3), (site, w)


def test_a_q_narrow_along_a_combination_of_sites_is_psis_to_see():
    """q's sd a tenth of the posterior's along x + y: the check widens one site at a time and
    keeps q's conditional of the other, which is then far too narrow (correlation −0.98 under
    q, none a posteriori), so its weights are few and its estimate unreliable; the importance
    weights of q itself say q is poor (relative ESS below ESS_POOR)."""
    z1, z2 = np.array(0.8), np.array(-0.4)
    prepared = prepare(ModelProgram(_two_means), (z1, z2), {}, fit_options(structure="joint"), random.PRNGKey(0))
    (block,) = prepared.plan.blocks
    mean = jnp.asarray([z1, z2]) / 1.25
    nat = {block.name: block.family.nat_from_view(GaussianView(mean, jnp.asarray(_scaled_along((1.0, 1.0), 0.1))))}
    data = model_data(prepared.plan, prepared.dyn_data)
    assert relative_ess(prepared.bundle.log_weights(nat, data, random.PRNGKey(1))) < ESS_POOR
    found = widths(prepared.bundle.narrow_sites, *prepared.bundle.narrow(nat, data, random.PRNGKey(1)))
    assert all(w.ess < 0.2 for w in found), found


def _normal_gamma(y):
    """Normal data of unknown mean and precision: a conjugate model fitted by VMP (two blocks)."""
    tau = numpyro.sample("tau", dist.Gamma(2.0, 2.0))
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0 / jnp.sqrt(tau)), obs=y)


def _logistic(X, y):
    intercept = numpyro.sample("intercept", dist.Normal(0.0, 2.5))
    w = numpyro.sample("w", dist.Normal(0.0, 2.5).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=intercept + X @ w), obs=y)


def _logistic_data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3))
    y = (rng.uniform(size=200) < 1.0 / (1.0 + np.exp(-(0.3 + X @ np.array([1.0, -0.5, 0.2]))))).astype(float)
    return X, y


@pytest.mark.parametrize(
    "model, data, sites",
    [
        (_normal_gamma, (np.random.default_rng(1).normal(1.0, 0.7, size=50),), {"mu"}),
        (_logistic, _logistic_data(), {"intercept"}),
    ],
)
def test_accurate_fits_are_not_flagged(model, data, sites):
    """A conjugate model fitted by VMP and a logistic regression: their scalar sites' posterior
    sds are q's (within 10 %), nothing is flagged, and the fit is left alone. Where the
    importance weights' relative ESS is at least ESS_CLOSE (0.95) the check is not run (such
    weights bound χ²(p‖q) below what a posterior 1.2× wider than q needs): no widths."""
    from blrppl.posterior.diagnostics import ESS_CLOSE

    result = blr_fit(model, data, rng_key=random.PRNGKey(0), progress_bar=False)
    d = result.diagnostics
    assert {w.site for w in d.widths} == (set() if d.ess >= ESS_CLOSE else sites), (d.ess, d.widths)
    assert all(abs(w.ratio - 1.0) < 0.1 for w in d.widths), d.widths
    assert d.narrow == () and not d.poor() and result.refinements == []


def test_a_narrow_site_makes_q_poor_and_the_diagnostics_say_so():
    wide = Width("kernel_var", 1.29, 0.03, 0.69)
    d = Diagnostics(
        khat=0.4, num_draws=1000, elbo_rel_change=0.0, rejected_steps=0, elbo_noise=0.0, ess=0.8,
        widths=(wide, Width("kernel_noise", 1.05, 0.02, 0.55)), narrow=(wide,),
    )
    assert d.poor() and not d._replace(narrow=()).poor()
    text = d.describe()
    assert "kernel_var 1.29" in text and "kernel_noise 1.05" in text
    assert "wider than q along 'kernel_var' 1.3×" in text


def _hyper(x, y):
    """Three scalar hyperparameters of one regression (one joint Gaussian block)."""
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(a + b * x, s), obs=y)


def test_the_advice_and_the_refinement_name_a_grid_over_the_widest_narrow_sites():
    """Flagged sites are named for a grid, widest first and as many as a grid holds, with the
    generic remedies (an over-dispersed start, more starts); the warning's
    advice says which sites."""
    x = np.linspace(-1.0, 1.0, 20)
    plan = plan_of(_hyper, (x, 0.5 * x))
    narrow = (Width("s", 3.0, 0.1, 0.3), Width("b", 2.0, 0.1, 0.3), Width("a", 1.5, 0.1, 0.3))
    assert named_remedies(plan, narrow) == (("s", "b", "a"), True)
    assert named_remedies(plan) == ((), True)
    # a funnel's scale flagged narrow: the grid alone, as for the funnel (no structure holds it)
    J, sigma, y = rm.EIGHT_SCHOOLS
    schools = plan_of(rm.eight_schools_model, (J, sigma, y))
    assert named_remedies(schools, (Width("tau", 1.65, 0.15, 0.15),)) == (("tau",), False)
    assert named_remedies(schools, (Width("mu", 1.5, 0.05, 0.5),)) == (("tau", "mu"), True)
    advice = poor_q_advice(plan, 1, narrow, grid_scales=MAX_SCALES)
    named = ", ".join(f"'{w.site}': 'grid'" for w in narrow[:MAX_SCALES])
    assert f"families={{{named}}}" in advice and "num_starts=4" in advice
    diagnostics = Diagnostics(
        khat=0.3, num_draws=1000, elbo_rel_change=0.0, rejected_steps=0, elbo_noise=0.0, ess=0.9, narrow=narrow,
    )
    first = types.SimpleNamespace(plan=plan, nat={}, diagnostics=diagnostics)
    changes = [c.change for c in refine_mod.candidates(first, fit_options(), random.PRNGKey(0), False)]
    assert changes[0] == f"families={{{named}}}"
    # (one joint block: not split into mean-field, a restriction of it)
    assert "structure='mean-field'" not in changes and "start 1 of num_starts=4" in changes
    # a site the user gave a family keeps it
    user = fit_options(families={"s": "gaussian"})
    changes = [c.change for c in refine_mod.candidates(first, user, random.PRNGKey(0), False)]
    assert "'s': 'grid'" not in changes[0]
