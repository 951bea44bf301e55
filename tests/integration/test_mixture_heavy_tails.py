"""Issue 53, third increment: the Gaussian mixture beside the blocks it does not hold (fitted
again given it), and on a model whose effects have a heavy-tailed (half-Cauchy) scale.

Float64 (the test conftest enables x64), fixed keys. References: a grid over the one latent
a posterior depends on (numerically normalised), and the long NUTS run of
``tests/data/eight_schools.json`` (4 × 10,000 draws, R-hat < 1.001); moments of q from
40,000 draws where it is not Gaussian (Monte Carlo error ≈ 0.005 sd).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

import reference_models as rm
from blrppl import blr_fit
from integration.test_nonconjugate import posterior_moments

DATA = pathlib.Path(__file__).parents[1] / "data"

#: the single Gaussian's fits warn that q is poor (the point of the comparison)
quiet = pytest.mark.filterwarnings("ignore::UserWarning")


def bimodal_with_follower(y, u):
    """θ's posterior has modes near ±2 (masses about 0.3 and 0.7); z follows θ: given θ,
    z ~ N(θ/5, 1/5) (its prior N(θ, 1) and u = 0 ~ N(z, 0.5²))."""
    theta = numpyro.sample("theta", dist.Normal(0.85, 2.0))
    numpyro.sample("y", dist.Normal(theta**2, 1.0), obs=y)
    z = numpyro.sample("z", dist.Normal(theta, 1.0))
    numpyro.sample("u", dist.Normal(z, 0.5), obs=u)


def _exact_z():
    """E[z] and sd[z] of the exact posterior: θ's marginal on a grid (z integrated out:
    u ~ N(θ, 1 + 0.25)), then E[z | θ] = θ/5, Var[z | θ] = 1/5."""
    grid = np.linspace(-8.0, 8.0, 20001)
    log_p = (
        dist.Normal(0.85, 2.0).log_prob(grid) + dist.Normal(grid**2, 1.0).log_prob(4.0)
        + dist.Normal(grid, np.sqrt(1.25)).log_prob(0.0)
    )
    p = np.exp(np.asarray(log_p) - np.max(log_p))
    p /= p.sum()
    mean = float(np.sum(p * grid))
    var = float(np.sum(p * grid**2)) - mean**2
    return mean / 5.0, np.sqrt(var / 25.0 + 0.2)


@quiet
def test_other_blocks_refitted_given_the_mixture():
    """Mean-field: the mixture holds θ, z its own Gaussian block. Given the mixture, z's best
    Gaussian is N(E_q[θ]/5, 1/5); the single fit's z sits at its θ's mean (the mode near +2)
    over 5. Refitted, z's mean is E_q[θ]/5 within the refit's Monte Carlo noise (0.015-0.029
    over the keys 0-3; held at the single fit's q it was 0.06-0.11 off) and 0.16 exact sds
    from the exact posterior's (the single fit's z: 0.41)."""
    data = (4.0, 0.0)
    single = blr_fit(
        bimodal_with_follower, data, structure="mean-field", refine=False, rng_key=random.PRNGKey(0), progress_bar=False
    )
    result = blr_fit(
        bimodal_with_follower, data, structure="mean-field", families={"theta": ("gaussian-mixture", 4)},
        rng_key=random.PRNGKey(0), progress_bar=False,
    )
    theta_mean = float(result.posterior["theta"].mean)
    z = result.posterior["z"]
    assert abs(float(z.mean) - theta_mean / 5.0) <= 0.05, (float(z.mean), theta_mean)
    assert float(z.variance) == pytest.approx(0.2, rel=0.02)
    exact_mean, exact_sd = _exact_z()
    single_error = abs(float(single.posterior["z"].mean) - exact_mean) / exact_sd
    error = abs(float(z.mean) - exact_mean) / exact_sd
    assert error <= 0.25 and error < single_error - 0.1, (error, single_error)
    assert "(z) fitted again given the mixture" in result.message, result.message


def _eight_schools_errors(result):
    stored = json.loads((DATA / "eight_schools.json").read_text())["params"]
    est = posterior_moments(result)
    err = {k: abs(est[k][0] - v["mean"]) / v["sd"] for k, v in stored.items()}
    ratio = {k: est[k][1] / v["sd"] for k, v in stored.items()}
    return err, ratio


@quiet
def test_eight_schools_half_cauchy_scale_within_the_issue_tolerances():
    """The eight schools, τ ~ HalfCauchy(5) (a funnel between τ and the effects θ): the single
    Gaussian (refine=False) holds the effects but not their scale (τ's sd 0.35 of NUTS's);
    a mixture of 8 over the joint block of (μ, τ, θ) has every mean within 0.2 NUTS sd and every
    sd within 0.75-1.33× (measured: means within 0.1, sds 0.99-1.04×). (This holds with the
    mixture of the earlier increments too: it is the issue's target on a Student-t-scale
    model, kept.)"""
    model, data = rm.eight_schools_model, rm.eight_schools_data()
    single = blr_fit(model, data, refine=False, rng_key=random.PRNGKey(0), progress_bar=False)
    _, single_ratio = _eight_schools_errors(single)
    assert single_ratio["tau"] < 0.75, single_ratio
    result = blr_fit(model, data, families={"theta": ("gaussian-mixture", 8)}, rng_key=random.PRNGKey(0), progress_bar=False)
    err, ratio = _eight_schools_errors(result)
    assert max(err.values()) <= 0.2, err
    assert all(0.75 <= r <= 1.33 for r in ratio.values()), ratio


def separate_parts(y, v):
    """r (conjugate Gamma, the mixture's site) and (a, b) share no factor."""
    r = numpyro.sample("r", dist.Gamma(2.0, 1.0))
    numpyro.sample("y", dist.Poisson(r), obs=y)
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    numpyro.sample("v", dist.Normal(a * b + a, 1.0), obs=v)


@quiet
def test_blocks_no_factor_joins_to_the_mixture_keep_the_single_fit():
    """Given the mixture, the best q of a block no factor joins to it is the single fit's: it is
    kept as it is (refitted by Monte Carlo steps, a's mean moved by 0.07 of its 0.36)."""
    data = (np.array([3.0, 4.0]), np.array([1.0, 0.5]))
    single = blr_fit(separate_parts, data, refine=False, rng_key=random.PRNGKey(0), progress_bar=False)
    result = blr_fit(separate_parts, data, families={"r": ("gaussian-mixture", 2)}, rng_key=random.PRNGKey(0), progress_bar=False)
    for site in ("a", "b"):
        np.testing.assert_allclose(float(result.posterior[site].mean), float(single.posterior[site].mean), atol=1e-4)
        np.testing.assert_allclose(float(result.posterior[site].variance), float(single.posterior[site].variance), rtol=1e-4)
    assert "fitted again" not in result.message and "keep the single Gaussian fit's q" in result.message
